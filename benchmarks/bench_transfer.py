#!/usr/bin/env python3
"""Transfer throughput: `rabbit-delay transfer` of N pending messages from one broker to
another, against a plain `Publisher.publish_many` of N messages to the same target, in
the same run.

Each round declares a source topology (a 1 h tier: nothing falls due during the run) on
the source broker and the same topology name on the target broker, there with a 1 h tier
and a [cascade] (1 s resolution): every moved message keeps its due time, exact to the
second. A round then

  1. publishes N messages into the source's 1 h tier (not timed: the set-up);
  2. publishes N messages with `Publisher.publish_many` into the target's 1 h tier (the
     baseline: the same target broker and confirms, no reading and no acking);
  3. transfers the N pending messages (`rabbit_delay._ops.transfer.execute.transfer`: read in
     batches, publish confirmed, ack), and deletes both topologies.

The two rates of a round are measured side by side, so their ratio means something on a
shared machine; the table shows medians over rounds. Lateness added: what the target's
route makes later than `rd-due-at` (max and mean, from the transfer's report; < 1 s with
the cascade: rounding up to its resolution). With `--target-tiers` the target has the 1 h
tier only: then each message waits a full hour again, late by its age in the source.

    .venv/bin/python benchmarks/bench_transfer.py            # 10,000 messages x 3 rounds
    .venv/bin/python benchmarks/bench_transfer.py --quick    # smoke: 2,000 x 1 round
    .venv/bin/python benchmarks/bench_transfer.py --json     # machine-readable results

The source is `--url` (default $RABBIT_DELAY_URL, else the local broker: RabbitMQ 3.10
here), the target `--to-url` (default the RabbitMQ 4.3 node of this machine,
amqp://guest:guest@127.0.0.1:5743/%2F). Exit code 1 if a transfer did not move every
message (a correctness bug), else 0.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from typing import Any

from rabbit_delay import Topology, topology_from_dict
from rabbit_delay._ops.delete.execute import delete_topology as sync_delete_topology
from rabbit_delay._ops.transfer.execute import transfer
from rabbit_delay._ops.transfer.rules import DEFAULT_TRANSFER_BATCH, Transfer
from rabbit_delay._urls import broker_url, redact
from rabbit_delay.sync import Publisher, broker_info, connected
from rabbit_delay.sync import declare as sync_declare

TARGET_URL = "amqp://guest:guest@127.0.0.1:5743/%2F"  # `bash .ci/brokers.sh url 4.3`
TIER = "1h"
QUEUE = "sink"
BODY: dict[str, Any] = {"order_id": 1234567, "reason": "payment-timeout", "customer": "c-000042"}


def topologies(cascade: bool) -> tuple[Topology, Topology]:
    namespace = f"bench-{uuid.uuid4().hex[:8]}"
    base: dict[str, Any] = {"namespace": namespace, "tiers": {TIER: TIER}, "queues": {QUEUE: {}}}
    target = dict(base)
    if cascade:
        target["cascade"] = {"levels": 13, "resolution": "1s"}  # up to 2 h 16 min, exact
    return topology_from_dict(base), topology_from_dict(target)


def declare(url: str, topology: Topology) -> None:
    with connected(url, name="bench-transfer declare") as connection:
        sync_declare(connection, topology)


def delete(url: str, topology: Topology) -> None:
    with connected(url, name="bench-transfer cleanup") as connection:
        sync_delete_topology(connection, topology)


def one_round(
    source_url: str, target_url: str, count: int, *, batch: int, cascade: bool
) -> dict[str, Any]:
    source, target = topologies(cascade)
    declare(source_url, source)
    try:
        declare(target_url, target)
        with Publisher.connect(source, source_url) as publisher:
            publisher.publish_many([BODY] * count, TIER, queue=QUEUE)
        with Publisher.connect(target, target_url) as publisher:
            started = time.perf_counter()
            publisher.publish_many([BODY] * count, TIER, queue=QUEUE)
            baseline_s = time.perf_counter() - started
        with (
            connected(source_url, name="bench-transfer source") as connection,
            Publisher(target, target_url, window=batch) as publisher,
        ):
            started = time.perf_counter()
            report = transfer(connection, publisher, Transfer(source, target), batch=batch)
            transfer_s = time.perf_counter() - started
    finally:
        delete(source_url, source)
        delete(target_url, target)
    baseline = count / baseline_s
    moved = report.moved / transfer_s
    return {
        "moved": report.moved,
        "complete": report.complete,
        "error": report.error,
        "publish_many_msg_s": round(baseline),
        "transfer_msg_s": round(moved),
        "ratio": round(moved / baseline, 3),
        "transfer_s": round(transfer_s, 3),
        "added_lateness_max_ms": report.added_max_ms,
        "added_lateness_mean_ms": round(report.added_mean_ms, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2,000 messages x 1 round (smoke)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--url", default=None, help="source broker (default: $RABBIT_DELAY_URL)")
    parser.add_argument("--to-url", default=TARGET_URL, help="target broker (default: 4.3 node)")
    parser.add_argument("--messages", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--batch", type=int, default=DEFAULT_TRANSFER_BATCH)
    parser.add_argument(
        "--target-tiers", action="store_true", help="target without a cascade (tiers only)"
    )
    args = parser.parse_args(argv)
    source_url = args.url or broker_url()
    count = args.messages or (2_000 if args.quick else 10_000)
    rounds = args.rounds or (1 if args.quick else 3)
    with connected(source_url) as c:
        source_version = broker_info(c).version_text
    with connected(args.to_url) as c:
        target_version = broker_info(c).version_text
    results = [
        one_round(source_url, args.to_url, count, batch=args.batch, cascade=not args.target_tiers)
        for _ in range(rounds)
    ]
    summary = {
        "config": {
            "source": redact(source_url),
            "source_version": source_version,
            "target": redact(args.to_url),
            "target_version": target_version,
            "messages": count,
            "rounds": rounds,
            "batch": args.batch,
            "target_cascade": not args.target_tiers,
        },
        "rounds": results,
        "median": {
            key: statistics.median(r[key] for r in results)
            for key in ("publish_many_msg_s", "transfer_msg_s", "ratio", "added_lateness_max_ms")
        },
    }
    ok = all(r["complete"] and r["moved"] == count for r in results)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(
            f"transfer {count:,} pending messages, RabbitMQ {source_version} -> {target_version}"
            f" ({'cascade' if not args.target_tiers else 'tiers only'} in the target), "
            f"batch {args.batch}, {rounds} round(s)"
        )
        print(
            f"{'round':>5} {'publish_many/s':>15} {'transfer/s':>11} {'ratio':>6} "
            f"{'late max':>9} {'late mean':>10}"
        )
        for i, r in enumerate(results, 1):
            print(
                f"{i:>5} {r['publish_many_msg_s']:>15,} {r['transfer_msg_s']:>11,} "
                f"{r['ratio']:>6.2f} {r['added_lateness_max_ms']:>7,}ms "
                f"{r['added_lateness_mean_ms']:>8,.0f}ms"
            )
        m = summary["median"]
        print(
            f"median: publish_many {m['publish_many_msg_s']:,.0f}/s, transfer "
            f"{m['transfer_msg_s']:,.0f}/s, ratio {m['ratio']:.2f}"
        )
        if not ok:
            print("ERROR: a transfer did not move every message", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
