"""The synchronous worker: pika, with handlers in a pool of threads.

Threading model. pika is not thread-safe, so one thread (the one calling `run()`)
owns the connection: it receives deliveries, acks, and publishes retries and parked
messages. Handlers run on `concurrency` pool threads; each finished delivery is put
on a results queue and the connection thread is woken with
`connection.add_callback_threadsafe` (at most one wake-up pending at a time), where
the action decided by the core (`rabbit_delay.consumer.decide`) is executed.

Delivery tags are only valid on the channel that delivered them: every delivery
carries the generation of its channel, and a result from an older generation (the
connection was lost meanwhile) is dropped, never acked. The broker redelivers that
message; the idempotency guard knows whether its handler already ran. The same holds
for the deliveries of a consumer the broker cancelled (RabbitMQ 4.3 cancels a quorum
consumer over `consumer_timeout` instead of closing its channel): their results are
dropped, and the queue is consumed again on the same channel.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections import deque
from functools import partial
from queue import SimpleQueue
from types import FrameType
from typing import Any, Unpack

import pika
import pika.exceptions
import pika.spec
from pika.adapters.blocking_connection import BlockingChannel

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
from rabbit_delay.consumer._stats import (
    WorkerMetrics,
    log_action,
    log_connection_lost,
)
from rabbit_delay.consumer._worker_base import WorkerBase, WorkerSettings
from rabbit_delay.errors import (
    BrokerError,
    BrokerUnavailable,
    MissingObjectError,
    PublishError,
    RabbitDelayError,
)
from rabbit_delay.idempotency import ClaimResult, Guard
from rabbit_delay.sync._connection import broker_info, connect
from rabbit_delay.sync.declarer import declare as declare_topology
from rabbit_delay.sync.publisher import Publisher
from rabbit_delay.urls import redact

log = logging.getLogger("rabbit_delay.worker")

POLL_S = 0.2  # how often the connection thread looks at the stop flag when idle
STORE_PAUSE_S = 1.0  # back-pressure when the idempotency store fails
PURGE_EVERY_S = 600.0
_CONNECTION_ERRORS = (
    pika.exceptions.AMQPConnectionError,
    pika.exceptions.ConnectionClosed,
    pika.exceptions.ChannelClosed,  # the consuming channel closed by the broker
    pika.exceptions.ChannelWrongStateError,
    pika.exceptions.StreamLostError,
    BrokerUnavailable,
    OSError,
)

# (generation, consumer, consumer tag, delivery tag, redelivered, properties, body)
_Job = tuple[int, Consumer, str, int, bool, pika.spec.BasicProperties, bytes]
# (generation, consumer, consumer tag, delivery tag, message_id, attempt,
#  action or None = not started)
_Result = tuple[int, Consumer, str, int, str | None, int, Action | None]


class Worker(WorkerBase):
    """Runs an App's consumers on pika until `stop()` (or SIGINT/SIGTERM).

    `prefetch` (default 2 x concurrency) bounds unacked deliveries per consumer;
    `concurrency` is the number of handler threads. With `declare=True` the topology
    is declared first; otherwise queues are only checked with passive declares, so
    the worker needs read permission on its queues and write permission on the tier
    and parking exchanges (for retries and parked messages), nothing more.

    Raises ConfigError at construction for a handler it cannot run (async def) or an
    unknown queue; `run()` raises BrokerUnavailable / MissingObjectError when it cannot
    start. After a successful start, lost connections are re-opened with backoff.
    """

    transport = Transport.SYNC
    default_concurrency = 4

    def __init__(
        self, app: App, url: str | None = None, **settings: Unpack[WorkerSettings]
    ) -> None:
        super().__init__(app, url, **settings)
        self._guard: Guard | None = (
            app.guard() if any(c.idempotent for c in self.consumers) else None
        )
        self._stop = threading.Event()
        self._stopping = False  # set on the connection thread when the drain begins
        self._gen = 0
        self._conn: pika.BlockingConnection | None = None
        self._channel: BlockingChannel | None = None
        self._publisher: Publisher | None = None
        self._broker: BrokerInfo = UNKNOWN  # the connected broker's version rules
        self._resubscribe: list[Consumer] = []  # cancelled by the broker, to consume again
        self._tracker = AckTracker()
        self._inflight = 0  # deliveries of the current channel not yet settled
        self._jobs: SimpleQueue[_Job | None] = SimpleQueue()
        self._results: deque[_Result] = deque()
        self._wake_pending = False
        self._seq = iter(range(1, 1 << 62))
        self._claims: dict[str, str] = {}  # owner -> key, for lease renewal
        self._claims_lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    # -- public ------------------------------------------------------------------------

    def stop(self) -> None:
        """Ask the worker to stop: cancel consumers, finish in-flight handlers. Thread-safe."""
        self._stop.set()
        self._wake()

    def run(self) -> None:
        """Consume until stopped. Raises BrokerUnavailable / MissingObjectError /
        DeclarationConflict when it cannot start."""
        restore = self._install_signals()
        try:
            self._start_threads()
            self._open()
            log.info(
                "worker %s consuming %s on %s (prefetch %d, concurrency %d)",
                self.identity,
                ", ".join(c.queue for c in self.consumers),
                redact(self.url),
                self.prefetch,
                self.concurrency,
            )
            while not self._stop.is_set():
                try:
                    self._loop()
                except _CONNECTION_ERRORS as exc:
                    if self._stop.is_set():
                        break
                    log_connection_lost(redact(repr(exc)), self._queue_names())
                    self._lost()
                    self._reconnect()
            if self._conn is not None:
                self._shutdown()
        finally:
            self._stop.set()
            self._close_connection()
            for _ in self._threads:
                self._jobs.put(None)
            restore()
            log.info("worker %s stopped: %s", self.identity, self.stats.as_dict())

    # -- connection thread ---------------------------------------------------------------

    def _loop(self) -> None:
        conn, channel = self._conn, self._channel
        assert conn is not None
        assert channel is not None
        while not self._stop.is_set():
            conn.process_data_events(time_limit=POLL_S)
            if channel.is_closed:
                # pika does not raise for a channel the broker closed (before 4.3: 406 on
                # consumer_timeout); its reason tells why.
                reason = getattr(channel, "_closing_reason", None)
                if isinstance(reason, pika.exceptions.ChannelClosed):
                    raise reason
                raise pika.exceptions.ChannelWrongStateError("the consuming channel closed")
            if self._resubscribe:
                self._consume_again()
            if self._results:
                self._drain()

    def _queue_names(self) -> list[str]:
        names = self.app.topology.names
        return [names.business_queue(c.queue) for c in self.consumers]

    def _open(self) -> None:
        conn = connect(self.url, name=self.name)
        try:
            broker = broker_info(conn)
            self.check_broker(broker)
            if self.declare:
                declare_topology(conn, self.app.topology)
            queue_names = self._queue_names()
            for queue_name in queue_names:
                _check_queue(conn, queue_name)
            channel = conn.channel()
            channel.basic_qos(prefetch_count=self.prefetch)
            channel.add_on_cancel_callback(self._on_cancel)
            self._publisher = Publisher(self.app.topology, connection=conn)
            self._conn, self._channel, self._broker = conn, channel, broker
            self._tracker = AckTracker()  # one per channel: tags never outlive their channel
            self._new_channel()
            self._resubscribe = []
            for consumer in self.consumers:
                self._consume(channel, consumer)
        except BaseException:
            self._conn = self._channel = self._publisher = None
            if conn.is_open:
                _quietly(conn.close)
            raise
        self.started.set()

    def _consume(self, channel: BlockingChannel, consumer: Consumer) -> str:
        queue_name = self.app.topology.names.business_queue(consumer.queue)
        tag: str = channel.basic_consume(
            queue_name, partial(self._on_message, consumer), auto_ack=False
        )
        self._by_tag[tag] = consumer
        return tag

    def _on_cancel(self, frame: Any) -> None:
        """basic.cancel from the broker (pika calls this while dispatching events)."""
        stopping = self._stopping or self._stop.is_set()
        again = self._consumer_cancelled(str(frame.method.consumer_tag), self._broker, stopping)
        if again is not None:  # consumed again from the loop, outside pika's dispatch
            self._resubscribe.append(again)

    def _consume_again(self) -> None:
        channel = self._channel
        assert channel is not None
        while self._resubscribe and not self._stopping:
            consumer = self._resubscribe.pop(0)
            tag = self._consume(channel, consumer)
            log.info("%s: consuming again (consumer tag %s)", consumer.queue, tag)

    def _lost(self) -> None:
        self.stats.reconnects += 1
        self.started.clear()
        self._gen += 1  # every delivery of the old channel is now stale
        self._inflight = 0
        self._wake_pending = False
        self._close_connection()

    def _reconnect(self) -> None:
        delay = 0.25
        while not self._stop.is_set():
            try:
                self._open()
            except (RabbitDelayError, *_CONNECTION_ERRORS) as exc:
                log.warning("reconnect failed (%s); next try in %.1fs", redact(str(exc)), delay)
                self._stop.wait(delay)
                delay = min(delay * 2, self.reconnect_max_s)
            else:
                log.info("reconnected to %s", redact(self.url))
                return

    def _close_connection(self) -> None:
        conn, self._conn, self._channel, self._publisher = self._conn, None, None, None
        self._resubscribe = []
        if conn is not None and conn.is_open:
            _quietly(conn.close)

    def _shutdown(self) -> None:
        """Cancel consumers, let in-flight handlers finish (up to the timeout), close."""
        conn, channel = self._conn, self._channel
        assert conn is not None
        assert channel is not None
        self._stopping = True
        try:
            for tag in list(self._by_tag):
                channel.basic_cancel(tag)
            deadline = time.monotonic() + self.shutdown_timeout
            while self._inflight > 0 and time.monotonic() < deadline:
                conn.process_data_events(time_limit=0.05)
                if self._results:
                    self._drain()
        except _CONNECTION_ERRORS as exc:
            log.warning("connection lost during shutdown (%s)", redact(repr(exc)))
            return
        if self._inflight:
            log.warning(
                "shutdown timeout (%.0fs): %d message(s) still being handled; the broker "
                "will redeliver them",
                self.shutdown_timeout,
                self._inflight,
            )
        self._close_connection()

    def _on_message(
        self,
        consumer: Consumer,
        _channel: BlockingChannel,
        method: pika.spec.Basic.Deliver,
        props: pika.spec.BasicProperties,
        body: bytes,
    ) -> None:
        self._inflight += 1
        self.stats.received += 1
        tag: int = method.delivery_tag
        self._tracker.delivered(tag)
        redelivered = bool(method.redelivered)
        ctag = str(method.consumer_tag)
        self._jobs.put((self._gen, consumer, ctag, tag, redelivered, props, body))

    def _wake(self) -> None:
        conn = self._conn
        if conn is None:
            return
        # A closed connection refuses; the results of its channel are stale anyway.
        with contextlib.suppress(pika.exceptions.AMQPError, AttributeError):
            conn.add_callback_threadsafe(self._drain)

    def _drain(self) -> None:
        # Reset before draining: a result posted meanwhile either is drained below or
        # sees the flag down and schedules another wake-up.
        self._wake_pending = False
        results = self._results
        while results:
            gen, consumer, ctag, tag, message_id, attempt, action = results.popleft()
            if gen != self._gen:
                self.stats.stale += 1
                continue
            self._inflight -= 1
            if ctag in self._cancelled:
                # The broker cancelled its consumer and took the message back: it is
                # redelivered to the new consumer; a copy or an ack now would be one too many.
                self.stats.stale += 1
                self._tracker.settled(tag)
                continue
            self._execute(consumer, tag, message_id, attempt, action)
        channel = self._channel
        if channel is not None:
            for tag, multiple in self._tracker.flush():  # acks coalesced where exact
                channel.basic_ack(tag, multiple=multiple)

    def _execute(
        self,
        consumer: Consumer,
        tag: int,
        message_id: str | None,
        attempt: int,
        action: Action | None,
    ) -> None:
        channel, tracker = self._channel, self._tracker
        assert channel is not None
        if action is None:  # not started before the shutdown: hand it back now
            self._nack(tag)
            return
        log_action(consumer.queue, message_id, attempt, action)
        self.stats.record(action)
        if self.metrics is not None:
            self.metrics.handled(consumer.queue, action)
        if isinstance(action, Ack | Skip):
            tracker.acked(tag)  # written at the end of the drain, coalesced (AckTracker)
        elif isinstance(action, Republish | Park):
            if self._publish(action):
                tracker.acked(tag)  # only once the new copy is confirmed
            elif isinstance(action, Republish) and action.requeue_if_unsent:
                self._nack(tag)
            else:
                # The broker dead-letters it into the parking exchange (reason rejected):
                # visible, and no hot loop of redeliveries.
                channel.basic_reject(tag, requeue=False)
                tracker.settled(tag)
        elif isinstance(action, BrokerRetry):
            # Counted towards the delivery limit and held back by the queue (4.3+ delayed
            # retry); the count is the next attempt's number.
            channel.basic_reject(tag, requeue=True)
            tracker.settled(tag)
        else:  # Requeue: the idempotency store failed (4.3+), or an unexpected error
            self._nack(tag)

    def _nack(self, tag: int) -> None:
        """Hand one delivery back (not started, or the store failed): nack, not reject,
        so from RabbitMQ 4.3 it does not count towards a quorum queue's delivery limit."""
        assert self._channel is not None
        self._channel.basic_nack(tag, multiple=False, requeue=True)
        self._tracker.settled(tag)
        self.stats.requeued += 1

    def _publish(self, action: Republish | Park) -> bool:
        try:
            if self._publisher is None:
                assert self._conn is not None
                self._publisher = Publisher(self.app.topology, connection=self._conn)
            self._publisher.publish_outgoing((action.outgoing,))
        except (PublishError, BrokerError) as exc:
            self.stats.publish_failures += 1
            if isinstance(exc, BrokerError):  # its channel is gone: open another next time
                self._publisher = None
            log.error(
                "could not publish %s of %s to %s: %s",
                type(action).__name__.lower(),
                action.outgoing.message_id,
                action.outgoing.exchange,
                exc,
            )
            return False
        return True

    # -- handler threads -------------------------------------------------------------------

    def _start_threads(self) -> None:
        for i in range(self.concurrency):
            t = threading.Thread(target=self._work, name=f"rabbit-delay-handler-{i}", daemon=True)
            t.start()
            self._threads.append(t)
        if self._guard is not None:
            t = threading.Thread(target=self._housekeeping, name="rabbit-delay-lease", daemon=True)
            t.start()

    def _work(self) -> None:
        jobs, results = self._jobs, self._results
        while True:
            job = jobs.get()
            if job is None:
                return
            gen, consumer, ctag, tag, redelivered, props, body = job
            if gen != self._gen:
                continue  # its channel is gone: the broker redelivers it
            action: Action | None = None
            message_id = props.message_id
            attempt = 0
            if not self._stopping and ctag not in self._cancelled:
                try:
                    action, attempt = self._handle(consumer, redelivered, props, body)
                except BaseException as exc:  # never leave a delivery unsettled
                    log.exception("%s: unexpected worker error", consumer.queue)
                    action = Requeue(repr(exc))
            results.append((gen, consumer, ctag, tag, message_id, attempt, action))
            if not self._wake_pending:
                self._wake_pending = True
                self._wake()

    def _handle(
        self,
        consumer: Consumer,
        redelivered: bool,
        props: pika.spec.BasicProperties,
        body: bytes,
    ) -> tuple[Action, int]:
        prepared = consumer.prepare(
            props.message_id, props.headers, redelivered, body, props.content_type, now_ms()
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
            outcome = _call(consumer, prepared, self.metrics)
            return consumer.finish(prepared, outcome, now_ms(), self._broker), attempt
        owner = f"{self.identity}:{next(self._seq)}"
        try:
            claim = guard.claim(key, owner)
        except Exception as exc:
            log.error("%s: idempotency store failed on claim: %r", consumer.queue, exc)
            time.sleep(STORE_PAUSE_S)
            return consumer.finish(prepared, Unavailable(exc), now_ms(), self._broker), attempt
        if claim is not ClaimResult.CLAIMED:
            return consumer.finish(prepared, claim, now_ms(), self._broker), attempt
        claims, lock = self._claims, self._claims_lock
        with lock:
            claims[owner] = key
        outcome = _call(consumer, prepared, self.metrics)
        with lock:  # after this, the lease renewer no longer touches this claim
            del claims[owner]
        try:
            if outcome is None:
                guard.done(key, owner)
            else:
                guard.failed(key, owner)
        except Exception as exc:
            # The handler's outcome stands; a duplicate may run again after the lease.
            log.error("%s: idempotency store failed after the handler: %r", consumer.queue, exc)
        return consumer.finish(prepared, outcome, now_ms(), self._broker), attempt

    def _housekeeping(self) -> None:
        """Renew the leases of running handlers; purge expired records now and then."""
        guard = self._guard
        assert guard is not None
        every = max(guard.lease_ms / 3000, 0.05)
        next_purge = time.monotonic() + PURGE_EVERY_S
        while not self._stop.wait(every):
            with self._claims_lock:
                held = list(self._claims.items())
                for owner, key in held:
                    try:
                        guard.store.claim(key, owner, now_ms=guard.clock(), lease_ms=guard.lease_ms)
                    except Exception as exc:
                        log.warning("lease renewal failed: %r", exc)
            if guard.store.needs_purge and time.monotonic() >= next_purge:
                next_purge = time.monotonic() + PURGE_EVERY_S
                try:
                    guard.purge()
                except Exception as exc:
                    log.warning("idempotency purge failed: %r", exc)

    # -- signals -----------------------------------------------------------------------------

    def _install_signals(self) -> Any:
        in_main = threading.current_thread() is threading.main_thread()
        if not self.install_signal_handlers or not in_main:
            return lambda: None
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

        def on_signal(signum: int, _frame: FrameType | None) -> None:
            # Only set the flag here: the loop polls it (pika is not reentrant).
            log.info(
                "signal %s: stopping (in-flight handlers get %.0fs)",
                signal.Signals(signum).name,
                self.shutdown_timeout,
            )
            self._stop.set()

        for sig in previous:
            signal.signal(sig, on_signal)

        def restore() -> None:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

        return restore


def _call(consumer: Consumer, prepared: Prepared, metrics: WorkerMetrics | None) -> Outcome:
    start = time.perf_counter() if metrics is not None else 0.0
    try:
        if consumer.takes_context:
            consumer.handler(prepared.message, prepared.ctx)
        else:
            consumer.handler(prepared.message)
    except Exception as exc:
        return exc
    finally:
        if metrics is not None:
            metrics.handler_time(consumer.queue, time.perf_counter() - start)
    return None


def _check_queue(conn: pika.BlockingConnection, queue_name: str) -> None:
    """Passive declare on a throwaway channel: needs no configure permission."""
    channel = conn.channel()
    try:
        channel.queue_declare(queue_name, passive=True)
    except pika.exceptions.ChannelClosedByBroker as exc:
        if exc.reply_code == 404:
            raise MissingObjectError(
                f"queue {queue_name!r} does not exist on the broker: declare the topology "
                "(`rabbit-delay declare`), or start the worker with --declare"
            ) from None
        raise BrokerError(
            f"cannot use queue {queue_name!r}: {exc.reply_code} {exc.reply_text}"
        ) from None
    _quietly(channel.close)


def _quietly(close: Any) -> None:
    with contextlib.suppress(pika.exceptions.AMQPError, OSError):
        close()
