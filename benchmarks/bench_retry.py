#!/usr/bin/env python3
"""Retry backends side by side: re-publishing through a delay tier ("tiers", the
default) against the quorum queue's own delayed retry ("broker", RabbitMQ 4.3+).

Each contender gets the same N always-failing messages (1,000; --quick: 200) in its own
business queue, max_attempts = 3: every message fails three times, is retried twice and
parked. Both schedules wait 200 ms per retry (a 200 ms tier; the broker backend with
min = max = 200 ms). One AsyncWorker (aio-pika, in-memory idempotency guard, prefetch
128, 64 handlers at once) drains each queue; the contenders take turns over several
rounds (order alternating) and the tables show medians.

    retries/s       retries handled per second: N x 2 / (time from the first delivery
                    until the N-th message is parked)
    time to park    that time, in seconds (the schedule alone is 2 x 200 ms)
    ops/retry       AMQP operations the worker sent per retry, counted on the wire (every
                    basic.publish, basic.ack, basic.reject and basic.nack frame of its
                    channels), minus those of parking (1 publish + 1 ack per message,
                    the same for both): tiers = publish (confirmed) + ack of the original;
                    broker = one reject. A coalesced multiple-ack is one frame, so the
                    tiers figure is a lower bound.
    broker hops     what the broker does on top per retry: tiers enqueues the copy in the
                    tier buffer and dead-letters it back through the due exchange (two
                    quorum-queue writes and a routing step); broker keeps the message in
                    its queue and only delays it (shown, not measured)

The operations are also shown per kind and per message (3 deliveries + park).

    .venv/bin/python benchmarks/bench_retry.py            # full run (~1 minute on 4.3)
    .venv/bin/python benchmarks/bench_retry.py --quick    # smoke: 200 messages x 2 rounds, < 30 s
    .venv/bin/python benchmarks/bench_retry.py --json     # machine-readable results

The broker is `--url`, else $RABBIT_DELAY_BENCH_URL, else the RabbitMQ 4.3 node of this
machine (amqp://guest:guest@127.0.0.1:5743/%2F). On a broker older than 4.3 only the
tiers backend runs (the other is shown as not measured). Exit code 1 if a message was
not attempted exactly max_attempts times and parked (a correctness bug), else 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import statistics
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import aiormq.channel
import pika

from rabbit_delay import App, AsyncWorker, HandlerContext, Topology, topology_from_dict
from rabbit_delay._envelope import encode_body, now_ms, outgoing
from rabbit_delay._ops.delete.execute import delete_topology as sync_delete_topology
from rabbit_delay._topology.delays import Route
from rabbit_delay._urls import redact
from rabbit_delay.stores import MemoryStore
from rabbit_delay.sync import Publisher, broker_info, connected
from rabbit_delay.sync import declare as sync_declare

URL_ENV = "RABBIT_DELAY_BENCH_URL"
DEFAULT_URL = "amqp://guest:guest@127.0.0.1:5743/%2F"  # the RabbitMQ 4.3 node here
TIERS, NATIVE = "tiers", "broker"
QUEUES = {TIERS: "retry-tiers", NATIVE: "retry-broker"}
DELAY = "200ms"
MAX_ATTEMPTS = 3
PREFETCH = 128
CONCURRENCY = 64
TIMEOUT_S = 180.0
BODY: dict[str, Any] = {"order_id": 1234567, "reason": "payment-timeout", "customer": "c-000042"}


@dataclass(frozen=True)
class Sizes:
    rounds: int
    messages: int


FULL = Sizes(rounds=5, messages=1_000)
QUICK = Sizes(rounds=2, messages=200)


def make_topology(native: bool) -> Topology:
    queues: dict[str, Any] = {
        QUEUES[TIERS]: {"retry": {"max_attempts": MAX_ATTEMPTS, "tiers": [DELAY]}},
    }
    if native:
        queues[QUEUES[NATIVE]] = {
            "retry": {"max_attempts": MAX_ATTEMPTS, "backend": "broker", "min": DELAY, "max": DELAY}
        }
    return topology_from_dict(
        {"namespace": "bench" + uuid.uuid4().hex[:8], "tiers": {DELAY: DELAY}, "queues": queues}
    )


def fill(url: str, topology: Topology, queue: str, n: int) -> None:
    """n messages in the business queue, as the due exchange delivers them."""
    key = topology.names.queue_key(queue)
    route = Route(topology.names.due_exchange(), key, DELAY, 0, key)
    body, content_type = encode_body(BODY)
    now = now_ms()
    with Publisher(topology, url) as publisher:
        publisher.publish_outgoing(outgoing(route, body, content_type, now) for _ in range(n))


def purge(url: str, queue: str) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        conn.channel().queue_purge(queue)
    finally:
        conn.close()


def ready(url: str, queue: str) -> int:
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        return int(conn.channel().queue_declare(queue, passive=True).method.message_count)
    finally:
        conn.close()


# -- counting what the worker sends ---------------------------------------------------------


class Wire:
    """What the worker sends, per kind, in messages: a multiple-ack counts every delivery
    it settles (tags are consecutive per channel; those settled one by one before are
    not counted twice)."""

    def __init__(self, parking_exchange: str) -> None:
        self.parking_exchange = parking_exchange
        self.ops: Counter[str] = Counter()
        self.frames = 0
        self._floor: dict[int, int] = {}  # channel -> highest tag a multiple-ack settled
        self._settled: dict[int, set[int]] = {}  # channel -> tags above it settled alone

    def publish(self, exchange: str) -> None:
        self.frames += 1
        self.ops["publish (park)" if exchange == self.parking_exchange else "publish (retry)"] += 1

    def settle(self, channel: object, kind: str, tag: int, multiple: bool) -> None:
        self.frames += 1
        key = id(channel)
        floor = self._floor.get(key, 0)
        settled = self._settled.setdefault(key, set())
        if not multiple:
            self.ops[kind] += 1
            settled.add(tag)
            return
        self.ops[kind] += sum(1 for t in range(floor + 1, tag + 1) if t not in settled)
        self._floor[key] = tag
        self._settled[key] = {t for t in settled if t > tag}


@contextlib.contextmanager
def counting(wire: Wire) -> Iterator[None]:
    """Count what aiormq channels send (in here: the worker's only)."""
    cls = aiormq.channel.Channel
    names = ("basic_publish", "basic_ack", "basic_reject", "basic_nack")
    originals = {name: getattr(cls, name) for name in names}

    async def publish(self: Any, *args: Any, **kwargs: Any) -> Any:
        wire.publish(kwargs.get("exchange", ""))
        return await originals["basic_publish"](self, *args, **kwargs)

    async def ack(self: Any, delivery_tag: int, multiple: bool = False) -> Any:
        wire.settle(self, "ack", delivery_tag, multiple)
        return await originals["basic_ack"](self, delivery_tag, multiple)

    async def reject(self: Any, delivery_tag: int, *, requeue: bool = True) -> Any:
        wire.settle(self, "reject (requeue)" if requeue else "reject", delivery_tag, False)
        return await originals["basic_reject"](self, delivery_tag, requeue=requeue)

    async def nack(
        self: Any, delivery_tag: int, multiple: bool = False, requeue: bool = True
    ) -> Any:
        wire.settle(self, "nack", delivery_tag, multiple)
        return await originals["basic_nack"](self, delivery_tag, multiple, requeue)

    replacements: tuple[Callable[..., Any], ...] = (publish, ack, reject, nack)
    for name, replacement in zip(names, replacements, strict=True):
        setattr(cls, name, replacement)
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(cls, name, original)


@dataclass
class Sample:
    seconds: float
    retries: int
    parked: int
    attempts: int
    ops: Counter[str]  # messages, per kind of operation
    frames: int  # AMQP method frames sent for them (a multiple-ack is one)

    @property
    def retries_per_s(self) -> float:
        return self.retries / self.seconds

    @property
    def ops_per_retry(self) -> float:
        """Operations per retry, parking (a publish and an ack per message) left out."""
        return (sum(self.ops.values()) - 2 * self.parked) / self.retries


async def run_backend(url: str, topology: Topology, backend: str, n: int) -> Sample:
    queue = QUEUES[backend]
    app = App(topology, store=MemoryStore())
    attempts = 0
    first = 0.0

    async def always_fails(message: bytes, ctx: HandlerContext) -> None:
        nonlocal attempts, first
        attempts += 1
        if attempts == 1:
            first = time.perf_counter()
        raise RuntimeError(f"downstream unavailable (attempt {ctx.attempt})")

    app.add_consumer(queue, always_fails)
    worker = AsyncWorker(
        app, url, prefetch=PREFETCH, concurrency=CONCURRENCY, install_signal_handlers=False
    )
    wire = Wire(topology.names.parking_exchange())
    with counting(wire):
        task = asyncio.create_task(worker.run())
        deadline = time.monotonic() + TIMEOUT_S
        # The worker signals nothing per park: poll its counters.
        while worker.stats.parked < n and not task.done() and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.002)
        last = time.perf_counter()
        worker.stop()
        await task
    if worker.stats.parked < n:
        raise RuntimeError(f"{backend}: only {worker.stats.parked} of {n} parked: {worker.stats}")
    stats = worker.stats
    return Sample(last - first, stats.retried, stats.parked, attempts, wire.ops, wire.frames)


