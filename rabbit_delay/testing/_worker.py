"""The in-memory worker: a driver of the delivery program (`_consumer/delivery.py`), as
`_sync/worker.py` and `_aio/worker.py` are, on the in-memory broker's loop and clock.

It decides nothing about a delivery: the program claims, runs, finishes, publishes and
settles; this module executes each step against the MemoryBroker, the app's guard and a
MemoryPublisher. Each delivery's program runs in a task of its own on the broker's
virtual-time loop; `def` handlers run inline on that loop (they take no virtual time),
`async def` handlers as awaited there (their `asyncio.sleep` takes virtual time), with
at most `concurrency` handlers running at once. Leases are held and renewed on the
virtual clock while a handler runs.

Stopping (`stop()`) is the real workers' shutdown in virtual time: consumers cancelled,
handlers running get `shutdown_timeout`, deliveries not started are handed back (nack),
and past the timeout the channel closes (the broker takes back what is unacked, counted
as a lost delivery) while the handlers still running record their results.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import rabbit_delay._consumer.delivery as dp
import rabbit_delay._consumer.lifecycle as lc
from rabbit_delay._consumer.app import App, Consumer, Transport, _is_async_store
from rabbit_delay._consumer.context import HandlerContext
from rabbit_delay._consumer.decide import (
    Action,
    Park,
    Republish,
    Skip,
)
from rabbit_delay._consumer.handlers import call_async_handler, call_handler
from rabbit_delay._consumer.housekeeping import Sleep, on_guard
from rabbit_delay._consumer.leases import claim_with, finish_with
from rabbit_delay._consumer.outcome import Outcome
from rabbit_delay._consumer.settings import DEFAULT_SHUTDOWN_TIMEOUT_S
from rabbit_delay._errors import BrokerError, ConfigError, PublishError, RabbitDelayError
from rabbit_delay._idempotency.guard import ClaimResult, Guard, IdempotencyStore
from rabbit_delay._observe.metrics import Metrics
from rabbit_delay._observe.report import ReportingWorker
from rabbit_delay._stores.memory import MemoryStore
from rabbit_delay.testing._broker import Channel, Delivered, KitError, MemoryBroker
from rabbit_delay.testing._publisher import MemoryPublisher

if TYPE_CHECKING:
    from rabbit_delay._observe.metrics import Metrics

log = logging.getLogger("rabbit_delay.worker")

# A URL for WorkerCore, never connected to: the worker consumes from a MemoryBroker.
MEMORY_URL = "amqp://rabbit-delay-testing/"
# How much virtual time a stop may take beyond shutdown_timeout (handlers that go on).
STOP_LIMIT_S = 86_400.0


@dataclass(frozen=True, slots=True)
class Handled:
    """One settled delivery: what the in-memory worker did with it, and why."""

    queue: str  # logical queue name, as in the topology
    message_id: str | None
    attempt: int
    outcome: Outcome
    reason: str | None  # park / skip / re-publish reason (`rd-park-reason` values...)
    action: Action | None  # what decide() returned (None: handed back, or stale)
    ran: bool  # whether the handler ran for this delivery
    error: BaseException | None  # what the handler raised (or why it could not decode)
    context: HandlerContext | None  # what the handler saw (None: it did not run)
    body: bytes
    at_ms: int  # virtual time it settled, UTC epoch ms
    publish_error: str | None = None  # the retry / park copy could not be published

    @property
    def at(self) -> datetime:
        return datetime.fromtimestamp(self.at_ms / 1000, UTC)


def _reason(action: Action | None) -> str | None:
    if isinstance(action, Park | Skip | Republish):
        return action.reason.value
    return None


@dataclass(slots=True, eq=False)
class _Live:
    """One delivery whose program is running."""

    gen: int  # the channel generation it came on
    tag: int
    consumer_tag: str
    ran: bool = False
    context: HandlerContext | None = None
    error: BaseException | None = None


class MemoryWorker(ReportingWorker):
    """Runs an App's consumers on a MemoryBroker, in virtual time.

    `store`: the idempotency store; default: the app's own (`App(store=...)`) when it
    was given one, else a fresh MemoryStore, so that tests never share or persist
    state. Either way the guard runs on the broker's virtual clock, and `app.cancel()`
    reaches the same store while the worker runs. Options as the real workers'
    (`queues`, `prefetch`, `concurrency` (default 16), `declare`, `shutdown_timeout`,
    `name`, `metrics`).

    Raises ConfigError for an unknown queue, or an asynchronous store (the kit calls
    its store synchronously: give the app a MemoryStore, SQLiteStore or RedisStore).
    """

    transport = Transport.MEMORY
    default_concurrency = 16

    def __init__(
        self,
        app: App,
        broker: MemoryBroker,
        *,
        store: IdempotencyStore | None = None,
        queues: Sequence[str] | None = None,
        prefetch: int | None = None,
        concurrency: int | None = None,
        declare: bool = False,
        shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
        name: str | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        super().__init__(
            app,
            MEMORY_URL,
            queues=queues,
            prefetch=prefetch,
            concurrency=concurrency,
            declare=declare,
            shutdown_timeout=shutdown_timeout,
            name=name,
            install_signal_handlers=False,
            metrics=metrics,
        )
        self.broker = broker
        self.clock = broker.now_ms
        chosen = store if store is not None else app.explicit_store
        if chosen is not None and _is_async_store(chosen):
            raise ConfigError(
                f"rabbit_delay.testing calls the idempotency store synchronously; "
                f"{type(chosen).__name__} is asynchronous: give the app (or the kit, "
                "store=...) a MemoryStore, SQLiteStore or RedisStore for tests"
            )
        self._store: IdempotencyStore = chosen if chosen is not None else MemoryStore()  # type: ignore[assignment]
        self.guard: Guard | None = None
        self.publisher = MemoryPublisher(app.topology, broker, metrics=metrics)
        self.records: list[Handled] = []
        self._channel: Channel | None = None
        self._lifecycle: lc.Lifecycle | None = None
        self._force = False
        self._gen = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._starting = 0  # deliveries whose task is about to start
        self._sem = asyncio.Semaphore(self.concurrency)
        self._renewer: asyncio.Task[None] | None = None
        self._stopping = False
        self._stopped = False
        self._restore: Callable[[], None] | None = None
        self._unregister: Callable[[], None] | None = None

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> MemoryWorker:
        """Check the broker and the queues (declaring the topology first with
        `declare=True`), guard the app, and consume: the lifecycle program of the real
        workers up to its Serve step. Raises IncompatibleBroker, DeclarationConflict,
        MissingObjectError (a queue the topology needs is absent: declare it, or start
        with declare=True), KitError when already started."""
        if self._lifecycle is not None or self._stopped:
            raise KitError("this in-memory worker was started already; make a new one")
        lifecycle = self._lifecycle = self.lifecycle()
        reply: object = None
        while (step := lifecycle.send(reply)) is not lc.SERVE:
            reply = self._start_step(step)
        return self

    def _start_step(self, step: lc.LifecycleStep) -> object:
        """A step of the lifecycle program before it serves."""
        broker = self.broker
        if isinstance(step, lc.Connect):
            return lc.Connected(self.url, broker.info)
        if isinstance(step, lc.CheckQueue):
            return broker.has_queue(step.name)
        if step is lc.DECLARE:
            try:
                broker.declare(self.app.topology)
            except RabbitDelayError as exc:
                return exc
        elif step is lc.CONSUME:
            self._consume_all()
        return None  # CLOSE: nothing was opened

    def _consume_all(self) -> None:
        broker = self.broker
        self._restore = self.app._install_guard(self._store, self.clock)
        self.guard = self.app.guard() if self.guarded else None
        self._unregister = broker.register_busy(self.busy)
        channel = self._channel = broker.channel()
        names = self.app.topology.names
        for consumer in self.consumers:
            deliver = self._on_delivery_of(consumer)
            queue_name = names.business_queue(consumer.queue)
            tag = channel.consume(queue_name, deliver, prefetch=self.prefetch)
            self.consuming(tag, consumer)
        self.started.set()
        self.ever_started = True

    def busy(self) -> bool:
        """Deliveries are in progress (for MemoryBroker.idle)."""
        return bool(self._tasks) or self._starting > 0

    def stop(self, *, force: bool = False) -> None:
        """Stop as the real workers do on SIGTERM, in virtual time (see the module
        docstring): the lifecycle program from its Serve step on. Returns once stopped,
        the app's own guard put back. With `force`, running handlers are abandoned
        (cancelled; their claims run out after the lease). Raises KitError when called
        from inside a handler."""
        if self._channel is None or self._stopped:
            return
        self._force = force
        done: list[bool] = []

        def stopped(task: asyncio.Future[None]) -> None:
            done.append(True)
            self._failed(task)

        def begin() -> None:
            asyncio.ensure_future(self._shutdown()).add_done_callback(stopped)

        self.broker.loop.call_soon(begin)
        limit = f"{self.shutdown_timeout + STOP_LIMIT_S}s"
        if not self.broker.run_until(lambda: bool(done), limit):
            raise KitError(
                f"the in-memory worker did not stop within {limit} of virtual time: "
                f"{len(self._tasks)} handler(s) still running"
            )

    async def _shutdown(self) -> None:
        lifecycle = self._lifecycle
        assert lifecycle is not None
        reply: object = lc.STOPPED
        while True:
            try:
                step = lifecycle.send(reply)
            except StopIteration:
                break
            reply = await self._stop_step(step)
        self._finish_stop()

    async def _stop_step(self, step: lc.LifecycleStep) -> object:
        """A step of the lifecycle program after it served, in virtual time."""
        channel = self._channel
        assert channel is not None
        if step is lc.CANCEL:
            self._stopping = True
            for tag in self.consumer_tags():
                channel.cancel(tag)
            return None
        if step is lc.CLOSE:
            channel.close()  # the broker takes back what is unacked
            if self._force:
                for task in self._tasks:
                    task.cancel()
            return None
        assert isinstance(step, lc.Wait)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + step.seconds
        # SETTLED: deliveries in flight settle (a forced stop waits for none);
        # RECORDED: running handlers record their results (never acked)
        settling = step.until is lc.Until.SETTLED
        while self.busy() and not (settling and self._force) and loop.time() < deadline:
            if self._tasks:
                await asyncio.wait(list(self._tasks), timeout=deadline - loop.time())
            else:
                await asyncio.sleep(0)  # deliveries about to start: they are handed back
        if settling:
            self._gen += 1  # what settles from now on cannot be acked
            return lc.Drained(len(self._tasks), self._force)
        return len(self._tasks)

    def _finish_stop(self) -> None:
        self._stopped = True
        self.started.clear()
        if self._unregister is not None:
            self._unregister()
        if self._restore is not None:
            self._restore()
        self.run_ends()

    # -- deliveries ------------------------------------------------------------------------

    def _on_delivery_of(self, consumer: Consumer) -> Callable[[Delivered], None]:
        loop = self.broker.loop

        def deliver(delivered: Delivered) -> None:
            # Called while the broker dispatches (maybe inside another delivery's ack):
            # the delivery starts on the next loop turn, in delivery order.
            self._starting += 1
            loop.call_soon(self._start_task, consumer, delivered)

        return deliver

    def _start_task(self, consumer: Consumer, delivered: Delivered) -> None:
        self._starting -= 1
        task = self.broker.loop.create_task(self._drive(consumer, delivered))
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._failed(task)

    def _failed(self, task: asyncio.Future[Any]) -> None:
        """An error of the kit itself (never a handler's): raised by the run it met."""
        if not task.cancelled() and task.exception() is not None:
            self.broker.record_error(task.exception())  # type: ignore[arg-type]

    async def _drive(self, consumer: Consumer, delivered: Delivered) -> None:
        """Drive one delivery's program to its end."""
        self.report.arrived()
        message = delivered.message
        delivery = dp.Delivery(
            message.message_id,
            message.headers,
            message.redelivered,
            message.body,
            message.content_type,
            self.clock(),
        )
        live = _Live(self._gen, delivered.tag, delivered.consumer_tag)
        program = self.program(consumer, delivery, self.broker.info)
        reply: object = None
        while True:
            try:
                step: dp.Step = program.send(reply)
            except StopIteration as stop:
                settled: dp.Settled = stop.value
                self.report.settled(settled)
                self._record(live, settled, message.body)
                return
            if isinstance(step, dp.Run):
                reply = await self._run(live, step)
            elif isinstance(step, dp.Pause):
                await asyncio.sleep(step.seconds)
                reply = None
            else:
                reply = self._execute(live, step)

    def _stale(self, live: _Live) -> bool:
        return live.gen != self._gen or live.consumer_tag in self._cancelled

    def _execute(self, live: _Live, step: dp.Step) -> object:
        """Every step but Run and Pause, synchronously (the store is called inline)."""
        if isinstance(step, dp.Finish):  # always executed: the handler did run
            assert self.guard is not None
            return finish_with(
                self.guard,
                self.leases,
                step.key,
                step.owner,
                step.succeeded,
                self.report,
                step.update,
            )
        if self._stale(live):
            return dp.STALE
        if isinstance(step, dp.Claim):
            if self._stopping:
                return dp.STOPPING
            assert self.guard is not None
            result = claim_with(
                self.guard, self.leases, step.key, step.owner, self.clock(), step.ref
            )
            if result is ClaimResult.CLAIMED:
                self._renew_while_held()
            return result
        if isinstance(step, dp.Publish):
            try:
                self.publisher.publish_outgoing((step.outgoing,))
            except (PublishError, BrokerError) as exc:
                return exc
            return None
        channel = self._channel
        assert channel is not None
        if isinstance(step, dp.WriteAck):
            channel.ack(live.tag)
        elif isinstance(step, dp.WriteNack):
            channel.nack(live.tag, requeue=True)
        else:
            assert isinstance(step, dp.WriteReject)
            channel.reject(live.tag, requeue=step.requeue)
        return None

    async def _run(self, live: _Live, step: dp.Run) -> object:
        if self._stopping:
            return dp.STOPPING
        async with self._sem:
            if self._stale(live):  # lost while waiting for a slot
                return dp.STALE
            if self._stopping:  # waited for a slot past the stop: not started
                return dp.STOPPING
            consumer, prepared = step.consumer, step.prepared
            live.ran = True
            live.context = prepared.ctx
            if consumer.is_async:
                outcome = await call_async_handler(consumer, prepared, self.report.timer)
            else:
                outcome = call_handler(consumer, prepared, self.report.timer)
            if isinstance(outcome, BaseException):
                live.error = outcome
            return outcome

    def _record(self, live: _Live, settled: dp.Settled, body: bytes) -> None:
        publish_error = settled.publish_error
        self.records.append(
            Handled(
                queue=settled.queue,
                message_id=settled.message_id,
                attempt=settled.attempt,
                outcome=settled.outcome,
                reason=_reason(settled.action),
                action=settled.action,
                ran=live.ran,
                error=live.error,
                context=live.context,
                body=body,
                at_ms=self.clock(),
                publish_error=publish_error,
            )
        )

    # -- leases ------------------------------------------------------------------------------

    def _renew_while_held(self) -> None:
        """Renew running handlers' leases on the virtual clock, only while some are held
        (a `def` handler holds its lease for no virtual time at all)."""
        if self._renewer is None or self._renewer.done():
            self._renewer = self.broker.loop.create_task(self._renew())
            self._renewer.add_done_callback(self._failed)

    async def _renew(self) -> None:
        """The housekeeping program, renewals only, until no lease is held."""
        guard = self.guard
        assert guard is not None
        program = self.housekeeping(purges=False, until_idle=True)
        with contextlib.suppress(StopIteration):
            step = next(program)
            while True:
                if isinstance(step, Sleep):
                    await asyncio.sleep(step.seconds)
                    step = program.send(False)
                else:
                    step = program.send(on_guard(guard, step))


__all__ = ["MEMORY_URL", "Handled", "MemoryWorker"]
