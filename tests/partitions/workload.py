"""The workload of a partition run: the real delay path, as users run it.

- one topology: a 2 s tier of 3 shards and a 5 s tier (quorum buffers, leaders
  balanced, 3 replicas), the binary cascade (3 levels of 1 s) for other delays, one
  business queue whose retries go through the 2 s tier (3 attempts, then the parking
  lot), the idempotency guard on one SQLite file both workers share;
- a sync Publisher and an AsyncPublisher, each given every node (in different orders),
  publishing at a steady rate, each message with an id of its own; a publish that
  returns was confirmed, one that raises is recorded as unconfirmed (and the publisher
  goes on: it recovers its connection itself);
- a sync Worker and an AsyncWorker, each given every node (in different orders); one
  message in 10 fails its first attempt (retried through the tier), one in 40 fails
  every attempt (parked);
- at the end: every queue's depth and the parking lot's message ids, read over AMQP.

With `schedule=True` the topology has a `[schedule]` table (docs/schedule.md): every
publish is recorded under its message id, as its key, in the same SQLite file the
guard uses, and both workers run the built-in sweeper, which republishes to the business
queue what is still scheduled past its due time plus `SWEEP_GRACE` (the reconciliation
that recovers what the broker stalls: docs/reliability.md#network-partitions).

`Recorder` keeps what the checker reads (checker.py); nothing here decides a verdict.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import pika
import pika.exceptions

from rabbit_delay import (
    App,
    AsyncWorker,
    ConnectionSettings,
    HandlerContext,
    ManagementUnavailable,
    RabbitDelayError,
    ReconnectBackoff,
    Topology,
    Worker,
    topology_from_dict,
)
from rabbit_delay._envelope import now_ms
from rabbit_delay._io.management import read_queue_counts
from rabbit_delay._plan.desired import desired
from rabbit_delay._topology.delays import IMMEDIATE
from rabbit_delay._urls import management_endpoint
from rabbit_delay.aio import AsyncPublisher
from rabbit_delay.sync import Publisher, Schedule, connect, declare

from .checker import Published, Run

QUEUE = "p23.orders"
TIERS = {"2s": 2000, "5s": 5000}
CASCADE_DELAY_MS = 3000  # no tier of 3 s: through the cascade (levels 1 s and 2 s)
RETRY_EVERY = 10  # message n with n % 10 == 0 fails its first attempt
PARK_EVERY = 40  # ... n % 40 == 0 fails every attempt: parked after 3
FAST = ConnectionSettings(
    backoff=ReconnectBackoff(initial_s=0.1, max_s=1.0), connect_timeout_s=10, heartbeat_s=10
)
RECOVERY_S = 15.0  # a publish call's deadline for its confirms, reconnecting included
# [schedule] of a run with the sweeper: longer than a Raft election and a paused node's
# return (a record merely late is not republished before, and a copy is absorbed anyway)
SWEEP_GRACE = "15s"
SWEEP_EVERY = "5s"


def make_topology(store: Path, *, schedule: bool = False) -> Topology:
    extra: dict[str, Any] = {}
    if schedule:
        extra["schedule"] = {"grace": SWEEP_GRACE, "sweep_every": SWEEP_EVERY}
    return topology_from_dict(
        {
            **extra,
            "namespace": f"p23-{uuid.uuid4().hex[:8]}",
            "queue_type": "quorum",
            "tiers": {t: t for t in TIERS},
            "cascade": {"levels": 3, "resolution": "1s"},
            "queues": {QUEUE: {"alias": "po", "retry": {"tiers": ["2s"], "max_attempts": 3}}},
            "scaling": {"shards": 3, "leader_locator": "balanced", "replicas": 3},
            "idempotency": {"store": "sqlite", "path": str(store)},
        }
    )


def route(n: int) -> tuple[str | None, int]:
    """Message n's tier (None: the cascade) and delay."""
    if n % 5 == 1:
        return "5s", TIERS["5s"]
    if n % 5 == 2:
        return None, CASCADE_DELAY_MS
    return "2s", TIERS["2s"]


def fails(n: int) -> int:
    """How many attempts of message n fail."""
    if n % PARK_EVERY == 0:
        return 99
    return 1 if n % RETRY_EVERY == 0 else 0


@dataclass
class Recorder:
    """What happened, thread-safe: publishes, handler runs, errors."""

    published: list[Published] = field(default_factory=list)
    runs: list[Run] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    last_run_ms: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def publish(self, p: Published) -> None:
        with self._lock:
            self.published.append(p)

    def run(self, r: Run) -> None:
        with self._lock:
            self.runs.append(r)
            self.last_run_ms = now_ms()

    def error(self, where: str, exc: BaseException) -> None:
        with self._lock:
            self.errors.append(f"{where}: {type(exc).__name__}: {str(exc)[:200]}")

    def settled(self) -> set[str]:
        """Ids whose effect is done, or that failed their last attempt (parked)."""
        with self._lock:
            return {r.message_id for r in self.runs if r.effect or r.attempt >= 3}

    def settled_by_sweeper(self) -> set[str]:
        """Ids whose first run to the end (effect, or the last attempt) was a copy the
        schedule's sweeper republished."""
        first: dict[str, bool] = {}
        with self._lock:
            for r in self.runs:
                if (r.effect or r.attempt >= 3) and r.message_id not in first:
                    first[r.message_id] = r.swept
        return {m for m, swept in first.items() if swept}

    def confirmed(self) -> set[str]:
        with self._lock:
            return {p.message_id for p in self.published if p.confirmed}


