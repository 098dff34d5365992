"""The synchronous worker: pika, with handlers in a pool of threads.

A driver of the delivery program (`rabbit_delay._consumer.delivery`): it decides
nothing about a delivery, it executes the program's steps.

Threading model. pika is not thread-safe, so one thread (the one calling `run()`)
owns the connection and executes every step but Run: claims and finishes (the ones of
a prefetched batch go to the idempotency store together, in one transaction or one
round trip), publishes, acks, nacks and rejects. Handlers (the Run steps) run on
`concurrency` pool threads; each finished one is put on a results queue and the
connection thread is woken with `connection.add_callback_threadsafe` (at most one
wake-up pending at a time). A housekeeping thread renews the leases of running
handlers (it holds no lock across a store round trip) and purges expired records.

Delivery tags are only valid on the channel that delivered them: every delivery
carries the generation of its channel, and a delivery of an older generation (the
connection was lost meanwhile) is answered STALE, never acked. The broker redelivers
that message; the idempotency guard knows whether its handler already ran. The same
holds for the deliveries of a consumer the broker cancelled (RabbitMQ 4.3 cancels a
quorum consumer over `consumer_timeout` instead of closing its channel): they are
dropped, and the queue is consumed again on the same channel.

Shutdown: consumers are cancelled, running handlers get `shutdown_timeout`; past it
the connection is closed (the broker redelivers what is unacked) and the worker still
waits for the running handlers to record their results, so the store is never closed
under one. A second SIGINT/SIGTERM (or `stop(force=True)`) stops at once: running
handlers are abandoned like a crash, and their claims run out after the lease.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from enum import Enum
from functools import partial
from queue import SimpleQueue
from typing import Any

import pika
import pika.exceptions
import pika.spec
from pika.adapters.blocking_connection import BlockingChannel

import rabbit_delay._consumer.delivery as dp
import rabbit_delay._consumer.lifecycle as lc
from rabbit_delay._broker import UNKNOWN, BrokerInfo
from rabbit_delay._consumer.acks import AckTracker
from rabbit_delay._consumer.app import Consumer, Transport
from rabbit_delay._consumer.context import clock_ms
from rabbit_delay._consumer.handlers import call_handler
from rabbit_delay._consumer.housekeeping import Sleep, on_guard
from rabbit_delay._consumer.leases import claim_with, finish_with
from rabbit_delay._errors import BrokerError, BrokerUnavailable, PublishError, RabbitDelayError
from rabbit_delay._idempotency.guard import Guard
from rabbit_delay._observe.report import ReportingWorker
from rabbit_delay._stop_signals import install_stop_signals
from rabbit_delay._sync.connection import broker_info, close_quietly, connect_first
from rabbit_delay._sync.declarer import declare as declare_topology
from rabbit_delay._sync.errors import CLIENT_ERRORS, mapped
from rabbit_delay._sync.publisher import WORKER_BLOCKED_TIMEOUT_S, Publisher
from rabbit_delay._sync.reconcile import Reconciling
from rabbit_delay._urls import redact

log = logging.getLogger("rabbit_delay.worker")

POLL_S = 0.2  # how often the connection thread looks at the stop flag when idle
# At most this many claims and finishes per store batch: a prefetch window arrives as one
# burst, and one batch for all of it would move the window in lockstep (every message
# waits for the whole batch before its handler, or its ack); smaller batches let the
# first acks go out, and the next deliveries come in, while the rest is stored.
STORE_BATCH = 64
# What ends a connection's loop: any client error (a lost connection, the consuming
# channel closed by the broker, ...) and a lost connection the map already translated.
_CONNECTION_ERRORS: tuple[type[BaseException], ...] = (*CLIENT_ERRORS, BrokerUnavailable)
# What a lifecycle step may meet, replied to the program: it decides whether that stops
# the start or fails one reconnect round (consumer/lifecycle.py).
_STEP_ERRORS: tuple[type[BaseException], ...] = (RabbitDelayError, *CLIENT_ERRORS)


class _Back(Enum):
    """What a handler thread hands back to the connection thread."""

    SETTLE = "settle"  # a settle step to execute (the program ran up to it)
    SETTLED = "settled"  # the program's end


@dataclass(slots=True, eq=False)
class _Live:
    """One delivery whose program is running."""

    gen: int  # the channel generation it came on
    consumer: Consumer
    ctag: str
    tag: int
    program: dp.Program | None  # made on a handler thread for a store that never blocks


class Worker(ReportingWorker):
    """Runs an App's consumers on pika until `stop()` (or SIGINT/SIGTERM).

    `prefetch` (default 2 x concurrency) bounds unacked deliveries per consumer;
    `concurrency` is the number of handler threads. With `declare=True` the topology
    is declared first; otherwise queues are only checked with passive declares, so
    the worker needs read permission on its queues and write permission on the tier
    and parking exchanges (for retries and parked messages), nothing more.

    Raises ConfigError at construction for a handler it cannot run (async def), an
    unknown queue or a malformed URL list; `run()` raises BrokerUnavailable (every URL
    tried, and why), MissingObjectError, AccessRefused, IncompatibleBroker or
    DeclarationConflict when it cannot start. After a successful start, lost
    connections are re-opened with backoff, over every URL (see WorkerCore).
    """

    transport = Transport.SYNC
    default_concurrency = 4

    def _prepare(self) -> None:
        self._guard: Guard | None = self.app.guard() if self.guarded else None
        self._stop = threading.Event()
        self._force = threading.Event()  # abandon running handlers (second signal)
        self._stopping = False  # set on the connection thread when the drain begins
        self._gen = 0
        self._conn: pika.BlockingConnection | None = None
        self._channel: BlockingChannel | None = None
        self._publisher: Publisher | None = None
        self._broker: BrokerInfo = UNKNOWN  # the connected broker's version rules
        self._resubscribe: list[Consumer] = []  # cancelled by the broker, to consume again
        self._tracker = AckTracker()
        self._inflight = 0  # deliveries of the current channel not yet settled
        self._running = 0  # programs away on the handler and store threads
        # (delivery, reply to send its program): a handler thread runs it onwards.
        self._jobs: SimpleQueue[tuple[_Live, object] | None] = SimpleQueue()
        self._results: deque[tuple[_Live, _Back, object]] = deque()
        # Claims and finishes for the store thread, run in batches (one transaction or
        # round trip for all that gathered while the previous batch ran).
        self._store_ops: SimpleQueue[tuple[_Live, dp.Claim | dp.Finish] | None] = SimpleQueue()
        self._inline_store = self._guard is not None and getattr(
            self._guard.store, "never_blocks", False
        )
        self._wake_pending = False
        self._threads: list[threading.Thread] = []
        self._housekeeper: threading.Thread | None = None
        self._done = threading.Event()  # stops the housekeeping thread

    # -- public ------------------------------------------------------------------------

    def stop(self, *, force: bool = False) -> None:
        """Ask the worker to stop: cancel consumers, finish in-flight handlers. With
        `force`, stop at once and abandon running handlers (their claims run out after
        the lease). Thread-safe."""
        if force:
            self._force.set()
        self._stop.set()
        self._wake()

    def stop_requested(self) -> bool:
        """True once `stop()` was called (or SIGINT/SIGTERM received)."""
        return self._stop.is_set()

    def run(self) -> None:
        """Consume until stopped. Raises BrokerUnavailable / MissingObjectError /
        DeclarationConflict / IncompatibleBroker / AccessRefused when it cannot start."""
        restore = self._install_signals()
        self.run_begins()
        reconciling: Reconciling | None = None
        lifecycle = self.lifecycle()
        try:
            self._start_threads()
            reply: object = None
            while True:
                try:
                    step = lifecycle.send(reply)
                except StopIteration:
                    break
                if reconciling is None and step is lc.SERVE:  # started: reconcile too
                    reconciling = self._start_reconciling()
                reply = self._execute(step)
        finally:
            lifecycle.close()
            self._stop.set()
            if reconciling is not None:
                reconciling.stop()
            self._close_connection()
            for _ in self._threads:
                self._jobs.put(None)
            self._store_ops.put(None)
            self._done.set()
            if self._housekeeper is not None:
                self._housekeeper.join(timeout=5)
            if not self._force.is_set():
                for t in self._threads:
                    t.join(timeout=1)
            restore()
            self.run_ends()

    def _start_reconciling(self) -> Reconciling | None:
        """The app's reconcilers on a thread of their own, each run publishing on a
        connection of its own (this one belongs to this thread)."""
        if not self.reconcilers:
            return None
        topology, urls, settings = self.app.topology, self.urls, self.settings.connection

        def connect() -> Publisher:
            return Publisher.connect(topology, urls, settings=settings)

        metrics = self.report.metrics.metrics if self.report.metrics is not None else None
        reconciling = Reconciling(self.app, self.reconcilers, self.identity, connect, metrics)
        reconciling.start()
        return reconciling

    # -- connection thread ---------------------------------------------------------------

    def _loop(self) -> None:
        conn, channel = self._conn, self._channel
        assert conn is not None
        assert channel is not None
        while not self._stop.is_set():
            self.beat()
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
            self._drain()

    def _why(self, exc: BaseException) -> str:
        """The broker's reason for a closed channel (consumer timeout, unknown delivery
        tag, ...), where pika only raised 'Channel is closed'."""
        channel = self._channel
        reason = getattr(channel, "_closing_reason", None) if channel is not None else None
        if isinstance(exc, pika.exceptions.ChannelWrongStateError) and isinstance(
            reason, pika.exceptions.ChannelClosed
        ):
            exc = reason
        return redact(repr(exc))

    def _consume(self, channel: BlockingChannel, consumer: Consumer) -> str:
        queue_name = self.app.topology.names.business_queue(consumer.queue)
        tag: str = channel.basic_consume(
            queue_name, partial(self._on_message, consumer), auto_ack=False
        )
        self.consuming(tag, consumer)
        return tag

    def _on_cancel(self, frame: Any) -> None:
        """basic.cancel from the broker (pika calls this while dispatching events)."""
        stopping = self._stopping or self._stop.is_set()
        again = self.consumer_cancelled(str(frame.method.consumer_tag), self._broker, stopping)
        if again is not None:  # consumed again from the loop, outside pika's dispatch
            self._resubscribe.append(again)

    def _consume_again(self) -> None:
        channel = self._channel
        assert channel is not None
        while self._resubscribe and not self._stopping:
            consumer = self._resubscribe.pop(0)
            tag = self._consume(channel, consumer)
            self.report.consuming_again(consumer.queue, tag)

    def _lost(self) -> None:
        self.started.clear()
        self._gen += 1  # every delivery of the old channel is now stale
        self._inflight = 0
        self._wake_pending = False
        self._close_connection()

    def _close_connection(self) -> None:
        conn, self._conn, self._channel, self._publisher = self._conn, None, None, None
        self._resubscribe = []
        close_quietly(conn)

    # -- the lifecycle program's steps (connection thread) --------------------------------

    def _execute(self, step: lc.LifecycleStep) -> object:
        """One step of the lifecycle program (consumer/lifecycle.py); its reply."""
        if step is lc.SERVE:
            return self._serve()
        if step is lc.CLOSE:
            self._close_connection()
            return None
        if step is lc.CANCEL:
            return self._cancel()
        if isinstance(step, lc.Wait):
            return self._wait(step)
        try:
            if isinstance(step, lc.Connect):
                return self._connect(step.urls)
            if isinstance(step, lc.CheckQueue):
                return _queue_exists(self._connection(), step.name)
            if step is lc.DECLARE:
                declare_topology(self._connection(), self.app.topology)
            else:
                self._consume_all()
        except _STEP_ERRORS as exc:
            return exc
        return None

    def _connection(self) -> pika.BlockingConnection:
        conn = self._conn
        assert conn is not None
        return conn

    def _connect(self, urls: tuple[str, ...]) -> lc.Connected:
        self.beat()
        conn, url = connect_first(urls, name=self.name, settings=self.settings.connection)
        self._conn, self.url, self._broker = conn, url, broker_info(conn)
        return lc.Connected(url, self._broker)

    def _consume_all(self) -> None:
        """Open the consuming channel (prefetch, a publisher for copies) and consume
        every queue; raises the error tree's classes."""
        conn = self._connection()
        with mapped(f"starting to consume {', '.join(self.queue_names())}", permission="read"):
            channel = conn.channel()
            channel.basic_qos(prefetch_count=self.prefetch)
            channel.add_on_cancel_callback(self._on_cancel)
            self._publisher = self._new_publisher(conn)
            self._channel = channel
            self._tracker = AckTracker()  # one per channel: tags never outlive their channel
            self.new_channel()
            self._resubscribe = []
            for consumer in self.consumers:
                self._consume(channel, consumer)
        self.started.set()
        self.ever_started = True

    def _new_publisher(self, conn: pika.BlockingConnection) -> Publisher:
        """The publisher of retry and park copies, on the worker's own connection."""
        return Publisher(
            self.app.topology, connection=conn, blocked_timeout=WORKER_BLOCKED_TIMEOUT_S
        ).open()

    def _serve(self) -> object:
        """Consume until asked to stop (STOPPED) or the connection is lost (Lost)."""
        try:
            self._loop()
        except _CONNECTION_ERRORS as exc:
            if not self._stop.is_set():
                why = self._why(exc)
                self._lost()
                return lc.Lost(why)
        return lc.STOPPED

    def _wait(self, step: lc.Wait) -> object:
        if step.until is lc.Until.STOP:
            return self._backoff(step.seconds)
        if step.until is lc.Until.SETTLED:
            return self._drain_all(step.seconds)
        return self._wait_running(step.seconds)

    def _backoff(self, seconds: float) -> bool:
        """Wait before the next reconnect round; True if asked to stop meanwhile."""
        deadline = time.monotonic() + seconds
        while not self._stop.is_set() and (left := deadline - time.monotonic()) > 0:
            self.beat()  # waiting is what this loop does now: it is alive
            self._stop.wait(min(left, 1.0))
        return self._stop.is_set()

    def _cancel(self) -> object:
        """Cancel the consumers: the stop begins."""
        channel = self._channel
        assert channel is not None
        self._stopping = True
        try:
            for tag in self.consumer_tags():
                channel.basic_cancel(tag)
        except _CONNECTION_ERRORS as exc:
            self._gen += 1
            return lc.Lost(self._why(exc))
        return None

    def _drain_all(self, seconds: float) -> object:
        """Let in-flight deliveries settle, up to `seconds` (or a forced stop)."""
        conn = self._connection()
        deadline = time.monotonic() + seconds
        try:
            while self._inflight > 0 and time.monotonic() < deadline:
                if self._force.is_set():
                    break
                self.beat()
                conn.process_data_events(time_limit=0.05)
                self._drain()
        except _CONNECTION_ERRORS as exc:
            self._gen += 1
            return lc.Lost(self._why(exc))
        self._gen += 1  # what settles from now on cannot be acked
        return lc.Drained(self._inflight, self._force.is_set())

    def _wait_running(self, seconds: float) -> int:
        """After the connection closed: let running handlers record their results in the
        store (done or released), so it is never closed under one; how many still run
        after `seconds`. A forced stop skips this: their claims run out after the lease."""
        deadline = time.monotonic() + seconds
        while (self._running or self._results) and not self._force.is_set():
            if time.monotonic() >= deadline:
                return self._running
            self.beat()
            time.sleep(0.05)
            self._drain()
        self._drain()
        return 0

    def _on_message(
        self,
        consumer: Consumer,
        _channel: BlockingChannel,
        method: pika.spec.Basic.Deliver,
        props: pika.spec.BasicProperties,
        body: bytes,
    ) -> None:
        self._inflight += 1
        self.report.arrived()
        tag: int = method.delivery_tag
        self._tracker.delivered(tag)
        # Its program runs on the handler threads (and its store steps on the store
        # thread) up to its first settle step: the connection thread does the I/O.
        self._running += 1
        # Even the program is made there: this thread is the worker's bottleneck.
        fresh = (consumer, props, body, bool(method.redelivered), clock_ms(), self._broker)
        self._jobs.put((_Live(self._gen, consumer, method.consumer_tag, tag, None), fresh))

    def _stale(self, live: _Live) -> bool:
        return live.gen != self._gen or live.ctag in self._cancelled

    # -- settling (connection thread) -----------------------------------------------------

    def _drain(self) -> None:
        """Execute the settle steps the handler threads handed back, then write the acks."""
        # Reset before draining: a result posted meanwhile either is drained below or
        # sees the flag down and schedules another wake-up.
        self._wake_pending = False
        results = self._results
        while results:
            live, kind, value = results.popleft()
            self._running -= 1
            if kind is _Back.SETTLED:
                self._settled(live, value)  # type: ignore[arg-type]
            else:
                self._settle(live, value)
        channel = self._channel
        if channel is not None and channel.is_open:
            for tag, multiple in self._tracker.flush():  # acks coalesced where exact
                channel.basic_ack(tag, multiple=multiple)

    def _settle(self, live: _Live, step: Any) -> None:
        """Run `live`'s program on from its first settle step, to its end: every step
        left is a settle step (publish, ack, nack, reject)."""
        program: Any = live.program
        while True:
            reply = dp.STALE if self._stale(live) else self._settle_step(live, step)
            try:
                step = program.send(reply)
            except StopIteration as stop:
                self._settled(live, stop.value)
                return

    def _settle_step(
        self, live: _Live, step: dp.Publish | dp.WriteAck | dp.WriteNack | dp.WriteReject
    ) -> Any:
        channel = self._channel
        assert channel is not None
        if isinstance(step, dp.WriteAck):
            self._tracker.acked(live.tag)  # written at the end of the drain, coalesced
            return None
        if isinstance(step, dp.Publish):
            return self._publish(step)
        if isinstance(step, dp.WriteNack):
            channel.basic_nack(live.tag, multiple=False, requeue=True)
        else:
            channel.basic_reject(live.tag, requeue=step.requeue)
        self._tracker.settled(live.tag)
        return None

    def _settled(self, live: _Live, settled: dp.Settled) -> None:
        if live.gen == self._gen:
            self._inflight -= 1
            if settled.stale:  # its consumer was cancelled: never acked on this channel
                self._tracker.settled(live.tag)
        self.report.settled(settled)

    def _publish(self, step: dp.Publish) -> object:
        """A copy, on the worker's connection; a publisher whose channel was lost is opened
        again for the next copy. The connection gone: STALE (the broker redelivers)."""
        conn = self._conn
        if conn is None:
            return dp.STALE
        try:
            if self._publisher is None:
                self._publisher = self._new_publisher(conn)
            self._publisher.publish_outgoing((step.outgoing,))
        except (PublishError, BrokerError) as exc:
            if isinstance(exc, BrokerError):  # its channel is gone: open another next time
                self._publisher = None
            return exc
        return None

    def _wake(self) -> None:
        conn = self._conn
        if conn is None:
            return
        # A closed connection refuses; the results of its channel are stale anyway.
        with contextlib.suppress(pika.exceptions.AMQPError, AttributeError):
            conn.add_callback_threadsafe(self._drain)

    # -- handler threads: the program up to its first settle step ------------------------

    def _start_threads(self) -> None:
        for i in range(self.concurrency):
            t = threading.Thread(target=self._work, name=f"rabbit-delay-handler-{i}", daemon=True)
            t.start()
            self._threads.append(t)
        if self._guard is not None and not self._inline_store:
            store = threading.Thread(
                target=self._store_work, args=(self._guard,), name="rabbit-delay-store", daemon=True
            )
            store.start()
            self._threads.append(store)
        if self._guard is not None:
            self._housekeeper = threading.Thread(
                target=self._housekeeping,
                args=(self._guard,),
                name="rabbit-delay-lease",
                daemon=True,
            )
            self._housekeeper.start()

    def _work(self) -> None:
        jobs, results = self._jobs, self._results
        while True:
            job = jobs.get()
            if job is None:
                return
            back = self._job(*job)
            if back is None:
                continue  # waiting for the store thread
            results.append(back)
            if not self._wake_pending:
                self._wake_pending = True
                self._wake()

    def _job(self, live: _Live, item: object) -> tuple[_Live, _Back, object] | None:
        """One job of a handler thread: a fresh delivery (make its program), a step
        handed over by the store thread, or a reply; then the program up to its next
        settle step (returned), store step or end."""
        kind = type(item)
        if kind is tuple:  # a fresh delivery: make its program
            fresh: Any = item
            consumer, props, body, redelivered, received_ms, broker = fresh
            delivery = dp.Delivery(
                props.message_id, props.headers, redelivered, body, props.content_type, received_ms
            )
            live.program = self.program(consumer, delivery, broker)
            item = None
        elif kind is dp.Run or kind is dp.Pause:  # a step handed over by the store thread
            item = self._execute_here(live, item)  # type: ignore[arg-type]
        return self._run_here(live, item)

    def _execute_here(self, live: _Live, step: dp.Run | dp.Pause) -> object:
        """A Run (the handler) or a Pause, on a handler thread."""
        if type(step) is dp.Pause:
            time.sleep(step.seconds)  # back-pressure: the store fails
            return None
        if self._stale(live):
            return dp.STALE  # its channel or consumer is gone: the broker redelivers it
        if self._stopping:
            return dp.STOPPING
        run: Any = step
        try:
            return call_handler(run.consumer, run.prepared, self.report.timer)
        except BaseException as exc:  # a KeyboardInterrupt-like escape: a failure
            return RuntimeError(f"handler escaped with {exc!r}")

    def _run_here(
        self, live: _Live, reply: object, *, handler_thread: bool = True
    ) -> tuple[_Live, _Back, object] | None:
        """Run `live`'s program on from `reply` up to its first settle step (returned,
        for the connection thread) or its end; a store step goes to the store thread,
        and on the store thread a Run or Pause to a handler thread (None)."""
        program: Any = live.program
        while True:
            try:
                step: dp.Step = program.send(reply)
            except StopIteration as stop:
                return live, _Back.SETTLED, stop.value
            kind = type(step)
            if kind is dp.Finish:  # always executed: the handler did run
                if not self._inline_store:
                    self._store_ops.put((live, step))  # type: ignore[arg-type]
                    return None
                reply = self._finish_now(step)  # type: ignore[arg-type]
            elif kind is dp.Run or kind is dp.Pause:
                if not handler_thread:
                    self._jobs.put((live, step))
                    return None
                reply = self._execute_here(live, step)  # type: ignore[arg-type]
            elif kind is dp.Claim:
                if self._stale(live):
                    reply = dp.STALE  # its channel or consumer is gone: redelivered
                elif self._stopping:
                    reply = dp.STOPPING
                elif self._inline_store:
                    reply = self._claim_now(step)  # type: ignore[arg-type]
                else:
                    self._store_ops.put((live, step))  # type: ignore[arg-type]
                    return None
            else:
                return live, _Back.SETTLE, step

    def _claim_now(self, step: dp.Claim) -> object:
        """A store that never blocks (memory): claimed on the handler thread at once."""
        assert self._guard is not None
        return claim_with(self._guard, self.leases, step.key, step.owner, self.clock(), step.ref)

    def _finish_now(self, step: dp.Finish) -> object:
        assert self._guard is not None
        return finish_with(
            self._guard, self.leases, step.key, step.owner, step.succeeded, self.report, step.update
        )

    # -- the store thread ------------------------------------------------------------------

    def _store_work(self, guard: Guard) -> None:
        """Claims and finishes in batches: all that gathered while the previous batch ran
        go to the store together (one transaction, one round trip; sqlite3 and the
        network release the GIL meanwhile). Each program then goes on on a handler thread."""
        ops = self._store_ops
        while True:
            first = ops.get()
            if first is None:
                return
            batch = [first]
            while len(batch) < STORE_BATCH and not ops.empty():
                more = ops.get_nowait()
                if more is None:
                    ops.put(None)  # stop after this batch
                    break
                batch.append(more)
            finishes = [(live, op) for live, op in batch if type(op) is dp.Finish]
            claims = [(live, op) for live, op in batch if type(op) is dp.Claim]
            self.leases.finishing_many([(op.key, op.owner) for _, op in finishes], self.report)
            pairs = [(op.key, op.owner) for _, op in claims]
            finished, claimed = guard.batch(
                [(op.key, op.owner, op.succeeded, op.update) for _, op in finishes],
                [(op.key, op.owner, op.ref) for _, op in claims],
            )
            self.leases.claimed_many(pairs, claimed, self.clock())
            # Each program goes on here up to its next Run (for a handler thread) or its
            # first settle step (for the connection thread, woken once per batch).
            back = []
            for (live, _), finish in zip(finishes, finished, strict=True):
                back.append(self._run_here(live, finish, handler_thread=False))
            for (live, _), claim in zip(claims, claimed, strict=True):
                back.append(self._run_here(live, claim, handler_thread=False))
            settle = [b for b in back if b is not None]
            if settle:
                self._results.extend(settle)
                if not self._wake_pending:
                    self._wake_pending = True
                    self._wake()

    def _housekeeping(self, guard: Guard) -> None:
        """The housekeeping program (consumer/housekeeping.py) on a thread of its own."""
        program = self.housekeeping(purges=guard.store.needs_purge)
        with contextlib.suppress(StopIteration):
            step = next(program)
            while True:
                if isinstance(step, Sleep):
                    step = program.send(self._done.wait(step.seconds))
                else:
                    step = program.send(on_guard(guard, step))

    # -- signals -----------------------------------------------------------------------------

    def _install_signals(self) -> Any:
        if not self.settings.install_signal_handlers:
            return lambda: None

        def on_signal(name: str) -> None:
            # Only set flags here: the loop polls them (pika is not reentrant).
            if self.on_signal(name, self._stop.is_set()):
                self._force.set()
            self._stop.set()

        return install_stop_signals(on_signal)


def _queue_exists(conn: pika.BlockingConnection, queue_name: str) -> bool:
    """Passive declare on a throwaway channel: needs no configure permission."""
    with mapped(f"checking queue {queue_name!r}", permission="read"):
        channel = conn.channel()
        try:
            channel.queue_declare(queue_name, passive=True)
        except pika.exceptions.ChannelClosedByBroker as exc:
            if exc.reply_code != 404:
                raise
            return False
        _quietly(channel.close)
    return True


def _quietly(close: Any) -> None:
    with contextlib.suppress(*CLIENT_ERRORS):
        close()
