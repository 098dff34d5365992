"""Publishers on the in-memory broker: the real `PublisherCore` (arguments, validation,
routing, encoding, headers, the ledger and how a call ends), with the broker's virtual
clock and an in-memory send. Confirms always come; `mandatory` returns are
UnroutableError, as on RabbitMQ."""

from __future__ import annotations

from collections.abc import Coroutine, Iterable
from typing import Any, Generic, TypeVar, Unpack

from rabbit_delay._envelope import Outgoing
from rabbit_delay._errors import RabbitDelayError
from rabbit_delay._idempotency.guard import run
from rabbit_delay._observe import tracing
from rabbit_delay._publishing.core import PublisherCore, PublisherOptions
from rabbit_delay._schedule_api.sync import Schedule
from rabbit_delay._stores.factory import store_from_config
from rabbit_delay._topology.model import Topology
from rabbit_delay.testing._broker import NO_ROUTE, MemoryBroker

OneT = TypeVar("OneT")
ManyT = TypeVar("ManyT")


def _send(
    core: PublisherCore[Any, Any], broker: MemoryBroker, messages: Iterable[Outgoing]
) -> list[str]:
    """Send every message of one call in order and end it the way both real publishers
    do (`PublisherCore.finish`): the ids, or the one error naming exactly those concerned.
    A missing exchange (404) ends the call, as RabbitMQ closes the channel."""
    ledger = core.ledger(messages)
    tag = 0
    while (index := ledger.take()) is not None:
        out = ledger.outs[index]
        tag += 1
        ledger.sent(index, tag)
        try:
            routed = broker.publish(out)
        except RabbitDelayError as exc:
            return core.result(ledger, exc)
        if not routed and out.mandatory:
            ledger.returned(out.message_id, NO_ROUTE)  # basic.return comes before the ack
        ledger.ack(tag)
    return core.result(ledger)


class _OnMemoryBroker(PublisherCore[OneT, ManyT], Generic[OneT, ManyT]):
    """A publisher of a MemoryBroker, on its virtual clock. A topology with [schedule]
    records keyed publishes in `store` (the TestBroker's, shared with its worker)."""

    def __init__(
        self, topology: Topology, broker: MemoryBroker, **options: Unpack[PublisherOptions]
    ) -> None:
        super().__init__(
            topology, borrowed=True, tracer=tracing.active, book=self._open_book, **options
        )
        self.broker = broker
        self._schedule: Schedule | None = None

    def _open_book(self) -> Any:
        """Without `store=`: the topology's [idempotency] store (a SQLite file is shared
        with the workers that use it; a memory store would be this publisher's alone)."""
        return store_from_config(self.topology.idempotency).schedule  # type: ignore[attr-defined]

    def now(self) -> int:
        return self.broker.now_ms()

    def _send(self, messages: Iterable[Outgoing]) -> list[str]:
        """Record the keyed messages in the schedule (the kit's store is synchronous),
        then send the others: the ids."""
        outs = list(messages)
        if not any(o.key is not None for o in outs):
            return _send(self, self.broker, outs)
        send, ids = run(self.recording(outs))
        if send:
            _send(self, self.broker, send)
        return ids


class MemoryPublisher(_OnMemoryBroker[str, list[str]]):
    """`rabbit_delay.sync.Publisher`'s API on a MemoryBroker: `publish_delayed`,
    `publish_many`, `publish_outgoing` return the message ids once "confirmed".

    Raises what the real publishers raise before anything is sent (DelayError,
    UnknownTargetError, EncodeError), UnroutableError for a message returned under
    `mandatory`, MissingObjectError for an exchange that does not exist.
    """

    def publish_outgoing(self, messages: Iterable[Outgoing]) -> list[str]:
        return self._send(messages)

    def _publish_one(self, out: Outgoing) -> str:
        return self._send((out,))[0]

    @property
    def schedule(self) -> Schedule:
        """The schedule through this publisher, on the virtual clock (`Publisher.schedule`)."""
        if self._schedule is None:
            self._schedule = Schedule(self.topology, publisher=self)  # type: ignore[arg-type]
        return self._schedule

    def __enter__(self) -> MemoryPublisher:
        return self

    def __exit__(self, *_exc: object) -> None:
        return None


class AsyncMemoryPublisher(
    _OnMemoryBroker[Coroutine[Any, Any, str], Coroutine[Any, Any, list[str]]]
):
    """`rabbit_delay.aio.AsyncPublisher`'s API (awaited) on a MemoryBroker, for code under
    test that publishes from async handlers or services. Raises like MemoryPublisher."""

    async def publish_outgoing(self, messages: Iterable[Outgoing]) -> list[str]:
        return self._send(messages)

    async def _publish_one(self, out: Outgoing) -> str:
        return self._send((out,))[0]

    async def __aenter__(self) -> AsyncMemoryPublisher:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        return None
