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

`async def` handlers run on the event loop; plain `def` handlers run in a thread pool
of `concurrency` threads, so a blocking handler does not stall the loop.

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
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, Unpack

import aio_pika
import aiormq
import aiormq.exceptions
from aio_pika.abc import AbstractChannel, AbstractConnection
from aiormq.abc import AbstractChannel as RawChannel
from aiormq.abc import DeliveredMessage
from pamqp.commands import Basic

from rabbit_delay.aio._connection import broker_info
from rabbit_delay.aio.declarer import declare as declare_topology
from rabbit_delay.aio.publisher import AsyncPublisher
from rabbit_delay.broker import UNKNOWN, BrokerInfo
from rabbit_delay.consumer import (
    Ack,
    Action,
    App,
    BrokerRetry,
    Consumer,
    Outcome,
    Park,
    Prepared,
    Republish,
    Requeue,
    Skip,
    Transport,
    Unavailable,
)
from rabbit_delay.consumer._acks import AckTracker
from rabbit_delay.consumer._context import clock_ms as now_ms
from rabbit_delay.consumer._stats import log_action, log_connection_lost
from rabbit_delay.consumer._worker_base import WorkerBase, WorkerSettings
from rabbit_delay.errors import (
    BrokerError,
    BrokerUnavailable,
    MissingObjectError,
    PublishError,
    RabbitDelayError,
)
from rabbit_delay.idempotency import AsyncGuard, ClaimResult
from rabbit_delay.urls import redact

log = logging.getLogger("rabbit_delay.worker")

STORE_PAUSE_S = 1.0  # back-pressure when the idempotency store fails
PURGE_EVERY_S = 600.0
_CHANNEL_GONE = (
    aiormq.exceptions.ChannelInvalidStateError,
    aiormq.exceptions.AMQPError,
    ConnectionError,
    RuntimeError,  # "writer is None" on a connection torn down mid-call
)


