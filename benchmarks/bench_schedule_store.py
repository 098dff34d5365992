#!/usr/bin/env python3
"""The schedule's store at scale: a million scheduled records in PostgreSQL or SQLite.

Loads N schedule records straight into the store's schedule table (PostgreSQL: COPY;
SQLite: one executemany in one transaction; never place_many one by one), then measures
through the store's own book (`store.schedule`), as the CLI, the dashboard and the
sweeper use it:

    bytes per record   PostgreSQL: pg_total_relation_size (heap, TOAST, the six
                       indexes) / N after VACUUM ANALYZE; SQLite: the table's and its
                       indexes' pages (dbstat, else the whole file) / N
    lookup             `lookup(scope, key)` of random existing keys: p50, p99, max
                       (target: p99 <= 5 ms)
    page               `select(Query(scope, after=(due, ""), limit=100))` at random due
                       times: a page of 100 in due order; and the same filtered by queue
                       and state (page_queue)
    overdue_empty      `overdue(scope, now, limit=100)` when no record is overdue: what
                       every sweep costs while all is well

The records: 90 % scheduled (due within 30 days, swept a minute after), 7 % handled
(kept 7 days), 3 % cancelled; four queues; random keys (a 64-bit mix of the index), a
56-byte JSON body and a traceparent header each, as a keyed publish records them.
Times are milliseconds of wall time per call, the store's Python included, on a warm
cache (the load just wrote the pages).

    .venv/bin/python benchmarks/bench_schedule_store.py --store postgres --records 1000000
    .venv/bin/python benchmarks/bench_schedule_store.py --store sqlite --records 1000000
    .venv/bin/python benchmarks/bench_schedule_store.py --store sqlite --quick   # 20,000

PostgreSQL: --url, else $RABBIT_DELAY_BENCH_POSTGRES, else
postgresql://postgres@127.0.0.1:5432/test; the tables (rd_bench_<hex> and its
_schedule) are dropped at the end. SQLite: a file in a temporary directory (or --dir),
removed at the end. The results go to benchmarks/results/
bench_schedule_store-<date>-<store>-<records>.json (or --out). Exit code 0; 1 with
--strict when the lookup target was missed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import sqlite3
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rabbit_delay._schedule.records import Query, ScheduleState
from rabbit_delay._stores.sql_schedule import _COLUMNS, _PAYLOAD, SQLSchedule
from rabbit_delay._urls import redact
from rabbit_delay.stores import PostgresStore, SQLiteStore

DEFAULT_PG_URL = "postgresql://postgres@127.0.0.1:5432/test"
PG_URL_ENV = "RABBIT_DELAY_BENCH_POSTGRES"
RESULTS = Path(__file__).resolve().parent / "results"
SCOPE = "bench"
QUEUES = ("orders.cancel", "mail.reminder", "billing.retry", "trials.expire")
DAY = 86_400_000
LOOKUP_TARGET_P99_MS = 5.0
_MIX = 0x9E3779B97F4A7C15  # odd: i -> i * _MIX mod 2**64 is one-to-one


def key_of(i: int) -> str:
    """The key of record i: distinct for every i, in no order."""
    return f"order-{(i * _MIX) % (1 << 64):016x}"


def records(n: int, now_ms: int, seed: int) -> Iterator[tuple[Any, ...]]:
    """The n records, as rows in the table's column order (`_COLUMNS`, `_PAYLOAD`)."""
    rng = random.Random(seed)
    for i in range(n):
        roll = rng.random()
        created = now_ms - rng.randrange(DAY)
        generation = 1 if rng.random() < 0.8 else rng.randint(2, 4)
        if roll < 0.90:
            state = ScheduleState.SCHEDULED.value
            due = now_ms + rng.randrange(60_000, 30 * DAY)
            updated, expires, sweep = created, None, due + 60_000
        elif roll < 0.97:
            state = ScheduleState.HANDLED.value
            due = now_ms - rng.randrange(60_000, DAY)
            updated = due + rng.randrange(5, 2_000)
            expires, sweep = updated + 7 * DAY, None
        else:
            state = ScheduleState.CANCELLED.value
            due = now_ms + rng.randrange(60_000, 30 * DAY)
            updated, expires, sweep = created, due + DAY, None
        body = json.dumps(
            {"order_id": i, "customer": f"c-{rng.randrange(10**6):06d}", "why": "unpaid"},
            separators=(",", ":"),
        ).encode()
        trace = f"00-{rng.getrandbits(128):032x}-{rng.getrandbits(64):016x}-01"
        yield (
            SCOPE,
            key_of(i),
            generation,
            state,
            QUEUES[i % len(QUEUES)],
            due,
            f"{rng.getrandbits(128):032x}",
            created,
            updated,
            0,
            None,
            expires,
            sweep,
            generation - 1,
            0,
            0,
            body,
            "application/json",
            json.dumps({"traceparent": trace}, separators=(",", ":")),
        )


