"""TestBroker: the in-memory broker, the app's topology declared on it, a publisher, and
the app's consumers running on an in-memory worker; one object for a user's test."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from types import TracebackType
from typing import TYPE_CHECKING

from rabbit_delay._consumer.app import App
from rabbit_delay._consumer.outcome import Outcome
from rabbit_delay._consumer.settings import DEFAULT_SHUTDOWN_TIMEOUT_S
from rabbit_delay._durations import DurationLike
from rabbit_delay._errors import ConfigError
from rabbit_delay._idempotency.guard import IdempotencyStore
from rabbit_delay._observe.report import WorkerStats
from rabbit_delay._schedule_api.sync import Schedule
from rabbit_delay._stores.memory import MemoryStore
from rabbit_delay._topology.model import Topology
from rabbit_delay.testing._broker import DEFAULT_VERSION, MemoryBroker, Message
from rabbit_delay.testing._publisher import AsyncMemoryPublisher, MemoryPublisher
from rabbit_delay.testing._worker import Handled, MemoryWorker

if TYPE_CHECKING:
    from rabbit_delay._observe.metrics import Metrics


class TestBroker:
    """An in-memory RabbitMQ on a virtual clock, with `app`'s topology declared on it (by
    the real declare program) and `app`'s consumers running on an in-memory worker (the
    real delivery program). Nothing happens until time is advanced:

        with TestBroker(app) as broker:
            broker.publisher.publish_delayed(
                CancelOrder(order_id=1), "30m", queue="orders.cancel-unpaid"
            )
            broker.advance("30m")
            assert broker.outcomes("orders.cancel-unpaid") == ["acked"]

    `app` may also be a bare Topology (a broker and publishers, no worker). `version` is
    the RabbitMQ version emulated (default 4.3.6; "3.10.8", "4.0.5" ... for their rules).
    `start` pins the virtual clock's start (default: now). `store` is the idempotency
    store (default: the app's own if it was given one, else a fresh MemoryStore);
    `queues`, `concurrency` (16), `prefetch`, `shutdown_timeout`, `metrics` as for the real
    workers.

    Raises what declaring raises (IncompatibleBroker for a topology the version cannot
    hold, MissingPluginError), ConfigError (a bad version or option, an async store).
    """

    __test__ = False  # not a test class, whatever a test module imports it as

    def __init__(
        self,
        app: App | Topology,
        *,
        version: str = DEFAULT_VERSION,
        start: datetime | None = None,
        store: IdempotencyStore | None = None,
        queues: Sequence[str] | None = None,
        concurrency: int | None = None,
        prefetch: int | None = None,
        shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
        metrics: Metrics | None = None,
    ) -> None:
        self.app = app if isinstance(app, App) else None
        self.topology = app.topology if isinstance(app, App) else app
        self.memory = MemoryBroker(version, start=start)
        self.worker: MemoryWorker | None = None
        if self.topology.schedule is not None and store is None:
            # one store for the worker, the publishers and app.cancel: the schedule's
            chosen = self.app.explicit_store if self.app is not None else None
            store = chosen if chosen is not None else MemoryStore()  # type: ignore[assignment]
        self.store = store
        try:
            self.memory.declare(self.topology)
            self.publisher = MemoryPublisher(
                self.topology, self.memory, metrics=metrics, store=store
            )
            self.async_publisher = AsyncMemoryPublisher(
                self.topology, self.memory, metrics=metrics, store=store
            )
            if self.app is not None and (self.app.consumers or queues):
                self.worker = MemoryWorker(
                    self.app,
                    self.memory,
                    store=store,
                    queues=queues,
                    concurrency=concurrency,
                    prefetch=prefetch,
                    shutdown_timeout=shutdown_timeout,
                    metrics=metrics,
                ).start()
        except BaseException:
            self.memory.close()
            raise

    @property
    def schedule(self) -> Schedule:
        """The topology's schedule on the virtual clock (a topology with [schedule]):
        `lookup`, `list`, `cancel`, `reschedule`, and `sweep()` (the workers' sweeper,
        run now). Raises ConfigError without a [schedule] table."""
        return self.publisher.schedule

    # -- time ----------------------------------------------------------------------------------

    @property
    def now(self) -> datetime:
        """The virtual time (aware, UTC)."""
        return self.memory.now

    def now_ms(self) -> int:
        """The virtual time in UTC epoch ms: a clock to give the code under test."""
        return self.memory.now_ms()

    def advance(self, duration: DurationLike) -> None:
        """Let `duration` ("30m", a timedelta, seconds) of virtual time pass: TTLs expire in
        order, due messages are delivered, handlers run, retry, park, as they would.

        Raises DurationError (a negative or unreadable duration), KitError (called from a
        handler, or an error in the kit), and whatever a `def` handler raised that is not
        an Exception (pytest.fail, KeyboardInterrupt).
        """
        self.memory.advance(duration)

    def run_until_idle(self, limit: DurationLike = "30d") -> timedelta:
        """Advance until nothing more can happen (no message waiting in a tier, a cascade
        level or a delayed retry; no delivery in progress); the virtual time that took.
        Raises KitError when something is still pending after `limit`, and like
        `advance`."""
        return timedelta(milliseconds=self.memory.run_until_idle(limit))

    async def aadvance(self, duration: DurationLike) -> None:
        """`advance` without blocking an `async def` test's event loop meanwhile (the
        kit runs on a thread; `def` handlers run there). Raises like `advance`."""
        await asyncio.to_thread(self.advance, duration)

    async def arun_until_idle(self, limit: DurationLike = "30d") -> timedelta:
        """`run_until_idle` without blocking the test's event loop (see `aadvance`)."""
        return await asyncio.to_thread(self.run_until_idle, limit)

    def run_until(self, predicate: Callable[[], object], timeout: DurationLike = "1d") -> bool:
        """Advance until `predicate()` holds (looked at whenever the broker settled at a
        virtual instant), at most `timeout`; whether it holds. Raises like `advance`."""
        return self.memory.run_until(predicate, timeout)

    # -- what happened ---------------------------------------------------------------------------

    def handled(self, queue: str | None = None) -> list[Handled]:
        """Every settled delivery (of `queue`, a topology queue name), in order."""
        records = self.worker.records if self.worker is not None else []
        if queue is not None:
            self._topology_queue(queue)
            records = [r for r in records if r.queue == queue]
        return list(records)

    def outcomes(self, queue: str | None = None) -> list[Outcome]:
        """`handled(queue)` as outcomes: "acked", "retried", "parked", "duplicate", ..."""
        return [r.outcome for r in self.handled(queue)]

    @property
    def stats(self) -> WorkerStats:
        """The in-memory worker's counters (as the real workers count)."""
        return self.worker.stats if self.worker is not None else WorkerStats()

    def parked(self, queue: str) -> list[Message]:
        """The messages in `queue`'s parking lot, oldest first, left in place."""
        self._topology_queue(queue)
        return self.memory.peek(self.topology.names.parking_queue(queue))

    def unroutable(self) -> list[Message]:
        """The messages in the catch-all queue (due messages no queue was bound for)."""
        return self.memory.peek(self.topology.names.unroutable_queue())

    def messages(self, name: str) -> list[Message]:
        """The messages waiting in a business queue (its topology name), a tier (its
        name: every shard of it) or any broker queue (its full name), left in place."""
        return [m for queue in self._broker_queues(name) for m in self.memory.peek(queue)]

    def queue_depth(self, name: str) -> int:
        """How many messages wait in a business queue, a tier or a broker queue (named
        as for `messages`), not counting deliveries in progress."""
        return sum(self.memory.depth(queue) for queue in self._broker_queues(name))

    def _topology_queue(self, queue: str) -> None:
        if queue not in self.topology.queues:
            known = ", ".join(sorted(self.topology.queues))
            raise ConfigError(f"unknown queue {queue!r}; the topology's queues are: {known}")

    def _broker_queues(self, name: str) -> list[str]:
        names = self.topology.names
        if name in self.topology.queues:
            return [names.business_queue(name)]
        if name in self.topology.tiers:
            return list(self.topology.tier_queues(name))
        if self.memory.has_queue(name):
            return [name]
        queues = ", ".join(sorted(self.topology.queues))
        tiers = ", ".join(self.topology.tiers)
        raise ConfigError(
            f"no queue {name!r}: name a topology queue ({queues}), a tier ({tiers}), or a "
            f"broker queue such as {names.parking_queue(next(iter(self.topology.queues)))!r}"
        )

    # -- the end --------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the worker as SIGTERM would (in virtual time; the app gets its own guard
        back) and close the broker. Idempotent."""
        try:
            if self.worker is not None and not self.memory.closed:
                self.worker.stop()
        finally:
            self.memory.close()

    def __enter__(self) -> TestBroker:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    async def __aenter__(self) -> TestBroker:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await asyncio.to_thread(self.close)

    def __repr__(self) -> str:
        return (
            f"<TestBroker {self.topology.names.prefix} on {self.memory.info.describe()}, "
            f"at {self.now.isoformat()}>"
        )
