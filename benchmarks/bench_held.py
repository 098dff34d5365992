#!/usr/bin/env python3
"""The [held] backend (RabbitMQ 4.3+) against the cascade and the tiers, in one run on
the same broker, with a holder (`rabbit-delay hold`) in a process of its own.

    lateness    random delays (0.1..60 s; --quick 0.1..3 s) sent at a steady pace to the
                held backend and the cascade at the same time (the same delays to both),
                and a 5 s tier (--quick 2 s) beside them: arrival (a consumer thread, this machine's
                clock) minus `rd-due-at` (p50/p99/max) and minus the time asked for
                (the cascade rounds delays UP to its 1 s resolution). "early" counts
                arrivals before `rd-due-at`: must be 0.
    publish     confirmed publishes/s through the sync Publisher (window 256), rounds in
                which the backends take turns (bench_delays.run_rates); the ratio to the
                tier is the median of the per-round ratios.
    burst       N messages published at once with the tier's delay (held: exact; tier: the
                tier), the holder running: end-to-end throughput (arrivals/s, first to
                last arrival) and lateness p99 of the burst. The holder settles every
                message twice (hold, then release): this is the holding path's throughput.

    .venv/bin/python benchmarks/bench_held.py --url amqp://...4.3...   # ~3 minutes
    .venv/bin/python benchmarks/bench_held.py --quick --json            # smoke, < 60 s

Exit code: 0; 1 when a message arrived early or went missing; 2 when the broker is older
than 4.3 (nothing to measure); with --strict also 1 when a target is missed (held p99
lateness <= 10 ms; burst throughput >= 0.5 x the tier's).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pika
from bench_delays import (
    BODY,
    QUEUE,
    Backend,
    Consumer,
    api,
    declare,
    delete_topology,
    pct,
    run_rates,
)

from rabbit_delay import Topology, topology_from_dict
from rabbit_delay._envelope import now_ms
from rabbit_delay._urls import broker_url, management_endpoint, redact
from rabbit_delay.sync import Publisher

ASKED = "bench-asked-ms"
LATENESS_TARGET_MS = 10
BURST_TARGET = 0.5


@dataclass(frozen=True)
class Sizes:
    lateness: int
    max_delay_s: float
    pace_per_s: int
    rounds: int
    per_round: int
    burst: int
    due_s: int  # the tier's delay, and the burst's
    pending: int  # the memory phase: messages held (and parked in a 1 h tier); 0: skipped


FULL = Sizes(
    lateness=1_000,
    max_delay_s=60,
    pace_per_s=50,
    rounds=20,
    per_round=1_000,
    burst=20_000,
    due_s=5,
    pending=100_000,
)
QUICK = Sizes(
    lateness=60,
    max_delay_s=3,
    pace_per_s=60,
    rounds=3,
    per_round=300,
    burst=600,
    due_s=2,
    pending=0,
)


class HeldBackend(Backend):
    def holding_queues(self) -> list[str]:
        if self.name == "held":
            return [self.topology.names.held_queue()]
        return super().holding_queues()


def make_topology(backend: str, due_s: int) -> Topology:
    """One topology per backend (each its own business queue to measure). Only the tier's
    has the tier of `due_s`: a delay equal to a tier takes the tier, whatever the backend."""
    data: dict[str, Any] = {
        "namespace": "bench-" + uuid.uuid4().hex[:8],
        "tiers": {"park": "1h"},
        "queues": {QUEUE: {}},
    }
    if backend == "tier":
        data["tiers"]["due"] = f"{due_s}s"
    else:
        data[backend] = {}
    return topology_from_dict(data, source="<bench_held>")


class HolderProcess:
    """`rabbit-delay hold` for `topology`, in a process of its own."""

    def __init__(self, topology: Topology, url: str) -> None:
        self.folder = tempfile.TemporaryDirectory()
        path = Path(self.folder.name) / "held.toml"
        path.write_text(
            f'namespace = "{topology.namespace}"\n[tiers]\npark = "1h"\n'
            f'[held]\n[queues."{QUEUE}"]\n',
            encoding="utf-8",
        )
        command = [sys.executable, "-m", "rabbit_delay", "hold", "-f", str(path), "--url", url]
        self.process = subprocess.Popen(
            [*command, "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.stats: dict[str, Any] = {}
        self.cpu_at_start: float | None = None

    def started(self) -> None:
        """Called once it holds: its start-up (imports, connecting) is not counted."""
        self.cpu_at_start = self.cpu_s()

    def cpu_s(self) -> float | None:
        """The CPU time (user + system) the holder process used so far (Linux)."""
        try:
            fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        cpu = self.cpu_s()
        self.process.terminate()
        out, err = self.process.communicate(timeout=30)
        self.folder.cleanup()
        try:
            self.stats = json.loads(out)
        except ValueError:
            self.stats = {"error": err[-500:]}
            return
        settles = self.stats["held"] + self.stats["released"]
        used = None if cpu is None or self.cpu_at_start is None else cpu - self.cpu_at_start
        self.stats["cpu_s"] = None if used is None else round(used, 2)
        self.stats["cpu_us_per_settle"] = round(used * 1e6 / settles) if used and settles else None


def summary(samples: list[tuple[int, int, int]], sent: int) -> dict[str, Any]:
    vs_due = sorted(a - d for a, d, _ in samples)
    vs_asked = sorted(a - k for a, _, k in samples)
    return {
        "sent": sent,
        "received": len(samples),
        "p50_ms": pct(vs_due, 50),
        "p99_ms": pct(vs_due, 99),
        "max_ms": vs_due[-1] if vs_due else None,
        "early": sum(1 for x in vs_due if x < 0),
        "asked_p99_ms": pct(vs_asked, 99),
    }


def wait_all(consumers: dict[str, Consumer], sent: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(len(c.samples) >= sent or c.error for c in consumers.values()):
            break
        time.sleep(0.1)
    for c in consumers.values():
        c.halt.set()
        c.join(10)


def lateness(url: str, topologies: dict[str, Topology], sizes: Sizes) -> dict[str, Any]:
    """Held and cascade get the same random delays, the tier its own, interleaved."""
    consumers = {
        name: Consumer(url, topology.names.business_queue(QUEUE))
        for name, topology in topologies.items()
    }
    for c in consumers.values():
        c.start()
        c.ready.wait(15)
    rng = random.Random(24)
    publishers = {name: Publisher.connect(t, url) for name, t in topologies.items()}
    try:
        t0 = time.monotonic()
        for i in range(sizes.lateness):
            delay = rng.uniform(0.1, sizes.max_delay_s)
            for name, publisher in publishers.items():
                now = now_ms()
                if name == "tier":
                    publisher.publish_delayed(
                        BODY, "due", queue=QUEUE, headers={ASKED: now + sizes.due_s * 1000}
                    )
                else:
                    asked = now + round(delay * 1000)
                    publisher.publish_delayed(
                        BODY, queue=QUEUE, delay=delay, headers={ASKED: asked}
                    )
            pause = t0 + (i + 1) / sizes.pace_per_s - time.monotonic()
            if pause > 0:
                time.sleep(pause)
    finally:
        for publisher in publishers.values():
            publisher.close()
    wait_all(consumers, sizes.lateness, sizes.max_delay_s + 30)
    return {
        name: {**summary(c.samples, sizes.lateness), "consumer_error": c.error}
        for name, c in consumers.items()
    }


def burst(url: str, name: str, topology: Topology, count: int, due_s: int) -> dict[str, Any]:
    consumer = Consumer(url, topology.names.business_queue(QUEUE))
    consumer.start()
    consumer.ready.wait(15)
    with Publisher(topology, url) as publisher:
        t0 = time.perf_counter()
        out = []
        for _ in range(count):
            now = now_ms()
            if name == "tier":
                out.append(
                    publisher.prepare(BODY, "due", queue=QUEUE, headers={ASKED: now + due_s * 1000})
                )
            else:
                out.append(
                    publisher.prepare(
                        BODY, queue=QUEUE, delay=due_s, headers={ASKED: now + due_s * 1000}
                    )
                )
        publisher.publish_outgoing(out)
        publish_s = time.perf_counter() - t0
    wait_all({name: consumer}, count, 120)
    arrivals = sorted(a for a, _, _ in consumer.samples)
    span_s = (arrivals[-1] - arrivals[0]) / 1000 if len(arrivals) > 1 else None
    return {
        **summary(consumer.samples, count),
        "publish_msg_s": round(count / publish_s),
        "arrivals_msg_s": round(len(arrivals) / span_s) if span_s else None,
        "consumer_error": consumer.error,
    }


def memory(url: str, topologies: dict[str, Topology], count: int, log: Any) -> dict[str, Any]:
    """`count` messages held for 1 h+ in the holding queue against `count` parked in the
    tier's 1 h buffer: each queue process's memory (management API, sampled every 5 s)
    per message once the holder has held them all."""
    endpoint = management_endpoint(url)
    held_q = topologies["held"].names.held_queue()
    tier_q = topologies["tier"].names.tier_queue("park")
    out: dict[str, Any] = {"pending": count}
    for name, queue in (("held", held_q), ("tier", tier_q)):
        with Publisher(topologies[name], url) as publisher:
            chunk = 5_000
            for start in range(0, count, chunk):
                n = min(chunk, count - start)
                if name == "tier":
                    batch = [publisher.prepare(BODY, "park", queue=QUEUE) for _ in range(n)]
                else:
                    batch = [publisher.prepare(BODY, queue=QUEUE, delay=3_601) for _ in range(n)]
                publisher.publish_outgoing(batch)
        field = "messages_delayed" if name == "held" else "messages"
        t0 = time.monotonic()
        row: dict[str, Any] = {}
        while time.monotonic() - t0 < 600:
            row = api(endpoint, f"queues/{endpoint.vhost_quoted}/{quote(queue, safe='')}")
            if int(row.get(field) or 0) >= count:
                break
            time.sleep(2)
        time.sleep(6)  # one more sample of the queue's memory
        row = api(endpoint, f"queues/{endpoint.vhost_quoted}/{quote(queue, safe='')}")
        out[name] = {
            "counted": int(row.get(field) or 0),
            "queue_memory_B": int(row.get("memory") or 0),
            "B_per_msg": round(int(row.get("memory") or 0) / count, 1),
            "seconds_to_count": round(time.monotonic() - t0, 1),
        }
        log(f"memory {name}: {out[name]}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small counts (smoke, < 60 s)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--url", default=None, help="AMQP URL of a RabbitMQ 4.3+ broker")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    parser.add_argument(
        "--holders", type=int, default=1, help="holder processes (each takes one core at most)"
    )
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    url = broker_url(args.url)

    def log(line: str) -> None:
        print(line, file=sys.stderr if args.json else sys.stdout, flush=True)

    conn = pika.BlockingConnection(pika.URLParameters(url))
    version = conn._impl.server_properties.get("version", b"")
    conn.close()
    version = version.decode() if isinstance(version, bytes) else str(version)
    if tuple(int(p) for p in version.split(".")[:2]) < (4, 3):
        log(f"the [held] backend needs RabbitMQ 4.3+; {redact(url)} runs {version}")
        return 2
    started = time.monotonic()
    topologies = {name: make_topology(name, sizes.due_s) for name in ("held", "cascade", "tier")}
    for topology in topologies.values():
        declare(url, topology)
    result: dict[str, Any] = {
        "broker": redact(url),
        "version": version,
        "quick": args.quick,
        "holders_count": args.holders,
    }
    holders: list[HolderProcess] = []
    try:
        backends = [HeldBackend(n, url, topologies[n]) for n in ("tier", "cascade", "held")]
        log("publish rounds (no holder: what is parked stays ready, purged between rounds)")
        run_rates(backends, sizes_for_rates(sizes), log)
        rates = {b.name: b.rates for b in backends}
        tier_rates = rates["tier"]
        result["publish"] = {
            name: {
                "msg_s": round(statistics.median(r)) if r else None,
                "ratio_vs_tier": round(
                    statistics.median(x / y for x, y in zip(r, tier_rates, strict=False)), 3
                )
                if r and name != "tier"
                else None,
            }
            for name, r in rates.items()
        }
        for b in backends:
            if b.error:
                result.setdefault("errors", []).append(f"{b.name}: {b.error}")
        holders = [HolderProcess(topologies["held"], url) for _ in range(args.holders)]
        time.sleep(3)  # the holders' start (imports, connection, link)
        for holder in holders:
            holder.started()
        log(
            f"lateness: {sizes.lateness} messages, 0.1..{sizes.max_delay_s} s, {sizes.pace_per_s}/s"
        )
        result["lateness"] = lateness(url, topologies, sizes)
        log(f"lateness: {json.dumps(result['lateness'])}")
        result["burst"] = {}
        for name in ("tier", "held"):
            log(f"burst {name}: {sizes.burst} messages, {sizes.due_s} s")
            result["burst"][name] = burst(url, name, topologies[name], sizes.burst, sizes.due_s)
            log(f"burst {name}: {json.dumps(result['burst'][name])}")
        if sizes.pending:
            log(f"memory: {sizes.pending:,} held against {sizes.pending:,} in a 1 h tier")
            result["memory"] = memory(url, topologies, sizes.pending, log)
        tier_burst = result["burst"]["tier"]["arrivals_msg_s"]
        held_burst = result["burst"]["held"]["arrivals_msg_s"]
        result["burst"]["held_vs_tier"] = (
            round(held_burst / tier_burst, 3) if held_burst and tier_burst else None
        )
    finally:
        for holder in holders:
            holder.stop()
        result["holders"] = [holder.stats for holder in holders]
        if holders:
            result["holder"] = _summed([holder.stats for holder in holders])
        for topology in topologies.values():
            delete_topology(url, topology)
    held_p99 = result["lateness"]["held"]["p99_ms"]
    result["targets"] = {
        "held_p99_ms": {"target": LATENESS_TARGET_MS, "value": held_p99},
        "burst_ratio": {"target": BURST_TARGET, "value": result["burst"]["held_vs_tier"]},
    }
    for key, t in result["targets"].items():
        t["met"] = (
            None
            if t["value"] is None
            else (t["value"] <= t["target"] if key == "held_p99_ms" else t["value"] >= t["target"])
        )
    result["seconds"] = round(time.monotonic() - started, 1)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_table(result)
    failed = False
    for section in ("lateness", "burst"):
        for name, row in result[section].items():
            if isinstance(row, dict) and (row["early"] or row["received"] < row["sent"]):
                missing = row["sent"] - row["received"]
                log(f"FAIL {section} {name}: {row['early']} early, {missing} missing")
                failed = True
    missed = any(t["met"] is False for t in result["targets"].values())
    return 1 if failed or (args.strict and missed) else 0


def _summed(stats: list[dict[str, Any]]) -> dict[str, Any]:
    """The holders' counts added up; CPU per settle over all of them."""
    keys = ("held", "released", "released_without_due_time", "connects")
    total: dict[str, Any] = {k: sum(int(s.get(k) or 0) for s in stats) for k in keys}
    total["max_late_ms"] = max(int(s.get("max_late_ms") or 0) for s in stats)
    cpu = [s.get("cpu_s") for s in stats]
    settles = total["held"] + total["released"]
    if all(c is not None for c in cpu) and settles:
        total["cpu_s"] = round(sum(cpu), 2)  # type: ignore[arg-type]
        total["cpu_us_per_settle"] = round(total["cpu_s"] * 1e6 / settles)
    return total


