#!/usr/bin/env python3
"""The dashboard's answers against the core calls `rabbit-delay status` and
`rabbit-delay parked list` make, in the same run, on the same broker.

One topology of 51 queues (2 tier buffers, 24 business queues, their 24 parking lots,
the catch-all), N messages parked in one lot (10,000; --quick: 2,000). Each round:

  baseline  `read_status(topology, urls)` (what `status` does) and a connect +
            `list_parked(..., limit=50)` + close (what `parked list` does)
  ours      the dashboard's HTTP answers, served in this process on a free port:
            /api/snapshot and /api/parked/<lot> when they read the broker (the cache
            invalidated first; interleaved with the baseline, median of 5 each) and
            when they come from the cache (median of 50 GETs);
            then 20 clients x 10 requests at once: how many broker reads they cost

Ratios are ours / baseline of the medians over rounds (a fresh read is a little more
work than the baseline: HTTP, JSON and, for parked pages, the whole lot is peeked once
and then paged from memory). At the end the lot is drained: exit code 1 if browsing
lost or reordered a message, else 0.

    .venv/bin/python benchmarks/bench_dashboard.py            # 10,000 parked x 3 rounds
    .venv/bin/python benchmarks/bench_dashboard.py --quick    # smoke: 2,000 x 1 round
    .venv/bin/python benchmarks/bench_dashboard.py --json     # machine-readable results
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable
from typing import Any

from rabbit_delay import Topology, topology_from_dict
from rabbit_delay import _headers as h
from rabbit_delay._envelope import JSON, Outgoing
from rabbit_delay._ops.dashboard.execute import BrokerBackend
from rabbit_delay._ops.dashboard.server import Dashboard, serve
from rabbit_delay._ops.delete.execute import delete_topology as sync_delete_topology
from rabbit_delay._ops.parked.execute import list_parked
from rabbit_delay._ops.status.execute import read_status
from rabbit_delay._sync.connection import close_quietly, connect_first
from rabbit_delay._urls import broker_url, redact
from rabbit_delay.sync import Publisher, connected
from rabbit_delay.sync import declare as sync_declare

LOT = "q07"
CACHED_GETS = 50
CLIENTS, PER_CLIENT = 20, 10
SAMPLES = 5


def topology() -> Topology:
    return topology_from_dict(
        {
            "namespace": f"bench-{uuid.uuid4().hex[:8]}",
            "tiers": {"1m": "1m", "5m": "5m"},
            "queues": {f"q{i:02d}": {} for i in range(24)},
        }
    )


def park(url: str, t: Topology, count: int) -> list[str]:
    names = t.names
    outs = [
        Outgoing(
            exchange=names.parking_exchange(),
            routing_key=names.queue_key(LOT),
            body=json.dumps({"order_id": i}).encode(),
            message_id=f"b{i:06d}",
            content_type=JSON,
            headers={
                h.H_ATTEMPT: 5,
                h.H_ERROR_TYPE: "TimeoutError",
                h.H_ERROR_MESSAGE: f"payment service timed out ({i})",
                h.H_ERROR_TRACEBACK: "Traceback (most recent call last):\nTimeoutError",
                h.H_PARK_REASON: "max_attempts",
            },
            mandatory=True,
            timestamp=int(time.time()),
        )
        for i in range(count)
    ]
    with Publisher(t, url=url) as publisher:
        return publisher.publish_outgoing(outs)


def timed(call: Callable[[], Any]) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def get(base: str, path: str) -> bytes:
    with urllib.request.urlopen(base + path, timeout=120) as answer:
        return bytes(answer.read())


def one_round(url: str, t: Topology, board: Dashboard, base: str) -> dict[str, float]:
    backend = board.backend
    assert isinstance(backend, BrokerBackend)

    def parked_list() -> None:
        connection, _ = connect_first([url], name="bench-dashboard parked list")
        try:
            list_parked(connection, t, LOT, offset=0, limit=50)
        finally:
            close_quietly(connection)

    def fresh_snapshot() -> None:
        board.poller.invalidate()
        get(base, "/api/snapshot")

    def fresh_page() -> None:
        backend.forget(LOT)
        get(base, f"/api/parked/{LOT}")

    # Interleaved, SAMPLES times each: the broker's and the management API's own
    # variations hit both sides alike.
    samples: dict[str, list[float]] = {}
    for _ in range(SAMPLES):
        for name, call in (
            ("status core (read_status)", lambda: read_status(t, [url])),
            ("dashboard /api/snapshot, broker read", fresh_snapshot),
            ("parked list core (list_parked, 50)", parked_list),
            ("dashboard parked page, lot peeked", fresh_page),
        ):
            samples.setdefault(name, []).append(timed(call))
    figures = {name: statistics.median(values) for name, values in samples.items()}
    figures["dashboard /api/snapshot, cached"] = statistics.median(
        timed(lambda: get(base, "/api/snapshot")) for _ in range(CACHED_GETS)
    )
    figures["dashboard overview page, cached"] = statistics.median(
        timed(lambda: get(base, "/")) for _ in range(CACHED_GETS // 5)
    )
    offsets = [i * 37 % 2000 for i in range(CACHED_GETS)]
    figures["dashboard parked page, cached"] = statistics.median(
        timed(lambda o=o: get(base, f"/api/parked/{LOT}?offset={o}")) for o in offsets
    )
    # Many clients at once: one broker read for all of them.
    board.poller.invalidate()
    before = board.poller.reads
    latencies: list[float] = []

    def client() -> None:
        for _ in range(PER_CLIENT):
            latencies.append(timed(lambda: get(base, "/api/snapshot")))

    threads = [threading.Thread(target=client) for _ in range(CLIENTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    figures["concurrent broker reads"] = board.poller.reads - before
    latencies.sort()
    figures["concurrent p99"] = latencies[int(len(latencies) * 0.99) - 1]
    return figures


def drained(url: str, queue: str, expected: int) -> list[str | None]:
    got: list[str | None] = []
    with connected(url, name="bench-dashboard drain") as connection:
        channel = connection.channel()
        channel.basic_qos(prefetch_count=1000)
        for method, props, _body in channel.consume(queue, inactivity_timeout=2):
            if method is None:
                break
            got.append(props.message_id)
            channel.basic_ack(method.delivery_tag)
            if len(got) >= expected:
                break
        channel.cancel()
    return got


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None, help="broker URL (default $RABBIT_DELAY_URL)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 2,000 parked, 1 round")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--parked", type=int, default=None, help="messages parked (10,000)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (3)")
    args = parser.parse_args()
    url = broker_url(args.url)
    count = args.parked or (2_000 if args.quick else 10_000)
    rounds = args.rounds or (1 if args.quick else 3)
    t = topology()
    with connected(url, name="bench-dashboard declare") as connection:
        sync_declare(connection, t)
    server = None
    try:
        ids = park(url, t, count)
        backend = BrokerBackend(t, [url], every=3600.0)  # reads only when told to
        board = Dashboard(backend, refresh_s=3600.0)
        server, _ = serve(board, "127.0.0.1", 0)
        base = f"http://127.0.0.1:{server.server_port}"
        results = [one_round(url, t, board, base) for _ in range(rounds)]
        left = drained(url, t.names.parking_queue(LOT), count)
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()
        with connected(url, name="bench-dashboard cleanup") as connection:
            sync_delete_topology(connection, t)
    medians = {k: statistics.median(r[k] for r in results) for k in results[0]}
    pairs = [
        ("dashboard /api/snapshot, broker read", "status core (read_status)"),
        ("dashboard /api/snapshot, cached", "status core (read_status)"),
        ("dashboard parked page, lot peeked", "parked list core (list_parked, 50)"),
        ("dashboard parked page, cached", "parked list core (list_parked, 50)"),
    ]
    ratios = [
        {"ours": a, "baseline": b, "ratio": medians[a] / medians[b] if medians[b] else None}
        for a, b in pairs
    ]
    intact = left == ids
    report = {
        "config": {
            "url": redact(url),
            "queues": 51,
            "parked": count,
            "rounds": rounds,
            "clients": CLIENTS,
            "requests_per_client": PER_CLIENT,
        },
        "medians_s": medians,
        "ratios": ratios,
        "lot_unchanged": intact,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"dashboard: 51 queues, {count} parked in one lot, {rounds} round(s), {redact(url)}")
        for name, value in medians.items():
            shown = (
                f"{value:.0f}" if name == "concurrent broker reads" else f"{value * 1000:.1f} ms"
            )
            print(f"  {name:<42} {shown:>10}")
        for r in ratios:
            ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else "?"
            print(f"  {r['ours']} / {r['baseline']}: {ratio}")
        print(f"  lot after browsing: {'unchanged (count and order)' if intact else 'CHANGED'}")
    return 0 if intact else 1


if __name__ == "__main__":
    sys.exit(main())
