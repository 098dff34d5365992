"""The Metrics class: each call moves the sample it should, in its own registry."""

from __future__ import annotations

import subprocess
import sys
import urllib.request

import pytest
from prometheus_client import REGISTRY, CollectorRegistry

from rabbit_delay.errors import (
    BrokerUnavailable,
    DelayError,
    MissingObjectError,
    NackError,
    UnroutableError,
)
from rabbit_delay.metrics import (
    Metrics,
    Outcome,
    PublishErrorReason,
    default_metrics,
    error_reason,
    start_metrics_server,
)


@pytest.fixture
def metrics() -> Metrics:
    return Metrics(CollectorRegistry())


def sample(m: Metrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, labels)


def test_published_counts_per_queue_and_tier(metrics: Metrics) -> None:
    assert sample(metrics, "rabbit_delay_published_total", queue="orders", tier="5m") is None
    metrics.published("orders", "5m")
    metrics.published("orders", "5m", count=3)
    metrics.published("orders", "cascade")
    assert sample(metrics, "rabbit_delay_published_total", queue="orders", tier="5m") == 4
    assert sample(metrics, "rabbit_delay_published_total", queue="orders", tier="cascade") == 1


@pytest.mark.parametrize(
    ("exc", "reason"),
    [
        (UnroutableError("x"), PublishErrorReason.UNROUTABLE),
        (NackError("x"), PublishErrorReason.NACK),
        (MissingObjectError("x"), PublishErrorReason.MISSING_OBJECT),
        (DelayError("x"), PublishErrorReason.INVALID),
        (BrokerUnavailable("x"), PublishErrorReason.BROKER),
        (RuntimeError("x"), PublishErrorReason.OTHER),
    ],
)
def test_publish_error_reason_from_exception(
    metrics: Metrics, exc: Exception, reason: PublishErrorReason
) -> None:
    assert error_reason(exc) is reason
    metrics.publish_error("orders", exc)
    metrics.publish_error("orders", reason)
    got = sample(metrics, "rabbit_delay_publish_errors_total", queue="orders", reason=reason.value)
    assert got == 2


def test_handled_by_outcome(metrics: Metrics) -> None:
    for outcome in Outcome:
        metrics.handled("push", outcome)
    metrics.handled("push", "retry")
    for outcome in Outcome:
        expected = 2 if outcome is Outcome.RETRY else 1
        got = sample(metrics, "rabbit_delay_handled_total", queue="push", outcome=outcome.value)
        assert got == expected


def test_handled_refuses_an_unknown_outcome(metrics: Metrics) -> None:
    with pytest.raises(ValueError, match="oops"):
        metrics.handled("push", "oops")
    assert sample(metrics, "rabbit_delay_handled_total", queue="push", outcome="oops") is None


def test_handler_time_and_timer(metrics: Metrics) -> None:
    metrics.handler_time("push", 0.2)
    with metrics.time_handler("push"):
        pass
    with pytest.raises(KeyError), metrics.time_handler("push"):
        raise KeyError("the handler failed")
    assert sample(metrics, "rabbit_delay_handler_seconds_count", queue="push") == 3
    total = sample(metrics, "rabbit_delay_handler_seconds_sum", queue="push")
    assert total is not None
    assert total >= 0.2
    assert sample(metrics, "rabbit_delay_handler_seconds_bucket", queue="push", le="0.25") == 3


def test_lateness(metrics: Metrics) -> None:
    metrics.lateness("push", None, 5_000)  # no rd-due-at: nothing recorded
    assert sample(metrics, "rabbit_delay_delivery_lateness_seconds_count", queue="push") is None
    metrics.lateness("push", 1_000, 1_300)  # 0.3 s late
    metrics.lateness("push", 2_000, 1_000)  # early (clock skew): counted as 0
    name = "rabbit_delay_delivery_lateness_seconds"
    assert sample(metrics, f"{name}_count", queue="push") == 2
    assert sample(metrics, f"{name}_sum", queue="push") == pytest.approx(0.3)
    assert sample(metrics, f"{name}_bucket", queue="push", le="0.05") == 1
    assert sample(metrics, f"{name}_bucket", queue="push", le="0.5") == 2


def test_one_instance_per_registry() -> None:
    registry = CollectorRegistry()
    Metrics(registry)
    with pytest.raises(ValueError, match="Duplicated"):
        Metrics(registry)


def test_instances_are_independent() -> None:
    a, b = Metrics(), Metrics()
    a.published("q", "1s")
    assert sample(a, "rabbit_delay_published_total", queue="q", tier="1s") == 1
    assert sample(b, "rabbit_delay_published_total", queue="q", tier="1s") is None


def test_import_registers_nothing() -> None:
    code = (
        "import rabbit_delay.metrics\n"
        "from prometheus_client import REGISTRY\n"
        "print(any(m.name.startswith('rabbit_delay') for m in REGISTRY.collect()))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=True
    )
    assert done.stdout.strip() == "False"


def test_default_metrics_is_one_lazy_instance_in_the_global_registry() -> None:
    first = default_metrics()
    assert default_metrics() is first
    assert first.registry is REGISTRY


def test_metrics_server_serves_the_registry(metrics: Metrics) -> None:
    metrics.published("orders", "5m")
    server, thread = start_metrics_server(0, addr="127.0.0.1", registry=metrics.registry)
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
    assert 'rabbit_delay_published_total{queue="orders",tier="5m"} 1.0' in text
