#!/usr/bin/env python3
"""The schedule's cost, side by side with the same work without it, in one run.

Publishing (`Publisher.publish_many` in calls of 1,000, confirmed, into a 1 h tier):

    publish-plain      a topology without [schedule]: nothing recorded (the baseline)
    publish-sqlite     with [schedule], records in SQLite (one transaction per call)
    publish-redis      with [schedule], records in Redis (one pipeline per call)
    publish-postgres   with [schedule], records in PostgreSQL (one transaction per call)

Consuming (a worker drains a pre-filled business queue; every message carries rd-key and
rd-generation, and its record exists):

    <worker>-<store>           the guard alone: a topology without [schedule]
    <worker>-<store>-schedule  the guard and the schedule's check and update, in the same
                               store call as the claim and the finish

for worker sync and async, store sqlite, redis, postgres (each skipped when its server is
unreachable). Targets: publishing with the schedule >= 0.7 x without it; consuming with
the schedule >= 0.9 x the guard alone. The contenders take turns over several rounds and
the medians are compared, each with its baseline of the same run. The topology (a unique
namespace), the Redis keys and the PostgreSQL tables are deleted at the end.

    .venv/bin/python benchmarks/bench_schedule.py            # full run, several minutes
    .venv/bin/python benchmarks/bench_schedule.py --quick    # smoke, about a minute
    .venv/bin/python benchmarks/bench_schedule.py --json     # machine-readable results

Exit code 0; 1 with `--strict` when a target was missed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_consume as bc

from rabbit_delay import Topology, topology_from_dict
from rabbit_delay import _headers as h
from rabbit_delay._envelope import encode_body, now_ms, outgoing
from rabbit_delay._schedule.records import Entry, OnConflict, Payload
from rabbit_delay._stores.redis import DEFAULT_REDIS_URL
from rabbit_delay._topology.delays import Route
from rabbit_delay._urls import broker_url, redact
from rabbit_delay.stores import (
    AsyncPostgresStore,
    AsyncRedisStore,
    PostgresStore,
    RedisStore,
    SQLiteStore,
)
from rabbit_delay.sync import Publisher
from rabbit_delay.sync import connect as sync_connect
from rabbit_delay.sync import declare as sync_declare

QUEUE = bc.QUEUE
BATCH = 1_000


@dataclass(frozen=True)
class Sizes:
    rounds: int
    publish: int
    consume: int


FULL = Sizes(rounds=5, publish=20_000, consume=20_000)
QUICK = Sizes(rounds=1, publish=2_000, consume=2_000)
PUBLISH_TARGET = 0.7
CONSUME_TARGET = 0.9


def topologies(namespace: str) -> tuple[Topology, Topology]:
    """The same names without and with [schedule]."""
    data: dict[str, Any] = {
        "namespace": namespace,
        "tiers": {"1h": "1h"},
        "queues": {QUEUE: {}},
        "idempotency": {"store": "memory"},
    }
    return topology_from_dict(data), topology_from_dict({**data, "schedule": {}})


# -- publishing -------------------------------------------------------------------------


def publish_rate(url: str, topology: Topology, n: int, store: Any) -> float:
    bodies = [{"order_id": i, "reason": "payment-timeout"} for i in range(n)]
    with Publisher(topology, url, store=store) as publisher:
        publisher.publish_many(bodies[:10], "1h", queue=QUEUE)  # warm: connection, store
        start = time.perf_counter()
        for i in range(0, n, BATCH):
            publisher.publish_many(bodies[i : i + BATCH], "1h", queue=QUEUE)
        return n / (time.perf_counter() - start)


def purge(url: str, topology: Topology) -> None:
    import pika

    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        channel = conn.channel()
        for queue in (*topology.tier_queues("1h"), topology.names.business_queue(QUEUE)):
            channel.queue_purge(queue)
    finally:
        conn.close()


# -- consuming --------------------------------------------------------------------------


def fill_keyed(url: str, topology: Topology, n: int) -> list[str]:
    """n messages in the business queue, as the due exchange delivers them, each with
    rd-key (its message_id) and rd-generation 1; their keys."""
    key = topology.names.queue_key(QUEUE)
    route = Route(topology.names.due_exchange(), key, "1h", 0, key)
    body, content_type = encode_body(bc.BODY)
    now = now_ms()
    outs = []
    for _ in range(n):
        out = outgoing(route, body, content_type, now)
        out.headers[h.H_KEY] = out.message_id
        out.headers[h.H_GENERATION] = 1
        outs.append(out)
    with Publisher(topology, url) as publisher:
        publisher.publish_outgoing(outs)
    return [o.message_id for o in outs]


def place(book: Any, topology: Topology, keys: list[str]) -> None:
    """The records of `keys`, as the publisher would have written them."""
    scope = topology.names.prefix
    now = now_ms()
    payload = Payload(encode_body(bc.BODY)[0], "application/json", {})
    for i in range(0, len(keys), BATCH):
        entries = [
            Entry(scope, k, QUEUE, now, k, payload, OnConflict.REPLACE, now + 3_600_000)
            for k in keys[i : i + BATCH]
        ]
        book.place_many(entries, now_ms=now)


def delete_redis_keys(url: str, prefix: str) -> None:
    """Every key of this run, a slice at a time (one DEL of 100,000s of keys times out)."""
    client = RedisStore(url, prefix=prefix)
    try:
        keys = list(client.client.scan_iter(match=prefix + "*", count=1000))
        for i in range(0, len(keys), 1_000):
            client.client.unlink(*keys[i : i + 1_000])
    finally:
        client.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small counts (smoke test)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--url", default=None, help="AMQP URL ($RABBIT_DELAY_URL, else local)")
    parser.add_argument("--only", default=None, help="comma-separated contenders")
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    rounds = args.rounds or sizes.rounds
    url = broker_url(args.url)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("pika").setLevel(logging.ERROR)

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    plain, scheduled = topologies("bench" + uuid.uuid4().hex[:8])
    conn = sync_connect(url, name="bench-schedule declare")
    sync_declare(conn, plain)
    conn.close()
    tmp = tempfile.TemporaryDirectory(prefix="bench-schedule-")
    redis_url = os.environ.get("RABBIT_DELAY_BENCH_REDIS", DEFAULT_REDIS_URL)
    redis_prefix = f"bench-schedule-{uuid.uuid4().hex[:8]}:"
    pg_url = os.environ.get("RABBIT_DELAY_BENCH_POSTGRES", bc.PG_DEFAULT)
    pg_tables: list[str] = []

    def sqlite() -> SQLiteStore:
        return SQLiteStore(Path(tmp.name) / f"{uuid.uuid4().hex}.sqlite3")

    def pg_table() -> str:
        pg_tables.append(f"bench_schedule_{uuid.uuid4().hex[:8]}")
        return pg_tables[-1]

    stores: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {
        # name: (a sync store, an async store) on a fresh backend
        "sqlite": (sqlite, sqlite),
    }
    if bc.redis_reachable(redis_url):
        stores["redis"] = (
            lambda: RedisStore(redis_url, prefix=redis_prefix),
            lambda: AsyncRedisStore(redis_url, prefix=redis_prefix),
        )
    else:
        log(f"Redis at {redact(redis_url)} unreachable: not measured")
    if bc.postgres_reachable(pg_url) and hasattr(PostgresStore, "scheduled_batch"):

        def pg_pair() -> tuple[Callable[[], Any], Callable[[], Any]]:
            table = pg_table()
            return (
                lambda: PostgresStore(pg_url, table=table, server_clock=False),
                lambda: AsyncPostgresStore(pg_url, table=table, server_clock=False),
            )

        stores["postgres"] = (
            lambda: pg_pair()[0](),
            lambda: pg_pair()[1](),
        )
    else:
        log(f"PostgreSQL at {redact(pg_url)} unreachable or without a schedule: not measured")

    contenders: dict[str, tuple[str, Callable[[], float]]] = {}  # name: (baseline, run)

    def publishing(name: str, make: Callable[[], Any] | None) -> Callable[[], float]:
        def run() -> float:
            store = make() if make is not None else None
            try:
                topology = scheduled if store is not None else plain
                return publish_rate(url, topology, sizes.publish, store)
            finally:
                if store is not None:
                    store.close()
                purge(url, plain)

        return run

    contenders["publish-plain"] = ("publish-plain", publishing("publish-plain", None))
    for store_name, (make_sync, _make_async) in stores.items():
        contenders[f"publish-{store_name}"] = (
            "publish-plain",
            publishing(store_name, make_sync),
        )

    def consuming(worker: str, make: Callable[[], Any], with_schedule: bool) -> Callable[[], float]:
        def run() -> float:
            topology = scheduled if with_schedule else plain
            keys = fill_keyed(url, plain, sizes.consume)
            store = make()
            book_store = store if worker == "sync" else None
            if with_schedule:
                if book_store is None:  # the async store's twin on the same backend
                    book_store = stores_sync_twin(store)
                place(book_store.schedule, topology, keys)
            gc.collect()
            if worker == "sync":
                return bc.sync_worker(url, topology, sizes.consume, store)
            return asyncio.run(bc.async_worker(url, topology, sizes.consume, store))

        return run

    def stores_sync_twin(store: Any) -> Any:
        if isinstance(store, SQLiteStore):
            return store
        if isinstance(store, AsyncRedisStore):
            return RedisStore(redis_url, prefix=redis_prefix)
        if isinstance(store, AsyncPostgresStore):
            return PostgresStore(pg_url, table=store.table, server_clock=False)
        raise TypeError(type(store))

    for worker in ("sync", "async"):
        for store_name, (make_sync, make_async) in stores.items():
            make = make_sync if worker == "sync" else make_async
            base = f"{worker}-{store_name}"
            contenders[base] = (base, consuming(worker, make, False))
            contenders[f"{base}-schedule"] = (base, consuming(worker, make, True))

    if args.only:
        wanted = {n.strip() for n in args.only.split(",") if n.strip()}
        wanted |= {contenders[n][0] for n in wanted if n in contenders}
        contenders = {n: c for n, c in contenders.items() if n in wanted}

    samples: dict[str, list[float]] = {name: [] for name in contenders}
    load_start = [round(x, 2) for x in os.getloadavg()]  # a shared machine: say how busy
    log(
        f"{sizes.publish} published / {sizes.consume} consumed x {rounds} rounds, "
        f"broker {redact(url)}"
    )
    try:
        names = list(contenders)
        for r in range(rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                rate = contenders[name][1]()
                samples[name].append(rate)
                log(f"  round {r + 1}: {name:<24} {rate:>9.0f} msg/s")
    finally:
        # each clean-up step runs whatever became of the one before
        with contextlib.ExitStack() as cleanup:
            for table in pg_tables:
                cleanup.callback(bc.drop_table, pg_url, table + "_schedule")
                cleanup.callback(bc.drop_table, pg_url, table)
            if "redis" in stores:
                cleanup.callback(delete_redis_keys, redis_url, redis_prefix)
            cleanup.callback(tmp.cleanup)
            bc.delete_topology(url, plain)

    medians = {name: statistics.median(values) for name, values in samples.items()}
    rows = []
    missed = []
    for name, median in medians.items():
        baseline = contenders[name][0]
        ratio = median / medians[baseline]
        target = None
        if name != baseline:
            target = PUBLISH_TARGET if name.startswith("publish-") else CONSUME_TARGET
        ok = None if target is None else ratio >= target
        if ok is False:
            missed.append(name)
        rows.append(
            {
                "contender": name,
                "msg_per_s": round(median),
                "ratio": round(ratio, 3),
                "vs": baseline,
                "target": target,
                "met": ok,
                "samples": [round(s) for s in samples[name]],
            }
        )
    if args.json:
        machine = {"cpus": os.cpu_count(), "load_average_start": load_start}
        machine["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
        report = {"date": time.strftime("%Y-%m-%d"), "machine": machine, "sizes": sizes.__dict__}
        print(json.dumps({**report, "rounds": rounds, "results": rows}, indent=2))
    else:
        print(f"\n{'contender':<26}{'msg/s':>10}{'ratio':>8}  {'vs':<16}{'target':>8}")
        for row in rows:
            target = f">= {row['target']:.2f}" if row["target"] else ""
            mark = {True: " ok", False: " MISSED", None: ""}[row["met"]]
            print(
                f"{row['contender']:<26}{row['msg_per_s']:>10}{row['ratio']:>8.2f}  "
                f"{row['vs']:<16}{target:>8}{mark}"
            )
    return 1 if args.strict and missed else 0


if __name__ == "__main__":
    sys.exit(main())
