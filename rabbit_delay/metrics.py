"""Prometheus metrics of publishers, workers, relays and reconcilers (prometheus-client).

    from rabbit_delay.metrics import default_metrics, start_metrics_server

    worker = Worker(app, metrics=default_metrics())   # the instance in the global REGISTRY
    start_metrics_server(9464)                        # /metrics on :9464

Nothing is created on import: the metrics live on a `Metrics` instance, registered in
the `CollectorRegistry` it is given (a fresh one by default). Every metric and its
labels: docs/observability.md.
"""

from rabbit_delay._io.endpoints import start_metrics_server
from rabbit_delay._observe.metrics import Metrics, default_metrics

__all__ = ["Metrics", "default_metrics", "start_metrics_server"]