# -- driver -----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="200 messages x 2 rounds (smoke)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--messages", type=int, default=None)
    parser.add_argument(
        "--url", default=None, help=f"AMQP URL (${URL_ENV}, else the 4.3 node on 5743)"
    )
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    rounds = args.rounds or sizes.rounds
    n = args.messages or sizes.messages
    url = args.url or os.environ.get(URL_ENV) or DEFAULT_URL
    # One warning per failed attempt is the worker's job; here it would be noise.
    logging.basicConfig(level=logging.ERROR)

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    with connected(url, name="bench-retry declare") as conn:
        broker = broker_info(conn)
        native = broker.supports_delayed_retry
        topology = make_topology(native)
        sync_declare(conn, topology)
    backends = [TIERS, NATIVE] if native else [TIERS]
    log(
        f"{n} always-failing messages x {rounds} rounds per backend, max_attempts "
        f"{MAX_ATTEMPTS}, {DELAY} per retry, AsyncWorker prefetch {PREFETCH} concurrency "
        f"{CONCURRENCY}, on {broker.describe()} at {redact(url)}"
    )
    if not native:
        log(f'  backend "broker" not measured: {broker.describe()} has no delayed retry (4.3+)')
    samples: dict[str, list[Sample]] = {b: [] for b in backends}
    wrong: list[str] = []
    try:
        for r in range(rounds):
            order = backends if r % 2 == 0 else backends[::-1]
            for backend in order:
                queue = QUEUES[backend]
                fill(url, topology, queue, n)
                sample = asyncio.run(run_backend(url, topology, backend, n))
                if sample.attempts != n * MAX_ATTEMPTS or sample.parked != n:
                    wrong.append(
                        f"{backend} round {r + 1}: {sample.attempts} attempts, {sample.parked} "
                        f"parked (want {n * MAX_ATTEMPTS}, {n})"
                    )
                left = ready(url, topology.names.business_queue(queue))
                if left:
                    wrong.append(f"{backend} round {r + 1}: {left} message(s) left in the queue")
                purge(url, topology.names.parking_queue(queue))
                samples[backend].append(sample)
                log(
                    f"  round {r + 1}: {backend:<7} {sample.retries_per_s:>8.0f} retries/s  "
                    f"{sample.seconds:6.2f} s to park  {sample.ops_per_retry:.2f} ops/retry  "
                    f"{dict(sample.ops)}"
                )
    finally:
        with connected(url, name="bench-retry cleanup") as conn:
            sync_delete_topology(conn, topology)

    rows: dict[str, dict[str, Any]] = {}
    for backend, got in samples.items():
        ops: Counter[str] = Counter()
        for s in got:
            ops.update(s.ops)
        messages = n * len(got)
        rows[backend] = {
            "retries_per_s": round(statistics.median(s.retries_per_s for s in got)),
            "seconds_to_park": round(statistics.median(s.seconds for s in got), 3),
            "ops_per_retry": round(statistics.median(s.ops_per_retry for s in got), 3),
            "ops_per_message": {k: round(v / messages, 3) for k, v in sorted(ops.items())},
            "frames_per_message": round(sum(s.frames for s in got) / messages, 3),
            "broker_hops_per_retry": 2 if backend == TIERS else 0,
            "samples_retries_per_s": [round(s.retries_per_s) for s in got],
        }
    ratios: dict[str, float] = {}
    if NATIVE in rows:
        per_round = [
            b.retries_per_s / t.retries_per_s
            for t, b in zip(samples[TIERS], samples[NATIVE], strict=True)
        ]
        ratios = {
            "retries_per_s_broker_vs_tiers": round(statistics.median(per_round), 2),
            "ops_per_retry_broker_vs_tiers": round(
                rows[NATIVE]["ops_per_retry"] / rows[TIERS]["ops_per_retry"], 2
            ),
        }
    result = {
        "broker": broker.describe(),
        "messages": n,
        "rounds": rounds,
        "max_attempts": MAX_ATTEMPTS,
        "delay": DELAY,
        "results": rows,
        "not_measured": [] if native else [NATIVE],
        "ratios": ratios,
        "errors": wrong,
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(
            f"\n{'backend':<9}{'retries/s':>10}{'s to park':>11}{'ops/retry':>11}"
            f"{'hops/retry':>12}  per message (3 deliveries + park)"
        )
        for backend, row in rows.items():
            per_message = ", ".join(f"{k} {v:g}" for k, v in row["ops_per_message"].items())
            print(
                f"{backend:<9}{row['retries_per_s']:>10}{row['seconds_to_park']:>11.2f}"
                f"{row['ops_per_retry']:>11.2f}{row['broker_hops_per_retry']:>12}  "
                f"{per_message}; {row['frames_per_message']:g} frames"
            )
        if not native:
            print(f"{NATIVE:<9}{'not measured: needs RabbitMQ 4.3+':>40}")
        for name, value in ratios.items():
            print(f"{name}: {value}")
        for line in wrong:
            print(f"ERROR: {line}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
