"""Synchronous publisher on pika: confirmed, persistent, mandatory.

Confirms are tracked by delivery tag on the channel's underlying (non-blocking) pika
channel, so a batch keeps a window of publishes in flight instead of paying one round
trip per message, which is all BlockingChannel.basic_publish can do.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

import pika
import pika.exceptions
import pika.frame
import pika.spec

from rabbit_delay.errors import (
    BrokerError,
    MissingObjectError,
    RabbitDelayError,
)
from rabbit_delay.message import Body, Outgoing, encode_body, now_ms
from rabbit_delay.publishing import DelayLike, PublisherCore, confirm_failure
from rabbit_delay.sync._connection import connect
from rabbit_delay.topology import Topology

if TYPE_CHECKING:
    from rabbit_delay.metrics import Metrics

PERSISTENT = 2
DEFAULT_WINDOW = 256


class Publisher(PublisherCore):
    """`publish_delayed` on a blocking pika connection.

    Use as a context manager, or call close(). Not thread-safe (neither is pika).
    """

    def __init__(
        self,
        topology: Topology,
        url: str | None = None,
        *,
        connection: pika.BlockingConnection | None = None,
        window: int = DEFAULT_WINDOW,
        metrics: Metrics | None = None,
    ) -> None:
        super().__init__(topology, metrics=metrics)
        self._own_connection = connection is None
        self.connection = (
            connection if connection is not None else connect(url, name="rabbit-delay publisher")
        )
        self.window = window
        self._open_channel()

    def _open_channel(self) -> None:
        """A fresh confirm-mode channel; also after the broker closed the last one (a 404
        on a missing exchange), whose unconfirmed publishes were already reported."""
        self._channel = self.connection.channel()
        # the non-blocking channel underneath: see module docstring
        self._impl: Any = self._channel._impl
        self._pending: dict[int, str] = {}  # delivery tag -> message_id
        self._next_tag = 1
        self._returned: dict[str, str] = {}  # message_id -> reply text
        self._nacked: list[str] = []
        selected: list[bool] = []
        self._impl.confirm_delivery(
            ack_nack_callback=self._on_confirm, callback=lambda _f: selected.append(True)
        )
        self._impl.add_on_return_callback(self._on_return)
        self._wait(lambda: bool(selected))

    # -- pika callbacks (run inside process_data_events) -------------------------------

    def _on_confirm(self, frame: pika.frame.Method[Any]) -> None:
        method = frame.method
        tag: int = method.delivery_tag
        tags = [t for t in self._pending if t <= tag] if method.multiple else [tag]
        nack = isinstance(method, pika.spec.Basic.Nack)
        for t in tags:
            message_id = self._pending.pop(t, None)
            if nack and message_id is not None:
                self._nacked.append(message_id)

    def _on_return(
        self,
        _ch: object,
        method: pika.spec.Basic.Return,
        props: pika.spec.BasicProperties,
        _b: bytes,
    ) -> None:
        # basic.return precedes the ack of the same message: remember it, fail on ack.
        self._returned[props.message_id or "?"] = f"{method.reply_code} {method.reply_text}"

    def _wait(self, done: Any) -> None:
        try:
            # BlockingChannel's own wait loop: runs pika's I/O until `done()` or a close
            self._channel._flush_output(done)
        except pika.exceptions.ChannelClosedByBroker as exc:
            if exc.reply_code == 404:
                raise MissingObjectError(
                    f"{exc.reply_text}; run `rabbit-delay declare` first"
                ) from None
            raise BrokerError(
                f"channel closed by the broker: {exc.reply_code} {exc.reply_text}"
            ) from None

    # -- publishing ----------------------------------------------------------------------

    def _send(self, out: Outgoing) -> None:
        props = pika.BasicProperties(
            content_type=out.content_type,
            delivery_mode=PERSISTENT,
            message_id=out.message_id,
            headers=out.headers,
            timestamp=out.timestamp,
        )
        self._impl.basic_publish(out.exchange, out.routing_key, out.body, props, out.mandatory)
        self._pending[self._next_tag] = out.message_id
        self._next_tag += 1

    def publish_outgoing(self, messages: Iterable[Outgoing]) -> list[str]:
        """Publish prepared messages with up to `window` unconfirmed at once.

        Returns the message ids once every one is confirmed. Raises UnroutableError or
        NackError naming the ids that failed (the others were confirmed), and
        MissingObjectError if an exchange does not exist.
        """
        if self.metrics is None:
            return self._publish(messages)
        outs = list(messages)
        try:
            ids = self._publish(outs)
        except RabbitDelayError as exc:
            self.record(outs, exc)
            raise
        self.record(outs)
        return ids

    def _publish(self, messages: Iterable[Outgoing]) -> list[str]:
        if self._channel.is_closed:
            self._open_channel()
        ids: list[str] = []
        window = self.window
        for out in messages:
            if len(self._pending) >= window:
                self._wait(lambda: len(self._pending) < window)
            self._send(out)
            ids.append(out.message_id)
        self._wait(lambda: not self._pending)
        self._raise_failures()
        return ids

    def _raise_failures(self) -> None:
        error = confirm_failure(self._returned, self._nacked)
        self._returned, self._nacked = {}, []
        if error is not None:
            raise error

    def publish_delayed(
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
        """Publish one message due after `tier` (or `delay`, or at `at`); return its message_id
        once the broker confirmed it.

        Raises DelayError / UnknownTargetError / EncodeError before sending, and
        UnroutableError / NackError if the broker did not accept it.
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
        return self.publish_outgoing((out,))[0]

    def publish_many(
        self,
        messages: Iterable[Body],
        tier: str | None = None,
        *,
        queue: str | None = None,
        routing_key: str | None = None,
        delay: DelayLike | None = None,
        at: datetime | None = None,
    ) -> list[str]:
        """Publish many messages to one target and delay, confirms pipelined.

        Every message is validated and encoded before the first is sent.
        """
        now = now_ms()
        route = self.route(tier, queue=queue, routing_key=routing_key, delay=delay, at=at, now=now)
        prepared = [self.outgoing(route, *encode_body(m), now) for m in messages]
        return self.publish_outgoing(prepared)

    # -- lifecycle -----------------------------------------------------------------------

    def close(self) -> None:
        try:
            if self._channel.is_open:
                self._channel.close()
            if self._own_connection and self.connection.is_open:
                self.connection.close()
        except pika.exceptions.AMQPError:
            pass  # closing a connection the broker already dropped

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, *_exc: tuple[type[BaseException] | None, BaseException | None, TracebackType | None]
    ) -> None:
        self.close()
