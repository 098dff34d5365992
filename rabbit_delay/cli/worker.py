"""worker: run an App's consumers."""

from __future__ import annotations

import asyncio
import importlib
import logging
import sys
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from rabbit_delay.cli._app import UrlOpt, app, errors_to_exit, fail, url_for
from rabbit_delay.consumer import App, Transport
from rabbit_delay.consumer._worker_base import WorkerSettings

if TYPE_CHECKING:
    from rabbit_delay.aio.worker import AsyncWorker
from rabbit_delay.durations import parse_ms
from rabbit_delay.errors import DurationError
from rabbit_delay.urls import redact


class TransportChoice(StrEnum):
    AUTO = "auto"
    SYNC = "sync"
    ASYNC = "async"


class LogLevel(StrEnum):
    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# The AMQP clients: pika (sync), aio-pika and aiormq under it (async).
CLIENT_LOGGERS = ("pika", "aio_pika", "aiormq")


class _RedactingFormatter(logging.Formatter):
    """Client libraries log what they like at debug level; never a password in a URL."""

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


def configure_logging(level: LogLevel) -> None:
    """rabbit-delay's loggers at `level`; the AMQP clients' only at debug.

    The workers log every connection problem themselves, redacted and once. The clients
    log the same failure again as a handful of ERROR lines and a traceback (pika's
    `LOGGER.exception` on a refused login), and pika logs each 404 of a passive declare
    as a warning: details for --log-level debug, noise otherwise.
    """
    handler = logging.StreamHandler()  # stderr
    handler.setFormatter(_RedactingFormatter(LOG_FORMAT))
    logging.basicConfig(level=logging.WARNING, handlers=[handler])
    logging.getLogger("rabbit_delay").setLevel(level.upper())
    client_level = logging.INFO if level is LogLevel.DEBUG else logging.CRITICAL
    for name in CLIENT_LOGGERS:
        logging.getLogger(name).setLevel(client_level)


def load_app(target: str, app_dir: Path) -> App:
    """Import `MODULE:ATTR` (ATTR may be dotted, or a factory returning an App)."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        fail(f"{target!r}: give the app as MODULE:APP, e.g. myapp.workers:app")
    sys.path.insert(0, str(app_dir.resolve()))
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        if exc.name == module_name or module_name.startswith(f"{exc.name}."):
            fail(
                f"cannot import module {module_name!r} from {app_dir.resolve()} "
                "(or sys.path): use --app-dir to name its directory"
            )
        raise
    obj: object = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            fail(f"module {module_name!r} has no attribute {attr!r}")
    if not isinstance(obj, App) and callable(obj):
        obj = obj()
    if not isinstance(obj, App):
        fail(f"{target!r} is a {type(obj).__name__}, not a rabbit_delay.consumer.App")
    return obj


TargetArg = Annotated[
    str, typer.Argument(metavar="MODULE:APP", help="The App, e.g. myapp.workers:app.")
]
QueueOpt = Annotated[
    list[str] | None,
    typer.Option("--queue", "-q", help="Consume only this queue (repeatable); default: all."),
]
PrefetchOpt = Annotated[
    int | None,
    typer.Option(
        "--prefetch", min=1, help="Unacked deliveries per queue (default: 2 x concurrency)."
    ),
]
ConcurrencyOpt = Annotated[
    int | None,
    typer.Option("--concurrency", "-c", min=1, help="Handlers at once (default: sync 4, async 16)"),
]
DeclareOpt = Annotated[
    bool, typer.Option("--declare", help="Declare the topology first (needs configure permission).")
]
TransportOpt = Annotated[
    TransportChoice,
    typer.Option(
        "--transport",
        help=(
            "sync (pika, threads) or async (aio-pika); auto: async if a handler or reconciler "
            "is async def."
        ),
    ),
]
ShutdownOpt = Annotated[
    str, typer.Option("--shutdown-timeout", help="On SIGINT/SIGTERM, time for in-flight handlers.")
]
AppDirOpt = Annotated[
    Path, typer.Option("--app-dir", help="Directory to import MODULE from (default: current).")
]
MetricsPortOpt = Annotated[
    int | None,
    typer.Option("--metrics-port", min=0, help="Serve Prometheus /metrics on this port."),
]
LogLevelOpt = Annotated[
    LogLevel,
    typer.Option(
        "--log-level",
        help="Level of rabbit-delay's loggers; debug also shows the AMQP client's (pika, aiormq).",
    ),
]


@app.command()
def worker(
    target: TargetArg,
    queue: QueueOpt = None,
    prefetch: PrefetchOpt = None,
    concurrency: ConcurrencyOpt = None,
    declare: DeclareOpt = False,
    transport: TransportOpt = TransportChoice.AUTO,
    shutdown_timeout: ShutdownOpt = "30s",
    app_dir: AppDirOpt = Path("."),
    log_level: LogLevelOpt = LogLevel.INFO,
    metrics_port: MetricsPortOpt = None,
    url: UrlOpt = None,
) -> None:
    """Run the consumers of MODULE:APP until SIGINT/SIGTERM.

    Acks after the handler returned; failures retry through the queue's delay tiers
    and end up in its parking lot. Without --declare, queues are only checked with
    passive declarations (read permission is enough).
    """
    configure_logging(log_level)
    try:
        timeout_s = parse_ms(shutdown_timeout) / 1000
    except DurationError as exc:
        fail(f"--shutdown-timeout: {exc}")
    with errors_to_exit():
        the_app = load_app(target, app_dir)
        consumers = the_app.select(queue)
        if transport is TransportChoice.AUTO:
            uses_async = any(c.is_async for c in consumers) or any(
                r.is_async for r in the_app.reconcilers.values()
            )
            chosen = Transport.ASYNC if uses_async else Transport.SYNC
        else:
            chosen = Transport(transport.value)
        broker = url_for(url)
        metrics = None
        if metrics_port is not None:
            from rabbit_delay.metrics import default_metrics, start_metrics_server

            metrics = default_metrics()
            start_metrics_server(metrics_port)
        # concurrency None: each worker's own default (4 threads, 16 tasks)
        settings: WorkerSettings = {
            "queues": queue,
            "prefetch": prefetch,
            "concurrency": concurrency,
            "declare": declare,
            "shutdown_timeout": timeout_s,
            "metrics": metrics,
        }
        try:
            if chosen is Transport.SYNC:
                from rabbit_delay.sync.worker import Worker

                Worker(the_app, broker, **settings).run()
            else:
                from rabbit_delay.aio.worker import AsyncWorker

                asyncio.run(_run_async(the_app, AsyncWorker(the_app, broker, **settings)))
        finally:
            if chosen is Transport.SYNC:
                the_app.close()


async def _run_async(the_app: App, async_worker: AsyncWorker) -> None:
    try:
        await async_worker.run()
    finally:
        await the_app.aclose()


__all__ = ["configure_logging", "load_app", "worker"]
