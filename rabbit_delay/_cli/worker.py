"""`rabbit-delay worker`: run an App's consumers."""

from __future__ import annotations

import asyncio
import logging
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

import rabbit_delay._cli.options as opt
from rabbit_delay._cli.hold import holder_for
from rabbit_delay._connection import DEFAULT_RECONNECT_MAX_S
from rabbit_delay._consumer.app import App, Transport
from rabbit_delay._consumer.settings import DEFAULT_SHUTDOWN_TIMEOUT_S, WorkerOptions
from rabbit_delay._consumer.worker import WorkerCore
from rabbit_delay._durations import parse_ms
from rabbit_delay._errors import DurationError

if TYPE_CHECKING:
    from rabbit_delay._aio.worker import AsyncWorker

log = logging.getLogger("rabbit_delay.worker")


class TransportChoice(StrEnum):
    AUTO = "auto"
    SYNC = "sync"
    ASYNC = "async"


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
ReconnectMaxOpt = Annotated[
    str,
    typer.Option(
        "--reconnect-max",
        help="After a lost connection, the longest wait between reconnect rounds "
        "(they start at 250ms and double).",
    ),
]
HealthPortOpt = Annotated[
    int | None,
    typer.Option(
        "--health-port",
        min=0,
        max=65535,
        help="Serve only /healthz (liveness) and /readyz (readiness) on this port, "
        "without metrics. Give this or --metrics-port.",
        show_default=False,
    ),
]
HoldOpt = Annotated[
    bool,
    typer.Option(
        "--hold",
        help="Also run a holder of the topology's holding queue (a held table, RabbitMQ "
        "4.3+, the held extra) in this process; see `rabbit-delay hold`.",
    ),
]
LogFormatOpt = Annotated[
    opt.LogFormat,
    typer.Option(
        "--log-format",
        help="text lines, or json: one JSON object per line (ts, level, logger, message; "
        "message_id, queue, attempt, tier for a delivery; exc_info).",
    ),
]


def worker(
    target: opt.TargetArg,
    queue: QueueOpt = None,
    prefetch: PrefetchOpt = None,
    concurrency: ConcurrencyOpt = None,
    declare: DeclareOpt = False,
    transport: TransportOpt = TransportChoice.AUTO,
    shutdown_timeout: ShutdownOpt = f"{DEFAULT_SHUTDOWN_TIMEOUT_S:g}s",
    reconnect_max: ReconnectMaxOpt = f"{DEFAULT_RECONNECT_MAX_S:g}s",
    app_dir: opt.AppDirOpt = Path("."),
    log_level: opt.LogLevelOpt = opt.LogLevel.INFO,
    log_format: LogFormatOpt = opt.LogFormat.TEXT,
    metrics_port: opt.MetricsPortOpt = None,
    health_port: HealthPortOpt = None,
    url: opt.UrlOpt = None,
    hold: HoldOpt = False,
) -> None:
    """Run the consumers of MODULE:APP until SIGINT/SIGTERM.

    Acks after the handler returned; failures retry through the queue's delay tiers
    and end up in its parking lot. Without --declare, queues are only checked with
    passive declarations (read permission is enough).
    """
    opt.configure_logging(log_level, log_format)
    if metrics_port is not None and health_port is not None:
        opt.fail("give --metrics-port (which also serves /healthz and /readyz) or --health-port")
    durations: dict[str, float] = {}
    for option, text in (
        ("--shutdown-timeout", shutdown_timeout),
        ("--reconnect-max", reconnect_max),
    ):
        try:
            durations[option] = parse_ms(text) / 1000
        except DurationError as exc:
            opt.fail(f"{option}: {exc}", kind=type(exc).__name__)
    if durations["--reconnect-max"] <= 0:
        opt.fail("--reconnect-max: must be longer than zero, e.g. 30s")
    with opt.errors_to_exit():
        broker = opt.url_for(url)  # before importing the app: a bad URL is refused at once
        the_app = opt.load_app(target, app_dir)
        consumers = the_app.select(queue)
        if transport is TransportChoice.AUTO:
            uses_async = any(c.is_async for c in consumers) or any(
                r.is_async for r in the_app.reconcilers.values()
            )
            chosen = Transport.ASYNC if uses_async else Transport.SYNC
        else:
            chosen = Transport(transport.value)
        metrics = None
        if metrics_port is not None:
            from rabbit_delay._observe.metrics import default_metrics

            metrics = default_metrics()
        # concurrency None: each worker's own default (4 threads, 16 tasks)
        settings: WorkerOptions = {
            "queues": queue,
            "prefetch": prefetch,
            "concurrency": concurrency,
            "declare": declare,
            "shutdown_timeout": durations["--shutdown-timeout"],
            "reconnect_max_s": durations["--reconnect-max"],
            "metrics": metrics,
        }
        holder = holder_for(the_app.topology, broker) if hold else None
        if holder is not None:
            holder.start()  # a thread of its own; stopped with the worker
        try:
            if chosen is Transport.SYNC:
                from rabbit_delay._sync.worker import Worker

                sync_worker = Worker(the_app, broker, **settings)
                _serve(sync_worker, metrics_port, health_port)
                sync_worker.run()
            else:
                from rabbit_delay._aio.worker import AsyncWorker

                async_worker = AsyncWorker(the_app, broker, **settings)
                _serve(async_worker, metrics_port, health_port)
                asyncio.run(_run_async(the_app, async_worker))
        finally:
            if holder is not None:
                holder.stop()
            if chosen is Transport.SYNC:
                the_app.close()


def _serve(the_worker: WorkerCore, metrics_port: int | None, health_port: int | None) -> None:
    """Start the HTTP endpoints (rabbit_delay._io.endpoints) before the worker runs, so a
    probe sees it starting. Exits when the port cannot be bound."""
    port = metrics_port if metrics_port is not None else health_port
    if port is None:
        return
    from rabbit_delay._io.endpoints import serve

    try:
        server, _thread = serve(port, health=the_worker.health, metrics=metrics_port is not None)
    except OSError as exc:
        option = "--metrics-port" if metrics_port is not None else "--health-port"
        opt.fail(f"{option} {port}: cannot listen there ({exc.strerror or exc})")
    routes = "/metrics, /healthz, /readyz" if metrics_port is not None else "/healthz, /readyz"
    log.info("serving %s on port %d", routes, server.server_port)


async def _run_async(the_app: App, async_worker: AsyncWorker) -> None:
    try:
        await async_worker.run()
    finally:
        await the_app.aclose()


__all__ = ["worker"]