class AsyncWorker(WorkerBase):
    """Runs an App's consumers on aio-pika until `stop()` (or SIGINT/SIGTERM).

    Same options and guarantees as the sync `Worker`; `concurrency` bounds handlers
    running at once (default 16). Runs sync and async handlers alike.

    Raises ConfigError at construction for an unknown queue; `run()` raises
    BrokerUnavailable / MissingObjectError when it cannot start. After a successful
    start, lost connections are re-opened with backoff.
    """

    transport = Transport.ASYNC
    default_concurrency = 16

    def __init__(
        self, app: App, url: str | None = None, **settings: Unpack[WorkerSettings]
    ) -> None:
        super().__init__(app, url, **settings)
        self._stop_requested = False
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
        self._seq = iter(range(1, 1 << 62))
        self._claims: dict[str, str] = {}  # owner -> key, for lease renewal
        self._renewing: asyncio.Lock | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._to_flush: dict[AckTracker, RawChannel] = {}
        self._ack_writes: set[asyncio.Future[None]] = set()
        self._ack_order = asyncio.Lock()  # ack frames reach the wire in flush order

    # -- public ------------------------------------------------------------------------

    def stop(self) -> None:
        """Ask the worker to stop; callable from any thread."""
        self._stop_requested = True
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop is already closed
                loop.call_soon_threadsafe(stop.set)

    async def run(self) -> None:
        """Consume until stopped. Raises BrokerUnavailable / MissingObjectError /
        DeclarationConflict when it cannot start."""
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._idle = asyncio.Event()
        self._renewing = asyncio.Lock()
        if self._stop_requested:
            self._stop.set()
        if any(c.idempotent for c in self.consumers):
            self._guard = self.app.async_guard()
        if any(not c.is_async for c in self.consumers):
            self._executor = ThreadPoolExecutor(self.concurrency, "rabbit-delay-handler")
        restore = self._install_signals()
        housekeeping: asyncio.Task[None] | None = None
        try:
            await self._open()
            log.info(
                "worker %s consuming %s on %s (prefetch %d, concurrency %d)",
                self.identity,
                ", ".join(c.queue for c in self.consumers),
                redact(self.url),
                self.prefetch,
                self.concurrency,
            )
            if self._guard is not None:
                housekeeping = asyncio.create_task(self._housekeeping(self._guard))
            while not self._stop.is_set():
                lost = self._lost
                assert lost is not None
                waiters = [asyncio.create_task(self._stop.wait()), asyncio.create_task(lost.wait())]
                await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
                for w in waiters:
                    w.cancel()
                if self._stop.is_set():
                    break
                log_connection_lost(self._lost_reason, self._queue_names())
                self.stats.reconnects += 1
                self.started.clear()
                await self._close_connection()
                await self._reconnect()
            if self._connection is not None:
                await self._shutdown()
        finally:
            if housekeeping is not None:
                housekeeping.cancel()
            await self._close_connection()
            cut_off = list(self._tasks)
            for task in cut_off:  # past the shutdown timeout: redelivered
                task.cancel()
            if cut_off:
                await asyncio.wait(cut_off, timeout=2)
            if self._executor is not None:
                self._executor.shutdown(wait=False, cancel_futures=True)
            restore()
            log.info("worker %s stopped: %s", self.identity, self.stats.as_dict())

    # -- connection --------------------------------------------------------------------

    def _queue_names(self) -> list[str]:
        names = self.app.topology.names
        return [names.business_queue(c.queue) for c in self.consumers]

    async def _open(self) -> None:
        connection = await _connect(self.url, self.name)
        try:
            broker = broker_info(connection)
            self.check_broker(broker)
            if self.declare:
                await declare_topology(connection, self.app.topology)
            for queue_name in self._queue_names():
                await _check_queue(connection, queue_name)
            channel = await connection.channel(publisher_confirms=False)
            await channel.set_qos(prefetch_count=self.prefetch)
            raw = await channel.get_underlay_channel()
            publisher = AsyncPublisher(self.app.topology, connection)
            await publisher.open()
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
            self._connection, self._channel, self._raw = connection, channel, raw
            self._publisher, self._lost, self._broker = publisher, lost, broker
            self._new_channel()
            for consumer in self.consumers:
                await self._consume(raw, tracker, consumer)
        except BaseException:
            self._connection = self._channel = self._raw = self._publisher = None
            with contextlib.suppress(Exception):
                await connection.close()
            raise
        self.started.set()

    async def _consume(self, raw: RawChannel, tracker: AckTracker, consumer: Consumer) -> str:
        queue_name = self.app.topology.names.business_queue(consumer.queue)
        ok = await raw.basic_consume(
            queue_name, partial(self._on_delivery, consumer, tracker), no_ack=False
        )
        tag = str(ok.consumer_tag)
        self._by_tag[tag] = consumer
        return tag

    def _on_cancel(self, raw: RawChannel, tracker: AckTracker, frame: Basic.Cancel) -> None:
        """basic.cancel from the broker: drop that consumer's deliveries, consume again."""
        if raw is not self._raw:  # a channel we already left
            return
        stopping = self._stopping or self._stop_requested
        again = self._consumer_cancelled(str(frame.consumer_tag), self._broker, stopping)
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
        log.info("%s: consuming again (consumer tag %s)", consumer.queue, tag)

    async def _reconnect(self) -> None:
        assert self._stop is not None
        delay = 0.25
        while not self._stop.is_set():
            try:
                await self._open()
            except (RabbitDelayError, aiormq.exceptions.AMQPError, OSError) as exc:
                log.warning("reconnect failed (%s); next try in %.1fs", redact(str(exc)), delay)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), delay)
                delay = min(delay * 2, self.reconnect_max_s)
            else:
                log.info("reconnected to %s", redact(self.url))
                return

    async def _close_connection(self) -> None:
        connection, self._connection = self._connection, None
        self._channel = self._raw = self._publisher = None
        if connection is not None and not connection.is_closed:
            with contextlib.suppress(Exception):
                await connection.close()

    async def _shutdown(self) -> None:
        """Cancel consumers, let in-flight handlers finish (up to the timeout), close."""
        self._stopping = True
        raw, idle = self._raw, self._idle
        assert idle is not None
        try:
            if raw is not None:
                for tag in list(self._by_tag):
                    await raw.basic_cancel(tag)
        except _CHANNEL_GONE as exc:
            log.warning("connection lost during shutdown (%s)", redact(repr(exc)))
        if self._tasks:
            idle.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(idle.wait(), self.shutdown_timeout)
        if self._tasks:
            log.warning(
                "shutdown timeout (%.0fs): %d message(s) still being handled; the broker "
                "will redeliver them",
                self.shutdown_timeout,
                len(self._tasks),
            )
        self._flush()
        if self._ack_writes:
            await asyncio.wait(list(self._ack_writes), timeout=5)
        await self._close_connection()

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
        self.stats.received += 1
        channel = message.channel
        ctag = str(message.delivery.consumer_tag)  # type: ignore[union-attr]
        cancelled = self._cancelled
        try:
            if ctag in cancelled:  # its consumer is gone: redelivered to the new one
                self.stats.stale += 1
                tracker.settled(tag)
                return
            if self._stopping:
                await self._nack(channel, tracker, tag)
                return
            async with self._sem:
                if ctag in cancelled:  # cancelled while waiting for a slot: not started
                    self.stats.stale += 1
                    tracker.settled(tag)
                    return
                if self._stopping:  # waited for a slot past the stop: not started
                    await self._nack(channel, tracker, tag)
                    return
                props = message.header.properties
                action, attempt = await self._handle(consumer, message)
            if channel.is_closed:  # lost meanwhile: the broker redelivers it
                self.stats.stale += 1
                return
            if ctag in cancelled:
                # The broker cancelled its consumer and took the message back: it is
                # redelivered to the new consumer; a copy or an ack now would be one too many.
                self.stats.stale += 1
                tracker.settled(tag)
                return
            log_action(consumer.queue, props.message_id, attempt, action)
            self.stats.record(action)
            if self.metrics is not None:
                self.metrics.handled(consumer.queue, action)
            await self._execute(channel, tracker, tag, action)
        except _CHANNEL_GONE:
            self.stats.stale += 1  # its channel is gone: the broker redelivers it
        except Exception:
            log.exception("%s: unexpected worker error", consumer.queue)
            with contextlib.suppress(*_CHANNEL_GONE):
                await self._nack(channel, tracker, tag)

    async def _nack(self, channel: RawChannel, tracker: AckTracker, tag: int) -> None:
        """Hand one delivery back (not started, or the store failed): nack, not reject,
        so from RabbitMQ 4.3 it does not count towards a quorum queue's delivery limit."""
        self.stats.requeued += 1
        await channel.basic_nack(tag, multiple=False, requeue=True)
        tracker.settled(tag)

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

    async def _handle(self, consumer: Consumer, message: DeliveredMessage) -> tuple[Action, int]:
        props = message.header.properties
        prepared = consumer.prepare(
            props.message_id,
            props.headers,
            bool(message.delivery.redelivered),  # type: ignore[union-attr]
            message.body,
            props.content_type,
            now_ms(),
        )
        if not isinstance(prepared, Prepared):
            return prepared, 1
        attempt = prepared.ctx.envelope.attempt
        if self.metrics is not None:
            ctx = prepared.ctx
            self.metrics.lateness(consumer.queue, ctx.envelope.due_at_ms, ctx.received_ms)
        key = prepared.key
        guard = self._guard
        if key is None or guard is None:
            outcome = await self._call(consumer, prepared)
            return consumer.finish(prepared, outcome, now_ms(), self._broker), attempt
        owner = f"{self.identity}:{next(self._seq)}"
        try:
            claim = await guard.claim(key, owner)
        except Exception as exc:
            log.error("%s: idempotency store failed on claim: %r", consumer.queue, exc)
            await asyncio.sleep(STORE_PAUSE_S)
            return consumer.finish(prepared, Unavailable(exc), now_ms(), self._broker), attempt
        if claim is not ClaimResult.CLAIMED:
            return consumer.finish(prepared, claim, now_ms(), self._broker), attempt
        claims = self._claims
        claims[owner] = key
        try:
            outcome = await self._call(consumer, prepared)
        except asyncio.CancelledError:
            # Cut off past the shutdown timeout: release the claim, so the redelivered
            # copy runs at once instead of waiting for the lease.
            await self._forget_claim(owner)
            with contextlib.suppress(Exception):
                await guard.failed(key, owner)
            raise
        await self._forget_claim(owner)
        try:
            if outcome is None:
                await guard.done(key, owner)
            else:
                await guard.failed(key, owner)
        except Exception as exc:
            # The handler's outcome stands; a duplicate may run again after the lease.
            log.error("%s: idempotency store failed after the handler: %r", consumer.queue, exc)
        return consumer.finish(prepared, outcome, now_ms(), self._broker), attempt

    async def _forget_claim(self, owner: str) -> None:
        renewing = self._renewing
        assert renewing is not None
        if renewing.locked():  # never release a claim the renewer is about to renew
            async with renewing:
                self._claims.pop(owner, None)
        else:
            self._claims.pop(owner, None)

    async def _call(self, consumer: Consumer, prepared: Prepared) -> Outcome:
        metrics = self.metrics
        start = time.perf_counter() if metrics is not None else 0.0
        try:
            if consumer.is_async:
                if consumer.takes_context:
                    await consumer.handler(prepared.message, prepared.ctx)
                else:
                    await consumer.handler(prepared.message)
            else:
                assert self._loop is not None
                call: Callable[[], Any] = (
                    partial(consumer.handler, prepared.message, prepared.ctx)
                    if consumer.takes_context
                    else partial(consumer.handler, prepared.message)
                )
                await self._loop.run_in_executor(self._executor, call)
        except Exception as exc:
            return exc
        finally:
            if metrics is not None:
                metrics.handler_time(consumer.queue, time.perf_counter() - start)
        return None

    async def _execute(
        self, channel: RawChannel, tracker: AckTracker, tag: int, action: Action
    ) -> None:
        if isinstance(action, Ack | Skip):
            self._ack(channel, tracker, tag)
        elif isinstance(action, Republish | Park):
            if channel.is_closed:  # redelivered anyway: a copy now would be one too many
                raise aiormq.exceptions.ChannelInvalidStateError("channel closed")
            if await self._publish(action):
                self._ack(channel, tracker, tag)  # only once the new copy is confirmed
            elif isinstance(action, Republish) and action.requeue_if_unsent:
                await self._nack(channel, tracker, tag)
            else:
                # The broker dead-letters it into the parking exchange (reason rejected):
                # visible, and no hot loop of redeliveries.
                await channel.basic_reject(tag, requeue=False)
                tracker.settled(tag)
        elif isinstance(action, BrokerRetry):
            # Counted towards the delivery limit and held back by the queue (4.3+ delayed
            # retry); the count is the next attempt's number.
            await channel.basic_reject(tag, requeue=True)
            tracker.settled(tag)
        else:  # Requeue: the idempotency store failed (4.3+)
            assert isinstance(action, Requeue)
            await self._nack(channel, tracker, tag)

    async def _publish(self, action: Republish | Park) -> bool:
        publisher = self._publisher
        if publisher is None:
            raise aiormq.exceptions.ChannelInvalidStateError("no connection")
        try:
            await publisher.publish_outgoing((action.outgoing,))
        except (PublishError, BrokerError) as exc:
            self.stats.publish_failures += 1
            log.error(
                "could not publish %s of %s to %s: %s",
                type(action).__name__.lower(),
                action.outgoing.message_id,
                action.outgoing.exchange,
                exc,
            )
            return False
        return True

    async def _housekeeping(self, guard: AsyncGuard) -> None:
        """Renew the leases of running handlers; purge expired records now and then."""
        renewing = self._renewing
        assert renewing is not None
        every = max(guard.lease_ms / 3000, 0.05)
        next_purge = time.monotonic() + PURGE_EVERY_S
        while True:
            await asyncio.sleep(every)
            async with renewing:
                for owner, key in list(self._claims.items()):
                    if owner not in self._claims:
                        continue
                    try:
                        await guard.store.claim(
                            key, owner, now_ms=guard.clock(), lease_ms=guard.lease_ms
                        )
                    except Exception as exc:
                        log.warning("lease renewal failed: %r", exc)
            if guard.store.needs_purge and time.monotonic() >= next_purge:
                next_purge = time.monotonic() + PURGE_EVERY_S
                try:
                    await guard.purge()
                except Exception as exc:
                    log.warning("idempotency purge failed: %r", exc)

    # -- signals ---------------------------------------------------------------------------

    def _install_signals(self) -> Callable[[], None]:
        loop = self._loop
        in_main = threading.current_thread() is threading.main_thread()
        if loop is None or not self.install_signal_handlers or not in_main:
            return lambda: None
        sigs = (signal.SIGINT, signal.SIGTERM)

        def on_signal(sig: signal.Signals) -> None:
            log.info(
                "signal %s: stopping (in-flight handlers get %.0fs)",
                sig.name,
                self.shutdown_timeout,
            )
            self.stop()

        for sig in sigs:
            loop.add_signal_handler(sig, on_signal, sig)

        def restore() -> None:
            for sig in sigs:
                loop.remove_signal_handler(sig)

        return restore


async def _connect(url: str, name: str) -> AbstractConnection:
    try:
        return await aio_pika.connect(url, client_properties={"connection_name": name})
    except (aiormq.exceptions.AMQPError, OSError, ValueError) as exc:
        raise BrokerUnavailable(f"cannot connect to {redact(url)}: {redact(repr(exc))}") from None


async def _check_queue(connection: AbstractConnection, queue_name: str) -> None:
    """Passive declare on a throwaway channel: needs no configure permission."""
    channel = await connection.channel(publisher_confirms=False)
    try:
        await channel.declare_queue(queue_name, passive=True)
    except aiormq.exceptions.ChannelNotFoundEntity:
        raise MissingObjectError(
            f"queue {queue_name!r} does not exist on the broker: declare the topology "
            "(`rabbit-delay declare`), or start the worker with --declare"
        ) from None
    except aiormq.exceptions.ChannelClosed as exc:
        raise BrokerError(f"cannot use queue {queue_name!r}: {exc}") from None
    finally:
        if not channel.is_closed:
            with contextlib.suppress(Exception):
                await channel.close()
