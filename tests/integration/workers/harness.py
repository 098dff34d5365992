"""Running either worker in a background thread, with one face, for the behaviour suite.

`RunningWorker(kind, app, url, ...)` runs `Worker.run()` on a thread, or
`AsyncWorker.run()` in `asyncio.run` on a thread; `stop()` is the same call the signal
handlers make. The handlers each kind runs are built by `worker_behaviour.handler` from
the same steps, so each behaviour test is written once. Every wait has a deadline.

Kinds: `KINDS` are the two workers (what `rabbit-delay worker --transport` takes);
`HANDLER_KINDS` adds "async-def", the async worker running a plain `def` handler in its
thread pool, a path of its own (the handler cannot be cancelled, and its result comes
back to the loop from another thread).
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pika
import pika.exceptions
from conftest import wait_for

from rabbit_delay import App
from rabbit_delay._urls import ManagementEndpoint

KINDS = ("sync", "async")  # the workers (transports)
HANDLER_KINDS = ("sync", "async", "async-def")  # a worker and the handlers it runs
START_S = 15.0
STOP_S = 20.0


def transport(kind: str) -> str:
    """The worker a kind runs on: "sync" or "async"."""
    if kind not in HANDLER_KINDS:
        raise ValueError(f"unknown worker kind {kind!r}; the kinds are {HANDLER_KINDS}")
    return "sync" if kind == "sync" else "async"


class RunningWorker:
    """A worker on a background thread. `error` holds what `run()` raised, if anything.

    `close_app=True` closes the app's idempotency store when `run()` returns, on the
    worker's thread, as `rabbit-delay worker` does (`app.close()` after the sync worker,
    `await app.aclose()` in the async worker's loop).
    """

    def __init__(
        self, kind: str, app: App, url: str, *, close_app: bool = False, **options: Any
    ) -> None:
        self.kind = kind
        self.name = f"rd-test-worker-{uuid.uuid4().hex[:10]}"
        options.setdefault("install_signal_handlers", False)
        if transport(kind) == "sync":
            from rabbit_delay import Worker

            self.worker: Any = Worker(app, url, name=self.name, **options)

            def target() -> None:
                try:
                    self.worker.run()
                finally:
                    if close_app:
                        app.close()

        else:
            from rabbit_delay import AsyncWorker

            self.worker = AsyncWorker(app, url, name=self.name, **options)

            async def run_async() -> None:
                try:
                    await self.worker.run()
                finally:
                    if close_app:
                        await app.aclose()

            def target() -> None:
                asyncio.run(run_async())

        self.error: BaseException | None = None

        def main() -> None:
            try:
                target()
            except BaseException as exc:
                self.error = exc

        self.thread = threading.Thread(target=main, name=f"{kind}-worker", daemon=True)

    @property
    def stats(self) -> Any:
        return self.worker.stats

    def start(self) -> RunningWorker:
        self.thread.start()
        wait_for(
            lambda: self.worker.started.is_set() or not self.thread.is_alive(),
            START_S,
            "the worker to start consuming",
        )
        if self.error is not None:
            raise self.error
        return self

    def stop(self, timeout: float = STOP_S) -> None:
        self.worker.stop()
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"the {self.kind} worker did not stop within {timeout}s"
        if self.error is not None:
            raise self.error


# -- broker state -------------------------------------------------------------------------


@dataclass
class Got:
    body: bytes
    properties: pika.BasicProperties

    @property
    def headers(self) -> dict[str, Any]:
        return dict(self.properties.headers or {})


def get_all(url: str, queue: str, expected: int, timeout: float = 15.0) -> list[Got]:
    """Take (and ack) `expected` messages from `queue`, waiting up to `timeout`."""
    got: list[Got] = []
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        channel = conn.channel()
        deadline = time.monotonic() + timeout
        while len(got) < expected:
            method, props, body = channel.basic_get(queue, auto_ack=True)
            if method is None:
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"{queue}: {len(got)} of {expected} message(s) in {timeout}s"
                    )
                time.sleep(0.05)
                continue
            got.append(Got(body, props))
    finally:
        conn.close()
    return got


def _mgmt(endpoint: ManagementEndpoint, method: str, path: str) -> Any:
    request = urllib.request.Request(endpoint.url(path), method=method)
    token = base64.b64encode(f"{endpoint.username}:{endpoint.password}".encode()).decode()
    request.add_header("Authorization", f"Basic {token}")
    request.add_header("X-Reason", "rabbit-delay test: connection loss")
    with urllib.request.urlopen(request, timeout=5) as response:
        data = response.read()
    return json.loads(data) if data else None


def connections_named(endpoint: ManagementEndpoint, client_name: str) -> list[str]:
    """The broker's names of the connections whose client-provided name is `client_name`
    (waits until the management API lists at least one)."""

    def find() -> list[str]:
        rows = _mgmt(endpoint, "GET", "connections?columns=name,client_properties")
        return [
            row["name"]
            for row in rows
            if (row.get("client_properties") or {}).get("connection_name") == client_name
        ]

    names: list[str] = wait_for(find, 20.0, f"connection {client_name!r} in the management API")
    return names


def close_connections(endpoint: ManagementEndpoint, names: list[str]) -> None:
    """Close these connections from the server side (never anyone else's)."""
    for name in names:
        try:
            _mgmt(endpoint, "DELETE", f"connections/{quote(name, safe='')}")
        except urllib.error.HTTPError as exc:
            if exc.code != 404:
                raise


WORKERS_DIR = Path(__file__).resolve().parent


def start_cli_worker(
    kind: str,
    module: str,
    topology_file: Path,
    log: Path,
    url: str,
    output: Path,
    *args: str,
    log_level: str = "info",
    cwd: Path | None = None,
    **env: str,
) -> subprocess.Popen[bytes]:
    """`rabbit-delay worker <module>:app` from this directory, as a process of its own:
    `kind` is one of HANDLER_KINDS ("async-def": the `def` handler on the async worker);
    stdout and stderr go to `output`. The apps read RD_TEST_TOPOLOGY, RD_TEST_LOG and
    RD_TEST_ASYNC."""
    environment = {
        **os.environ,
        "RD_TEST_TOPOLOGY": str(topology_file),
        "RD_TEST_LOG": str(log),
        "RD_TEST_ASYNC": "1" if kind == "async" else "0",
        "PYTHONUNBUFFERED": "1",
        **env,
    }
    command = [
        sys.executable,
        "-c",
        "from rabbit_delay._cli.app import main; main()",
        "worker",
        f"{module}:app",
        "--app-dir",
        str(WORKERS_DIR),
        "--transport",
        transport(kind),
        "--url",
        url,
        "--log-level",
        log_level,
        *args,
    ]
    with output.open("wb") as sink:
        return subprocess.Popen(
            command,
            env=environment,
            cwd=cwd,
            stdout=sink,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