def percentiles(samples_ms: list[float]) -> dict[str, float]:
    ordered = sorted(samples_ms)
    n = len(ordered)

    def rank(q: float) -> float:
        return round(ordered[max(0, math.ceil(q * n) - 1)], 3)

    return {"n": n, "p50_ms": rank(0.5), "p99_ms": rank(0.99), "max_ms": round(ordered[-1], 3)}


def timed(call: Callable[[], Any], times: int) -> tuple[list[float], Any]:
    samples: list[float] = []
    last: Any = None
    for _ in range(times):
        started = time.perf_counter()
        last = call()
        samples.append((time.perf_counter() - started) * 1000)
    return samples, last


def measure(book: Any, n: int, now_ms: int, lookups: int, pages: int, seed: int) -> dict[str, Any]:
    """The figures, through the store's book."""
    rng = random.Random(seed + 1)
    for i in rng.sample(range(n), min(20, n)):  # the connection, the statements' plans
        book.lookup(SCOPE, key_of(i))
    picks = [rng.randrange(n) for _ in range(lookups)]
    samples: list[float] = []
    found = 0
    for i in picks:
        started = time.perf_counter()
        record = book.lookup(SCOPE, key_of(i))
        samples.append((time.perf_counter() - started) * 1000)
        found += record is not None and record.key == key_of(i)
    result: dict[str, Any] = {"lookup": {**percentiles(samples), "found": found}}

    def page(queue: str | None) -> Callable[[], Any]:
        def one() -> Any:
            after = (now_ms + rng.randrange(60_000, 29 * DAY), "")
            state = None if queue is None else ScheduleState.SCHEDULED
            return book.select(Query(SCOPE, queue=queue, state=state, after=after, limit=100))

        return one

    samples, last = timed(page(None), pages)
    result["page"] = {**percentiles(samples), "rows": len(last)}
    samples, last = timed(page(QUEUES[1]), pages)
    result["page_queue"] = {**percentiles(samples), "rows": len(last)}
    samples, last = timed(lambda: book.overdue(SCOPE, now_ms=now_ms, limit=100), pages)
    result["overdue_empty"] = {**percentiles(samples), "rows": len(last)}
    return result


def statements(sql: SQLSchedule, now_ms: int) -> dict[str, Any]:
    """The measured operations' statements (their first), to show the plans of."""
    after = (now_ms + 15 * DAY, "")
    programs = {
        "lookup": sql.lookup(SCOPE, key_of(0)),
        "page": sql.select(Query(SCOPE, after=after, limit=100)),
        "page_queue": sql.select(
            Query(SCOPE, queue=QUEUES[1], state=ScheduleState.SCHEDULED, after=after, limit=100)
        ),
        "overdue_empty": sql.overdue(SCOPE, now_ms, 100),
    }
    return {name: next(program) for name, program in programs.items()}


# -- the stores -----------------------------------------------------------------------------


def run_postgres(args: argparse.Namespace, now_ms: int) -> dict[str, Any]:
    import psycopg

    url = args.url or os.environ.get(PG_URL_ENV, DEFAULT_PG_URL)
    table = "rd_bench_" + uuid.uuid4().hex[:12]
    store = PostgresStore(url, table=table)
    schedule = store.schedule_table
    try:
        store.schedule.lookup(SCOPE, "-")  # the tables, created as on first use
        with psycopg.connect(url, autocommit=True) as conn:
            started = time.perf_counter()
            columns = f"{_COLUMNS}, {_PAYLOAD}"
            with conn.cursor().copy(f"COPY {schedule} ({columns}) FROM STDIN") as copy:
                for row in records(args.records, now_ms, args.seed):
                    copy.write_row(row)
            loaded = time.perf_counter() - started
            conn.execute(f"VACUUM ANALYZE {schedule}")
            ((rows,),) = conn.execute(f"SELECT count(*) FROM {schedule}").fetchall()
            ((total, heap, indexes, version),) = conn.execute(
                "SELECT pg_total_relation_size(%(t)s), pg_relation_size(%(t)s), "
                "pg_indexes_size(%(t)s), current_setting('server_version')",
                {"t": schedule},
            ).fetchall()
            per_index = conn.execute(
                "SELECT c.relname, pg_relation_size(c.oid) FROM pg_index i "
                "JOIN pg_class c ON c.oid = i.indexrelid WHERE i.indrelid = %s::regclass "
                "ORDER BY 1",
                (schedule,),
            ).fetchall()
            plans = {
                name: [
                    line
                    for (line,) in conn.execute(
                        "EXPLAIN " + statement.text, statement.params
                    ).fetchall()
                ]
                for name, statement in statements(store._schedule_sql, now_ms).items()
            }
        figures = measure(store.schedule, args.records, now_ms, args.lookups, args.pages, args.seed)
    finally:
        store.close()
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(f"DROP TABLE IF EXISTS {schedule}, {table}")
    sizes = {
        "total_bytes": total,
        "heap_bytes": heap,
        "toast_bytes": total - heap - indexes,
        "indexes_bytes": indexes,
        "per_index_bytes": {name.removeprefix(schedule + "_"): size for name, size in per_index},
    }
    return {
        "backend": f"PostgreSQL {version}",
        "url": redact(url),
        "rows": rows,
        "load_s": round(loaded, 2),
        "bytes_per_record": round(total / rows, 1),
        "size": sizes,
        **figures,
        "plans": plans,
    }


