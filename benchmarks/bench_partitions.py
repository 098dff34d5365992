"""Partitions, Jepsen-style (issue 23): the delay path on a 3-node cluster whose members
are cut from each other, per fault kind and RabbitMQ version; a table of what the
checker finds.

For each version (`.ci/brokers.sh` VERSIONs: host = the machine's rabbitmq-server, 3.10
here; 4.3; 4.0) one cluster is started in network namespaces (tests/partitions/cluster.py),
and each fault kind runs `--runs` times for `--duration` seconds on it, a fresh topology
each run (tests/partitions/run.py: the workload, faults of `--fault` seconds with
`--heal` seconds between them, the last heal, the drain, the checker). Every run's
outcome is one JSON line on stdout (`--json`) or in `--out`; the table sums them:
published, confirmed, handled, parked, lost, duplicates, unexpected, early, stuck,
lateness (p50 / p99 / max of the messages due during a fault, ms), and the dead letters
that stalled (RabbitMQ 3.10) and were sent again by a new buffer leader.

Needs root (namespaces, nftables). The result goes in docs/reliability.md.

    sudo .venv/bin/python benchmarks/bench_partitions.py     # 1 x 60 s per kind, host and 4.3
    sudo .venv/bin/python benchmarks/bench_partitions.py --runs 10 --duration 180
    sudo .venv/bin/python benchmarks/bench_partitions.py --quick     # one kind, host, 15 s
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from partitions.cluster import PartitionCluster, leftovers, unavailable_reason
from partitions.run import KINDS, run_partitions

NET_BASE = 20  # 10.23.20.0/24 and up: never the tests' nets


def label(row: dict[str, Any]) -> str:
    """'RabbitMQ 3.10.8', with its cluster_partition_handling when not pause_minority."""
    handling = row.get("partition_handling") or "pause_minority"
    major = str(row["version"]).split(".")[0]
    extra = f" ({handling})" if major == "3" and handling != "pause_minority" else ""
    return f"RabbitMQ {row['version']}{extra}"


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of the runs, one line per version, fault kind and recovery.

    "stalled, recovered by": dead letters missing at the drain deadline that arrived
    after the buffers' leadership moved (`leadership`), or, in a run with [schedule]
    (`sweeper`), the messages a sweeper copy settled first; "held at the end": the dead
    letters the buffers' leaders still held, unconfirmed, when the run ended.
    """
    head = (
        "| version | fault | runs | published | confirmed | handled | parked | lost | "
        "duplicates | unexpected | early | stuck | lateness due in a fault p50 / p99 / max "
        "| stalled, recovered by | held at the end |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    groups: dict[tuple[str, str, bool], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((label(r), r["fault"], bool(r.get("schedule"))), []).append(r)
    lines = []
    for (version, fault, schedule), runs in groups.items():
        v = [r["verdict"] for r in runs]

        def total(key: str, v: list[dict[str, Any]] = v) -> int:
            return sum(int(x[key] or 0) for x in v)

        def worst(key: str, v: list[dict[str, Any]] = v) -> str:
            values = [x[key] for x in v if x[key] is not None]
            return f"{max(values) / 1000:.1f} s" if values else "-"

        if schedule:
            recovered = f"{sum(int(r.get('settled_by_sweeper', 0)) for r in runs)} sweeper"
        else:
            recovered = f"{sum(int(r['unstalled']) for r in runs)} leadership"
        held = sum(sum(max(n, 0) for n in r.get("held_dead_letters", {}).values()) for r in runs)
        lines.append(
            f"| {version} | {fault} | {len(runs)} | {total('published')} | "
            f"{total('confirmed')} | {total('handled')} | {total('parked')} | "
            f"**{total('lost')}** | {total('duplicates')} | {total('unexpected')} | "
            f"{total('early')} | {total('stuck')} | {worst('fault_lateness_p50_ms')} / "
            f"{worst('fault_lateness_p99_ms')} / {worst('fault_lateness_max_ms')} | "
            f"{recovered} | {held} |"
        )
    return head + "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--versions", default="host,4.3", help="brokers.sh VERSIONs")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"of {', '.join(KINDS)}")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of faults")
    parser.add_argument("--fault", type=float, default=20.0, help="seconds per fault")
    parser.add_argument("--heal", type=float, default=10.0, help="seconds between faults")
    parser.add_argument("--rate", type=float, default=30.0, help="msg/s per publisher")
    parser.add_argument("--partition-handling", default="pause_minority", help="3.x only")
    parser.add_argument(
        "--schedule",
        action="store_true",
        help="the workload with [schedule]: its sweeper recovers stalled messages, no "
        "leadership moves",
    )
    parser.add_argument(
        "--net", type=int, default=NET_BASE, help="the first 10.23.N.0/24 (one per version)"
    )
    parser.add_argument("--quick", action="store_true", help="one kind, host, 20 s")
    parser.add_argument("--json", action="store_true", help="JSON lines on stdout")
    parser.add_argument("--out", type=Path, help="append the JSON lines to this file")
    args = parser.parse_args()
    # SIGTERM (and SIGINT, which a shell's background job ignores) end the run through
    # its finally blocks: every cluster is removed before the process exits
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    reason = unavailable_reason()
    if reason is not None:
        print(f"bench_partitions: {reason}", file=sys.stderr)
        return 2
    versions = args.versions.split(",")
    kinds = args.kinds.split(",")
    if args.quick:
        versions, kinds, args.duration, args.fault = ["host"], ["isolate-queue-leader"], 15, 20
    rows: list[dict[str, Any]] = []
    log = (lambda _m: None) if args.json else (lambda m: print(f"  {m}", flush=True))
    for i, version in enumerate(versions):
        conf = ["consumer_disconnected_timeout = 5000"] if version == "4.3" else []
        cluster = PartitionCluster(
            version,
            net=args.net + i,
            partition_handling=args.partition_handling,
            conf=conf,
        )
        began = time.monotonic()
        try:
            cluster.start()
            log(f"{version}: cluster of {cluster.version} up in {time.monotonic() - began:.0f}s")
            for kind in kinds:
                for n in range(args.runs):
                    with tempfile.TemporaryDirectory() as work:
                        outcome = run_partitions(
                            cluster,
                            kind,
                            Path(work),
                            duration_s=args.duration,
                            fault_s=args.fault,
                            heal_s=args.heal,
                            rate=args.rate,
                            schedule=args.schedule,
                            log=log,
                        )
                    row = outcome.as_dict()
                    row["partition_handling"] = args.partition_handling
                    row["load"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
                    rows.append(row)
                    line = json.dumps(row, default=str)
                    if args.out:
                        with args.out.open("a", encoding="utf-8") as f:
                            f.write(line + "\n")
                    if args.json:
                        print(line, flush=True)
                    else:
                        print(f"{kind} run {n + 1}: {outcome.summary()}", flush=True)
        finally:
            cluster.cleanup()
    # this run's nets only: another run (another --net) may be going on beside it
    mine = [f"-{args.net + i}-" for i in range(len(versions))]
    mine += [f"br{args.net + i}" for i in range(len(versions))]
    mine += [f"v{args.net + i}-" for i in range(len(versions))]
    left = [x for x in leftovers() if any(m in x for m in mine)]
    if not args.json:
        print()
        print(table(rows))
        print(f"left on the machine: {', '.join(left) or 'nothing'}")
    return 1 if left or any(r["verdict"]["lost"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
