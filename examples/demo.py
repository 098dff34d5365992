"""rabbit-delay in ten seconds: declare, publish delayed messages, watch them arrive on time.

    bash .ci/demo                       # creates .venv, makes sure RabbitMQ is up, runs this
    .venv/bin/python examples/demo.py   # the same, once .venv exists and a broker runs

What it does:

1. declares a small topology (namespace `demo`: tiers 1s and 3s, three business queues);
2. publishes a few delayed messages through the sync publisher, and one through the
   async one (every publish confirmed by the broker);
3. runs the consumer framework's worker (pydantic models, manual acks, idempotency
   guard) and prints, for each message, its queue, tier, scheduled time, arrival time
   and lateness. One push handler fails on its first attempt: the worker retries it
   through the 1 s tier (attempt 2). One coupon message does not fit its model: it is
   parked at once with the validation error;
4. deletes the demo topology (unless --keep) and exits 0 when every message arrived on
   time (never early, less than 1 s late), the retry happened and the bad message was
   parked. Otherwise it exits 1; 2 if there is no broker.

The broker is $RABBIT_DELAY_URL or amqp://guest:guest@127.0.0.1:5672/%2F.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import pika
import pika.exceptions
from pydantic import BaseModel

from rabbit_delay import (
    App,
    BrokerUnavailable,
    ConnectionSettings,
    HandlerContext,
    RabbitDelayError,
    Topology,
    Worker,
    redact,
    topology_from_dict,
)
from rabbit_delay.aio import AsyncPublisher
from rabbit_delay.stores import MemoryStore
from rabbit_delay.sync import Publisher, connect, connected, declare
from rabbit_delay.sync import delete_topology as sync_delete_topology

NAMESPACE_ENV = "RABBIT_DELAY_EXAMPLE_NAMESPACE"  # tests run examples in a namespace of their own
MAX_LATE_MS = 1_000
ON_TIME = f"never early, less than {MAX_LATE_MS} ms late"
GRACE_S = 5.0  # how long after the last due time to wait for stragglers


def demo_topology(namespace: str) -> Topology:
    return topology_from_dict(
        {
            "namespace": namespace,
            "tiers": {"1s": "1s", "3s": "3s"},
            "queues": {
                "orders.cancel-unpaid": {
                    "tiers": ["3s", "1s"],
                    "bindings": ["order.payment-timeout"],
                },
                "coupons.expire": {"tiers": ["1s", "3s"]},
                "push.send": {"tiers": ["1s"]},
            },
        },
        source="examples/demo.py",
    )


@dataclass
class Sent:
    queue: str
    what: str
    arrived_ms: int | None = None
    due_ms: int | None = None
    tier: str | None = None
    attempt: int = 1


def publish_sync(topology: Topology, url: str, sent: dict[str, Sent]) -> None:
    with Publisher(topology, url) as publisher:
        mid = publisher.publish_delayed({"order_id": 1001}, "3s", queue="orders.cancel-unpaid")
        sent[mid] = Sent("orders.cancel-unpaid", "cancel order 1001 if still unpaid")
        mid = publisher.publish_delayed({"coupon": "WELCOME10"}, "1s", queue="coupons.expire")
        sent[mid] = Sent("coupons.expire", "expire coupon WELCOME10")
        # A delay instead of a tier name: it must match a tier exactly (1 s here).
        mid = publisher.publish_delayed(
            {"user": 42, "text": "your cart misses you"},
            delay=timedelta(seconds=1),
            queue="push.send",
        )
        sent[mid] = Sent("push.send", "push to user 42")
        # Through a binding key instead of the queue name.
        mid = publisher.publish_delayed(
            {"order_id": 1002}, "1s", routing_key="order.payment-timeout"
        )
        sent[mid] = Sent("orders.cancel-unpaid", "cancel order 1002 (by binding key)")
        # Many at once: confirms pipelined.
        coupons = ["SPRING5", "VIP20", "FREESHIP"]
        for code, mid in zip(
            coupons,
            publisher.publish_many([{"coupon": c} for c in coupons], "3s", queue="coupons.expire"),
            strict=True,
        ):
            sent[mid] = Sent("coupons.expire", f"expire coupon {code}")
        # Does not fit the Coupon model: the worker parks it at once (no retry).
        publisher.publish_delayed({"kupon": "TYPO"}, "1s", queue="coupons.expire")


async def publish_async(topology: Topology, url: str, sent: dict[str, Sent]) -> None:
    publisher = await AsyncPublisher.connect(topology, url)
    try:
        mid = await publisher.publish_delayed(
            {"user": 7, "text": "come back"}, "1s", queue="push.send"
        )
        sent[mid] = Sent("push.send", "push to user 7 (async publisher)")
    finally:
        await publisher.close()


def clock(ms: int | None) -> str:
    if ms is None:
        return "-"
    return datetime.fromtimestamp(ms / 1000, UTC).astimezone().strftime("%H:%M:%S.%f")[:-3]


class Coupon(BaseModel):
    coupon: str


class CancelOrder(BaseModel):
    order_id: int


class Push(BaseModel):
    user: int
    text: str


def demo_app(topology: Topology, sent: dict[str, Sent]) -> App:
    """Handlers for the three queues; each records when its message arrived."""
    app = App(topology, store=MemoryStore())  # one process: the in-memory guard will do
    failed_once: set[str] = set()

    def record(ctx: HandlerContext) -> None:
        entry = sent.get(ctx.message_id or "")
        if entry is not None and entry.arrived_ms is None:
            entry.arrived_ms = ctx.received_ms
            entry.due_ms = ctx.envelope.due_at_ms
            entry.tier = ctx.tier
            entry.attempt = ctx.attempt

    @app.consumer("orders.cancel-unpaid", model=CancelOrder)
    def cancel_order(msg: CancelOrder, ctx: HandlerContext) -> None:
        record(ctx)

    @app.consumer("coupons.expire", model=Coupon)
    def expire_coupon(msg: Coupon, ctx: HandlerContext) -> None:
        record(ctx)

    @app.consumer("push.send", model=Push)
    def send_push(msg: Push, ctx: HandlerContext) -> None:
        if msg.user == 42 and ctx.message_id not in failed_once:
            failed_once.add(ctx.message_id or "")
            raise ConnectionError("push gateway timed out")  # retried through the 1s tier
        record(ctx)

    return app


def consume(app: App, url: str, sent: dict[str, Sent], deadline: float) -> Any:
    """Run the worker until every sent message was handled or the deadline passed."""
    worker = Worker(app, url, install_signal_handlers=False)
    thread = threading.Thread(target=worker.run, name="demo worker", daemon=True)
    thread.start()
    try:
        if not worker.started.wait(10):
            raise RuntimeError("the worker did not start")
        while time.monotonic() < deadline and not (
            all(s.arrived_ms is not None for s in sent.values()) and worker.stats.parked >= 1
        ):
            time.sleep(0.05)
    finally:
        worker.stop()  # as SIGTERM would: in-flight handlers finish, then it closes
        thread.join(10)
    return worker.stats  # the worker's counters: acked, retried, parked...


def purge_business_queues(topology: Topology, url: str) -> None:
    """Leftovers of an interrupted earlier run would be reported as strays."""
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        ch = conn.channel()
        for queue in topology.queues:
            ch.queue_purge(topology.names.business_queue(queue))
    finally:
        conn.close()


def delete_topology(topology: Topology, url: str) -> None:
    with connected(url, name="rabbit-delay demo cleanup") as connection:
        sync_delete_topology(connection, topology)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="rabbit-delay demo: delayed messages arriving on time."
    )
    parser.add_argument(
        "--url", default=None, help="AMQP URL (default: $RABBIT_DELAY_URL, else the local broker)"
    )
    parser.add_argument("--namespace", default=os.environ.get(NAMESPACE_ENV, "demo"))
    parser.add_argument(
        "--keep", action="store_true", help="keep the demo topology on the broker afterwards"
    )
    args = parser.parse_args(argv)
    # The worker logs each retry and park at INFO: show them in line with the output.
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="  [worker] %(message)s")
    logging.getLogger("pika").setLevel(logging.ERROR)  # the declarer's 404 probes are expected
    logging.getLogger("aio_pika").setLevel(logging.WARNING)
    logging.getLogger("aiormq").setLevel(logging.WARNING)

    url = ConnectionSettings().resolve(args.url)[0]
    topology = demo_topology(args.namespace)
    print(f"broker:   {redact(url)}")
    try:
        conn = connect(url, name="rabbit-delay demo")
    except BrokerUnavailable as exc:
        print(
            f"error: {exc}\nIs RabbitMQ running? `bash .ci/demo` starts a local one; "
            "with Docker: docker compose up -d rabbitmq",
            file=sys.stderr,
        )
        return 2
    try:
        report = declare(conn, topology)
    except RabbitDelayError as exc:
        print(f"error: {redact(str(exc))}", file=sys.stderr)
        return 1
    finally:
        if conn.is_open:
            conn.close()
    created = len(report.created)
    print(f"topology: {topology.names.prefix}.*  tiers 1s, 3s  ({created} object(s) created)")

    sent: dict[str, Sent] = {}
    try:
        purge_business_queues(topology, url)
        publish_sync(topology, url, sent)
        asyncio.run(publish_async(topology, url, sent))
        print(f"published {len(sent)} delayed messages (confirmed); waiting for them...\n")
        deadline = time.monotonic() + max(topology.tiers.values()) / 1000 + GRACE_S
        stats = consume(demo_app(topology, sent), url, sent, deadline)
    except RabbitDelayError as exc:
        print(f"error: {redact(str(exc))}", file=sys.stderr)
        return 1
    finally:
        if not args.keep:
            delete_topology(topology, url)

    header = (
        f"{'queue':<22}{'tier':<6}{'try':<4}{'scheduled':<14}{'arrived':<14}{'late ms':>8}"
        "  result   message"
    )
    print(header)
    print("-" * len(header))
    failures = 0
    for record in sorted(sent.values(), key=lambda s: (s.due_ms or 2**62, s.queue)):
        late = (
            None
            if record.arrived_ms is None or record.due_ms is None
            else record.arrived_ms - record.due_ms
        )
        if late is None:
            result = "MISSING"
        elif late < 0:
            result = "EARLY"
        elif late >= MAX_LATE_MS:
            result = "LATE"
        else:
            result = "on time"
        failures += result != "on time"
        late_text = "-" if late is None else str(late)
        print(
            f"{record.queue:<22}{record.tier or '-':<6}{record.attempt:<4}"
            f"{clock(record.due_ms):<14}{clock(record.arrived_ms):<14}"
            f"{late_text:>8}  {result:<8} {record.what}"
        )
    print(
        f"\nworker: {stats.acked} handled, {stats.retried} retried through a tier, "
        f"{stats.parked} parked (the coupon that does not fit its model)"
    )
    if stats.retried < 1 or stats.parked != 1:
        print("expected one retry and one parked message", file=sys.stderr)
        failures += 1
    if failures:
        print(f"\n{failures} of {len(sent)} message(s) not on time ({ON_TIME})")
        return 1
    print(f"\nall {len(sent)} messages arrived on time ({ON_TIME})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
