#!/usr/bin/env python3
"""Arbitrary delays: the TTL tier, the binary cascade and (when available) the
delayed-message plugin, measured in one run with the same messages.

For each backend:

    publish rate   confirmed publishes/s of the same body and headers through the sync
                   Publisher (prepare + publish_outgoing, window 256), median of several
                   rounds; the backends take turns within each round and the cascade/tier
                   ratio is the median of the per-round ratios (the broker is shared, its
                   load drifts between rounds far more than between neighbours). Tier:
                   a 1 h tier; cascade and plugin: 1 h + 1 s (any delay that is not a tier).
    lateness       arrival (a consumer thread, this machine's clock) minus `rd-due-at`,
                   and minus the time asked for (the cascade rounds delays UP to its
                   resolution, so "vs asked" includes that rounding). Messages are paced
                   (not a burst): tier 5 s each; cascade and plugin random 1..9 s.
                   "early" counts arrivals before `rd-due-at`: must be 0.
    memory         with N pending (100,000; --quick: 5,000): (a) the memory of the queue
                   processes holding them, from the management API (/api/queues, refreshed
                   every 5 s): for a quorum queue that is the Ra server, which keeps only
                   an index entry per message; (b) the node's memory breakdown delta
                   (/api/nodes/NAME/memory): `quorum_ets` holds the Ra WAL's in-memory
                   tables (recently written log entries, message bodies included, until
                   the WAL rolls over at 512 MB and they move to segment files on disk),
                   `binary` the bodies in flight. On a shared broker (b) is noisy: other
                   tests write to the same WAL. The plugin keeps its messages in a Mnesia
                   table (RAM and disk) on one node: its cost shows in (b) only.

    .venv/bin/python benchmarks/bench_delays.py            # full run, ~3-4 minutes
    .venv/bin/python benchmarks/bench_delays.py --quick    # smoke: small counts, < 60 s
    .venv/bin/python benchmarks/bench_delays.py --json     # machine-readable results

The plugin runs when RABBIT_DELAY_PLUGIN_URL names a broker that has it. Exit code: 0,
or 1 if a message arrived early or went missing (a correctness bug), or if `--strict`
is given and a target was missed (cascade rate >= 0.8 x tier rate; cascade lateness
p99 vs asked < 100 ms + resolution).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import random
import statistics
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import pika
import pika.exceptions

from rabbit_delay import RabbitDelayError, Topology, topology_from_dict
from rabbit_delay._envelope import Outgoing, encode_body, now_ms
from rabbit_delay._ops.delete.execute import delete_topology as sync_delete_topology
from rabbit_delay._urls import ManagementEndpoint, broker_url, management_endpoint, redact
from rabbit_delay.sync import Publisher, connected
from rabbit_delay.sync import connect as sync_connect
from rabbit_delay.sync import declare as sync_declare

PLUGIN_URL_ENV = "RABBIT_DELAY_PLUGIN_URL"
QUEUE = "sink"
PARK_TIER = "park"  # 1 h: nothing parked by the rate and memory phases expires
DUE_TIER = "due"  # 5 s: the tier's lateness phase
PARK_S = 3_600
PLUGIN_PARK_S = 300
BODY: dict[str, Any] = {"order_id": 1234567, "reason": "payment-timeout", "customer": "c-000042"}
ASKED = "bench-asked-ms"  # the exact time asked for (publish time + unrounded delay)
LATENESS_TARGET_MS = 100  # + the cascade's resolution
RATE_TARGET = 0.8  # cascade publish rate / tier publish rate


@dataclass(frozen=True)
class Sizes:
    rounds: int
    per_round: int
    lateness: int
    pace_per_s: int  # publishing pace of the lateness phase
    pending: int
    due_s: int  # the tier's delay in the lateness phase; the others: random 1..2*due_s-1


FULL = Sizes(rounds=40, per_round=1_000, lateness=2_000, pace_per_s=500, pending=100_000, due_s=5)
QUICK = Sizes(rounds=10, per_round=300, lateness=200, pace_per_s=200, pending=5_000, due_s=2)


@dataclass
class Backend:
    name: str  # "tier", "cascade" or "plugin"
    url: str
    topology: Topology
    rates: list[float] = field(default_factory=list)
    lateness: dict[str, Any] = field(default_factory=dict)
    memory: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    def prepare(self, publisher: Publisher, delay_s: float | None = None) -> Outgoing:
        """One message for this backend; `delay_s` None: the long parking delay."""
        now = now_ms()
        if self.name == "tier":
            tier = PARK_TIER if delay_s is None else DUE_TIER
            delay_ms = self.topology.tiers[tier]
            return publisher.prepare(BODY, tier, queue=QUEUE, headers={ASKED: now + delay_ms})
        if delay_s is None:
            # The plugin's store cannot be purged: park for 5 min there, so what the run
            # leaves behind fires soon after (into the deleted exchange, i.e. nowhere).
            delay_s = PLUGIN_PARK_S if self.name == "plugin" else PARK_S + 1
        seconds = delay_s
        return publisher.prepare(
            BODY, queue=QUEUE, delay=seconds, headers={ASKED: now + round(seconds * 1000)}
        )

    def holding_queues(self) -> list[str]:
        """The queue that holds this backend's parked messages (none for the plugin)."""
        n = self.topology.names
        if self.name == "tier":
            return [n.tier_queue(PARK_TIER)]
        if self.name == "cascade":
            cfg = self.topology.cascade
            assert cfg is not None
            units = -(-(PARK_S + 1) * 1000 // cfg.resolution)
            return [n.cascade_queue(units.bit_length() - 1)]  # parked at its highest bit
        return []


# -- topology ---------------------------------------------------------------------------


def make_topology(backend: str) -> Topology:
    data: dict[str, Any] = {
        "namespace": "bench-" + uuid.uuid4().hex[:8],
        "tiers": {PARK_TIER: "1h", DUE_TIER: "5s"},
        "queues": {QUEUE: {}},
    }
    data[backend] = {}
    return topology_from_dict(data, source="<bench_delays>")


def declare(url: str, topology: Topology) -> None:
    conn = sync_connect(url, name="bench_delays declare")
    try:
        sync_declare(conn, topology)
    finally:
        if conn.is_open:
            conn.close()


def delete_topology(url: str, topology: Topology) -> None:
    # Deleting a quorum queue that holds 100,000 messages can time out on the broker
    # (541) while it goes on deleting: retry on a new connection; gone objects are skipped.
    for attempt in range(1, 6):
        try:
            with connected(url, name="rabbit-delay cleanup") as connection:
                sync_delete_topology(connection, topology)
            return
        except RabbitDelayError as exc:
            print(f"cleanup attempt {attempt}: {exc}", file=sys.stderr)
            time.sleep(2 * attempt)


def purge(url: str, queues: list[str]) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        ch = conn.channel()
        for q in queues:
            ch.queue_purge(q)
    finally:
        conn.close()


# -- management API ---------------------------------------------------------------------


def api(endpoint: ManagementEndpoint, path: str) -> Any:
    request = urllib.request.Request(endpoint.url(path))
    token = base64.b64encode(f"{endpoint.username}:{endpoint.password}".encode()).decode()
    request.add_header("Authorization", f"Basic {token}")
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.load(response)


def node_memory(endpoint: ManagementEndpoint) -> dict[str, int]:
    node = api(endpoint, "overview")["node"]
    breakdown = api(endpoint, f"nodes/{quote(node, safe='')}/memory")["memory"]
    flat = {k: v for k, v in breakdown.items() if isinstance(v, int)}
    flat["total"] = int(breakdown["total"]["erlang"])
    return flat


def queue_stats(endpoint: ManagementEndpoint, names: list[str]) -> dict[str, tuple[int, int]]:
    """name -> (messages, memory) as last collected by the management plugin."""
    out = {}
    for name in names:
        q = api(endpoint, f"queues/{endpoint.vhost_quoted}/{quote(name, safe='')}")
        out[name] = (int(q.get("messages") or 0), int(q.get("memory") or 0))
    return out


# -- consuming --------------------------------------------------------------------------


class Consumer(threading.Thread):
    """Records (arrival, rd-due-at, asked) for each delivery, in its own thread."""

    def __init__(self, url: str, queue: str) -> None:
        super().__init__(daemon=True)
        self.url, self.queue = url, queue
        self.samples: list[tuple[int, int, int]] = []
        self.ready = threading.Event()
        self.halt = threading.Event()
        self.error: str | None = None

    def run(self) -> None:
        try:
            conn = pika.BlockingConnection(pika.URLParameters(self.url))
            ch = conn.channel()
            ch.basic_qos(prefetch_count=1_000)

            def on_message(ch: Any, method: Any, props: Any, _body: bytes) -> None:
                arrived = now_ms()
                headers = props.headers or {}
                self.samples.append((arrived, int(headers["rd-due-at"]), int(headers[ASKED])))
                ch.basic_ack(method.delivery_tag)

            ch.basic_consume(self.queue, on_message)
            self.ready.set()
            while not self.halt.is_set():
                conn.process_data_events(time_limit=0.02)
            conn.close()
        except Exception as exc:  # reported with the results
            self.error = repr(exc)
            self.ready.set()


def pct(ordered: list[int], p: float) -> int | None:
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))] if ordered else None


