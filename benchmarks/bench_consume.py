#!/usr/bin/env python3
"""Consuming throughput: the workers against the raw clients, in one run.

Contenders (each drains the same pre-filled business queue, manual acks, the same
prefetch; every message is a JSON body with the headers a delayed message carries):

    raw-aio        aio-pika Queue.consume, callback awaits message.ack()
    async-memory   AsyncWorker: pydantic model, async handler, in-memory idempotency guard
    async-sqlite   AsyncWorker: the same with the SQLite guard (WAL file in a temp dir)
    async-redis    AsyncWorker with the Redis guard (a batch of claims per pipeline)
    async-postgres AsyncWorker with the PostgreSQL guard (psycopg's async connection,
                   a batch of claims per statement)
    raw-pika       pika BlockingChannel.basic_consume, basic_ack in the callback
    sync-memory    Worker (pika, handler threads): pydantic model, in-memory guard
    sync-sqlite    Worker with the SQLite guard (a prefetched batch per transaction)
    sync-redis     Worker with the Redis guard (a batch per pipeline)
    sync-postgres  Worker with the PostgreSQL guard (a batch's finishes and claims in
                   one round trip, one commit)

The clock runs from the first delivery to the last handled one (connection set-up is
not measured). The contenders take turns over several rounds and the median rate is
reported, because the machines this runs on are small and noisy. Each contender is
reported as a ratio to its baseline: the memory guard to the raw client, the durable
guards to the memory guard of the same worker. Targets: async-memory >= 0.85 x raw-aio,
sync-memory >= 1.0 x raw-pika, the SQLite guard >= 0.75 x the memory guard for both
workers; the Redis and PostgreSQL guards are measured (Redis on
$RABBIT_DELAY_BENCH_REDIS, default redis://127.0.0.1:6379/0; PostgreSQL on
$RABBIT_DELAY_BENCH_POSTGRES, default postgresql://postgres@127.0.0.1:5432/test; each
skipped when unreachable). The topology (a unique namespace), the Redis keys and the
PostgreSQL table (a unique name) are deleted at the end.

    .venv/bin/python benchmarks/bench_consume.py            # full run, a few minutes
    .venv/bin/python benchmarks/bench_consume.py --quick    # smoke: small counts, < 1 min
    .venv/bin/python benchmarks/bench_consume.py --json     # machine-readable results

Exit code 0; 1 with `--strict` when a target was missed.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aio_pika
import pika
import pika.exceptions
from pydantic import BaseModel

from rabbit_delay import App, AsyncWorker, HandlerContext, Topology, Worker, topology_from_dict
from rabbit_delay._envelope import encode_body, now_ms, outgoing
from rabbit_delay._ops.delete.execute import delete_topology as sync_delete_topology
from rabbit_delay._stores.redis import DEFAULT_REDIS_URL
from rabbit_delay._topology.delays import Route
from rabbit_delay._urls import broker_url, redact
from rabbit_delay.stores import (
    AsyncPostgresStore,
    AsyncRedisStore,
    MemoryStore,
    PostgresStore,
    RedisStore,
    SQLiteStore,
)
from rabbit_delay.sync import Publisher, connected
from rabbit_delay.sync import connect as sync_connect
from rabbit_delay.sync import declare as sync_declare

QUEUE = "sink"
PREFETCH = 128
ASYNC_CONCURRENCY = 64
SYNC_CONCURRENCY = 4
TIMEOUT_S = 120.0


class OrderTimeout(BaseModel):
    order_id: int
    reason: str
    customer: str


BODY = OrderTimeout(order_id=1234567, reason="payment-timeout", customer="c-000042")


@dataclass(frozen=True)
class Sizes:
    rounds: int
    messages: int


FULL = Sizes(rounds=5, messages=20_000)
QUICK = Sizes(rounds=2, messages=3_000)
BASELINE = {
    "raw-aio": "raw-aio",
    "async-memory": "raw-aio",
    "async-sqlite": "async-memory",
    "async-redis": "async-memory",
    "async-postgres": "async-memory",
    "raw-pika": "raw-pika",
    "sync-memory": "raw-pika",
    "sync-sqlite": "sync-memory",
    "sync-redis": "sync-memory",
    "sync-postgres": "sync-memory",
}
TARGETS = {"async-memory": 0.85, "sync-memory": 1.0, "async-sqlite": 0.75, "sync-sqlite": 0.75}


def make_topology(queue_type: str) -> Topology:
    return topology_from_dict(
        {
            "namespace": "bench" + uuid.uuid4().hex[:8],
            "queue_type": queue_type,
            "tiers": {"1h": "1h"},
            "queues": {QUEUE: {}},
        }
    )


def delete_topology(url: str, topology: Topology) -> None:
    with connected(url, name="rabbit-delay cleanup") as connection:
        sync_delete_topology(connection, topology)


def fill(url: str, topology: Topology, n: int) -> None:
    """Put n messages in the business queue, as the due exchange would deliver them."""
    key = topology.names.queue_key(QUEUE)
    route = Route(topology.names.due_exchange(), key, "1h", 0, key)
    body, content_type = encode_body(BODY)
    now = now_ms()
    with Publisher(topology, url) as publisher:
        publisher.publish_outgoing(outgoing(route, body, content_type, now) for _ in range(n))


class Finish:
    """Counts handled messages; notes the first and the n-th."""

    def __init__(self, n: int, on_done: Callable[[], None]) -> None:
        self.n = n
        self.count = 0
        self.first = 0.0
        self.last = 0.0
        self.on_done = on_done
        self._lock = threading.Lock()

    def hit(self) -> None:
        with self._lock:
            self.count += 1
            if self.count == 1:
                self.first = time.perf_counter()
            if self.count == self.n:
                self.last = time.perf_counter()
                self.on_done()

    def rate(self) -> float:
        if self.count < self.n:
            raise RuntimeError(f"only {self.count} of {self.n} messages were handled")
        return (self.n - 1) / (self.last - self.first)


# -- async contenders -------------------------------------------------------------------


async def raw_aio(url: str, topology: Topology, n: int) -> float:
    done = asyncio.Event()
    finish = Finish(n, done.set)
    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=PREFETCH)
        queue = await channel.get_queue(topology.names.business_queue(QUEUE), ensure=False)

        async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            await message.ack()
            finish.hit()

        tag = await queue.consume(on_message)
        await asyncio.wait_for(done.wait(), TIMEOUT_S)
        await queue.cancel(tag)
    finally:
        await connection.close()
    return finish.rate()


Store = (
    MemoryStore | SQLiteStore | RedisStore | AsyncRedisStore | PostgresStore | AsyncPostgresStore
)


def app_for(topology: Topology, store: Store, finish: Finish, *, asynchronous: bool) -> App:
    app = App(topology, store=store)
    if asynchronous:

        async def handle(msg: OrderTimeout, ctx: HandlerContext) -> None:
            finish.hit()

        app.add_consumer(QUEUE, handle, model=OrderTimeout)
    else:

        def handle_sync(msg: OrderTimeout, ctx: HandlerContext) -> None:
            finish.hit()

        app.add_consumer(QUEUE, handle_sync, model=OrderTimeout)
    return app


async def async_worker(url: str, topology: Topology, n: int, store: Store) -> float:
    done = asyncio.Event()
    finish = Finish(n, done.set)
    app = app_for(topology, store, finish, asynchronous=True)
    worker = AsyncWorker(
        app, url, prefetch=PREFETCH, concurrency=ASYNC_CONCURRENCY, install_signal_handlers=False
    )
    task = asyncio.create_task(worker.run())
    waiter = asyncio.create_task(done.wait())
    await asyncio.wait({task, waiter}, timeout=TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED)
    worker.stop()
    await task
    waiter.cancel()
    await app.aclose()
    return finish.rate()


# -- sync contenders --------------------------------------------------------------------


def raw_pika(url: str, topology: Topology, n: int) -> float:
    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    ch.basic_qos(prefetch_count=PREFETCH)
    finish = Finish(n, ch.stop_consuming)

    def on_message(channel: Any, method: Any, _props: Any, _body: bytes) -> None:
        channel.basic_ack(method.delivery_tag)
        finish.hit()

    ch.basic_consume(topology.names.business_queue(QUEUE), on_message)
    ch.start_consuming()
    conn.close()
    return finish.rate()


def sync_worker(url: str, topology: Topology, n: int, store: Store) -> float:
    worker: Worker | None = None

    def stop() -> None:
        assert worker is not None
        worker.stop()

    finish = Finish(n, stop)
    app = app_for(topology, store, finish, asynchronous=False)
    worker = Worker(
        app, url, prefetch=PREFETCH, concurrency=SYNC_CONCURRENCY, install_signal_handlers=False
    )
    timer = threading.Timer(TIMEOUT_S, worker.stop)
    timer.start()
    worker.run()
    timer.cancel()
    app.close()
    return finish.rate()


# -- driver ----------------------------------------------------------------------------


def redis_reachable(url: str) -> bool:
    try:
        store = RedisStore(url, prefix="bench-consume-ping:")
        try:
            store.client.ping()
        finally:
            store.close()
    except Exception:
        return False
    return True


PG_DEFAULT = "postgresql://postgres@127.0.0.1:5432/test"


def postgres_reachable(url: str) -> bool:
    try:
        import psycopg

        psycopg.connect(url, connect_timeout=3).close()
    except Exception:
        return False
    return True


def drop_table(url: str, table: str) -> None:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"DROP TABLE IF EXISTS {table}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small counts (smoke test, < 1 min)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    parser.add_argument("--queue-type", choices=["quorum", "classic"], default="quorum")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--messages", type=int, default=None)
    parser.add_argument("--url", default=None, help="AMQP URL ($RABBIT_DELAY_URL, else local)")
    parser.add_argument(
        "--only",
        default=None,
        help="comma-separated contenders to run (with their baselines), e.g. sync-sqlite",
    )
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    rounds = args.rounds or sizes.rounds
    n = args.messages or sizes.messages
    url = broker_url(args.url)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("pika").setLevel(logging.ERROR)  # passive-declare 404s of `declare`

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    topology = make_topology(args.queue_type)
    conn = sync_connect(url, name="bench-consume declare")
    sync_declare(conn, topology)
    conn.close()
    tmp = tempfile.TemporaryDirectory(prefix="bench-consume-")

    def sqlite() -> SQLiteStore:
        return SQLiteStore(Path(tmp.name) / f"{uuid.uuid4().hex}.sqlite3")

    redis_url = os.environ.get("RABBIT_DELAY_BENCH_REDIS", DEFAULT_REDIS_URL)
    redis_prefix = f"bench-consume-{uuid.uuid4().hex[:8]}:"
    contenders: dict[str, Callable[[], float]] = {
        "raw-aio": lambda: asyncio.run(raw_aio(url, topology, n)),
        "async-memory": lambda: asyncio.run(async_worker(url, topology, n, MemoryStore())),
        "async-sqlite": lambda: asyncio.run(async_worker(url, topology, n, sqlite())),
        "raw-pika": lambda: raw_pika(url, topology, n),
        "sync-memory": lambda: sync_worker(url, topology, n, MemoryStore()),
        "sync-sqlite": lambda: sync_worker(url, topology, n, sqlite()),
    }
    if redis_reachable(redis_url):

        def async_redis() -> float:
            return asyncio.run(
                async_worker(url, topology, n, AsyncRedisStore(redis_url, prefix=redis_prefix))
            )

        contenders["async-redis"] = async_redis
        contenders["sync-redis"] = lambda: sync_worker(
            url, topology, n, RedisStore(redis_url, prefix=redis_prefix)
        )
    else:
        log(f"Redis at {redact(redis_url)} unreachable: the Redis guard is not measured")
    pg_url = os.environ.get("RABBIT_DELAY_BENCH_POSTGRES", PG_DEFAULT)
    pg_table = f"bench_consume_{uuid.uuid4().hex[:8]}"
    if postgres_reachable(pg_url):

        def async_postgres() -> float:
            store = AsyncPostgresStore(pg_url, table=pg_table)
            return asyncio.run(async_worker(url, topology, n, store))

        contenders["async-postgres"] = async_postgres
        contenders["sync-postgres"] = lambda: sync_worker(
            url, topology, n, PostgresStore(pg_url, table=pg_table)
        )
    else:
        log(f"PostgreSQL at {redact(pg_url)} unreachable: the PostgreSQL guard is not measured")
    if args.only:
        wanted = {name.strip() for name in args.only.split(",") if name.strip()}
        unknown = wanted - set(contenders)
        if unknown:
            parser.error(f"unknown contender(s) {sorted(unknown)}; known: {sorted(contenders)}")
        while True:  # each contender's baseline, and the baseline's
            more = {BASELINE[name] for name in wanted} - wanted
            if not more:
                break
            wanted |= more
        contenders = {name: run for name, run in contenders.items() if name in wanted}
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    log(
        f"{n} messages x {rounds} rounds per contender, {args.queue_type} queue, "
        f"prefetch {PREFETCH}, broker {redact(url)}"
    )
    try:
        names = list(contenders)
        for r in range(rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                fill(url, topology, n)
                gc.collect()  # each contender starts without the previous one's garbage
                rate = contenders[name]()
                samples[name].append(rate)
                log(f"  round {r + 1}: {name:<13} {rate:>9.0f} msg/s")
    finally:
        delete_topology(url, topology)
        tmp.cleanup()
        if "sync-redis" in contenders or "async-redis" in contenders:
            # every record of this run (purge() would leave them: the Redis store expires
            # records by the server's clock, with the retention as their TTL)
            store = RedisStore(redis_url, prefix=redis_prefix)
            keys = list(store.client.scan_iter(match=redis_prefix + "*", count=1_000))
            for i in range(0, len(keys), 1_000):
                store.client.unlink(*keys[i : i + 1_000])
            store.close()
        if "sync-postgres" in contenders or "async-postgres" in contenders:
            drop_table(pg_url, pg_table + "_schedule")  # the store makes it beside its own
            drop_table(pg_url, pg_table)

    medians = {name: statistics.median(values) for name, values in samples.items()}
    rows = []
    missed = []
    for name, median in medians.items():
        ratio = median / medians[BASELINE[name]]
        target = TARGETS.get(name)
        ok = None if target is None else ratio >= target
        if ok is False:
            missed.append(name)
        rows.append(
            {
                "contender": name,
                "msg_per_s": round(median),
                "ratio": round(ratio, 3),
                "vs": BASELINE[name],
                "target": target,
                "met": ok,
                "samples": [round(s) for s in samples[name]],
            }
        )
    if args.json:
        print(
            json.dumps(
                {
                    "messages": n,
                    "rounds": rounds,
                    "queue_type": args.queue_type,
                    "prefetch": PREFETCH,
                    "results": rows,
                },
                indent=2,
            )
        )
    else:
        print(f"\n{'contender':<14}{'msg/s':>10}{'ratio':>8}  {'vs':<9}{'target':>8}")
        for row in rows:
            target = f">= {row['target']:.2f}" if row["target"] else ""
            mark = {True: " ok", False: " MISSED", None: ""}[row["met"]]
            print(
                f"{row['contender']:<14}{row['msg_per_s']:>10}{row['ratio']:>8.2f}  "
                f"{row['vs']:<9}{target:>8}{mark}"
            )
    return 1 if args.strict and missed else 0


if __name__ == "__main__":
    sys.exit(main())
