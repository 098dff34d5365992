#!/usr/bin/env python3
"""Sharded tier buffers under a sustained burst: one node, a 3-node cluster, the broker's
dead-letter prefetch, and a large backlog of pending messages.

    node       N messages (60,000; --quick: 6,000) published at full speed with the sync
               `Publisher.publish_many` (chunks of 5,000) into one tier (3 s; --quick: 1 s)
               of a topology with shards = 1, 2, 4, 8 (one topology, one namespace per
               shard count, declared once). The shard counts take turns within each round
               (order rotating), and each figure is the median over the rounds; a ratio
               is the median of the per-round ratios to shards = 1 of the same round. A
               consumer in a process of its own (raw pika, auto-ack, so it is never the
               bottleneck) on the business queue records each arrival (this machine's
               clock) against the message's `rd-due-at`:
                 publish msg/s     N / time of the publish_many calls
                 dead-letter msg/s received / (last arrival - first rd-due-at): the
                                   rate at which the buffers emptied into the queue
                 dl/pub            dead-letter msg/s / publish msg/s of the same burst:
                                   1.0 when the buffers keep up with the publisher (on
                                   a slow or busy broker the publish, not the buffers,
                                   is then the limit)
                 late p50/p99/max  arrival - rd-due-at, in ms
                 early             arrivals before rd-due-at (must be 0)
                 lost              N - distinct ids received (must be 0)
               Broker: --url (default $RABBIT_DELAY_URL, else the local broker); it is
               only published to, never reconfigured.
    cluster    (--cluster VERSION: host, 4.0 or 4.3) the same on a 3-node cluster started
               with `.ci/brokers.sh cluster-start` (leaders balanced over the members, the
               broker's default replica count), then removed.
    prefetch   (--prefetch, on by default in a full run) on a scratch node of the
               machine's own RabbitMQ (`brokers.sh start host`): shards = 1 with the
               broker's `dead_letter_worker_consumer_prefetch` at 32 (its default) and at
               512, set with `rabbitmqctl eval application:set_env(...)` before each
               topology is declared (the dead-letter worker reads it when it starts) and
               read back; rounds interleaved as above.
    pending    (--pending N, full run only) N messages pending in one tier (long enough
               for the whole publish) on a scratch node: node memory (management API)
               before and after, per pending message, then the time until every one was
               dead-lettered and consumed, lost (must be 0).

    .venv/bin/python benchmarks/bench_scale.py              # node + prefetch, ~6 minutes
    .venv/bin/python benchmarks/bench_scale.py --quick      # node only, small, < 20 s
    .venv/bin/python benchmarks/bench_scale.py --cluster host --pending 200000
    .venv/bin/python benchmarks/bench_scale.py --json       # machine-readable results

Exit code: 1 if a message arrived early or went missing (a correctness bug), or if
`--strict` is given and the target was missed (on one node, the best shard count's
median p99 lateness <= 1 s), else 0.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import multiprocessing.connection
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pika
import pika.exceptions
from bench_delays import api, node_memory  # the same management reads as bench_delays

from rabbit_delay import RabbitDelayError, Topology, topology_from_dict
from rabbit_delay._envelope import now_ms
from rabbit_delay._ops.delete.execute import delete_topology as sync_delete_topology
from rabbit_delay._urls import broker_url, management_endpoint, redact
from rabbit_delay.sync import Publisher, connected
from rabbit_delay.sync import declare as sync_declare

BROKERS_SH = Path(__file__).resolve().parents[1] / ".ci" / "brokers.sh"
QUEUE = "sink"
TIER = "burst"
PENDING_TIER = "pending"
SHARDS = (1, 2, 4, 8)
CHUNK = 5_000
# A paced burst publishes rate/PACE_TICKS messages PACE_TICKS times a second.
PACE_TICKS = 20
PACED_SHARDS = (1, 4, 8)
# Below what this 2-core node publishes and dead-letters at once (7-8k msg/s with 4-8
# shards), above what one buffer dead-letters (4-5k msg/s).
PACED_RATE = 5_000
PHASES = ("node", "paced", "cluster", "prefetch", "pending")
BODY: dict[str, Any] = {"order_id": 1234567, "reason": "payment-timeout", "customer": "c-000042"}
P99_TARGET_MS = 1_000  # issue 10: the best shard count, one node
PREFETCH_KEY = "dead_letter_worker_consumer_prefetch"
# brokers.sh derives management (+10000), distribution (+20000) and CLI (+30000..+30009)
# ports from the AMQP port: all must be free.
_DERIVED = (0, 10000, 20000, *range(30000, 30010))

Log = Callable[[str], None]


@dataclass(frozen=True)
class Sizes:
    messages: int
    rounds: int
    tier_s: int
    prefetch_rounds: int


FULL = Sizes(messages=60_000, rounds=5, tier_s=3, prefetch_rounds=3)
QUICK = Sizes(messages=6_000, rounds=1, tier_s=1, prefetch_rounds=1)


# -- topology ---------------------------------------------------------------------------


def make_topology(tiers: dict[str, str], shards: int) -> Topology:
    data: dict[str, Any] = {
        "namespace": "bench-" + uuid.uuid4().hex[:8],
        "tiers": tiers,
        "queues": {QUEUE: {}},
        "scaling": {"shards": shards},
    }
    return topology_from_dict(data, source="<bench_scale>")


def declare(url: str, topology: Topology) -> None:
    with connected(url, name="bench_scale declare") as connection:
        sync_declare(connection, topology)


def delete_topology(url: str, topology: Topology, log: Log) -> None:
    # Deleting a quorum queue that holds many messages can time out on the broker (541)
    # while it goes on deleting: retry on a new connection; gone objects are skipped.
    for attempt in range(1, 6):
        try:
            with connected(url, name="rabbit-delay cleanup") as connection:
                sync_delete_topology(connection, topology)
            return
        except RabbitDelayError as exc:
            log(f"cleanup attempt {attempt}: {exc}")
            time.sleep(2 * attempt)


# -- scratch nodes and clusters (.ci/brokers.sh) ----------------------------------------


def brokers_sh(*args: str, timeout: float = 300) -> str:
    done = subprocess.run(
        ["bash", str(BROKERS_SH), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"brokers.sh {' '.join(args)} failed:\n{done.stderr[-2000:]}")
    return done.stdout


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_base_port(members: int = 1) -> int:
    """A port P with every derived port free for `members` nodes at P, P+10, P+20..."""
    while True:
        port = random.randint(6000, 9999)
        if all(_port_free(port + 10 * i + d) for i in range(members) for d in _DERIVED):
            return port


@contextlib.contextmanager
def scratch_node(kind: str, log: Log) -> Iterator[tuple[str, str]]:
    """A scratch node of `kind` with the management plugin: (name, AMQP URL); removed
    afterwards, whatever happens."""
    name = f"bench{uuid.uuid4().hex[:6]}"
    port = free_base_port()
    t0 = time.monotonic()
    try:
        brokers_sh("start", kind, name, "--port", str(port))
        log(f"scratch node {kind} {name} on port {port} up in {time.monotonic() - t0:.0f} s")
        yield name, f"amqp://guest:guest@127.0.0.1:{port}/%2F"
    finally:
        with contextlib.suppress(Exception):
            brokers_sh("rm", kind, name, timeout=180)


@contextlib.contextmanager
def scratch_cluster(kind: str, log: Log) -> Iterator[list[str]]:
    """A 3-node cluster of `kind`: its members' AMQP URLs; removed afterwards."""
    name = f"bench{uuid.uuid4().hex[:6]}"
    port = free_base_port(3)
    t0 = time.monotonic()
    try:
        brokers_sh("cluster-start", kind, name, "--nodes", "3", "--port", str(port), timeout=600)
        urls = brokers_sh("cluster-urls", kind, name).split()
        log(f"cluster {kind} {name} ({len(urls)} members) up in {time.monotonic() - t0:.0f} s")
        yield urls
    finally:
        with contextlib.suppress(Exception):
            brokers_sh("cluster-rm", kind, name, timeout=300)