def sizes_for_rates(sizes: Sizes) -> Any:
    from bench_delays import Sizes as DelaySizes

    return DelaySizes(
        rounds=sizes.rounds, per_round=sizes.per_round, lateness=0, pace_per_s=1, pending=0, due_s=1
    )


def fmt(value: Any) -> str:
    return "-" if value is None else str(value)


def print_table(result: dict[str, Any]) -> None:
    print(f"\nRabbitMQ {result['version']} at {result['broker']}")
    head = f"{'lateness':<10}{'sent':>6}{'recv':>6}{'p50':>6}{'p99':>6}{'max':>7}{'early':>6}"
    print(f"\n{head}{'asked p99':>10}")
    for name, row in result["lateness"].items():
        print(
            f"{name:<10}{row['sent']:>6}{row['received']:>6}{fmt(row['p50_ms']):>6}"
            f"{fmt(row['p99_ms']):>6}{fmt(row['max_ms']):>7}{row['early']:>6}"
            f"{fmt(row['asked_p99_ms']):>10}"
        )
    print(f"\n{'publish':<10}{'msg/s':>8}{'vs tier':>8}")
    for name, row in result["publish"].items():
        print(f"{name:<10}{fmt(row['msg_s']):>8}{fmt(row['ratio_vs_tier']):>8}")
    print(
        f"\n{'burst':<10}{'sent':>7}{'pub/s':>8}{'arrive/s':>9}{'p50':>7}{'p99':>7}{'max':>7}{'early':>6}"
    )
    for name in ("tier", "held"):
        row = result["burst"][name]
        print(
            f"{name:<10}{row['sent']:>7}{fmt(row['publish_msg_s']):>8}{fmt(row['arrivals_msg_s']):>9}"
            f"{fmt(row['p50_ms']):>7}{fmt(row['p99_ms']):>7}{fmt(row['max_ms']):>7}{row['early']:>6}"
        )
    print(f"held/tier burst arrivals: {fmt(result['burst']['held_vs_tier'])}")
    print(f"holder: {result.get('holder')}")
    for key, t in result["targets"].items():
        verdict = "-" if t["met"] is None else ("met" if t["met"] else "MISSED")
        print(f"target {key}: {fmt(t['value'])} (target {t['target']}) {verdict}")
    print(f"(total {result['seconds']} s)")


if __name__ == "__main__":
    sys.exit(main())
