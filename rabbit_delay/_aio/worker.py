"""The asynchronous worker: aio-pika, handlers as tasks bounded by a semaphore.

The connection and channels are aio-pika's; deliveries are consumed on the channel's
underlying aiormq channel (as AsyncPublisher publishes on it), which hands each
delivery to one task with its channel attached. Each delivery is acked, nacked or
rejected on *that* channel object: after a lost connection the old channel refuses
(ChannelInvalidStateError), so a delivery tag never reaches another channel. The
broker redelivers such a message; the idempotency guard knows if its handler ran. A
consumer the broker cancels (RabbitMQ 4.3 does so for a quorum consumer over
`consumer_timeout`, where older versions close the channel) is consumed again on the
same channel; the results of its deliveries are dropped the same way.

A driver of the delivery program (`rabbit_delay._consumer.delivery`): each delivery's
program runs in a task of its own and this module only executes its steps. The claims
and finishes issued in one loop turn go to the idempotency store as one batch.
`async def` handlers run on the event loop; plain `def` handlers run in a thread pool
of `concurrency` threads, so a blocking handler does not stall the loop.

Shutdown: consumers are cancelled, running handlers get `shutdown_timeout`; past it the
connection is closed (the broker redelivers what is unacked) and the worker still waits
for running handlers to record their results, so the store is never closed under one.
A second SIGINT/SIGTERM (or `stop(force=True)`) stops at once: running handlers are
abandoned like a crash, and their claims run out after the lease.

The connection is a plain (not robust) aio-pika connection: reconnection is this
worker's own loop, with backoff, so consumers, publisher and generation change
together and nothing is restored behind its back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import aiormq
import aiormq.exceptions
from aio_pika.abc import AbstractChannel, AbstractConnection
from aiormq.abc import AbstractChannel as RawChannel
from aiormq.abc import DeliveredMessage
from pamqp.commands import Basic

import rabbit_delay._consumer.delivery as dp
import rabbit_delay._consumer.lifecycle as lc
from rabbit_delay._aio.connection import broker_info, close_quietly, connect_first
from rabbit_delay._aio.declarer import declare as declare_topology
from rabbit_delay._aio.errors import CLIENT_ERRORS, mapped
from rabbit_delay._aio.publisher import WORKER_BLOCKED_TIMEOUT_S, AsyncPublisher
from rabbit_delay._aio.reconcile import AsyncReconciling
from rabbit_delay._aio.store_batches import StoreBatches
from rabbit_delay._aio.threads import DaemonThreads
from rabbit_delay._broker import UNKNOWN, BrokerInfo
from rabbit_delay._consumer.acks import AckTracker
from rabbit_delay._consumer.app import Consumer, Transport
from rabbit_delay._consumer.context import clock_ms
from rabbit_delay._consumer.handlers import call_async_handler, call_handler
from rabbit_delay._consumer.housekeeping import Renew, Sleep
from rabbit_delay._errors import BrokerError, PublishError, RabbitDelayError
from rabbit_delay._idempotency.guard import AsyncGuard
from rabbit_delay._observe.report import ReportingWorker
from rabbit_delay._urls import redact

log = logging.getLogger("rabbit_delay.worker")

HEARTBEAT_S = 0.5  # how often the event loop proves it is not blocked

_CHANNEL_GONE = (
    aiormq.exceptions.ChannelInvalidStateError,
    aiormq.exceptions.AMQPError,
    ConnectionError,
    RuntimeError,  # "writer is None" on a connection torn down mid-call
)
# What a lifecycle step may meet, replied to the program: it decides whether that stops
# the start or fails one reconnect round (consumer/lifecycle.py).
_STEP_ERRORS: tuple[type[BaseException], ...] = (RabbitDelayError, *CLIENT_ERRORS)


class AsyncWorker(ReportingWorker):
    """Runs an App's consumers on aio-pika until `stop()` (or SIGINT/SIGTERM).

    Same options and guarantees as the sync `Worker`; `concurrency` bounds handlers
    running at once (default 16). Runs sync and async handlers alike.

    Raises ConfigError at construction for an unknown queue or a malformed URL list;
    `run()` raises BrokerUnavailable (every URL tried, and why), MissingObjectError,
    AccessRefused, IncompatibleBroker or DeclarationConflict when it cannot start.
    After a successful start, lost connections are re-opened with backoff, over every
    URL (see WorkerCore).
    """

    transport = Transport.ASYNC
    default_concurrency = 16

    def _prepare(self) -> None:
        self._stop_requested = False
        self._force = False  # abandon running handlers (second signal)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._lost: asyncio.Event | None = None
        self._stopping = False
        self._guard: AsyncGuard | None = None
        self._connection: AbstractConnection | None = None
        self._channel: AbstractChannel | None = None
        self._raw: RawChannel | None = None
        self._publisher: AsyncPublisher | None = None
        self._broker: BrokerInfo = UNKNOWN  # the connected broker's version rules
        self._lost_reason = ""
        self._sem = asyncio.Semaphore(self.concurrency)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._idle: asyncio.Event | None = None
        self._batches: StoreBatches | None = None
        self._executor: DaemonThreads | None = None
        self._to_flush: dict[AckTracker, RawChannel] = {}
        self._ack_writes: set[asyncio.Future[None]] = set()
        self._ack_order = asyncio.Lock()  # ack frames reach the wire in flush order

    # -- public ------------------------------------------------------------------------

    def stop(self, *, force: bool = False) -> None:
        """Ask the worker to stop; callable from any thread. With `force`, stop at once
        and abandon running handlers (their claims run out after the lease)."""
        self._stop_requested = True
        if force:
            self._force = True
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop is already closed
                loop.call_soon_threadsafe(stop.set)

    def stop_requested(self) -> bool:
        """True once `stop()` was called (or SIGINT/SIGTERM received)."""
        return self._stop_requested

    async def run(self) -> None:
        """Consume until stopped. Raises BrokerUnavailable / MissingObjectError /
        DeclarationConflict / IncompatibleBroker / AccessRefused when it cannot start."""
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._idle = asyncio.Event()
        if self._stop_requested:
            self._stop.set()
        if self.guarded:
            self._guard = self.app.async_guard()
            self._batches = StoreBatches(self._guard)
        if any(not c.is_async for c in self.consumers):
            self._executor = DaemonThreads(self.concurrency, "rabbit-delay-handler")
        restore = self._install_signals()
        housekeeping: asyncio.Task[None] | None = None
        self.run_begins()
        heartbeat = asyncio.create_task(self._heartbeat())
        reconciling: AsyncReconciling | None = None
        lifecycle = self.lifecycle()
        try:
            reply: object = None
            while True:
                try:
                    step = lifecycle.send(reply)
                except StopIteration:
                    break
                if reconciling is None and step is lc.SERVE:  # started: reconcile too
                    reconciling = self._start_reconciling()
                    if self._guard is not None:
                        housekeeping = asyncio.create_task(self._housekeeping(self._guard))
                reply = await self._execute_step(step)
        finally:
            lifecycle.close()
            if reconciling is not None:
                await reconciling.stop()
            await self._close_connection()
            abandoned = list(self._tasks)
            for task in abandoned:  # forced: their claims run out after the lease
                task.cancel()
            if abandoned:
                await asyncio.wait(abandoned, timeout=2)
            if housekeeping is not None:
                housekeeping.cancel()
            heartbeat.cancel()
            if self._executor is not None:
                # Forced: a running `def` handler cannot be interrupted; its daemon thread
                # is left behind, and the process may exit under it.
                self._executor.shutdown(wait=not abandoned, cancel_futures=True)
            restore()
            self.run_ends()

    async def _heartbeat(self) -> None:
        """Beat from the event loop itself: a loop blocked by a handler that never
        awaits stops beating, and /healthz says so (consumer/health.py)."""
        while True:
            self.beat()
            await asyncio.sleep(HEARTBEAT_S)

    def _start_reconciling(self) -> AsyncReconciling | None:
        """The app's reconcilers in a task of their own, each run publishing on a
        connection of its own."""
        if not self.reconcilers:
            return None
        topology, urls, settings = self.app.topology, self.urls, self.settings.connection

        async def connect() -> AsyncPublisher:
            return await AsyncPublisher.connect(topology, urls, settings=settings)

        metrics = self.report.metrics.metrics if self.report.metrics is not None else None
        reconciling = AsyncReconciling(self.app, self.reconcilers, self.identity, connect, metrics)
        reconciling.start()
        return reconciling

    # -- the lifecycle program's steps ------------------------------------------------------

    async def _execute_step(self, step: lc.LifecycleStep) -> object:
        """One step of the lifecycle program (consumer/lifecycle.py); its reply."""
        if step is lc.SERVE:
            return await self._serve()
        if step is lc.CLOSE:
            await self._close_connection()
            return None
        if step is lc.CANCEL:
            return await self._cancel()
        if isinstance(step, lc.Wait):
            return await self._wait(step)
        try:
            if isinstance(step, lc.Connect):
                return await self._connect(step.urls)
            connection = self._connection
            assert connection is not None
            if isinstance(step, lc.CheckQueue):
                return await _queue_exists(connection, step.name)
            if step is lc.DECLARE:
                await declare_topology(connection, self.app.topology)
            else:
                await self._consume_all(connection)
        except _STEP_ERRORS as exc:
            return exc
        return None

    async def _connect(self, urls: tuple[str, ...]) -> lc.Connected:
        connection, url = await connect_first(
            urls, name=self.name, settings=self.settings.connection
        )
        self._connection, self.url, self._broker = connection, url, broker_info(connection)
        return lc.Connected(url, self._broker)

    async def _consume_all(self, connection: AbstractConnection) -> None:
        """Open the consuming channel (prefetch, a publisher for copies) and consume
        every queue; raises the error tree's classes."""
        with mapped("opening the consuming channel"):
            channel = await connection.channel(publisher_confirms=False)
            await channel.set_qos(prefetch_count=self.prefetch)
            raw = await channel.get_underlay_channel()
        publisher = await AsyncPublisher(
            self.app.topology, connection=connection, blocked_timeout=WORKER_BLOCKED_TIMEOUT_S
        ).open()
        lost = asyncio.Event()

        def on_close(_sender: object = None, exc: BaseException | None = None) -> None:
            # The first reason wins (the channel's, when the broker closed it).
            if not lost.is_set():
                self._lost_reason = redact(repr(exc)) if exc is not None else "closed"
            lost.set()

        connection.close_callbacks.add(on_close)
        channel.close_callbacks.add(on_close)
        tracker = AckTracker()  # one per channel: tags never outlive their channel
        raw.on_consumer_cancel_callbacks.add(partial(self._on_cancel, raw, tracker))
        # In place before the first delivery can arrive.
        self._channel, self._raw, self._publisher, self._lost = channel, raw, publisher, lost
        self.new_channel()
        queues = ", ".join(self.queue_names())
        with mapped(f"starting to consume {queues}", permission="read"):
            for consumer in self.consumers:
                await self._consume(raw, tracker, consumer)
        self.started.set()
        self.ever_started = True

    async def _serve(self) -> object:
        """Until asked to stop (STOPPED) or the connection is lost (Lost)."""
        stop, lost = self._stop, self._lost
        assert stop is not None
        assert lost is not None
        waiters = [asyncio.create_task(stop.wait()), asyncio.create_task(lost.wait())]
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        for waiter in waiters:
            waiter.cancel()
        if stop.is_set():
            return lc.STOPPED
        self.started.clear()
        return lc.Lost(self._lost_reason)

    async def _wait(self, step: lc.Wait) -> object:
        if step.until is lc.Until.STOP:
            return await self._backoff(step.seconds)
        if step.until is lc.Until.SETTLED:
            return await self._drain(step.seconds)
        return await self._wait_running(step.seconds)

    async def _backoff(self, seconds: float) -> bool:
        """Wait before the next reconnect round; True if asked to stop meanwhile."""
        stop = self._stop
        assert stop is not None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), seconds)
        return stop.is_set()

    async def _cancel(self) -> object:
        """Cancel the consumers: the stop begins."""
        self._stopping = True
        raw = self._raw
        try:
            if raw is not None:
                for tag in self.consumer_tags():
                    await raw.basic_cancel(tag)
        except _CHANNEL_GONE as exc:
            return lc.Lost(redact(repr(exc)))
        return None

    async def _drain(self, seconds: float) -> lc.Drained:
        """Let in-flight deliveries settle, up to `seconds` (or a forced stop), and their
        acks reach the wire."""
        idle = self._idle
        assert idle is not None
        if self._tasks:
            idle.clear()
            deadline = time.monotonic() + seconds
            while self._tasks and not self._force and time.monotonic() < deadline:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(idle.wait(), 0.2)
        unsettled = len(self._tasks)
        self._flush()
        if self._ack_writes:
            await asyncio.wait(list(self._ack_writes), timeout=5)
        return lc.Drained(unsettled, self._force)

    async def _wait_running(self, seconds: float) -> int:
        """After the connection closed: let running handlers record their results in the
        store (done or released), so it is never closed under one; their acks are stale.
        How many still run after `seconds`; a forced stop skips this."""
        if self._tasks and not self._force:
            await asyncio.wait(list(self._tasks), timeout=seconds)
        return 0 if self._force else len(self._tasks)

    async def _close_connection(self) -> None:
        connection, self._connection = self._connection, None
        self._channel = self._raw = self._publisher = None
        await close_quietly(connection)

    async def _consume(self, raw: RawChannel, tracker: AckTracker, consumer: Consumer) -> str:
        queue_name = self.app.topology.names.business_queue(consumer.queue)
        ok = await raw.basic_consume(
            queue_name, partial(self._on_delivery, consumer, tracker), no_ack=False
        )
        tag = str(ok.consumer_tag)
        self.consuming(tag, consumer)
        return tag

    def _on_cancel(self, raw: RawChannel, tracker: AckTracker, frame: Basic.Cancel) -> None:
        """basic.cancel from the broker: drop that consumer's deliveries, consume again."""
        if raw is not self._raw:  # a channel we already left
            return
        stopping = self._stopping or self._stop_requested
        again = self.consumer_cancelled(str(frame.consumer_tag), self._broker, stopping)
        if again is not None:
            task = asyncio.ensure_future(self._consume_again(raw, tracker, again))
            self._tasks.add(task)
            task.add_done_callback(self._task_done)

    async def _consume_again(
        self, raw: RawChannel, tracker: AckTracker, consumer: Consumer
    ) -> None:
        try:
            tag = await self._consume(raw, tracker, consumer)
        except _CHANNEL_GONE as exc:  # the channel went too: the reconnect consumes again
            log.warning("%s: could not consume again (%s)", consumer.queue, redact(repr(exc)))
            if self._lost is not None and raw is self._raw:
                self._lost_reason = redact(repr(exc))
                self._lost.set()
            return
        self.report.consuming_again(consumer.queue, tag)

    # -- deliveries --------------------------------------------------------------------

    async def _on_delivery(
        self, consumer: Consumer, tracker: AckTracker, message: DeliveredMessage
    ) -> None:
        """aiormq's task for one delivery: hand it to a task of our own and return.

        aiormq cancels its tasks when their channel closes; a handler cut off mid-way by
        a lost connection could leave half its work done. Our task lets it finish (its
        ack then fails as stale, and the guard recognises the redelivered copy).
        """
        # aiormq starts these tasks in delivery order: register before anything else.
        tag: int = message.delivery.delivery_tag  # type: ignore[union-attr,assignment]
        tracker.delivered(tag)
        task = asyncio.get_running_loop().create_task(
            self._on_message(consumer, tracker, message, tag)
        )
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        tasks = self._tasks
        tasks.discard(task)
        if not tasks and self._idle is not None:
            self._idle.set()

    async def _on_message(
        self, consumer: Consumer, tracker: AckTracker, message: DeliveredMessage, tag: int
    ) -> None:
        """Drive one delivery's program to its end."""
        self.report.arrived()
        props = message.header.properties
        delivery = dp.Delivery(
            props.message_id,
            props.headers,
            bool(message.delivery.redelivered),  # type: ignore[union-attr]
            message.body,
            props.content_type,
            clock_ms(),
        )
        live = _Live(
            message.channel,
            tracker,
            tag,
            str(message.delivery.consumer_tag),  # type: ignore[union-attr]
        )
        program = self.program(consumer, delivery, self._broker)
        reply: object = None
        while True:
            try:
                step: dp.Step = program.send(reply)
            except StopIteration as stop:
                settled: dp.Settled = stop.value
                if settled.stale and not live.channel.is_closed:
                    tracker.settled(tag)  # its consumer was cancelled: never acked
                self.report.settled(settled)
                return
            try:
                reply = await self._execute(live, step)
            except _CHANNEL_GONE:
                reply = dp.STALE  # its channel is gone: the broker redelivers it

    def _stale(self, live: _Live) -> bool:
        return live.channel.is_closed or live.ctag in self._cancelled

    async def _execute(self, live: _Live, step: dp.Step) -> object:
        if isinstance(step, dp.Finish):  # always executed: the handler did run
            self.leases.finishing(step.key, step.owner, self.report)
            assert self._batches is not None
            return await self._batches.finish(step.key, step.owner, step.succeeded, step.update)
        if self._stale(live):
            return dp.STALE
        if isinstance(step, dp.Claim):
            if self._stopping:
                return dp.STOPPING
            assert self._batches is not None
            result = await self._batches.claim(step.key, step.owner, step.ref)
            self.leases.claimed(step.key, step.owner, result, self.clock())
            return result
        if isinstance(step, dp.Run):
            return await self._run(live, step)
        if isinstance(step, dp.Pause):
            await asyncio.sleep(step.seconds)
            return None
        if isinstance(step, dp.WriteAck):
            self._ack(live.channel, live.tracker, live.tag)
            return None
        if isinstance(step, dp.Publish):
            publisher = self._publisher
            if publisher is None:  # lost meanwhile: the broker redelivers the original
                return dp.STALE
            try:
                await publisher.publish_outgoing((step.outgoing,))
            except (PublishError, BrokerError) as exc:
                return exc
            return None
        if isinstance(step, dp.WriteNack):
            await live.channel.basic_nack(live.tag, multiple=False, requeue=True)
        else:
            await live.channel.basic_reject(live.tag, requeue=step.requeue)
        live.tracker.settled(live.tag)
        return None

    async def _run(self, live: _Live, step: dp.Run) -> object:
        if self._stopping:
            return dp.STOPPING
        async with self._sem:
            if self._stale(live):  # cancelled or lost while waiting for a slot
                return dp.STALE
            if self._stopping:  # waited for a slot past the stop: not started
                return dp.STOPPING
            consumer, prepared = step.consumer, step.prepared
            if consumer.is_async:
                return await call_async_handler(consumer, prepared, self.report.timer)
            assert self._loop is not None
            return await self._loop.run_in_executor(
                self._executor, call_handler, consumer, prepared, self.report.timer
            )

    def _ack(self, channel: RawChannel, tracker: AckTracker, tag: int) -> None:
        """Mark for ack; written at the end of this loop iteration, coalesced (AckTracker)."""
        tracker.acked(tag)
        if not self._to_flush:
            assert self._loop is not None
            self._loop.call_soon(self._flush)
        self._to_flush[tracker] = channel

    def _flush(self) -> None:
        to_flush, self._to_flush = self._to_flush, {}
        for tracker, channel in to_flush.items():
            frames = tracker.flush()
            if frames:
                task = asyncio.ensure_future(self._write_acks(channel, frames))
                self._ack_writes.add(task)
                task.add_done_callback(self._ack_writes.discard)

    async def _write_acks(self, channel: RawChannel, frames: list[tuple[int, bool]]) -> None:
        # One flush at a time, in order: a later flush's multiple-ack assumes the single
        # acks of the earlier ones are on the wire; overtaking them would settle those
        # tags first, and their own acks would then close the channel (406 unknown
        # delivery tag), losing every unacked delivery of the channel.
        try:
            async with self._ack_order:
                for tag, multiple in frames:
                    await channel.basic_ack(tag, multiple=multiple)
        except _CHANNEL_GONE:
            log.debug("acks lost with their channel; the broker redelivers those messages")

    async def _housekeeping(self, guard: AsyncGuard) -> None:
        """The housekeeping program (consumer/housekeeping.py) in a task of its own."""
        program = self.housekeeping(purges=guard.store.needs_purge)
        with contextlib.suppress(StopIteration):
            step = next(program)
            while True:
                if isinstance(step, Sleep):
                    await asyncio.sleep(step.seconds)
                    step = program.send(False)
                    continue
                try:
                    if isinstance(step, Renew):
                        reply: object = await guard.renew(step.key, step.owner)
                    else:
                        reply = await guard.purge()
                except Exception as exc:
                    reply = exc
                step = program.send(reply)

    # -- signals ---------------------------------------------------------------------------

    def _install_signals(self) -> Callable[[], None]:
        loop = self._loop
        in_main = threading.current_thread() is threading.main_thread()
        if loop is None or not self.settings.install_signal_handlers or not in_main:
            return lambda: None
        sigs = (signal.SIGINT, signal.SIGTERM)

        def on_signal(sig: signal.Signals) -> None:
            self.stop(force=self.on_signal(sig.name, self._stop_requested))

        for sig in sigs:
            loop.add_signal_handler(sig, on_signal, sig)

        def restore() -> None:
            for sig in sigs:
                loop.remove_signal_handler(sig)

        return restore


@dataclass(slots=True, eq=False)
class _Live:
    """One delivery whose program is running: where it is settled."""

    channel: RawChannel
    tracker: AckTracker
    tag: int
    ctag: str


async def _queue_exists(connection: AbstractConnection, queue_name: str) -> bool:
    """Passive declare on a throwaway channel: needs no configure permission."""
    with mapped(f"checking queue {queue_name!r}", permission="read"):
        channel = await connection.channel(publisher_confirms=False)
        try:
            await channel.declare_queue(queue_name, passive=True)
        except aiormq.exceptions.ChannelNotFoundEntity:
            return False
        finally:
            if not channel.is_closed:
                with contextlib.suppress(*CLIENT_ERRORS, RuntimeError):
                    await channel.close()
    return True