def ctl_eval(kind: str, node: str, expr: str) -> str:
    return brokers_sh("ctl", kind, node, "eval", expr, timeout=120).strip()


def broker_version(url: str) -> str:
    with contextlib.suppress(Exception):
        conn = pika.BlockingConnection(pika.URLParameters(url))
        try:
            version = conn._impl.server_properties.get("version", "?")
            return version.decode() if isinstance(version, bytes) else str(version)
        finally:
            conn.close()
    return "?"


def leaders(url: str, queues: tuple[str, ...]) -> dict[str, str]:
    """queue -> its leader's node name (management API), for the cluster figures."""
    out = {}
    with contextlib.suppress(Exception):
        endpoint = management_endpoint(url)
        for q in queues:
            info = api(endpoint, f"queues/{endpoint.vhost_quoted}/{quote(q, safe='')}")
            out[q] = str(info.get("leader") or info.get("node") or "?")
    return out


# -- consuming (a process of its own: never the bottleneck, never the publisher's GIL) ---


def _consume(
    url: str,
    queue: str,
    expected: int,
    deadline_s: float,
    pipe: multiprocessing.connection.Connection,
) -> None:
    arrivals: list[int] = []
    dues: list[int] = []
    ids: set[str] = set()
    error = None
    try:
        params = pika.URLParameters(url)
        params.heartbeat = 60
        conn = pika.BlockingConnection(params)
        ch = conn.channel()

        def on_message(_ch: Any, _method: Any, props: Any, _body: bytes) -> None:
            arrivals.append(now_ms())
            dues.append(int((props.headers or {})["rd-due-at"]))
            ids.add(props.message_id)

        ch.basic_consume(queue, on_message, auto_ack=True)
        pipe.send("ready")
        end = time.monotonic() + deadline_s
        while len(ids) < expected and time.monotonic() < end:
            conn.process_data_events(time_limit=0.05)
        conn.close()
    except Exception as exc:  # reported with the results
        error = repr(exc)
        with contextlib.suppress(Exception):
            pipe.send("ready")
    pipe.send((arrivals, dues, len(ids), error))
    pipe.close()


