"""Synchronous publisher on pika: confirmed, persistent, mandatory; recovers from a lost
connection and notices a blocked broker.

Confirms are tracked by delivery tag on the channel's underlying (non-blocking) pika
channel, so a call keeps a window of publishes in flight instead of paying one round
trip per message, which is all BlockingChannel.basic_publish can do.

What a call knows (the ledger of confirms), when to give up and what to raise are decided
in the core (`rabbit_delay._publishing.confirms`, `_publishing.core.PublisherCore`), the same
for the aio-pika publisher; this module sends, waits and reconnects as told.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from types import TracebackType
from typing import Any, Self, Unpack

import pika
import pika.exceptions
import pika.frame
import pika.spec
from pika.adapters.blocking_connection import BlockingChannel

from rabbit_delay._connection import ConnectionSettings, failover_order
from rabbit_delay._envelope import Outgoing
from rabbit_delay._errors import BrokerBlocked, RabbitDelayError, StoreError
from rabbit_delay._idempotency.guard import run
from rabbit_delay._observe import tracing
from rabbit_delay._publishing.confirms import (
    BlockedState,
    Ledger,
    Recovery,
    log_recovered,
    recoverable,
    recovery_failed,
)
from rabbit_delay._publishing.core import (
    BLOCKED_BACKSTOP_S,
    WORKER_BLOCKED_TIMEOUT_S,
    PublisherCore,
    PublisherOptions,
    URLs,
)
from rabbit_delay._schedule_api.sync import Schedule
from rabbit_delay._stores.factory import store_from_config
from rabbit_delay._sync.connection import close_quietly, connect_first
from rabbit_delay._sync.errors import CLIENT_ERRORS, mapped
from rabbit_delay._topology.model import Topology
from rabbit_delay._urls import redact

PERSISTENT = 2

# One blocked state per connection, shared by every publisher on it (a worker makes a
# new publisher after a failed publish): one warning per block, not one per publisher.
_BLOCKED: weakref.WeakKeyDictionary[pika.BlockingConnection, BlockedState] = (
    weakref.WeakKeyDictionary()
)


def blocked_state(connection: pika.BlockingConnection) -> BlockedState:
    """The connection.blocked / unblocked state of `connection`, registered once."""
    state = _BLOCKED.get(connection)
    if state is None:
        params = connection._impl.params
        state = BlockedState(f"{params.host}:{params.port}")

        def on_blocked(_c: object, frame: pika.frame.Method[Any]) -> None:
            state.block(str(getattr(frame.method, "reason", "") or ""), time.monotonic())

        def on_unblocked(_c: object, _f: object) -> None:
            state.unblock(time.monotonic())

        # On the impl: its callbacks run inside the I/O loop, also while a publish waits
        # (BlockingConnection's own ones are dispatched only by process_data_events).
        connection._impl.add_on_connection_blocked_callback(on_blocked)
        connection._impl.add_on_connection_unblocked_callback(on_unblocked)
        _BLOCKED[connection] = state
    return state


class Publisher(PublisherCore[str, list[str]]):
    """`publish_delayed` on a blocking pika connection (the same API as AsyncPublisher).

    `Publisher.connect(topology, url)` returns an open publisher owning its connection;
    `Publisher(topology, url)` does no I/O until `open()`, `with` or the first publish;
    `Publisher(topology, connection=conn)` publishes on your connection (never closed
    nor reconnected by the publisher). Options: see `PublisherOptions` and
    docs/publishing.md. Not thread-safe (neither is pika).
    """

    def __init__(
        self,
        topology: Topology,
        url: URLs | None = None,
        *,
        connection: pika.BlockingConnection | None = None,
        **options: Unpack[PublisherOptions],
    ) -> None:
        super().__init__(
            topology,
            url,
            borrowed=connection is not None,
            tracer=tracing.active,
            book=self._open_book,
            **options,
        )
        self._own_store: Any = None  # the [idempotency] store opened for the schedule
        self._schedule: Schedule | None = None
        self._recorder: ThreadPoolExecutor | None = None  # writes records beside the sends
        self.connection = connection
        self._channel: BlockingChannel | None = None
        self._impl: Any = None  # the non-blocking channel underneath: see module docstring
        self._next_tag = 1
        self._ledger: Ledger | None = None  # the call in progress: pika callbacks fill it
        self._blocked = BlockedState()

    @classmethod
    def connect(
        cls,
        topology: Topology,
        url: URLs | None = None,
        **options: Unpack[PublisherOptions],
    ) -> Self:
        """An open publisher on a connection of its own (the first URL that answers).
        Raises BrokerUnavailable, or ConfigError for bad options."""
        return cls(topology, url, **options).open()

    # -- lifecycle -----------------------------------------------------------------------

    @property
    def is_open(self) -> bool:
        connection, channel = self.connection, self._channel
        return (
            connection is not None
            and connection.is_open
            and channel is not None
            and channel.is_open
        )

    def open(self) -> Self:
        """Connect (own connection) and open a confirm-mode channel; idempotent.
        Raises BrokerUnavailable, ConnectionLost (a borrowed connection that is closed),
        AccessRefused."""
        if not self.is_open:
            with mapped("opening a publisher channel"):
                connection = self.connection
                if self.owns_connection and (connection is None or not connection.is_open):
                    self._connect(self.url)
                self._open_channel()
        return self

    def _open_book(self) -> Any:
        store = store_from_config(self.topology.idempotency)
        self._own_store = store
        return store.schedule  # type: ignore[attr-defined]

    @property
    def schedule(self) -> Schedule:
        """The topology's schedule, through this publisher: look up, list, cancel and
        reschedule messages by key (a topology with [schedule]; docs/schedule.md)."""
        if self._schedule is None:
            self._schedule = Schedule(self.topology, publisher=self)
        return self._schedule

    def close(self) -> None:
        """Close the channel, and the connection if the publisher owns it (and the store
        it opened for the schedule). Idempotent; a connection the broker already dropped
        needs nothing."""
        store, self._own_store, self._book = self._own_store, None, None
        recorder, self._recorder = self._recorder, None
        if recorder is not None:
            recorder.shutdown(wait=True)
        if store is not None:
            with contextlib.suppress(Exception):
                store.close()
        channel, self._channel, self._impl = self._channel, None, None
        if channel is not None and channel.is_open:
            with contextlib.suppress(*CLIENT_ERRORS):  # its connection is gone: so is it
                channel.close()
        if self.owns_connection:
            close_quietly(self.connection)

    def __enter__(self) -> Self:
        return self.open()

    def __exit__(
        self, _t: type[BaseException] | None, _e: BaseException | None, _tb: TracebackType | None
    ) -> None:
        self.close()

    def _connection_settings(self) -> ConnectionSettings:
        # pika closes a connection blocked longer than its blocked_connection_timeout: a
        # backstop behind our own wait, which keeps the connection (see docs/publishing.md)
        settings = self.settings or ConnectionSettings()
        return replace(settings, blocked_timeout_s=self.blocked_timeout_s + BLOCKED_BACKSTOP_S)

    def _connect(self, url: URLs | None) -> None:
        close_quietly(self.connection)
        self._channel = self._impl = None
        self.connection, self._url_in_use = connect_first(
            url, name="rabbit-delay publisher", settings=self._connection_settings()
        )

    def _open_channel(self) -> None:
        """A fresh confirm-mode channel; also after the broker closed the last one (a 404
        on a missing exchange), whose unconfirmed publishes were already reported."""
        assert self.connection is not None
        channel = self.connection.channel()
        impl = channel._impl
        selected: list[bool] = []
        impl.confirm_delivery(
            ack_nack_callback=lambda frame: self._on_confirm(impl, frame),
            callback=lambda _f: selected.append(True),
        )
        impl.add_on_return_callback(lambda *args: self._on_return(impl, *args))
        self._channel, self._impl, self._next_tag = channel, impl, 1
        channel._flush_output(lambda: bool(selected))
        self._blocked = blocked_state(self.connection)

    # -- pika callbacks (run inside the I/O loop) ----------------------------------------

    def _on_confirm(self, impl: object, frame: pika.frame.Method[Any]) -> None:
        ledger = self._ledger
        if ledger is None or impl is not self._impl:
            return  # a late confirm of a call that already ended, or of an old channel
        method = frame.method
        nack = isinstance(method, pika.spec.Basic.Nack)
        ledger.ack(method.delivery_tag, multiple=bool(method.multiple), nack=nack)

    def _on_return(
        self,
        impl: object,
        _ch: object,
        method: pika.spec.Basic.Return,
        props: pika.spec.BasicProperties,
        _body: bytes,
    ) -> None:
        # basic.return precedes the ack of the same message
        ledger = self._ledger
        if ledger is not None and impl is self._impl:
            ledger.returned(props.message_id or "", f"{method.reply_code} {method.reply_text}")

    # -- publishing ----------------------------------------------------------------------

    def _send(self, out: Outgoing) -> int:
        """Put one message on the wire; its delivery tag."""
        props = pika.BasicProperties(
            content_type=out.content_type,
            delivery_mode=PERSISTENT,
            message_id=out.message_id,
            headers=out.headers,
            timestamp=out.timestamp,
        )
        self._impl.basic_publish(out.exchange, out.routing_key, out.body, props, out.mandatory)
        tag = self._next_tag
        self._next_tag += 1
        return tag

    def publish_outgoing(self, messages: Iterable[Outgoing]) -> list[str]:
        """Send messages already built (a retry, a replay, a relayed outbox row), wait for
        every confirm, recover a lost connection; their message ids, in order. Messages
        marked for the schedule (`key`) are recorded first (StoreError when that fails,
        before any is sent); one the schedule keeps is not sent, and its id is the kept
        message's.

        Raises UnroutableError (returned under `mandatory`), NackError, or
        UnconfirmedError / BrokerBlocked past the recovery or blocked deadline, each naming
        the message ids concerned; on a connection you passed in, a lost connection
        raises at once."""
        outs = list(messages)
        chunks = self.record_chunks(outs) if any(o.key is not None for o in outs) else []
        if len(chunks) < 2:
            send, ids = self._recorded(outs)
            if send:
                _ledger, failure = self._tracked(send)
                if failure is not None:
                    raise failure
            return ids
        return self._publish_chunks(chunks)

    def _publish_chunks(self, chunks: list[list[Outgoing]]) -> list[str]:
        """Record chunk i + 1 (on the recorder thread) while chunk i is sent."""
        if self._recorder is None:
            self._recorder = ThreadPoolExecutor(1, thread_name_prefix="rabbit-delay-record")
        ids: list[str] = []
        pending = self._recorder.submit(run, self.recording(chunks[0]))
        for i in range(len(chunks)):
            try:
                send, got = pending.result()
            except StoreError as exc:
                raise self.sent_before(exc, ids) from exc.__cause__
            later = i + 1 < len(chunks)
            if later:
                pending = self._recorder.submit(run, self.recording(chunks[i + 1]))
            if send:
                _ledger, failure = self._tracked(send)
                if failure is not None:
                    if later:
                        with contextlib.suppress(Exception):  # no write after the call ends
                            pending.result()
                    unsent = [o.message_id for chunk in chunks[i + 1 :] for o in chunk]
                    raise self.unsent_too(failure, unsent)
            ids.extend(got)
        return ids

    def _recorded(self, messages: Iterable[Outgoing]) -> tuple[list[Outgoing], list[str]]:
        """The keyed messages recorded in the schedule first (`PublisherCore.recording`):
        what to send, and the ids to return."""
        outs = list(messages)
        if all(o.key is None for o in outs):
            return outs, [o.message_id for o in outs]
        return run(self.recording(outs))

    def publish_tracked(
        self, messages: Iterable[Outgoing]
    ) -> tuple[Ledger, RabbitDelayError | None]:
        """Publish like `publish_outgoing` (same window, recovery and deadline), but
        return each message's outcome instead of raising: the call's ledger
        (`ledger.states[i]` of `ledger.outs[i]`: CONFIRMED, RETURNED, NACKED, or
        UNSENT / SENT when the call ended early) and the error publish_outgoing would
        have raised, or None when every message was confirmed. For a caller that
        settles each message on its own, such as the outbox relay. Keyed messages are
        recorded in the schedule first (raises StoreError when that fails, before any
        is sent); one kept by the schedule is left out of the ledger."""
        send, _ids = self._recorded(messages)
        return self._tracked(send)

    def _tracked(self, messages: Iterable[Outgoing]) -> tuple[Ledger, RabbitDelayError | None]:
        ledger = self.ledger(messages)
        error: RabbitDelayError | None = None
        try:
            self._publish(ledger)
        except RabbitDelayError as exc:
            error = exc
        return ledger, self.settle(ledger, error)

    def _publish(self, ledger: Ledger) -> None:
        """Send every message of `ledger` until each has its outcome; on a lost
        connection (own connection), reconnect and re-send the unconfirmed ones."""
        recovery: Recovery | None = None
        while True:
            try:
                self.open()
                with mapped("publishing", permission="write"):
                    self._run(ledger)
                return
            except BrokerBlocked:
                # pika's own timeout closed the connection: name what the broker said
                if self._blocked.blocked:
                    raise self._blocked.error(self.blocked_timeout_s) from None
                raise
            except RabbitDelayError as exc:
                recovery = self.after_loss(ledger, recovery, exc)
                self._reconnect(recovery, exc)

    def _reconnect(self, recovery: Recovery, error: RabbitDelayError) -> None:
        """Connect again (the next URL first) with backoff, until the deadline: then
        raise ConnectionLost (the call names its unconfirmed ids)."""
        lost_url = self._url_in_use
        close_quietly(self.connection)
        self._channel = self._impl = None
        urls = (self.settings or ConnectionSettings()).resolve(self.url)
        while True:
            delay = recovery.next_delay(time.monotonic())
            if delay is None:
                raise recovery_failed(recovery, error)
            time.sleep(delay)
            try:
                with mapped("reconnecting the publisher"):
                    self._connect(failover_order(urls, lost_url))
                    self._open_channel()
            except RabbitDelayError as exc:
                if not recoverable(exc):
                    raise
                error = exc
            else:
                assert self._url_in_use is not None
                log_recovered(redact(self._url_in_use), recovery, time.monotonic())
                return

    def _run(self, ledger: Ledger) -> None:
        """Keep up to `window` messages in flight until each has its outcome; send
        nothing more while the broker blocks the connection."""
        self._ledger = ledger
        try:
            window = self.window
            blocked = self._blocked
            if blocked.blocked and self.connection is not None:
                # pika reads frames only while we wait: an unblock that came since the
                # last call is still in the socket
                self.connection.process_data_events(0)
            while not ledger.done:
                while ledger.in_flight < window and not blocked.blocked:
                    index = ledger.take()
                    if index is None:
                        break
                    ledger.sent(index, self._send(ledger.outs[index]))
                if not ledger.done:
                    self._wait(ledger)
        finally:
            self._ledger = None

    def _wait(self, ledger: Ledger) -> None:
        """Run pika's I/O until a message gets its outcome, the blocked state changes,
        or a block reaches `blocked_timeout` (then raise BrokerBlocked)."""
        assert self.connection is not None
        assert self._channel is not None
        blocked = self._blocked
        settled, reason = ledger.settled, blocked.reason
        fired: list[bool] = []
        ioloop: Any = None
        timer: object = None
        deadline = blocked.deadline(self.blocked_timeout_s)
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise blocked.error(self.blocked_timeout_s)
            ioloop = self.connection._impl.ioloop
            timer = ioloop.call_later(left, lambda: fired.append(True))

        def ready() -> bool:
            return ledger.settled != settled or blocked.reason != reason or bool(fired)

        try:
            # BlockingChannel's own wait loop: runs pika's I/O until ready() or a close
            self._channel._flush_output(ready)
        finally:
            if timer is not None:
                ioloop.remove_timeout(timer)

    def _publish_one(self, out: Outgoing) -> str:
        return self.publish_outgoing((out,))[0]


__all__ = ["WORKER_BLOCKED_TIMEOUT_S", "Publisher", "blocked_state"]