def measure_lateness(backend: Backend, sizes: Sizes, log: Callable[[str], None]) -> dict[str, Any]:
    url, topology = backend.url, backend.topology
    rng = random.Random(7)  # the same delays for the cascade and the plugin
    consumer = Consumer(url, topology.names.business_queue(QUEUE))
    consumer.start()
    consumer.ready.wait(15)
    batch = max(1, sizes.pace_per_s // 10)
    t0 = time.monotonic()
    with Publisher(topology, url) as publisher:
        for start in range(0, sizes.lateness, batch):
            count = min(batch, sizes.lateness - start)
            if backend.name == "tier":
                out = [backend.prepare(publisher, sizes.due_s) for _ in range(count)]
            else:
                out = [
                    backend.prepare(publisher, rng.uniform(1, 2 * sizes.due_s - 1))
                    for _ in range(count)
                ]
            publisher.publish_outgoing(out)
            pause = t0 + (start + count) / sizes.pace_per_s - time.monotonic()
            if pause > 0:
                time.sleep(pause)
    publish_s = time.monotonic() - t0
    deadline = time.monotonic() + 2 * sizes.due_s + 30
    while len(consumer.samples) < sizes.lateness and time.monotonic() < deadline:
        if consumer.error:
            break
        time.sleep(0.1)
    consumer.halt.set()
    consumer.join(10)
    vs_due = sorted(a - d for a, d, _ in consumer.samples)
    vs_asked = sorted(a - k for a, _, k in consumer.samples)
    result = {
        "sent": sizes.lateness,
        "received": len(vs_due),
        "publish_s": round(publish_s, 2),
        "p50_ms": pct(vs_due, 50),
        "p99_ms": pct(vs_due, 99),
        "max_ms": vs_due[-1] if vs_due else None,
        "early": sum(1 for x in vs_due if x < 0),
        "asked_p50_ms": pct(vs_asked, 50),
        "asked_p99_ms": pct(vs_asked, 99),
        "consumer_error": consumer.error,
    }
    log(f"lateness {backend.name}: {result}")
    return result


# -- phases -----------------------------------------------------------------------------


def publish_batch(backend: Backend, count: int) -> float:
    """Publish `count` parked messages; the rate in msg/s (prepare included)."""
    with Publisher(backend.topology, backend.url) as publisher:
        publisher.publish_outgoing([backend.prepare(publisher) for _ in range(20)])  # warm-up
        t0 = time.perf_counter()
        chunk = 5_000
        for start in range(0, count, chunk):
            n = min(chunk, count - start)
            publisher.publish_outgoing(backend.prepare(publisher) for _ in range(n))
        return count / (time.perf_counter() - t0)


def run_rates(backends: list[Backend], sizes: Sizes, log: Callable[[str], None]) -> None:
    """Many short rounds, the backends side by side in each (order alternating), so that
    both see the same broker load: the machine is shared and its load drifts by the second."""
    live = [b for b in backends if not b.error]
    publishers = {b.name: Publisher.connect(b.topology, b.url) for b in live}
    try:
        for b in live:  # warm-up: connections, code paths; not measured
            publishers[b.name].publish_outgoing([b.prepare(publishers[b.name]) for _ in range(50)])
        for r in range(sizes.rounds):
            for b in live if r % 2 == 0 else live[::-1]:
                publisher = publishers[b.name]
                t0 = time.perf_counter()
                publisher.publish_outgoing([b.prepare(publisher) for _ in range(sizes.per_round)])
                b.rates.append(sizes.per_round / (time.perf_counter() - t0))
            if (r + 1) % 10 == 0 or r + 1 == sizes.rounds:
                for b in live:
                    purge(b.url, b.holding_queues())
                log(
                    f"round {r + 1}/{sizes.rounds}: "
                    + ", ".join(f"{b.name} {statistics.median(b.rates):,.0f}/s" for b in live)
                )
    except Exception as exc:
        for b in live:
            b.error = b.error or f"rate rounds failed: {exc!r}"
    finally:
        for publisher in publishers.values():
            publisher.close()


def run_memory(backends: list[Backend], sizes: Sizes, log: Callable[[str], None]) -> None:
    """N pending per backend: node breakdown delta per backend, then queue-process memory."""
    for b in backends:
        if b.error:
            continue
        try:
            endpoint = management_endpoint(b.url)
            before = node_memory(endpoint)
            t0 = time.monotonic()
            rate = publish_batch(b, sizes.pending)
            time.sleep(1)
            after = node_memory(endpoint)
            delta = {k: after[k] - before.get(k, 0) for k in after}
            # The WAL's in-memory tables are flushed when it rolls over (512 MB): then
            # the node's memory drops, whatever was published. The delta means nothing.
            rolled_over = delta.get("quorum_ets", 0) < 0
            b.memory = {
                "pending": sizes.pending,
                "publish_rate": round(rate),
                "publish_s": round(time.monotonic() - t0, 1),
                "node_total_B_per_msg": None
                if rolled_over
                else round(delta["total"] / sizes.pending, 1),
                "wal_rolled_over": rolled_over,
                "node_delta_B_per_msg": {
                    k: round(delta.get(k, 0) / sizes.pending, 1)
                    for k in ("quorum_queue_procs", "quorum_ets", "binary", "mnesia", "other_ets")
                },
            }
            log(f"memory {b.name}: {b.memory}")
        except Exception as exc:
            b.error = f"memory phase failed: {exc!r}"
    # Queue-process memory, once the management stats show every pending message.
    deadline = time.monotonic() + 20
    waiting = [b for b in backends if not b.error and b.holding_queues()]
    while waiting and time.monotonic() < deadline:
        for b in list(waiting):
            endpoint = management_endpoint(b.url)
            stats = queue_stats(endpoint, b.holding_queues())
            if sum(m for m, _ in stats.values()) >= sizes.pending:
                holding = [name for name, (m, _) in stats.items() if m]
                memory = sum(stats[name][1] for name in holding)
                b.memory["queue_procs_B_per_msg"] = round(memory / sizes.pending, 1)
                b.memory["holding_queues"] = holding
                waiting.remove(b)
        if waiting:
            time.sleep(0.5)
    for b in backends:
        if not b.error:
            with contextlib.suppress(Exception):
                purge(b.url, b.holding_queues())


# -- report -----------------------------------------------------------------------------


def summarise(backends: list[Backend], sizes: Sizes, resolution_ms: int) -> dict[str, Any]:
    tier = next(b for b in backends if b.name == "tier")
    rows: dict[str, Any] = {}
    for b in backends:
        ratio = None
        if b.rates and tier.rates and b is not tier:
            ratio = statistics.median(x / y for x, y in zip(b.rates, tier.rates, strict=False))
        rows[b.name] = {
            "broker": redact(b.url),
            "error": b.error,
            "publish_msg_s": round(statistics.median(b.rates)) if b.rates else None,
            "publish_rates": [round(r) for r in b.rates],
            "ratio_vs_tier": None if ratio is None else round(ratio, 3),
            "lateness": b.lateness,
            "memory": b.memory,
        }
    cascade = rows.get("cascade", {})
    targets = {
        "cascade_rate_ratio": {"target": RATE_TARGET, "value": cascade.get("ratio_vs_tier")},
        "cascade_asked_p99_ms": {
            "target": LATENESS_TARGET_MS + resolution_ms,
            "value": cascade.get("lateness", {}).get("asked_p99_ms"),
        },
    }
    targets["cascade_rate_ratio"]["met"] = (
        None
        if targets["cascade_rate_ratio"]["value"] is None
        else targets["cascade_rate_ratio"]["value"] >= RATE_TARGET
    )
    asked = targets["cascade_asked_p99_ms"]
    asked["met"] = None if asked["value"] is None else asked["value"] < asked["target"]
    return {"backends": rows, "targets": targets}


def fmt(value: Any, spec: str = "") -> str:
    return "-" if value is None else format(value, spec)


def print_table(result: dict[str, Any]) -> None:
    cfg = result["config"]
    print(
        f"\nrounds {cfg['rounds']} x {cfg['per_round']} msgs; lateness {cfg['lateness']} msgs "
        f"paced at {cfg['pace_per_s']}/s (tier {cfg['due_s']} s; cascade/plugin random "
        f"1..{2 * cfg['due_s'] - 1} s, resolution {cfg['resolution_ms']} ms); memory with "
        f"{cfg['pending']:,} pending; body {cfg['body_bytes']} B"
    )
    head = (
        f"{'backend':<9}{'publish/s':>10}{'vs tier':>8}{'batch/s':>8}{'late p50':>9}{'p99':>6}"
        f"{'max':>7}{'early':>6}{'asked p99':>10}{'queue B/msg':>12}{'node B/msg':>11}  broker"
    )
    print("\n" + head)
    for name, row in result["backends"].items():
        if row["error"] and not row["publish_msg_s"]:
            print(f"{name:<9}  {row['error']}")
            continue
        lat, mem = row["lateness"], row["memory"]
        print(
            f"{name:<9}{fmt(row['publish_msg_s'], ',d'):>10}{fmt(row['ratio_vs_tier'], '.2f'):>8}"
            f"{fmt(mem.get('publish_rate'), ',d'):>8}"
            f"{fmt(lat.get('p50_ms')):>9}{fmt(lat.get('p99_ms')):>6}{fmt(lat.get('max_ms')):>7}"
            f"{fmt(lat.get('early')):>6}{fmt(lat.get('asked_p99_ms')):>10}"
            f"{fmt(mem.get('queue_procs_B_per_msg'), '.0f'):>12}"
            f"{fmt(mem.get('node_total_B_per_msg'), '.0f'):>11}  {row['broker']}"
        )
        if row["error"]:
            print(f"{'':<9}  {row['error']}")
    print(
        "publish/s: median of the rounds; batch/s: the one big batch of the memory phase\n"
        "late: arrival - rd-due-at (ms); asked: arrival - the time asked for (includes the "
        "cascade's rounding up)\nqueue B/msg: queue process memory / pending; node B/msg: "
        "node memory delta / pending (noisy on a shared broker)"
    )
    for name, row in result["backends"].items():
        if row["memory"].get("node_delta_B_per_msg"):
            parts = ", ".join(
                f"{k} {v:g}" for k, v in row["memory"]["node_delta_B_per_msg"].items()
            )
            note = (
                " (the WAL rolled over meanwhile: not meaningful)"
                if row["memory"].get("wal_rolled_over")
                else ""
            )
            print(f"  {name} node delta B/msg: {parts}{note}")
    for key, t in result["targets"].items():
        verdict = "-" if t["met"] is None else ("met" if t["met"] else "MISSED")
        print(f"target {key}: {fmt(t['value'])} (target {t['target']}) {verdict}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small counts (smoke test, < 60 s)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--url", default=None, help="AMQP URL (default $RABBIT_DELAY_URL or local)")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    url = broker_url(args.url)
    plugin_url = os.environ.get(PLUGIN_URL_ENV)

    def log(line: str) -> None:
        print(line, file=sys.stderr if args.json else sys.stdout, flush=True)

    started = time.monotonic()
    cascade_topology = make_topology("cascade")
    assert cascade_topology.cascade is not None
    backends = [
        Backend("tier", url, cascade_topology),  # one topology: tiers and cascade side by side
        Backend("cascade", url, cascade_topology),
    ]
    declared = [(url, cascade_topology)]
    log(f"declaring {cascade_topology.names.prefix}.* on {redact(url)}")
    declare(url, cascade_topology)
    if plugin_url:
        plugin = Backend("plugin", plugin_url, make_topology("plugin"))
        try:
            declare(plugin_url, plugin.topology)
            declared.append((plugin_url, plugin.topology))
        except Exception as exc:
            plugin.error = f"cannot declare the plugin topology: {exc}"
        backends.append(plugin)
    else:
        log(f"plugin: skipped ({PLUGIN_URL_ENV} is not set)")
    try:
        run_rates(backends, sizes, log)
        for b in backends:
            if not b.error:
                b.lateness = measure_lateness(b, sizes, log)
        run_memory(backends, sizes, log)
    finally:
        for where, topology in declared:
            delete_topology(where, topology)
    result: dict[str, Any] = {
        "config": {
            "quick": args.quick,
            "rounds": sizes.rounds,
            "per_round": sizes.per_round,
            "lateness": sizes.lateness,
            "pace_per_s": sizes.pace_per_s,
            "due_s": sizes.due_s,
            "pending": sizes.pending,
            "resolution_ms": cascade_topology.cascade.resolution,
            "levels": cascade_topology.cascade.levels,
            "body_bytes": len(encode_body(BODY)[0]),
            "seconds": round(time.monotonic() - started, 1),
        },
        **summarise(backends, sizes, cascade_topology.cascade.resolution),
    }
    if not plugin_url:
        result["backends"]["plugin"] = {
            "broker": None,
            "error": f"skipped: {PLUGIN_URL_ENV} is not set",
            "publish_msg_s": None,
            "lateness": {},
            "memory": {},
        }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_table(result)
        print(f"\n(total {result['config']['seconds']} s)")
    failed = False
    for b in backends:
        lat = b.lateness
        if lat and (lat["early"] or lat["received"] < lat["sent"]):
            log(f"FAIL {b.name}: {lat['early']} early, {lat['sent'] - lat['received']} missing")
            failed = True
    if args.strict and any(t["met"] is False for t in result["targets"].values()):
        failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
