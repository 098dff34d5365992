"""Asynchronous publisher on aio-pika: confirmed, persistent, mandatory.

Publishes through the channel's underlying aiormq channel: aiormq tracks confirms per
delivery tag and maps a basic.return to its publish by message_id, so each call awaits
exactly its own outcome and a batch simply keeps a window of them in flight.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from types import TracebackType
from typing import TYPE_CHECKING, Self

import aiormq
from aio_pika.abc import AbstractChannel as AbstractAioChannel
from aio_pika.abc import AbstractConnection
from aiormq.abc import AbstractChannel
from pamqp.commands import Basic

from rabbit_delay.aio._connection import plain_channel
from rabbit_delay.errors import (
    BrokerError,
    MissingObjectError,
    NackError,
    PublishError,
    RabbitDelayError,
    UnroutableError,
)
from rabbit_delay.message import Body, Outgoing, encode_body, now_ms
from rabbit_delay.publishing import DelayLike, PublisherCore, confirm_failure
from rabbit_delay.topology import Topology

if TYPE_CHECKING:
    from rabbit_delay.metrics import Metrics

PERSISTENT = 2
DEFAULT_WINDOW = 256


class AsyncPublisher(PublisherCore):
    """`publish_delayed` on an aio-pika connection (the same methods as the sync Publisher).

    Create with `await AsyncPublisher.connect(topology, url)` or pass a connection and
    call `await publisher.open()`. Safe to use from many tasks at once.
    """

    def __init__(
        self,
        topology: Topology,
        connection: AbstractConnection,
        *,
        window: int = DEFAULT_WINDOW,
        own: bool = False,
        metrics: Metrics | None = None,
    ) -> None:
        super().__init__(topology, metrics=metrics)
        self.connection = connection
        self.window = window
        self._own = own
        self._channel: AbstractChannel | None = None
        self._owner: AbstractAioChannel | None = None  # the aio-pika channel owning `_channel`
        self._opening = asyncio.Lock()

    @classmethod
    async def connect(
        cls,
        topology: Topology,
        url: str | None = None,
        *,
        window: int = DEFAULT_WINDOW,
        metrics: Metrics | None = None,
    ) -> AsyncPublisher:
        from rabbit_delay.aio._connection import connect

        connection = await connect(url, name="rabbit-delay publisher")
        publisher = cls(topology, connection, window=window, own=True, metrics=metrics)
        await publisher.open()
        return publisher

    async def open(self) -> AbstractChannel:
        async with self._opening:
            if self._channel is None or self._channel.is_closed:
                await self._close_channel()
                self._owner = await plain_channel(self.connection, confirms=True)
                self._channel = await self._owner.get_underlay_channel()
            return self._channel

    async def _close_channel(self) -> None:
        owner, self._owner, self._channel = self._owner, None, None
        if owner is not None and not owner.is_closed:
            await owner.close()

    async def _send(self, out: Outgoing) -> None:
        channel = self._channel
        if channel is None or channel.is_closed:
            channel = await self.open()
        properties = Basic.Properties(
            content_type=out.content_type,
            delivery_mode=PERSISTENT,
            message_id=out.message_id,
            headers=out.headers,  # type: ignore[arg-type]
            # aware: pamqp takes a naive datetime for UTC, fromtimestamp() gives local time
            timestamp=datetime.fromtimestamp(out.timestamp, UTC),
        )
        try:
            await channel.basic_publish(
                out.body,
                exchange=out.exchange,
                routing_key=out.routing_key,
                properties=properties,
                mandatory=out.mandatory,
            )
        except aiormq.exceptions.PublishError as exc:
            # exc.message is the returned message; its delivery frame is a Basic.Return
            reply = getattr(getattr(exc.message, "delivery", None), "reply_text", "NO_ROUTE")
            raise _failure({out.message_id: str(reply)}, ()) from None
        except aiormq.exceptions.DeliveryError:
            raise _failure({}, (out.message_id,)) from None
        except aiormq.exceptions.ChannelNotFoundEntity as exc:
            raise MissingObjectError(f"{exc}; run `rabbit-delay declare` first") from None
        except aiormq.exceptions.ChannelClosed as exc:
            raise BrokerError(f"channel closed by the broker: {exc}") from None

    async def publish_outgoing(self, messages: Iterable[Outgoing]) -> list[str]:
        """Publish prepared messages with up to `window` unconfirmed at once.

        Every message is attempted; then UnroutableError / NackError is raised naming the
        ids that failed (the others were confirmed).
        """
        outs = list(messages)
        if self.metrics is None:
            return await self._publish(outs)
        try:
            ids = await self._publish(outs)
        except RabbitDelayError as exc:
            self.record(outs, exc)
            raise
        self.record(outs)
        return ids

    async def _publish(self, outs: list[Outgoing]) -> list[str]:
        if len(outs) == 1:
            await self._send(outs[0])
            return [outs[0].message_id]
        window = asyncio.Semaphore(self.window)

        async def one(out: Outgoing) -> None:
            async with window:
                await self._send(out)

        results = await asyncio.gather(*(one(o) for o in outs), return_exceptions=True)
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            _raise_combined(failures)
        return [o.message_id for o in outs]

    async def publish_delayed(
        self,
        msg: Body,
        tier: str | None = None,
        *,
        queue: str | None = None,
        routing_key: str | None = None,
        delay: DelayLike | None = None,
        at: datetime | None = None,
        message_id: str | None = None,
        headers: Mapping[str, object] | None = None,
    ) -> str:
        """Publish one message; return its message_id once confirmed.

        See Publisher.publish_delayed for what it raises.
        """
        out = self.prepare(
            msg,
            tier,
            queue=queue,
            routing_key=routing_key,
            delay=delay,
            at=at,
            message_id=message_id,
            headers=headers,
        )
        await self.publish_outgoing((out,))
        return out.message_id

    async def publish_many(
        self,
        messages: Iterable[Body],
        tier: str | None = None,
        *,
        queue: str | None = None,
        routing_key: str | None = None,
        delay: DelayLike | None = None,
        at: datetime | None = None,
    ) -> list[str]:
        """Publish many messages to one target and delay, confirms pipelined."""
        now = now_ms()
        route = self.route(tier, queue=queue, routing_key=routing_key, delay=delay, at=at, now=now)
        prepared = [self.outgoing(route, *encode_body(m), now) for m in messages]
        return await self.publish_outgoing(prepared)

    async def close(self) -> None:
        await self._close_channel()
        if self._own:
            await self.connection.close()

    async def __aenter__(self) -> Self:
        await self.open()
        return self

    async def __aexit__(
        self, _t: type[BaseException] | None, _e: BaseException | None, _tb: TracebackType | None
    ) -> None:
        await self.close()


def _failure(returned: dict[str, str], nacked: tuple[str, ...]) -> PublishError:
    error = confirm_failure(returned, nacked)
    assert error is not None
    return error


def _raise_combined(failures: list[BaseException]) -> None:
    """One error for a batch, as the sync publisher raises it (see confirm_failure)."""
    other = [f for f in failures if not isinstance(f, UnroutableError | NackError)]
    if other:
        raise other[0]
    returned = {
        i: r for f in failures if isinstance(f, UnroutableError) for i, r in f.replies.items()
    }
    nacked = [i for f in failures if isinstance(f, NackError) for i in f.message_ids]
    raise _failure(returned, tuple(nacked))
