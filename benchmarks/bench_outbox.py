#!/usr/bin/env python3
"""Outbox relay throughput against direct `publish_many`, and the commit-to-confirm lag,
in one run, for SQLite and PostgreSQL.

Throughput, interleaved rounds (the contenders' order rotates every round):

    direct              Publisher.publish_many of N messages (validated, encoded, confirmed)
    relay-sqlite        N rows committed in one transaction to an SQLite outbox, then
                        Relay.run_once(): rows/s from the commit to all confirmed and marked
    relay-postgresql    the same on PostgreSQL

Every message is the same JSON body to the same 1 h tier (nothing expires during the
run; the buffer is purged and the outbox table emptied between measurements). The ratio
of each relay to `direct` is the median of the per-round ratios: target >= 0.8.

Lag: rows committed one per transaction at a steady pace while a relay runs (`run()`,
default settings: poll 200 ms, backing off to 2 s when idle, batch 500); each row's lag
is its `sent_at` (set right after its confirm) minus its commit time. p50 / p99 / max.

    .venv/bin/python benchmarks/bench_outbox.py            # full run, a few minutes
    .venv/bin/python benchmarks/bench_outbox.py --quick    # smoke, < 60 s (CI runs this)
    .venv/bin/python benchmarks/bench_outbox.py --json     # machine-readable results

PostgreSQL: --pg-url (default $RABBIT_DELAY_TEST_POSTGRES_URL, else
postgresql://postgres@127.0.0.1:5432/test); unreachable, it is reported as not measured.
Exit code: 0, or 1 if a row was lost or published twice, or with --strict if a ratio
target was missed.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
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

import pika

from rabbit_delay import Topology, topology_from_dict
from rabbit_delay._ops.delete.execute import delete_topology as sync_delete_topology
from rabbit_delay._urls import broker_url, redact
from rabbit_delay.outbox import Outbox, Relay
from rabbit_delay.sync import Publisher, connected
from rabbit_delay.sync import declare as sync_declare

PARK = "park"  # 1 h
QUEUE = "sink"
BODY: dict[str, Any] = {"order_id": 1234567, "reason": "payment-timeout", "customer": "c-000042"}
TARGET = 0.8
PG_DEFAULT = "postgresql://postgres@127.0.0.1:5432/test"


@dataclass(frozen=True)
class Sizes:
    rounds: int
    rows: int  # per throughput measurement
    lag_rows: int
    lag_rate: int  # rows committed per second during the lag phase


FULL = Sizes(rounds=7, rows=5_000, lag_rows=2_000, lag_rate=400)
QUICK = Sizes(rounds=3, rows=1_000, lag_rows=300, lag_rate=300)


def make_topology() -> Topology:
    return topology_from_dict(
        {
            "namespace": "bench-" + uuid.uuid4().hex[:8],
            "tiers": {PARK: "1h"},
            "queues": {QUEUE: {}},
        },
        source="<bench_outbox>",
    )


class Backend:
    """One outbox table: its own connection for the application side, a relay."""

    def __init__(self, name: str, url: str, connect: Callable[[], Any], topology: Topology) -> None:
        self.name = name
        self.url = url
        self.connect = connect
        self.table = "bench_outbox_" + uuid.uuid4().hex[:8]
        self.outbox = Outbox(topology, table=self.table)
        self.conn = connect()
        self.outbox.install(self.conn)
        self.conn.commit()

    def empty(self) -> None:
        # PostgreSQL: TRUNCATE, so that no round scans the dead rows of the one before
        cur = self.conn.cursor()
        verb = "DELETE FROM" if self.name == "sqlite" else "TRUNCATE"
        cur.execute(f"{verb} {self.table}")
        self.conn.commit()

    def add_committed(self, n: int) -> None:
        for _ in range(n):
            self.outbox.add(self.conn, BODY, PARK, queue=QUEUE)
        self.conn.commit()

    def sent_lags(self, committed: dict[str, float]) -> list[float]:
        cur = self.conn.cursor()
        cur.execute(f"SELECT message_id, sent_at FROM {self.table} WHERE sent_at IS NOT NULL")
        rows = cur.fetchall()
        self.conn.commit()
        return [sent - committed[m] for m, sent in rows if m in committed]

    def drop(self) -> None:
        cur = self.conn.cursor()
        cur.execute(f"DROP TABLE IF EXISTS {self.table}")
        self.conn.commit()
        self.conn.close()


def open_backends(
    topology: Topology, tmp: Path, pg_url: str, log: Callable[[str], None]
) -> tuple[list[Backend], list[str]]:
    path = tmp / "bench.db"
    setup = sqlite3.connect(path)
    setup.execute("PRAGMA journal_mode=WAL")
    setup.close()
    backends = [Backend("sqlite", f"sqlite:///{path}", lambda: sqlite3.connect(path), topology)]
    not_measured: list[str] = []
    try:
        import psycopg

        psycopg.connect(pg_url, connect_timeout=3).close()
    except Exception as exc:
        log(f"postgresql: not measured ({type(exc).__name__}: {redact(str(exc)).strip()})")
        not_measured.append("postgresql")
    else:
        backends.append(Backend("postgresql", pg_url, lambda: psycopg.connect(pg_url), topology))
    return backends, not_measured


def purge(url: str, topology: Topology) -> int:
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        return int(conn.channel().queue_purge(topology.names.tier_queue(PARK)).method.message_count)
    finally:
        conn.close()


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


def run_throughput(
    url: str, topology: Topology, backends: list[Backend], sizes: Sizes, log: Callable[[str], None]
) -> tuple[dict[str, list[float]], list[str]]:
    rates: dict[str, list[float]] = {"direct": [], **{f"relay-{b.name}": [] for b in backends}}
    errors: list[str] = []
    relays = {b.name: Relay(topology, b.url, table=b.table, url=url).open() for b in backends}
    try:
        with Publisher(topology, url) as publisher:
            publisher.publish_many([BODY] * 100, PARK, queue=QUEUE)  # warm up
            for relay in relays.values():
                relay.run_once()
            purge(url, topology)
            names = list(rates)
            for round_no in range(sizes.rounds):
                shift = round_no % len(names)
                for name in names[shift:] + names[:shift]:
                    if name == "direct":
                        start = time.perf_counter()
                        publisher.publish_many([BODY] * sizes.rows, PARK, queue=QUEUE)
                        elapsed = time.perf_counter() - start
                    else:
                        backend = next(b for b in backends if f"relay-{b.name}" == name)
                        backend.empty()
                        backend.add_committed(sizes.rows)
                        start = time.perf_counter()  # from the commit
                        stats = relays[backend.name].run_once()
                        elapsed = time.perf_counter() - start
                        if stats.relayed != sizes.rows:
                            errors.append(f"{name}: relayed {stats.relayed} of {sizes.rows}")
                    published = purge(url, topology)
                    if published != sizes.rows:
                        errors.append(f"{name}: {published} in the buffer, {sizes.rows} sent")
                    rates[name].append(sizes.rows / elapsed)
                line = ", ".join(f"{n} {rates[n][-1]:,.0f}/s" for n in names)
                log(f"round {round_no + 1}/{sizes.rounds}: {line}")
    finally:
        for relay in relays.values():
            relay.close()
    return rates, errors


def run_lag(url: str, topology: Topology, backend: Backend, sizes: Sizes) -> dict[str, Any]:
    backend.empty()
    relay = Relay(topology, backend.url, table=backend.table, url=url).open()
    thread = threading.Thread(target=relay.run, name=f"relay-{backend.name}")
    thread.start()
    committed: dict[str, float] = {}
    interval = 1 / sizes.lag_rate
    try:
        start = time.monotonic()
        for i in range(sizes.lag_rows):
            pause = start + i * interval - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            message_id = backend.outbox.add(backend.conn, BODY, PARK, queue=QUEUE)
            backend.conn.commit()
            committed[message_id] = time.time() * 1000
        deadline = time.monotonic() + 30
        while relay.stats.relayed < sizes.lag_rows and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        relay.stop()
        thread.join(30)
        relay.close()
    lags = backend.sent_lags(committed)
    purge(url, topology)
    return {
        "rows": sizes.lag_rows,
        "relayed": len(lags),
        "rate_rows_s": sizes.lag_rate,
        "p50_ms": round(pct(lags, 50), 1) if lags else None,
        "p99_ms": round(pct(lags, 99), 1) if lags else None,
        "max_ms": round(max(lags), 1) if lags else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small counts (smoke test)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--url", default=None, help="broker URL (default: $RABBIT_DELAY_URL)")
    parser.add_argument(
        "--pg-url", default=os.environ.get("RABBIT_DELAY_TEST_POSTGRES_URL", PG_DEFAULT)
    )
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--strict", action="store_true", help="exit 1 if a target is missed")
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    if args.rounds:
        sizes = Sizes(args.rounds, sizes.rows, sizes.lag_rows, sizes.lag_rate)
    url = broker_url(args.url)

    def log(line: str) -> None:
        print(line, file=sys.stderr if args.json else sys.stdout, flush=True)

    topology = make_topology()
    with connected(url, name="bench_outbox declare") as conn:
        sync_declare(conn, topology)
    log(f"broker {redact(url)}, topology {topology.names.prefix}, {sizes}")
    backends: list[Backend] = []
    try:
        with tempfile.TemporaryDirectory(prefix="bench-outbox-") as tmp:
            backends, not_measured = open_backends(topology, Path(tmp), args.pg_url, log)
            rates, errors = run_throughput(url, topology, backends, sizes, log)
            lag = {b.name: run_lag(url, topology, b, sizes) for b in backends}
            for name, figures in lag.items():
                log(f"lag {name}: {figures}")
                if figures["relayed"] != figures["rows"]:
                    errors.append(f"lag {name}: {figures['relayed']} of {figures['rows']} sent")
            for backend in backends:
                backend.drop()
    finally:
        with connected(url, name="bench_outbox cleanup") as conn:
            sync_delete_topology(conn, topology)
    ratios = []
    for backend in backends:
        name = f"relay-{backend.name}"
        per_round = [ours / base for ours, base in zip(rates[name], rates["direct"], strict=True)]
        ratio = statistics.median(per_round)
        ratios.append(
            {
                "ours": name,
                "baseline": "direct",
                "ratio": round(ratio, 3),
                "per_round": [round(r, 3) for r in per_round],
                "target": TARGET,
                "met": ratio >= TARGET,
            }
        )
    result = {
        "config": {
            "rounds": sizes.rounds,
            "rows": sizes.rows,
            "lag_rows": sizes.lag_rows,
            "lag_rate_rows_s": sizes.lag_rate,
            "broker": redact(url),
        },
        "throughput": {
            name: {"median_rows_s": round(statistics.median(r), 1), "rates": [round(x) for x in r]}
            for name, r in rates.items()
        },
        "ratios": ratios,
        "lag": lag,
        "not_measured": not_measured,
        "errors": errors,
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for name, figures in result["throughput"].items():
            log(f"{name:<18} {figures['median_rows_s']:>10,.0f} rows/s (median)")
        for r in ratios:
            log(f"{r['ours']} / direct: {r['ratio']:.2f} (target >= {TARGET}: {r['met']})")
    for error in errors:
        print(f"error: {error}", file=sys.stderr)
    if errors:
        return 1
    if args.strict and not all(r["met"] for r in ratios):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
