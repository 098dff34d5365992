"""`rabbit-delay dashboard`: a local web UI on what `status`, `parked` and `replay` read
and do (docs/dashboard.md). The decisions are in
rabbit_delay._ops.dashboard.rules, the HTTP layer in rabbit_delay._ops.dashboard.server,
the broker calls in rabbit_delay._ops.dashboard.execute."""

from __future__ import annotations

import json
import logging
import threading
from typing import Annotated

import typer

import rabbit_delay._cli.options as opt
from rabbit_delay._durations import parse_positive_ms
from rabbit_delay._errors import ConfigError
from rabbit_delay._ops.dashboard.rules import (
    DEFAULT_HOST,
    DEFAULT_PORT,
    DEFAULT_REFRESH_S,
    MIN_REFRESH_S,
    check_binding,
    parse_auth,
    start_message,
)
from rabbit_delay._stop_signals import install_stop_signals
from rabbit_delay._urls import redact

log = logging.getLogger("rabbit_delay.dashboard")


def dashboard(
    file: opt.TopologyArg = None,
    topology_file: opt.TopologyOpt = None,
    url: opt.UrlOpt = None,
    port: Annotated[
        int, typer.Option("--port", "-p", min=0, max=65535, help="Port to listen on (0: any free).")
    ] = DEFAULT_PORT,
    host: Annotated[
        str,
        typer.Option(
            "--host",
            help="Address to listen on. Anything but loopback needs --auth.",
        ),
    ] = DEFAULT_HOST,
    metrics: Annotated[
        list[str] | None,
        typer.Option(
            "--metrics",
            help="A worker's Prometheus endpoint (http://HOST:PORT/metrics, its "
            "--metrics-port); repeat it for several workers: their lateness histograms are "
            "summed per queue and tier.",
            show_default=False,
        ),
    ] = None,
    refresh: Annotated[
        str,
        typer.Option(
            "--refresh",
            help=f"How often the broker is read, at most, whatever the number of pages open "
            f"(a duration or seconds, at least {MIN_REFRESH_S:g}s).",
        ),
    ] = f"{DEFAULT_REFRESH_S:g}s",
    allow_actions: Annotated[
        bool,
        typer.Option(
            "--allow-actions",
            help="Allow replaying and purging parked messages from the page (POST, with a "
            "per-run token). Read-only without it.",
        ),
    ] = False,
    auth: Annotated[
        str | None,
        typer.Option(
            "--auth",
            help="user:password (HTTP Basic) or a TOKEN (Authorization: Bearer TOKEN, or "
            "HTTP Basic with TOKEN as the password) required on every request; needed to "
            "listen on anything but loopback.",
            show_default=False,
        ),
    ] = None,
    management_url: opt.MgmtOpt = None,
    no_management: opt.NoMgmtOpt = False,
    log_level: opt.LogLevelOpt = opt.LogLevel.INFO,
    as_json: opt.JsonOpt = False,
) -> None:
    """Serve a web UI: the topology as a picture with live depths and what needs
    attention (the rules of `status --check`), the age of each tier's oldest message,
    lateness histograms from the workers' metrics, and the parking lots (paged; a
    message's traceback and body on demand). For a topology with a schedule: per queue
    what comes due over the next hours, and a key's record. Nothing is moved unless
    --allow-actions.

    Runs until Ctrl-C / SIGTERM. Exit code 1 when it cannot start (bad option, topology
    or URL, a non-loopback --host without --auth, the port taken).
    """
    from rabbit_delay._ops.dashboard.execute import BrokerBackend
    from rabbit_delay._ops.dashboard.server import Dashboard, serve

    opt.configure_logging(log_level)
    with opt.errors_to_exit():
        every_s = parse_positive_ms(refresh) / 1000
        if every_s < MIN_REFRESH_S:
            raise ConfigError(
                f"--refresh {refresh}: at least {MIN_REFRESH_S:g}s (every read costs a passive "
                "declare per queue and exchange)"
            )
        credentials = parse_auth(auth)
        check_binding(host, credentials)
        topology = opt.resolve_topology(file, topology_file)
        urls = opt.url_for(url)
        backend = BrokerBackend(
            topology,
            urls,
            every=every_s,
            management_url=management_url,
            no_management=no_management,
        )
        board = Dashboard(
            backend,
            refresh_s=every_s,
            metrics_urls=tuple(metrics or ()),
            allow_actions=allow_actions,
            auth=credentials,
            host=host,
            port=port,
        )
    try:
        server, thread = serve(board, host, port)
    except OSError as exc:
        opt.fail(f"cannot listen on {host}:{port}: {exc.strerror or exc}", kind="OSError")
    # Before the start line: a SIGTERM sent as soon as it is read stops cleanly.
    stop = threading.Event()
    restore = install_stop_signals(lambda _name: stop.set())
    line = start_message(
        host,
        server.server_port,
        actions=allow_actions,
        auth=credentials,
        broker=redact(urls[0]),
        refresh_s=every_s,
    )
    if as_json:
        print(
            json.dumps(
                {
                    "listening": f"{host}:{server.server_port}",
                    "port": server.server_port,
                    "actions": allow_actions,
                    "auth": credentials is not None,
                    "broker": redact(urls[0]),
                    "refresh_s": every_s,
                }
            ),
            flush=True,
        )
    else:
        opt.out.print(line, markup=False)
    log.info("%s", line)
    try:
        while not stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        restore()
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
        backend.close()
    log.info("dashboard stopped")
    raise typer.Exit(0)


__all__ = ["dashboard"]
