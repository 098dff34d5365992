"""Asynchronous publisher on aio-pika: confirmed, persistent, mandatory; recovers from a
lost connection and notices a blocked broker.

Publishes through the channel's underlying aiormq channel: aiormq tracks confirms per
delivery tag and maps a basic.return to its publish by message_id, so each send awaits
exactly its own outcome and a call simply keeps a window of them in flight.

What a call knows (the ledger of confirms), when to give up and what to raise are decided
in the core (`rabbit_delay._publishing.confirms`, `_publishing.core.PublisherCore`), the same
for the pika publisher; this module sends, waits and reconnects as told.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections.abc import Coroutine, Iterable
from datetime import UTC, datetime
from types import TracebackType
from typing import Any, Self, Unpack

import aiormq
from aio_pika.abc import AbstractChannel as AbstractAioChannel
from aio_pika.abc import AbstractConnection
from aiormq.abc import AbstractChannel
from pamqp.commands import Basic

from rabbit_delay._aio.connection import close_quietly, connect_first, plain_channel
from rabbit_delay._aio.errors import mapped
from rabbit_delay._connection import ConnectionSettings, failover_order
from rabbit_delay._envelope import Outgoing
from rabbit_delay._errors import RabbitDelayError, StoreError
from rabbit_delay._idempotency.guard import run_async
from rabbit_delay._observe import tracing
from rabbit_delay._publishing.confirms import (
    BlockedState,
    Ledger,
    Recovery,
    State,
    log_recovered,
    recoverable,
    recovery_failed,
)
from rabbit_delay._publishing.core import (
    WORKER_BLOCKED_TIMEOUT_S,
    PublisherCore,
    PublisherOptions,
    URLs,
)
from rabbit_delay._schedule_api.aio import AsyncSchedule
from rabbit_delay._stores.factory import async_store_from_config
from rabbit_delay._topology.model import Topology
from rabbit_delay._urls import redact

log = logging.getLogger("rabbit_delay.publisher")

PERSISTENT = 2


class _Blocked(BlockedState):
    """BlockedState that also wakes the publishes waiting on the connection."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.listeners: set[asyncio.Event] = set()

    def block(self, reason: str, now: float) -> None:
        super().block(reason, now)
        for event in self.listeners:
            event.set()

    def unblock(self, now: float) -> None:
        super().unblock(now)
        for event in self.listeners:
            event.set()


# One blocked state per aiormq connection, shared by every publisher on it.
_BLOCKED: weakref.WeakKeyDictionary[Any, _Blocked] = weakref.WeakKeyDictionary()
# aiormq handles connection.blocked / unblocked in these (name-mangled) methods and
# offers no callback: the publisher wraps them on each connection it uses.
_ON_BLOCKED = "_Connection__handle_connection_blocked"
_ON_UNBLOCKED = "_Connection__handle_connection_unblocked"


def blocked_state(connection: AbstractConnection) -> _Blocked:
    """The connection.blocked / unblocked state of `connection`, hooked once."""
    transport = connection.transport
    underlay: Any = transport.connection if transport is not None else None
    if underlay is None:  # not connected: nothing can block
        return _Blocked("connection")
    state = _BLOCKED.get(underlay)
    if state is not None:
        return state
    state = _Blocked(f"{underlay.url.host}:{underlay.url.port}")
    on_blocked = getattr(underlay, _ON_BLOCKED, None)
    on_unblocked = getattr(underlay, _ON_UNBLOCKED, None)
    if on_blocked is None or on_unblocked is None:
        log.debug("this aiormq does not let the publisher see connection.blocked")
    else:

        async def blocked(frame: Any) -> None:
            await on_blocked(frame)
            state.block(str(getattr(frame, "reason", "") or ""), time.monotonic())

        async def unblocked(frame: Any) -> None:
            await on_unblocked(frame)
            state.unblock(time.monotonic())

        setattr(underlay, _ON_BLOCKED, blocked)
        setattr(underlay, _ON_UNBLOCKED, unblocked)
    _BLOCKED[underlay] = state
    return state


