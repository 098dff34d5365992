"""Order timeouts with the consumer framework: publish, handle, cancel.

    .venv/bin/python examples/order_timeout_worker.py

What it does:

1. declares a small topology (a 1 s tier, one business queue `orders.timeout`) in a
   namespace of its own;
2. starts a worker (the sync one, handler threads on pika; `--async` for aio-pika)
   whose handler cancels the orders that are still unpaid when their timeout fires;
3. publishes a payment timeout for orders 1001 and 1002, due in 1 s;
4. order 1002 is paid at once: `app.cancel(message_id)` records a tombstone, so its
   timeout is acked and dropped when it comes due, without running the handler;
5. waits (at most 15 s) for the timeout of 1001 to be handled and the one of 1002 to
   be dropped, stops the worker as SIGTERM would, deletes the topology, and exits 0.
   It exits 1 if something else happened, 2 if there is no broker.

The broker is $RABBIT_DELAY_URL or amqp://guest:guest@127.0.0.1:5672/%2F. The same
app runs as a service with `rabbit-delay worker myapp:app`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from rabbit_delay import (
    App,
    BrokerUnavailable,
    ConnectionSettings,
    HandlerContext,
    Topology,
    redact,
    topology_from_dict,
)
from rabbit_delay.sync import Publisher, connect, connected, declare
from rabbit_delay.sync import delete_topology as sync_delete_topology

NAMESPACE_ENV = "RABBIT_DELAY_EXAMPLE_NAMESPACE"  # tests run examples in a namespace of their own
DEADLINE_S = 15.0


class OrderTimeout(BaseModel):
    order_id: int


def make_app(namespace: str, store_path: Path) -> tuple[App, dict[int, str]]:
    topology = topology_from_dict(
        {
            "namespace": namespace,
            "tiers": {"1s": "1s"},
            "queues": {"orders.timeout": {"retry": {"tiers": ["1s"], "max_attempts": 3}}},
            # SQLite: shared by every worker process and by the code that calls cancel().
            "idempotency": {"store": "sqlite", "path": str(store_path)},
        },
        source="examples/order_timeout_worker.py",
    )
    app = App(topology)
    cancelled: dict[int, str] = {}  # stands in for the orders database

    @app.consumer("orders.timeout", model=OrderTimeout)
    def cancel_unpaid_order(msg: OrderTimeout, ctx: HandlerContext) -> None:
        # Runs once per message, acked only after it returns; an exception would retry
        # it through the 1 s tier, then park it with the reason.
        cancelled[msg.order_id] = f"attempt {ctx.attempt}, {ctx.lateness_ms} ms after due"
        print(f"order {msg.order_id}: still unpaid, cancelled ({cancelled[msg.order_id]})")

    return app, cancelled


def delete_topology(url: str, topology: Topology) -> None:
    with connected(url, name="rabbit-delay cleanup") as connection:
        sync_delete_topology(connection, topology)


def start_worker(app: App, url: str, use_async: bool) -> tuple[threading.Thread, Any]:
    """The worker on a thread, so this one script can also publish; `rabbit-delay worker`
    runs it in the foreground instead, stopped by SIGINT/SIGTERM."""
    if use_async:
        from rabbit_delay import AsyncWorker

        async_worker = AsyncWorker(app, url, install_signal_handlers=False)
        thread = threading.Thread(target=lambda: asyncio.run(async_worker.run()), daemon=True)
        thread.start()
        return thread, async_worker
    from rabbit_delay import Worker

    worker = Worker(app, url, install_signal_handlers=False)
    thread = threading.Thread(target=worker.run, name="worker", daemon=True)
    thread.start()
    return thread, worker


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--async", dest="use_async", action="store_true", help="run the aio-pika worker"
    )
    args = parser.parse_args(argv)
    url = ConnectionSettings().resolve(None)[0]
    namespace = os.environ.get(NAMESPACE_ENV) or "orders" + uuid.uuid4().hex[:6]
    with tempfile.TemporaryDirectory(prefix="order-timeouts-") as tmp:
        app, cancelled = make_app(namespace, Path(tmp) / "idempotency.sqlite3")
        try:
            conn = connect(url, name="example order_timeout_worker")
        except BrokerUnavailable as exc:
            print(f"no broker: {redact(str(exc))}", file=sys.stderr)
            return 2
        try:
            declare(conn, app.topology)
        finally:
            conn.close()
        print(f"declared {app.topology.names.prefix}: tier 1s, queue orders.timeout")
        try:
            return run(app, cancelled, url, args.use_async)
        finally:
            delete_topology(url, app.topology)
            app.close()


def run(app: App, cancelled: dict[int, str], url: str, use_async: bool) -> int:
    thread, worker = start_worker(app, url, use_async)
    if not worker.started.wait(10):
        print("the worker did not start", file=sys.stderr)
        return 1
    with Publisher(app.topology, url) as publisher:
        ids = {
            order_id: publisher.publish_delayed(
                OrderTimeout(order_id=order_id), "1s", queue="orders.timeout"
            )
            for order_id in (1001, 1002)
        }
    print(f"published payment timeouts for orders 1001 and 1002 (due in 1 s): {ids}")
    app.cancel(ids[1002])  # the payment of 1002 arrived: its timeout must not fire
    print("order 1002 paid: its timeout is cancelled")

    stats = worker.stats
    deadline = time.monotonic() + DEADLINE_S
    while not (1001 in cancelled and stats.cancelled == 1) and time.monotonic() < deadline:
        time.sleep(0.1)
    worker.stop()
    thread.join(DEADLINE_S)
    print(f"worker stats: {stats.as_dict()}")
    if sorted(cancelled) == [1001] and stats.cancelled == 1 and stats.parked == 0:
        print("ok: 1001 cancelled once by the worker, 1002's timeout dropped")
        return 0
    print(f"unexpected: cancelled orders {sorted(cancelled)}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