def ordered(urls: Sequence[str], first: int) -> str:
    """The node list starting at `first`, as a comma-separated URL string."""
    return ",".join([*urls[first:], *urls[:first]])


class Workload:
    """Publishers and workers on a cluster's nodes (see the module docstring)."""

    def __init__(
        self, urls: Sequence[str], store: Path, *, rate: float = 40.0, schedule: bool = False
    ) -> None:
        self.urls = list(urls)
        self.topology = make_topology(store, schedule=schedule)
        self.rate = rate  # per publisher, messages per second
        self.rec = Recorder()
        self._stop_publishing = threading.Event()
        self._threads: list[threading.Thread] = []
        self.workers: list[Any] = []
        self.guard_duplicates = 0
        self.worker_stats: dict[str, dict[str, int]] = {}

    # -- setup -----------------------------------------------------------------------------

    def declare(self) -> None:
        conn = connect(self.urls[0], name="p23 declare")
        try:
            declare(conn, self.topology)
        finally:
            conn.close()

    def _handler(self, worker: str) -> Any:
        rec = self.rec

        def record(message: dict[str, Any], ctx: HandlerContext) -> None:
            ok = ctx.attempt > fails(int(message["n"]))
            swept = ctx.tier == IMMEDIATE  # only the sweeper sends to the queue "now" here
            rec.run(Run(str(ctx.message_id), ctx.attempt, ctx.lateness_ms or 0, ok, swept))
            if not ok:
                raise RuntimeError(f"{worker}: attempt {ctx.attempt} of {ctx.message_id} fails")

        if worker == "sync":

            def handle(message: dict[str, Any], ctx: HandlerContext) -> None:
                record(message, ctx)

            return handle

        async def ahandle(message: dict[str, Any], ctx: HandlerContext) -> None:
            record(message, ctx)

        return ahandle

    def start(self) -> None:
        """Workers consuming, then both publishers publishing (until `stop_publishing`)."""
        for i, kind in enumerate(("sync", "async")):
            app = App(self.topology)
            app.add_consumer(QUEUE, self._handler(kind))
            urls = ordered(self.urls, i)
            if kind == "sync":
                w: Any = Worker(
                    app, urls, name=f"p23-{kind}", install_signal_handlers=False,
                    connection_settings=FAST,
                )  # fmt: skip
                target: Any = w.run
            else:
                w = AsyncWorker(
                    app, urls, name=f"p23-{kind}", install_signal_handlers=False,
                    connection_settings=FAST,
                )  # fmt: skip

                def target(w: Any = w) -> None:
                    asyncio.run(w.run())

            self.workers.append(w)
            self._spawn(f"{kind} worker", target)
        deadline = time.monotonic() + 30
        while not all(w.started.is_set() for w in self.workers):
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers not consuming in 30 s: {self.rec.errors}")
            time.sleep(0.1)
        self._spawn("sync publisher", self._sync_publisher)
        self._spawn("async publisher", lambda: asyncio.run(self._async_publisher()))

    def _spawn(self, name: str, target: Any) -> None:
        def main() -> None:
            try:
                target()
            except BaseException as exc:  # recorded: the run reports it
                self.rec.error(name, exc)

        t = threading.Thread(target=main, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    # -- publishers ------------------------------------------------------------------------

    def _one(self, prefix: str, n: int) -> tuple[dict[str, int], dict[str, Any], int]:
        tier, delay_ms = route(n)
        options: dict[str, Any] = {"queue": QUEUE, "message_id": f"{prefix}-{n}"}
        if tier is None:
            options["delay"] = timedelta(milliseconds=delay_ms)
        else:
            options["tier"] = tier
        return {"n": n}, options, delay_ms

    def _sync_publisher(self) -> None:
        publisher = Publisher.connect(
            self.topology, ordered(self.urls, 0), settings=FAST, recovery_timeout=RECOVERY_S
        )
        try:
            n, began = 0, time.monotonic()
            while not self._stop_publishing.is_set():
                n += 1
                body, options, delay_ms = self._one("s", n)
                sent = now_ms()
                try:
                    publisher.publish_delayed(body, **options)
                    ok = True
                except RabbitDelayError as exc:
                    ok = False
                    self.rec.error("sync publish", exc)
                self.rec.publish(
                    Published(options["message_id"], ok, sent + delay_ms, fails(n) > 3)
                )
                pause = began + n / self.rate - time.monotonic()
                if pause > 0:
                    time.sleep(pause)
        finally:
            with contextlib.suppress(Exception):
                publisher.close()

    async def _async_publisher(self) -> None:
        publisher = await AsyncPublisher.connect(
            self.topology, ordered(self.urls, 2), settings=FAST, recovery_timeout=RECOVERY_S
        )
        try:
            n, began = 0, time.monotonic()
            while not self._stop_publishing.is_set():
                n += 1
                body, options, delay_ms = self._one("a", n)
                sent = now_ms()
                try:
                    await publisher.publish_delayed(body, **options)
                    ok = True
                except RabbitDelayError as exc:
                    ok = False
                    self.rec.error("async publish", exc)
                self.rec.publish(
                    Published(options["message_id"], ok, sent + delay_ms, fails(n) > 3)
                )
                pause = began + n / self.rate - time.monotonic()
                if pause > 0:
                    await asyncio.sleep(pause)
        finally:
            with contextlib.suppress(Exception):
                await publisher.close()

    def stop_publishing(self) -> None:
        self._stop_publishing.set()
        for t in self._threads:
            if "publisher" in t.name:
                t.join(RECOVERY_S + 10)

    # -- the end ---------------------------------------------------------------------------

    def wait_settled(self, timeout: float, quiet_s: float = 3.0) -> bool:
        """Until every confirmed message ran to its end (effect or last attempt) and no
        handler ran for `quiet_s` (late duplicates), or `timeout`. True if settled."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            missing = self.rec.confirmed() - self.rec.settled()
            if not missing and now_ms() - self.rec.last_run_ms > quiet_s * 1000:
                return True
            time.sleep(0.5)
        return False

    def stop(self) -> None:
        self._stop_publishing.set()
        for w in self.workers:
            with contextlib.suppress(Exception):
                w.stop()
        for t in self._threads:
            t.join(30)
        for w in self.workers:
            stats = w.stats.as_dict()
            self.worker_stats[w.name] = stats
            self.guard_duplicates += stats.get("duplicate", 0)

    def swept(self) -> dict[str, int]:
        """With `schedule`: the keys (message ids) the sweeper republished, and how many
        times each (read from the schedule's records in the store); {} without."""
        if self.topology.schedule is None:
            return {}
        found: dict[str, int] = {}
        with Schedule(self.topology) as schedule:
            after = None
            while True:
                page = schedule.list(limit=1000, after=after)
                found |= {r.key: r.republished for r in page if r.republished}
                after = schedule.next_cursor(page, 1000)
                if after is None:
                    return found

    def dead_lettering(self) -> dict[str, int]:
        """Messages each quorum queue dead-lettered that its target has not confirmed
        (the management API's `messages_dlx`, sampled every 5 s): {} if no node tells.
        The dead letters as the queues' leaders hold them: `PartitionCluster.dead_letters_held`."""
        prefix = self.topology.names.prefix
        for url in self.urls:
            try:
                counts = read_queue_counts(management_endpoint(url), prefix)
            except ManagementUnavailable:
                continue
            # a queue the API gives no figures for is left out, not counted as 0 (3.10
            # stops reporting the queues of a node after a partition)
            return {q: c.dead_lettering for q, c in counts.items() if c.dead_lettering is not None}
        return {}

    def dead_lettering_queues(self) -> list[str]:
        """The queues that dead-letter at-least-once: tier buffers and cascade levels."""
        names = self.topology.names
        tiers = [q for t in TIERS for q in self.topology.tier_queues(t)]
        levels = [names.cascade_queue(level) for level in range(3)]
        return tiers + levels

    def stalled(self) -> dict[str, int]:
        """`dead_lettering()` of the queues where it stays above 0 for two samples of the
        management API (it reports every 5 s: one sample may be stale)."""
        first = {q: n for q, n in self.dead_lettering().items() if n}
        if not first:
            return {}
        time.sleep(6)
        again = self.dead_lettering()
        return {q: min(n, again.get(q, 0)) for q, n in first.items() if again.get(q, 0)}

    def queues(
        self, dead_letters: dict[str, int] | None = None
    ) -> tuple[dict[str, int], list[str]]:
        """Depth of every queue that must end empty (ready messages, and those
        dead-lettered but not confirmed by their target, as `<queue> (dead-lettering)`:
        `dead_letters` when given, as the queues' leaders told them, else the management
        API's messages_dlx), and the ids in the parking lot."""
        spec = desired(self.topology)
        stalled = (
            self.stalled() if dead_letters is None else {q: n for q, n in dead_letters.items() if n}
        )
        parking = self.topology.names.parking_queue(QUEUE)
        for url in self.urls:
            try:
                params = pika.URLParameters(url)
                params.connection_attempts = 1
                params.socket_timeout = 5
                conn = pika.BlockingConnection(params)
            except (pika.exceptions.AMQPError, OSError):
                continue
            try:
                ch = conn.channel()
                left = {
                    q.name: ch.queue_declare(q.name, passive=True).method.message_count
                    for q in spec.queues
                    if q.name != parking
                }
                parked: list[str] = []
                while True:
                    method, props, _body = ch.basic_get(parking, auto_ack=True)
                    if method is None:
                        break
                    parked.append(str(props.message_id))
                left |= {f"{q} (dead-lettering)": n for q, n in stalled.items()}
                return left, parked
            finally:
                with contextlib.suppress(Exception):
                    conn.close()
        raise RuntimeError("no node answers to read the queues")