class AsyncPublisher(PublisherCore[Coroutine[Any, Any, str], Coroutine[Any, Any, list[str]]]):
    """`publish_delayed` on an aio-pika connection (the same API as the sync Publisher).

    `await AsyncPublisher.connect(topology, url)` returns an open publisher owning its
    connection; `AsyncPublisher(topology, url)` does no I/O until `await open()`,
    `async with` or the first publish; `AsyncPublisher(topology, connection=conn)`
    publishes on your connection (never closed nor reconnected by the publisher).
    Options: see `PublisherOptions` and docs/publishing.md. Many tasks of one event
    loop may publish at once.
    """

    def __init__(
        self,
        topology: Topology,
        url: URLs | None = None,
        *,
        connection: AbstractConnection | None = None,
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
        self._schedule: AsyncSchedule | None = None
        self.connection = connection
        self._channel: AbstractChannel | None = None
        self._owner: AbstractAioChannel | None = None  # the aio-pika channel owning `_channel`
        self._opening = asyncio.Lock()
        self._generation = 0  # bumped at each (re)open: a lost one is recovered once
        self._blocked = _Blocked("connection")

    @classmethod
    async def connect(
        cls,
        topology: Topology,
        url: URLs | None = None,
        **options: Unpack[PublisherOptions],
    ) -> Self:
        """An open publisher on a connection of its own (the first URL that answers).
        Raises BrokerUnavailable, or ConfigError for bad options."""
        return await cls(topology, url, **options).open()

    # -- lifecycle -----------------------------------------------------------------------

    @property
    def is_open(self) -> bool:
        connection, channel = self.connection, self._channel
        return (
            connection is not None
            and not connection.is_closed
            and channel is not None
            and not channel.is_closed
        )

    async def open(self) -> Self:
        """Connect (own connection) and open a confirm-mode channel; idempotent.
        Raises BrokerUnavailable, ConnectionLost (a borrowed connection that is closed),
        AccessRefused."""
        async with self._opening:
            if not self.is_open:
                await self._open(self.url)
        return self

    async def _open(self, url: URLs | None) -> None:
        with mapped("opening a publisher channel"):
            connection = self.connection
            if self.owns_connection and (connection is None or connection.is_closed):
                await self._close_channel()
                await close_quietly(connection)
                settings = self.settings or ConnectionSettings()
                self.connection, self._url_in_use = await connect_first(
                    url, name="rabbit-delay publisher", settings=settings
                )
            assert self.connection is not None
            await self._close_channel()
            self._owner = await plain_channel(self.connection, confirms=True)
            self._channel = await self._owner.get_underlay_channel()
            self._blocked = blocked_state(self.connection)
            self._generation += 1

    async def _close_channel(self) -> None:
        owner, self._owner, self._channel = self._owner, None, None
        if owner is not None and not owner.is_closed:
            with contextlib.suppress(Exception):  # best effort: its connection may be gone
                await owner.close()

    def _open_book(self) -> Any:
        store = async_store_from_config(self.topology.idempotency)
        self._own_store = store
        return store.schedule  # type: ignore[attr-defined]

    @property
    def schedule(self) -> AsyncSchedule:
        """The topology's schedule, through this publisher: look up, list, cancel and
        reschedule messages by key (a topology with [schedule]; docs/schedule.md)."""
        if self._schedule is None:
            self._schedule = AsyncSchedule(self.topology, publisher=self)
        return self._schedule

    async def close(self) -> None:
        """Close the channel, and the connection if the publisher owns it (and the store
        it opened for the schedule). Idempotent; a connection the broker already dropped
        needs nothing."""
        store, self._own_store, self._book = self._own_store, None, None
        if store is not None:
            with contextlib.suppress(Exception):
                await store.close()
        await self._close_channel()
        if self.owns_connection:
            await close_quietly(self.connection)

    async def __aenter__(self) -> Self:
        return await self.open()

    async def __aexit__(
        self, _t: type[BaseException] | None, _e: BaseException | None, _tb: TracebackType | None
    ) -> None:
        await self.close()

    # -- publishing ----------------------------------------------------------------------

    async def _send(self, out: Outgoing) -> None:
        """Put one message on the wire and await its outcome: returns once confirmed;
        aiormq raises PublishError (returned), DeliveryError (nacked), or a closed
        channel's error."""
        channel = self._channel
        if channel is None:
            raise aiormq.exceptions.ChannelInvalidStateError("the publisher's channel is closed")
        properties = Basic.Properties(
            content_type=out.content_type,
            delivery_mode=PERSISTENT,
            message_id=out.message_id,
            headers=out.headers,  # type: ignore[arg-type]
            # aware: pamqp takes a naive datetime for UTC, fromtimestamp() gives local time
            timestamp=datetime.fromtimestamp(out.timestamp, UTC),
        )
        await channel.basic_publish(
            out.body,
            exchange=out.exchange,
            routing_key=out.routing_key,
            properties=properties,
            mandatory=out.mandatory,
        )

    async def publish_outgoing(self, messages: Iterable[Outgoing]) -> list[str]:
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
        if not any(o.key is not None for o in outs):
            return await self._publish_ledger(outs)
        chunks = self.record_chunks(outs)
        if len(chunks) == 1:
            send, ids = await run_async(self.recording(outs))
            if send:
                await self._publish_ledger(send)
            return ids
        return await self._publish_chunks(chunks)

    async def _publish_chunks(self, chunks: list[list[Outgoing]]) -> list[str]:
        """Record chunk i + 1 (a task of its own) while chunk i is sent."""
        ids: list[str] = []
        pending = asyncio.ensure_future(run_async(self.recording(chunks[0])))
        for i in range(len(chunks)):
            try:
                send, got = await pending
            except StoreError as exc:
                raise self.sent_before(exc, ids) from exc.__cause__
            later = i + 1 < len(chunks)
            if later:
                pending = asyncio.ensure_future(run_async(self.recording(chunks[i + 1])))
            if send:
                try:
                    await self._publish_ledger(send)
                except RabbitDelayError as failure:
                    if later:
                        with contextlib.suppress(Exception):  # no write after the call ends
                            await pending
                    unsent = [o.message_id for chunk in chunks[i + 1 :] for o in chunk]
                    raise self.unsent_too(failure, unsent) from None
            ids.extend(got)
        return ids

    async def _publish_ledger(self, messages: Iterable[Outgoing]) -> list[str]:
        ledger = self.ledger(messages)
        error: RabbitDelayError | None = None
        try:
            await self._publish(ledger)
        except RabbitDelayError as exc:
            error = exc
        return self.result(ledger, error)

    async def _publish(self, ledger: Ledger) -> None:
        """Send every message of `ledger` until each has its outcome; on a lost
        connection (own connection), reconnect and re-send the unconfirmed ones."""
        recovery: Recovery | None = None
        while True:
            generation = self._generation
            try:
                if not self.is_open:
                    await self.open()
                    generation = self._generation
                with mapped("publishing", permission="write"):
                    await self._run(ledger)
                return
            except RabbitDelayError as exc:
                recovery = self.after_loss(ledger, recovery, exc)
                await self._reconnect(recovery, exc, generation)

    async def _reconnect(
        self, recovery: Recovery, error: RabbitDelayError, generation: int
    ) -> None:
        """Connect again (the next URL first) with backoff, until the deadline: then
        raise ConnectionLost (the call names its unconfirmed ids). Calls that lost the
        same connection reconnect it once."""
        lost_url = self._url_in_use
        urls = (self.settings or ConnectionSettings()).resolve(self.url)
        while True:
            delay = recovery.next_delay(time.monotonic())
            if delay is None:
                raise recovery_failed(recovery, error)
            await asyncio.sleep(delay)
            try:
                async with self._opening:
                    if self._generation == generation or not self.is_open:
                        await close_quietly(self.connection)
                        await self._open(failover_order(urls, lost_url))
            except RabbitDelayError as exc:
                if not recoverable(exc):
                    raise
                error = exc
            else:
                assert self._url_in_use is not None
                log_recovered(redact(self._url_in_use), recovery, time.monotonic())
                return

    async def _run(self, ledger: Ledger) -> None:
        """Keep up to `window` messages in flight until each has its outcome; send
        nothing more while the broker blocks the connection; raise BrokerBlocked once
        the block is `blocked_timeout` old, or the first client error of a send."""
        window = self.window
        blocked = self._blocked
        progress = asyncio.Event()
        failures: list[BaseException] = []
        tasks: set[asyncio.Task[None]] = set()

        async def one(index: int) -> None:
            try:
                await self._send(ledger.outs[index])
            except aiormq.exceptions.PublishError as exc:
                # exc.message is the returned message; its delivery frame a Basic.Return
                reply = getattr(getattr(exc.message, "delivery", None), "reply_text", None)
                ledger.settle(index, State.RETURNED, str(reply or "NO_ROUTE"))
            except aiormq.exceptions.DeliveryError:
                ledger.settle(index, State.NACKED)
            except Exception as exc:  # a lost channel: mapped by the caller
                failures.append(exc)
            else:
                ledger.settle(index, State.CONFIRMED)
            finally:
                progress.set()

        blocked.listeners.add(progress)
        try:
            while not failures:
                while ledger.in_flight < window and not blocked.blocked:
                    index = ledger.take()
                    if index is None:
                        break
                    ledger.sent(index)
                    task = asyncio.create_task(one(index))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                if ledger.done:
                    return
                progress.clear()
                deadline = blocked.deadline(self.blocked_timeout_s)
                if deadline is None:
                    await progress.wait()
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    raise blocked.error(self.blocked_timeout_s)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(progress.wait(), left)
            raise failures[0]
        finally:
            blocked.listeners.discard(progress)
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)

    async def _publish_one(self, out: Outgoing) -> str:
        return (await self.publish_outgoing((out,)))[0]


__all__ = ["WORKER_BLOCKED_TIMEOUT_S", "AsyncPublisher", "blocked_state"]