class Consumer:
    def __init__(self, url: str, queue: str, expected: int, deadline_s: float) -> None:
        ctx = multiprocessing.get_context("fork")
        self._pipe, child = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(
            target=_consume, args=(url, queue, expected, deadline_s, child), daemon=True
        )
        self._proc.start()
        child.close()
        if not self._pipe.poll(30) or self._pipe.recv() != "ready":
            raise RuntimeError("the consumer did not start")

    def result(self, timeout: float) -> tuple[list[int], list[int], int, str | None]:
        try:
            if not self._pipe.poll(timeout):
                raise RuntimeError("the consumer did not report")
            arrivals, dues, distinct, error = self._pipe.recv()
            return arrivals, dues, distinct, error
        finally:
            self._proc.join(10)
            if self._proc.is_alive():
                self._proc.kill()


def pct(ordered: list[int], p: float) -> int | None:
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))] if ordered else None


# -- one burst ----------------------------------------------------------------------------


def burst(
    url: str,
    consume_url: str,
    topology: Topology,
    tier: str,
    count: int,
    rate: int | None = None,
) -> dict[str, Any]:
    """Publish `count` messages into `tier` at full speed (or at `rate` msg/s, in a
    `publish_many` of rate/20 messages every 50 ms on a fixed schedule); what the
    consumer saw."""
    tier_s = topology.tiers[tier] / 1000
    deadline_s = tier_s + count / 500 + 30  # generous: a slow drain still gets measured
    consumer = Consumer(consume_url, topology.names.business_queue(QUEUE), count, deadline_s)
    chunk = CHUNK if rate is None else max(1, rate // PACE_TICKS)
    with Publisher(topology, url) as publisher:
        publisher.publish_many([BODY] * 10, tier, queue=QUEUE)  # warm-up (counted as sent)
        t0 = time.perf_counter()
        for i, start in enumerate(range(0, count - 10, chunk)):
            if rate is not None:  # the next tick of the schedule (never catches up in bulk)
                time.sleep(max(0.0, t0 + i * chunk / rate - time.perf_counter()))
            publisher.publish_many([BODY] * min(chunk, count - 10 - start), tier, queue=QUEUE)
        publish_s = time.perf_counter() - t0
    arrivals, dues, distinct, error = consumer.result(deadline_s + 30)
    late = sorted(a - d for a, d in zip(arrivals, dues, strict=True))
    drain_ms = (max(arrivals) - min(dues)) if arrivals else 0
    return {
        "sent": count,
        "received": len(arrivals),
        "lost": count - distinct,
        "duplicates": len(arrivals) - distinct,
        "publish_msg_s": round((count - 10) / publish_s),
        "deadletter_msg_s": round(len(arrivals) / (drain_ms / 1000)) if drain_ms > 0 else None,
        "drain_s": round(drain_ms / 1000, 2),
        # 1.0: the buffers emptied as fast as they were filled (not the bottleneck)
        "keeps_up": round(len(arrivals) / (drain_ms / 1000) / ((count - 10) / publish_s), 2)
        if drain_ms > 0
        else None,
        "p50_ms": pct(late, 50),
        "p99_ms": pct(late, 99),
        "max_ms": late[-1] if late else None,
        "early": sum(1 for x in late if x < 0),
        "consumer_error": error,
    }


@dataclass
class Series:
    """One contender of an interleaved comparison: its bursts, one per round."""

    label: str
    topology: Topology
    bursts: list[dict[str, Any]] = field(default_factory=list)

    def median(self, key: str) -> float | None:
        values = [b[key] for b in self.bursts if b.get(key) is not None]
        return statistics.median(values) if values else None


def interleaved(
    series: list[Series],
    rounds: int,
    url: str,
    consume_url: str,
    count: int,
    log: Log,
    before: Callable[[Series], None] | None = None,
    rate: int | None = None,
) -> None:
    for r in range(rounds):
        order = series[r % len(series) :] + series[: r % len(series)]
        for s in order:
            if before is not None:
                before(s)
            b = burst(url, consume_url, s.topology, TIER, count, rate)
            s.bursts.append(b)
            log(
                f"round {r + 1}/{rounds} {s.label}: publish {b['publish_msg_s']:,}/s, "
                f"dead-letter {b['deadletter_msg_s']}/s, late p50 {b['p50_ms']} p99 "
                f"{b['p99_ms']} max {b['max_ms']} ms, early {b['early']}, lost {b['lost']}"
            )


def summarise(series: list[Series]) -> dict[str, Any]:
    base = series[0]
    rows: dict[str, Any] = {}
    for s in series:

        def ratio(key: str, s: Series = s) -> float | None:
            pairs = [
                (x[key], y[key])
                for x, y in zip(s.bursts, base.bursts, strict=False)
                if x.get(key) and y.get(key)
            ]
            return round(statistics.median(a / b for a, b in pairs), 2) if pairs else None

        rows[s.label] = {
            "publish_msg_s": s.median("publish_msg_s"),
            "deadletter_msg_s": s.median("deadletter_msg_s"),
            "p50_ms": s.median("p50_ms"),
            "p99_ms": s.median("p99_ms"),
            "max_ms": s.median("max_ms"),
            "early": sum(b["early"] for b in s.bursts),
            "lost": sum(b["lost"] for b in s.bursts),
            "duplicates": sum(b["duplicates"] for b in s.bursts),
            "keeps_up": s.median("keeps_up"),
            "ratio_deadletter": ratio("deadletter_msg_s"),
            "ratio_p99": ratio("p99_ms"),
            "ratio_publish": ratio("publish_msg_s"),
            "p99_rounds": [b["p99_ms"] for b in s.bursts],
            "deadletter_rounds": [b["deadletter_msg_s"] for b in s.bursts],
            "consumer_errors": [b["consumer_error"] for b in s.bursts if b["consumer_error"]],
        }
    return rows


# -- phases -----------------------------------------------------------------------------


def shard_phase(
    urls: list[str], sizes: Sizes, log: Log, shards: tuple[int, ...] = SHARDS
) -> dict[str, Any]:
    """shards = 1, 2, 4, 8 (or `shards`) interleaved; publish to and consume from the
    first URL. The first count is the baseline of the ratios."""
    url = urls[0]
    tiers = {TIER: f"{sizes.tier_s}s"}
    series = [Series(f"shards={n}", make_topology(tiers, n)) for n in shards]
    try:
        for s in series:
            declare(url, s.topology)
        placement = {}
        if len(urls) > 1:
            for s in series:
                placement[s.label] = leaders(url, s.topology.tier_queues(TIER))
        interleaved(series, sizes.rounds, url, url, sizes.messages, log)
    finally:
        for s in series:
            delete_topology(url, s.topology, log)
    out: dict[str, Any] = {"broker": redact(url), "rows": summarise(series)}
    if len(urls) > 1:
        out["members"] = [redact(u) for u in urls]
        out["buffer_leaders"] = placement
    return out


def paced_phase(url: str, sizes: Sizes, rate: int, log: Log) -> dict[str, Any]:
    """shards = 1, 4, 8 interleaved at a sustained `rate` msg/s (not full speed): the
    lateness a tier gives when the node is not saturated by the publisher itself."""
    tiers = {TIER: f"{sizes.tier_s}s"}
    series = [Series(f"shards={n}", make_topology(tiers, n)) for n in PACED_SHARDS]
    try:
        for s in series:
            declare(url, s.topology)
        interleaved(series, sizes.prefetch_rounds, url, url, sizes.messages, log, rate=rate)
    finally:
        for s in series:
            delete_topology(url, s.topology, log)
    return {"broker": redact(url), "rate_msg_s": rate, "rows": summarise(series)}


def prefetch_phase(kind: str, sizes: Sizes, log: Log) -> dict[str, Any]:
    """shards = 1 with the broker's dead-letter prefetch 32 vs 512, on a scratch node."""
    tiers = {TIER: f"{sizes.tier_s}s"}
    with scratch_node(kind, log) as (node, url):
        series = [Series(f"prefetch={p}", make_topology(tiers, 1)) for p in (32, 512)]
        read_back = {}
        try:
            for s, value in zip(series, (32, 512), strict=True):
                ctl_eval(kind, node, f"application:set_env(rabbit, {PREFETCH_KEY}, {value}).")
                read_back[s.label] = ctl_eval(
                    kind, node, f"application:get_env(rabbit, {PREFETCH_KEY})."
                )
                declare(url, s.topology)  # the queue's dead-letter worker starts now
            log(f"{PREFETCH_KEY} read back: {read_back}")
            interleaved(series, sizes.prefetch_rounds, url, url, sizes.messages, log)
        finally:
            for s in series:
                delete_topology(url, s.topology, log)
        return {
            "broker": f"scratch node ({kind}) {broker_version(url)}",
            "read_back": read_back,
            "rows": summarise(series),
        }


def pending_phase(kind: str, count: int, log: Log) -> dict[str, Any]:
    """`count` messages pending in one buffer: memory per message, then the drain."""
    # Long enough that the whole publish ends before the first message is due.
    # (a busy 2-core broker confirms 3,000-8,000 msg/s).
    tier_s = max(60, count // 3_000 + 30)
    topology = make_topology({PENDING_TIER: f"{tier_s}s"}, 1)
    with scratch_node(kind, log) as (_node, url):
        endpoint = management_endpoint(url)
        declare(url, topology)
        try:
            time.sleep(2)
            before = node_memory(endpoint)
            consumer = Consumer(
                url, topology.names.business_queue(QUEUE), count, tier_s + count / 1_000 + 120
            )
            t0 = time.perf_counter()
            with Publisher(topology, url) as publisher:
                for start in range(0, count, CHUNK):
                    n = min(CHUNK, count - start)
                    publisher.publish_many([BODY] * n, PENDING_TIER, queue=QUEUE)
            publish_s = time.perf_counter() - t0
            time.sleep(1)
            after = node_memory(endpoint)
            log(f"pending: {count:,} published in {publish_s:.1f} s; waiting for the drain")
            arrivals, dues, distinct, error = consumer.result(tier_s + count / 1_000 + 180)
        finally:
            delete_topology(url, topology, log)
        late = sorted(a - d for a, d in zip(arrivals, dues, strict=True))
        drain_ms = (max(arrivals) - min(dues)) if arrivals else 0
        delta = {k: after[k] - before.get(k, 0) for k in after}
        return {
            "broker": f"scratch node ({kind}) {broker_version(url)}",
            "pending": count,
            "tier_s": tier_s,
            "publish_msg_s": round(count / publish_s),
            "node_total_before_MB": round(before["total"] / 1e6, 1),
            "node_total_after_MB": round(after["total"] / 1e6, 1),
            "node_B_per_msg": round(delta["total"] / count, 1),
            "breakdown_B_per_msg": {
                k: round(delta.get(k, 0) / count, 1)
                for k in ("quorum_queue_procs", "quorum_ets", "binary", "other_ets", "code")
            },
            "received": len(arrivals),
            "lost": count - distinct,
            "duplicates": len(arrivals) - distinct,
            "drain_s": round(drain_ms / 1000, 1),
            "deadletter_msg_s": round(len(arrivals) / (drain_ms / 1000)) if drain_ms else None,
            "p50_ms": pct(late, 50),
            "p99_ms": pct(late, 99),
            "max_ms": late[-1] if late else None,
            "early": sum(1 for x in late if x < 0),
            "consumer_error": error,
        }


# -- report -----------------------------------------------------------------------------


def fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 100 else f"{v:g}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def print_rows(title: str, phase: dict[str, Any]) -> None:
    print(f"\n{title} ({phase.get('broker', '')})")
    if phase.get("error"):
        print(f"  not measured: {phase['error']}")
        return
    print(
        f"  {'':<12} {'publish/s':>10} {'dl-out/s':>9} {'dl/pub':>6} {'x dl':>5} "
        f"{'p50':>7} {'p99':>7} {'x p99':>6} {'max':>7} {'early':>5} {'lost':>5}"
    )
    for label, r in phase["rows"].items():
        print(
            f"  {label:<12} {fmt(r['publish_msg_s']):>10} {fmt(r['deadletter_msg_s']):>9} "
            f"{fmt(r['keeps_up']):>6} "
            f"{fmt(r['ratio_deadletter']):>5} {fmt(r['p50_ms']):>7} {fmt(r['p99_ms']):>7} "
            f"{fmt(r['ratio_p99']):>6} {fmt(r['max_ms']):>7} {r['early']:>5} {r['lost']:>5}"
        )


def print_report(result: dict[str, Any]) -> None:
    cfg = result["config"]
    print(
        f"\n{cfg['messages']:,} messages per burst into a {cfg['tier_s']} s tier, "
        f"{cfg['rounds']} round(s); medians; x: median per-round ratio to the first row; "
        "latenesses in ms"
    )
    if "node" in result:
        print_rows("one node", result["node"])
    if "paced" in result:
        rate = result["paced"].get("rate_msg_s")
        print_rows(f"one node, paced at {fmt(rate)} msg/s (not full speed)", result["paced"])
    if "cluster" in result:
        print_rows("3-node cluster", result["cluster"])
    if "prefetch" in result:
        print_rows("dead-letter prefetch, shards=1", result["prefetch"])
        if "read_back" in result["prefetch"]:
            print(f"  read back: {result['prefetch']['read_back']}")
    if "pending" in result:
        p = result["pending"]
        print(f"\npending ({p.get('broker', '')})")
        for k, v in p.items():
            if k != "broker":
                print(f"  {k}: {v}")
    t = result["target"]
    verdict = "-" if t["met"] is None else ("met" if t["met"] else "MISSED")
    print(
        f"\ntarget: best p99 on one node {fmt(t['value'])} ms ({t['best']}) <= 1,000 ms: {verdict}"
    )


def correctness_failures(result: dict[str, Any]) -> list[str]:
    out = []
    for phase in ("node", "paced", "cluster", "prefetch"):
        for label, r in result.get(phase, {}).get("rows", {}).items():
            if r["early"] or r["lost"]:
                out.append(f"{phase} {label}: {r['early']} early, {r['lost']} lost")
    p = result.get("pending")
    if p and "lost" in p and (p["lost"] or p["early"]):
        out.append(f"pending: {p['early']} early, {p['lost']} lost")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small counts, node only (< 20 s)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--url", default=None, help="AMQP URL (default $RABBIT_DELAY_URL or local)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds of the shard phase")
    parser.add_argument("--messages", type=int, default=None, help="messages per burst")
    parser.add_argument(
        "--cluster", metavar="VERSION", help="also on a 3-node cluster: host, 4.0 or 4.3"
    )
    parser.add_argument(
        "--no-prefetch", action="store_true", help="skip the dead-letter prefetch comparison"
    )
    parser.add_argument(
        "--pending", type=int, default=0, metavar="N", help="N pending messages (full run only)"
    )
    parser.add_argument(
        "--scratch", default="host", metavar="VERSION", help="scratch node version (host)"
    )
    parser.add_argument("--only", choices=PHASES, nargs="*")
    parser.add_argument(
        "--rate",
        type=int,
        default=PACED_RATE,
        metavar="N",
        help=f"msg/s of the paced phase (default {PACED_RATE:,})",
    )
    parser.add_argument(
        "--shards",
        type=int,
        nargs="+",
        metavar="N",
        help="shard counts of the node and cluster phases, the first the baseline "
        "(default 1 2 4 8)",
    )
    parser.add_argument("--strict", action="store_true", help="exit 1 when the target is missed")
    args = parser.parse_args(argv)
    # A kill (TERM) still runs every `finally`: topologies deleted, scratch nodes removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sizes = QUICK if args.quick else FULL
    if args.rounds or args.messages:
        sizes = Sizes(
            messages=args.messages or sizes.messages,
            rounds=args.rounds or sizes.rounds,
            tier_s=sizes.tier_s,
            prefetch_rounds=args.rounds or sizes.prefetch_rounds,
        )
    if args.pending and args.quick:
        parser.error("--pending is for a full run only (drop --quick)")
    only = set(args.only or PHASES)
    shards = tuple(args.shards) if args.shards else SHARDS
    if any(n < 1 for n in shards):
        parser.error("--shards: each count must be at least 1")
    url = broker_url(args.url)

    def log(line: str) -> None:
        print(line, file=sys.stderr if args.json else sys.stdout, flush=True)

    started = time.monotonic()
    result: dict[str, Any] = {
        "config": {
            "quick": args.quick,
            "messages": sizes.messages,
            "rounds": sizes.rounds,
            "tier_s": sizes.tier_s,
            "shards": list(shards),
            "broker_version": broker_version(url),
        }
    }
    phases: list[tuple[str, Callable[[], dict[str, Any]]]] = []
    if "node" in only:
        phases.append(("node", lambda: shard_phase([url], sizes, log, shards)))
    if not args.quick and "paced" in only:
        phases.append(("paced", lambda: paced_phase(url, sizes, args.rate, log)))
    if args.cluster and "cluster" in only:

        def cluster() -> dict[str, Any]:
            with scratch_cluster(args.cluster, log) as urls:
                out = shard_phase(urls, sizes, log, shards)
                out["broker"] = f"3-node cluster ({args.cluster}) {broker_version(urls[0])}"
                return out

        phases.append(("cluster", cluster))
    if not args.quick and not args.no_prefetch and "prefetch" in only:
        phases.append(("prefetch", lambda: prefetch_phase(args.scratch, sizes, log)))
    if args.pending and "pending" in only:
        phases.append(("pending", lambda: pending_phase(args.scratch, args.pending, log)))
    for name, run in phases:
        t0 = time.monotonic()
        log(f"-- {name}")
        try:
            result[name] = run()
        except Exception as exc:
            result[name] = {"error": f"{type(exc).__name__}: {exc}"}
            log(f"{name} failed: {exc}")
        result[name]["seconds"] = round(time.monotonic() - t0, 1)
        log(f"{name}: {json.dumps(result[name])}")
    rows = result.get("node", {}).get("rows", {})
    p99s = {k: r["p99_ms"] for k, r in rows.items() if r["p99_ms"] is not None}
    best = min(p99s, key=lambda k: p99s[k]) if p99s else None
    result["target"] = {
        "best": best,
        "value": p99s.get(best) if best else None,
        "met": None if best is None else p99s[best] <= P99_TARGET_MS,
    }
    result["config"]["seconds"] = round(time.monotonic() - started, 1)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_report(result)
        print(f"\n(total {result['config']['seconds']} s)")
    failures = correctness_failures(result)
    for failure in failures:
        log(f"FAIL {failure}")
    if args.strict and result["target"]["met"] is False:
        return 1
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
