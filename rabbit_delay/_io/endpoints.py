"""The worker's HTTP endpoints, on one port: `/metrics` (Prometheus), `/healthz`
(liveness) and `/readyz` (readiness).

prometheus-client's own server serves nothing but metrics, so this is a small WSGI
app on wsgiref (standard library, one thread per request, daemon threads) that hands
`/metrics` to prometheus-client's WSGI app and answers the health routes from a
callable returning `consumer.Health` (`WorkerCore.health`). Health answers are 200
with a small JSON body, or 503 with the same body when not live / not ready; any
other path is 404. Requests are not logged (a probe every few seconds would drown the
worker's log).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import REGISTRY, CollectorRegistry, make_wsgi_app

if TYPE_CHECKING:
    from wsgiref.types import StartResponse, WSGIApplication, WSGIEnvironment

    from rabbit_delay._consumer.health import Health

METRICS_PATH = "/metrics"
LIVENESS_PATH = "/healthz"
READINESS_PATH = "/readyz"

_JSON = [("Content-Type", "application/json"), ("Cache-Control", "no-store")]


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a hanging client never holds the process at exit
    allow_reuse_address = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


def endpoints_app(
    health: Callable[[], Health] | None = None,
    registry: CollectorRegistry | None = None,
    *,
    metrics: bool = True,
) -> WSGIApplication:
    """The WSGI app: /metrics (when `metrics`, serving `registry`, by default the global
    REGISTRY), /healthz and /readyz (when `health` is given)."""
    metrics_app = make_wsgi_app(registry if registry is not None else REGISTRY)
    served = ([METRICS_PATH] if metrics else []) + (
        [LIVENESS_PATH, READINESS_PATH] if health is not None else []
    )
    not_found = f"not found: this server serves {', '.join(served)}\n".encode()

    def app(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO") or "/"
        if metrics and path == METRICS_PATH:
            return metrics_app(environ, start_response)  # type: ignore[no-any-return]
        if health is not None and path in (LIVENESS_PATH, READINESS_PATH):
            now = health()
            ok = now.live if path == LIVENESS_PATH else now.ready
            body = json.dumps(now.as_json()).encode()
            status = "200 OK" if ok else "503 Service Unavailable"
            start_response(status, [*_JSON, ("Content-Length", str(len(body)))])
            return [body]
        start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
        return [not_found]

    return app


def serve(
    port: int,
    *,
    addr: str = "0.0.0.0",
    health: Callable[[], Health] | None = None,
    registry: CollectorRegistry | None = None,
    metrics: bool = True,
) -> tuple[WSGIServer, threading.Thread]:
    """Serve `endpoints_app(...)` on `addr:port` from a daemon thread. Port 0 picks a
    free port (`server.server_port`); `server.shutdown()` stops it. Raises OSError if
    the port is taken."""
    server = make_server(
        addr,
        port,
        endpoints_app(health, registry, metrics=metrics),
        server_class=_Server,
        handler_class=_QuietHandler,
    )
    thread = threading.Thread(target=server.serve_forever, name="rabbit-delay-http", daemon=True)
    thread.start()
    return server, thread


__all__ = [
    "LIVENESS_PATH",
    "METRICS_PATH",
    "READINESS_PATH",
    "endpoints_app",
    "serve",
    "start_metrics_server",
]


def start_metrics_server(
    port: int, *, addr: str = "0.0.0.0", registry: CollectorRegistry | None = None
) -> tuple[WSGIServer, threading.Thread]:
    """Serve /metrics over HTTP on a daemon thread (`rabbit_delay._io.endpoints`, which
    also serves a worker's /healthz and /readyz when given its health).

    Serves `registry`, by default the global REGISTRY (where `default_metrics()` lives,
    beside the process and platform collectors). Port 0 picks a free port
    (`server.server_port`); `server.shutdown()` stops it. Raises OSError if the port is
    taken.
    """
    return serve(port, addr=addr, registry=registry if registry is not None else REGISTRY)