def run_sqlite(args: argparse.Namespace, now_ms: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="rd-bench-") as folder:
        path = Path(folder) / "schedule.sqlite3"
        store = SQLiteStore(path)
        schedule = f"{store.table}_schedule"
        try:
            conn = sqlite3.connect(path, isolation_level=None)
            started = time.perf_counter()
            marks = ", ".join(["?"] * 19)
            conn.execute("BEGIN IMMEDIATE")
            conn.executemany(
                f"INSERT INTO {schedule} ({_COLUMNS}, {_PAYLOAD}) VALUES ({marks})",
                records(args.records, now_ms, args.seed),
            )
            conn.execute("COMMIT")
            loaded = time.perf_counter() - started
            conn.execute("ANALYZE")
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            (rows,) = conn.execute(f"SELECT count(*) FROM {schedule}").fetchone()
            page_size = conn.execute("PRAGMA page_size").fetchone()[0]
            file_bytes = page_size * conn.execute("PRAGMA page_count").fetchone()[0]
            try:
                per_name = dict(
                    conn.execute(
                        "SELECT name, sum(pgsize) FROM dbstat WHERE name IN (SELECT name FROM "
                        "sqlite_master WHERE tbl_name = ?) GROUP BY name",
                        (schedule,),
                    ).fetchall()
                )
            except sqlite3.OperationalError:  # no dbstat in this SQLite
                per_name = {}
            plans = {
                name: [
                    row[-1]
                    for row in conn.execute(
                        "EXPLAIN QUERY PLAN " + statement.text, statement.params
                    ).fetchall()
                ]
                for name, statement in statements(store._sql_schedule, now_ms).items()
            }
            conn.close()
            figures = measure(
                store.schedule, args.records, now_ms, args.lookups, args.pages, args.seed
            )
        finally:
            store.close()
    total = sum(per_name.values()) if per_name else file_bytes
    indexes = {
        "pkey" if name.startswith("sqlite_autoindex_") else name.removeprefix(schedule + "_"): size
        for name, size in per_name.items()
        if name != schedule
    }
    return {
        "backend": f"SQLite {sqlite3.sqlite_version}",
        "rows": rows,
        "load_s": round(loaded, 2),
        "bytes_per_record": round(total / rows, 1),
        "size": {
            "total_bytes": total,
            "file_bytes": file_bytes,
            "table_bytes": per_name.get(schedule),
            "per_index_bytes": indexes,
            "measured_by": "dbstat" if per_name else "the file's pages",
        },
        **figures,
        "plans": plans,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", choices=("postgres", "sqlite"), required=True)
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--lookups", type=int, default=1_000)
    parser.add_argument("--pages", type=int, default=200, help="pages and sweeps timed")
    parser.add_argument("--quick", action="store_true", help="smoke: 20,000 records")
    parser.add_argument("--url", help=f"PostgreSQL (default ${PG_URL_ENV} or the local one)")
    parser.add_argument("--dir", help="SQLite: where its temporary directory goes")
    parser.add_argument("--out", help="the JSON file (default: benchmarks/results/...)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    parser.add_argument("--seed", type=int, default=21)
    args = parser.parse_args(argv)
    if args.quick:
        args.records, args.lookups, args.pages = 20_000, 300, 50
    now_ms = int(time.time() * 1000)
    run = run_postgres if args.store == "postgres" else run_sqlite
    figures = run(args, now_ms)
    met = figures["lookup"]["p99_ms"] <= LOOKUP_TARGET_P99_MS
    import psycopg

    result = {
        "benchmark": "bench_schedule_store",
        "store": args.store,
        "records": args.records,
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "psycopg": psycopg.__version__,
            "load_average": [round(x, 2) for x in os.getloadavg()],  # at the end
        },
        **figures,
        "targets": {"lookup_p99_ms": {"target": LOOKUP_TARGET_P99_MS, "met": met}},
    }
    out = (
        Path(args.out)
        if args.out
        else RESULTS / (f"bench_schedule_store-{result['date']}-{args.store}-{args.records}.json")
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{figures['backend']}: {figures['rows']:,} records loaded in {figures['load_s']} s")
        print(f"  bytes per record   {figures['bytes_per_record']}")
        for name in ("lookup", "page", "page_queue", "overdue_empty"):
            f = figures[name]
            print(
                f"  {name:<18} p50 {f['p50_ms']:.3f} ms  p99 {f['p99_ms']:.3f} ms  "
                f"max {f['max_ms']:.3f} ms  (n={f['n']})"
            )
        print(f"  lookup p99 <= {LOOKUP_TARGET_P99_MS} ms: {'met' if met else 'MISSED'}")
        print(f"  -> {out}")
    return 1 if args.strict and not met else 0


if __name__ == "__main__":
    sys.exit(main())
