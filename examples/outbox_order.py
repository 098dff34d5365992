"""The transactional outbox: an order and its payment timeout, in one transaction.

    .venv/bin/python examples/outbox_order.py

What it does:

1. declares a small topology in a namespace of its own: a `payment-timeout` tier (30
   minutes in a shop; 2 s here, so the example ends) and the business queue
   `orders.cancel-unpaid`;
2. places order 1001: one SQLite transaction writes the order row AND its timeout
   message (`Outbox.add`), so there is never an order without its timeout, nor a
   timeout for an order that does not exist;
3. tries to place order 1002, whose transaction fails after the outbox row was written:
   the rollback takes the row with it, and its timeout is never published;
4. runs the relay in-process once (`Relay.run_once()`; a service runs
   `rabbit-delay relay FILE --db sqlite:///shop.db` instead): the committed row is
   published, confirmed, and marked sent;
5. a worker receives the timeout when it is due (counted from the order's creation, not
   from the relay) and cancels order 1001, still unpaid; then it stops, deletes the
   topology and exits 0 (1 if anything else happened, 2 without a broker).

The broker is $RABBIT_DELAY_URL or amqp://guest:guest@127.0.0.1:5672/%2F.
"""

from __future__ import annotations

import os
import sqlite3
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

from pydantic import BaseModel

from rabbit_delay import (
    App,
    BrokerUnavailable,
    ConnectionSettings,
    HandlerContext,
    Topology,
    Worker,
    redact,
    topology_from_dict,
)
from rabbit_delay.outbox import Outbox, Relay
from rabbit_delay.sync import connect, connected, declare, delete_topology

NAMESPACE_ENV = "RABBIT_DELAY_EXAMPLE_NAMESPACE"  # tests run examples in a namespace of their own
TIMEOUT = "2s"  # a shop would write "30m"
DEADLINE_S = 20.0


class CancelUnpaid(BaseModel):
    order_id: int


def make_topology(namespace: str) -> Topology:
    return topology_from_dict(
        {
            "namespace": namespace,
            "tiers": {"payment-timeout": TIMEOUT},
            "queues": {"orders.cancel-unpaid": {"tiers": ["payment-timeout"]}},
            "idempotency": {"store": "memory"},
        },
        source="examples/outbox_order.py",
    )


def open_shop(path: Path, outbox: Outbox) -> sqlite3.Connection:
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA journal_mode=WAL")  # the relay reads while the shop writes
    conn.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, status TEXT NOT NULL)")
    outbox.install(conn)
    conn.commit()
    return conn


def place_order(conn: sqlite3.Connection, outbox: Outbox, order_id: int, *, fail: bool) -> str:
    """The order and its timeout, in one transaction (`with conn`: commit, or rollback
    on an exception)."""
    with conn:
        conn.execute("INSERT INTO orders VALUES (?, 'open')", (order_id,))
        message_id = outbox.add(
            conn,
            CancelUnpaid(order_id=order_id),
            "payment-timeout",
            queue="orders.cancel-unpaid",
            message_id=f"order-{order_id}-payment-timeout",
        )
        if fail:
            raise RuntimeError(f"order {order_id}: the card was declined while saving")
    return message_id


def main() -> int:
    url = ConnectionSettings().resolve(None)[0]
    namespace = os.environ.get(NAMESPACE_ENV) or "outbox" + uuid.uuid4().hex[:6]
    topology = make_topology(namespace)
    try:
        conn = connect(url, name="example outbox_order")
    except BrokerUnavailable as exc:
        print(f"no broker: {redact(str(exc))}", file=sys.stderr)
        return 2
    try:
        declare(conn, topology)
    finally:
        conn.close()
    try:
        with tempfile.TemporaryDirectory(prefix="outbox-order-") as tmp:
            return run(topology, Path(tmp) / "shop.db", url)
    finally:
        with connected(url, name="rabbit-delay cleanup") as cleanup:
            delete_topology(cleanup, topology)


def run(topology: Topology, path: Path, url: str) -> int:
    outbox = Outbox(topology)
    shop = open_shop(path, outbox)
    app = App(topology)
    cancelled: dict[int, int] = {}  # order id -> ms after its due time

    # The worker's own connection to the shop's database (it runs on another thread).
    worker_db = sqlite3.connect(path, check_same_thread=False)

    @app.consumer("orders.cancel-unpaid", model=CancelUnpaid)
    def cancel_unpaid(msg: CancelUnpaid, ctx: HandlerContext) -> None:
        with worker_db:
            worker_db.execute(
                "UPDATE orders SET status = 'cancelled' WHERE id = ? AND status = 'open'",
                (msg.order_id,),
            )
        cancelled[msg.order_id] = ctx.lateness_ms or 0
        print(f"order {msg.order_id}: unpaid at its timeout, cancelled ({ctx.lateness_ms} ms late)")

    worker = Worker(app, url, install_signal_handlers=False)
    thread = threading.Thread(target=worker.run, name="worker", daemon=True)
    thread.start()
    try:
        if not worker.started.wait(10):
            print("the worker did not start", file=sys.stderr)
            return 1
        return scenario(topology, path, url, shop, outbox, cancelled)
    finally:
        worker.stop()
        thread.join(DEADLINE_S)
        app.close()
        shop.close()
        worker_db.close()


def scenario(
    topology: Topology,
    path: Path,
    url: str,
    shop: sqlite3.Connection,
    outbox: Outbox,
    cancelled: dict[int, int],
) -> int:
    placed = time.monotonic()
    place_order(shop, outbox, 1001, fail=False)
    print(f"order 1001 placed: the order and its {TIMEOUT} timeout committed together")
    try:
        place_order(shop, outbox, 1002, fail=True)
    except RuntimeError as exc:
        print(f"order 1002 failed ({exc}): rolled back, with its timeout")
    failures: list[str] = []
    if outbox.pending(shop) != 1:
        failures.append(f"{outbox.pending(shop)} pending outbox rows, expected 1")

    with Relay(topology, f"sqlite:///{path}", url=url) as relay:
        stats = relay.run_once()
        left = relay.pending()
    print(f"relay: {stats.relayed} row(s) published and marked sent, {left} pending")
    if (stats.relayed, left) != (1, 0):
        failures.append(f"the relay relayed {stats.relayed} row(s), left {left}")

    deadline = time.monotonic() + DEADLINE_S
    while 1001 not in cancelled and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # order 1002's timeout, had it been published, would be due too
    status = dict(shop.execute("SELECT id, status FROM orders").fetchall())
    waited = time.monotonic() - placed
    if status != {1001: "cancelled"}:
        failures.append(f"orders are {status}, expected only 1001, cancelled")
    if sorted(cancelled) != [1001]:
        failures.append(f"timeouts handled for orders {sorted(cancelled)}, expected [1001]")
    if cancelled.get(1001, 0) < 0 or waited < topology.tiers["payment-timeout"] / 1000:
        failures.append("the timeout arrived before it was due")
    for failure in failures:
        print(f"FAILED: {failure}", file=sys.stderr)
    if failures:
        return 1
    print("ok: one transaction for the order and its timeout; the rolled-back one never sent")
    return 0


if __name__ == "__main__":
    sys.exit(main())
