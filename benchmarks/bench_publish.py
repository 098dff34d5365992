#!/usr/bin/env python3
"""Publishing throughput against the raw clients, and delivery lateness, in one run.

Contenders (every one confirmed, persistent, mandatory, into the same tier exchange,
with the same body, the same properties and as many headers):

    raw-aio-pipelined   aio-pika Exchange.publish, gathered with a window of 256
    raw-aio-single      aio-pika Exchange.publish, awaited one by one
    raw-pika-single     pika BlockingChannel.confirm_delivery + basic_publish, one by one
    async-batched       AsyncPublisher.publish_many
    async-single        AsyncPublisher.publish_delayed, awaited one by one
    sync-single         Publisher.publish_delayed, one by one
    sync-batched        Publisher.publish_many

The contenders take turns over several rounds; within a round each of ours is
interleaved with its baseline in slices (ours, raw, raw, ours, ...). The median rate of
each is reported, and each ratio is the median of the per-round ratios, because the
broker here is shared and the machine small: its load drifts, so only contenders that ran
side by side are compared.
Every message goes to a 1 h tier, so nothing expires during the run; the buffer is purged
after every round and the whole topology (a unique namespace) is deleted at the end.

Lateness: N messages go through a 2 s tier (sync publish_many, chunks of 100); a raw pika
consumer on the business queue compares each arrival with its `rd-due-at` header.

    .venv/bin/python benchmarks/bench_publish.py            # full run, a few minutes
    .venv/bin/python benchmarks/bench_publish.py --quick    # smoke: small counts, < 40 s
    .venv/bin/python benchmarks/bench_publish.py --json     # machine-readable results

Exit code: 0, or 1 if a message arrived before it was due (a correctness bug), or if
`--strict` is given and a throughput target was missed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import aio_pika
import pika
import pika.exceptions

from rabbit_delay import Topology, topology_from_dict
from rabbit_delay._envelope import encode_body, now_ms
from rabbit_delay._ops.delete.execute import delete_topology as sync_delete_topology
from rabbit_delay._urls import broker_url, redact
from rabbit_delay.aio import AsyncPublisher
from rabbit_delay.sync import Publisher, connected
from rabbit_delay.sync import connect as sync_connect
from rabbit_delay.sync import declare as sync_declare

PERSISTENT = 2
WINDOW = 256
PARK_TIER = "park"  # 1 h: nothing published by the throughput rounds expires
DUE_TIER = "due"  # 2 s: the lateness measurement
QUEUE = "sink"
BODY: dict[str, Any] = {"order_id": 1234567, "reason": "payment-timeout", "customer": "c-000042"}


@dataclass(frozen=True)
class Sizes:
    rounds: int
    single: int  # messages per round for the one-by-one contenders
    batched: int  # messages per round for the pipelined / batched contenders
    slices: int  # a round interleaves a group's contenders in this many slices
    lateness: int


FULL = Sizes(rounds=15, single=600, batched=3_000, slices=6, lateness=2_000)
QUICK = Sizes(rounds=4, single=200, batched=1_000, slices=4, lateness=300)


@dataclass(frozen=True)
class Target:
    ours: str
    baseline: str
    factor: float | None  # None: shown, not a target


TARGETS = (
    Target("async-batched", "raw-aio-pipelined", 0.9),
    Target("sync-single", "raw-pika-single", 0.9),
    Target("sync-batched", "raw-pika-single", 3.0),
    Target("async-single", "raw-aio-single", None),
)


@dataclass
class Samples:
    rates: list[float] = field(default_factory=list)
    cpu_us: list[float] = field(default_factory=list)  # client CPU per message


# -- topology ---------------------------------------------------------------------------


def make_topology(queue_type: str) -> Topology:
    return topology_from_dict(
        {
            "namespace": "bench-" + uuid.uuid4().hex[:8],
            "queue_type": queue_type,
            "tiers": {PARK_TIER: "1h", DUE_TIER: "2s"},
            "queues": {QUEUE: {}},
        },
        source="<bench_publish>",
    )


def delete_topology(url: str, topology: Topology) -> None:
    with connected(url, name="rabbit-delay cleanup") as connection:
        sync_delete_topology(connection, topology)


# -- what the raw clients send: the same bytes, properties and header count as ours ------


def raw_headers(topology: Topology) -> Callable[[], dict[str, object]]:
    key = topology.names.queue_key(QUEUE)
    delay = topology.tiers[PARK_TIER]

    def make() -> dict[str, object]:
        now = now_ms()
        return {
            "rd-due-at": now + delay,
            "rd-delay-ms": delay,
            "rd-tier": PARK_TIER,
            "rd-attempt": 1,
            "rd-target": key,
        }

    return make


# -- contenders -------------------------------------------------------------------------


class SyncContenders:
    def __init__(self, url: str, topology: Topology) -> None:
        self.topology = topology
        self.exchange = topology.names.tier_exchange(PARK_TIER)
        self.key = topology.names.queue_key(QUEUE)
        self.body, self.content_type = encode_body(BODY)
        self.headers = raw_headers(topology)
        self.raw_conn = pika.BlockingConnection(pika.URLParameters(url))
        self.raw_ch = self.raw_conn.channel()
        self.raw_ch.confirm_delivery()
        self.publisher = Publisher.connect(topology, url)

    def raw_pika_single(self, n: int) -> None:
        ch, body, exchange, key = self.raw_ch, self.body, self.exchange, self.key
        for _ in range(n):
            props = pika.BasicProperties(
                content_type=self.content_type,
                delivery_mode=PERSISTENT,
                message_id=uuid.uuid4().hex,
                headers=self.headers(),
                timestamp=int(time.time()),
            )
            ch.basic_publish(
                exchange, key, body, props, mandatory=True
            )  # raises if returned/nacked

    def sync_single(self, n: int) -> None:
        publish = self.publisher.publish_delayed
        for _ in range(n):
            publish(BODY, PARK_TIER, queue=QUEUE)

    def sync_batched(self, n: int) -> None:
        self.publisher.publish_many([BODY] * n, PARK_TIER, queue=QUEUE)

    def purge(self) -> None:
        self.raw_ch.queue_purge(self.topology.names.tier_queue(PARK_TIER))

    def close(self) -> None:
        self.publisher.close()
        if self.raw_conn.is_open:
            self.raw_conn.close()


class AsyncContenders:
    def __init__(self, url: str, topology: Topology) -> None:
        self.url = url
        self.topology = topology
        self.body, self.content_type = encode_body(BODY)
        self.headers = raw_headers(topology)
        self.key = topology.names.queue_key(QUEUE)

    async def open(self) -> None:
        # Plain (not robust) connection: the leanest raw baseline.
        self.raw_conn = await aio_pika.connect(self.url)
        self.raw_ch = await self.raw_conn.channel(publisher_confirms=True, on_return_raises=True)
        self.raw_ex = await self.raw_ch.get_exchange(
            self.topology.names.tier_exchange(PARK_TIER), ensure=False
        )
        self.publisher = await AsyncPublisher.connect(self.topology, self.url)

    def _message(self) -> aio_pika.Message:
        return aio_pika.Message(
            self.body,
            content_type=self.content_type,
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            message_id=uuid.uuid4().hex,
            headers=self.headers(),  # type: ignore[arg-type]
            timestamp=datetime.now(),
        )

    async def raw_aio_single(self, n: int) -> None:
        ex, key = self.raw_ex, self.key
        for _ in range(n):
            await ex.publish(self._message(), key, mandatory=True)

    async def raw_aio_pipelined(self, n: int) -> None:
        ex, key = self.raw_ex, self.key
        window = asyncio.Semaphore(WINDOW)

        async def one() -> None:
            async with window:
                await ex.publish(self._message(), key, mandatory=True)

        await asyncio.gather(*(one() for _ in range(n)))

    async def async_single(self, n: int) -> None:
        publish = self.publisher.publish_delayed
        for _ in range(n):
            await publish(BODY, PARK_TIER, queue=QUEUE)

    async def async_batched(self, n: int) -> None:
        await self.publisher.publish_many([BODY] * n, PARK_TIER, queue=QUEUE)

    async def close(self) -> None:
        await self.publisher.close()
        await self.raw_conn.close()


# -- running ----------------------------------------------------------------------------


def run_rounds(
    url: str, topology: Topology, sizes: Sizes, log: Callable[[str], None]
) -> dict[str, Samples]:
    runner = asyncio.Runner()
    sync = SyncContenders(url, topology)
    aio = AsyncContenders(url, topology)
    runner.run(aio.open())

    def async_call(fn: Callable[[int], Awaitable[None]]) -> Callable[[int], None]:
        return lambda n: runner.run(fn(n))  # type: ignore[arg-type]

    Contender = tuple[str, Callable[[int], None], int]
    # Each of ours runs interleaved with its baseline, slice by slice, so both see the same
    # broker load (the broker is shared and its load drifts): the groups rotate every round,
    # and the order inside a group reverses every slice.
    groups: list[list[Contender]] = [
        [
            ("raw-aio-pipelined", async_call(aio.raw_aio_pipelined), sizes.batched),
            ("async-batched", async_call(aio.async_batched), sizes.batched),
        ],
        [
            ("raw-aio-single", async_call(aio.raw_aio_single), sizes.single),
            ("async-single", async_call(aio.async_single), sizes.single),
        ],
        [
            ("raw-pika-single", sync.raw_pika_single, sizes.single),
            ("sync-single", sync.sync_single, sizes.single),
            ("sync-batched", sync.sync_batched, sizes.batched),
        ],
    ]
    samples = {name: Samples() for group in groups for name, _, _ in group}
    try:
        # Warm-up: connections, channels, code paths; not measured.
        for group in groups:
            for _, fn, _ in group:
                fn(20)
        sync.purge()
        for r in range(sizes.rounds):
            shift = r % len(groups)
            for group in groups[shift:] + groups[:shift]:
                elapsed = dict.fromkeys([name for name, _, _ in group], 0.0)
                cpu = dict.fromkeys(elapsed, 0.0)
                for s in range(sizes.slices):
                    for name, fn, n in group if (r + s) % 2 == 0 else group[::-1]:
                        cpu0, t0 = time.process_time(), time.perf_counter()
                        fn(n // sizes.slices)
                        elapsed[name] += time.perf_counter() - t0
                        cpu[name] += time.process_time() - cpu0
                for name, _, n in group:
                    sent = n // sizes.slices * sizes.slices
                    samples[name].rates.append(sent / elapsed[name])
                    samples[name].cpu_us.append(cpu[name] / sent * 1e6)
            sync.purge()
            log(
                f"round {r + 1}/{sizes.rounds}: "
                + ", ".join(f"{k} {v.rates[-1]:,.0f}" for k, v in samples.items())
            )
    finally:
        try:
            runner.run(aio.close())
        finally:
            runner.close()
            sync.close()
    return samples


def measure_lateness(url: str, topology: Topology, count: int) -> dict[str, Any]:
    """Publish `count` messages through the 2 s tier and time their arrival."""
    names = topology.names
    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    ch.basic_qos(prefetch_count=1_000)
    latencies: list[int] = []
    try:
        t0 = time.monotonic()
        with Publisher(topology, url) as publisher:
            for start in range(0, count, 100):
                publisher.publish_many([BODY] * min(100, count - start), DUE_TIER, queue=QUEUE)
        publish_s = time.monotonic() - t0
        deadline = time.monotonic() + topology.tiers[DUE_TIER] / 1000 + 30
        unacked = 0
        for method, props, _body in ch.consume(names.business_queue(QUEUE), inactivity_timeout=0.5):
            if method is not None and props is not None:
                arrived = now_ms()
                latencies.append(arrived - int((props.headers or {})["rd-due-at"]))
                unacked += 1
                if unacked >= 200 or len(latencies) >= count:
                    ch.basic_ack(method.delivery_tag or 0, multiple=True)
                    unacked = 0
            if len(latencies) >= count or time.monotonic() > deadline:
                break
        ch.cancel()
    finally:
        if conn.is_open:
            conn.close()
    ordered = sorted(latencies)

    def pct(p: float) -> int | None:
        return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))] if ordered else None

    return {
        "tier": DUE_TIER,
        "tier_ms": topology.tiers[DUE_TIER],
        "sent": count,
        "received": len(ordered),
        "publish_s": round(publish_s, 3),
        "p50_ms": pct(50),
        "p99_ms": pct(99),
        "max_ms": ordered[-1] if ordered else None,
        "min_ms": ordered[0] if ordered else None,
        "early": sum(1 for x in ordered if x < 0),
    }


def summarise(samples: dict[str, Samples]) -> dict[str, Any]:
    throughput: dict[str, dict[str, Any]] = {
        name: {
            "median_msg_s": round(statistics.median(s.rates), 1),
            "min_msg_s": round(min(s.rates), 1),
            "max_msg_s": round(max(s.rates), 1),
            "cpu_us_per_msg": round(statistics.median(s.cpu_us), 1),
            "rates": [round(r, 1) for r in s.rates],
        }
        for name, s in samples.items()
    }
    ratios = []
    for t in TARGETS:
        # Paired: ours / baseline within each round (they ran side by side), then the median.
        per_round = [
            o / b for o, b in zip(samples[t.ours].rates, samples[t.baseline].rates, strict=True)
        ]
        ratio = statistics.median(per_round)
        of_medians = throughput[t.ours]["median_msg_s"] / throughput[t.baseline]["median_msg_s"]
        ratios.append(
            {
                "ours": t.ours,
                "baseline": t.baseline,
                "ratio": round(ratio, 3),
                "ratio_of_medians": round(of_medians, 3),
                "round_ratios": [round(x, 3) for x in per_round],
                "target": t.factor,
                "met": None if t.factor is None else ratio >= t.factor,
            }
        )
    return {"throughput": throughput, "ratios": ratios}


def print_table(result: dict[str, Any]) -> None:
    cfg = result["config"]
    print(
        f"\nbroker {cfg['broker']}  queue type {cfg['queue_type']}  rounds {cfg['rounds']}  "
        f"messages/round: single {cfg['single']}, batched {cfg['batched']}  "
        f"body {cfg['body_bytes']} B, {cfg['headers']} headers"
    )
    print(f"\n{'contender':<20}{'median msg/s':>14}{'min':>10}{'max':>10}{'client CPU µs/msg':>20}")
    for name, t in result["throughput"].items():
        print(
            f"{name:<20}{t['median_msg_s']:>14,.0f}{t['min_msg_s']:>10,.0f}{t['max_msg_s']:>10,.0f}"
            f"{t['cpu_us_per_msg']:>20,.1f}"
        )
    print(f"\n{'ours':<16}{'vs baseline':<20}{'ratio':>8}{'(of medians)':>14}{'target':>9}  result")
    for r in result["ratios"]:
        target = "-" if r["target"] is None else f">= {r['target']:g}"
        verdict = "(info)" if r["met"] is None else ("met" if r["met"] else "MISSED")
        print(
            f"{r['ours']:<16}{r['baseline']:<20}{r['ratio']:>8.2f}{r['ratio_of_medians']:>14.2f}"
            f"{target:>9}  {verdict}"
        )
    print("ratio: median over rounds of ours / baseline measured side by side in that round")
    lat = result["lateness"]
    print(
        f"\nlateness through the {lat['tier']} tier ({lat['tier_ms']} ms), "
        f"{lat['received']}/{lat['sent']} received (published in {lat['publish_s']} s): "
        f"p50 {lat['p50_ms']} ms, p99 {lat['p99_ms']} ms, max {lat['max_ms']} ms, "
        f"min {lat['min_ms']} ms, early {lat['early']}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small counts (smoke test, < 40 s)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument(
        "--url", default=None, help="AMQP URL (default $RABBIT_DELAY_URL or the local broker)"
    )
    parser.add_argument("--queue-type", choices=["quorum", "classic"], default="quorum")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument(
        "--strict", action="store_true", help="exit 1 when a throughput target is missed"
    )
    args = parser.parse_args(argv)

    sizes = QUICK if args.quick else FULL
    if args.rounds:
        sizes = Sizes(args.rounds, sizes.single, sizes.batched, sizes.slices, sizes.lateness)
    url = broker_url(args.url)

    def log(line: str) -> None:
        print(line, file=sys.stderr if args.json else sys.stdout, flush=True)

    topology = make_topology(args.queue_type)
    started = time.monotonic()
    log(f"declaring {topology.names.prefix}.* on {redact(url)}")
    conn = sync_connect(url, name="bench_publish declare")
    try:
        sync_declare(conn, topology)
    finally:
        conn.close()
    try:
        samples = run_rounds(url, topology, sizes, log)
        log(f"lateness: {sizes.lateness} messages through the {DUE_TIER} tier")
        lateness = measure_lateness(url, topology, sizes.lateness)
    finally:
        delete_topology(url, topology)
    result: dict[str, Any] = {
        "config": {
            "broker": redact(url),
            "queue_type": args.queue_type,
            "quick": args.quick,
            "rounds": sizes.rounds,
            "single": sizes.single,
            "batched": sizes.batched,
            "slices": sizes.slices,
            "window": WINDOW,
            "body_bytes": len(encode_body(BODY)[0]),
            "headers": len(raw_headers(topology)()),
            "seconds": round(time.monotonic() - started, 1),
        },
        **summarise(samples),
        "lateness": lateness,
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_table(result)
        print(f"\n(total {result['config']['seconds']} s)")
    failed = lateness["early"] > 0 or lateness["received"] < lateness["sent"]
    if failed:
        log(f"FAIL: {lateness['early']} early, {lateness['sent'] - lateness['received']} missing")
    if args.strict and any(r["met"] is False for r in result["ratios"]):
        failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
