"""The publisher logic both transports share: the arguments, validation, routing and
encoding of a publish, the options and lifecycle rules of a publisher, how a call ends
(its ids, or the one error naming exactly the ids concerned) and the metrics. No I/O.

The ledger of confirms, the recovery deadline and the blocked rule are in
`rabbit_delay._publishing.confirms`; `_sync/publisher.py` (pika) and `_aio/publisher.py` (aio-pika)
only send, wait and reconnect as told.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from functools import partial
from typing import TYPE_CHECKING, Any, Generic, Literal, Protocol, TypedDict, TypeVar, Unpack

import rabbit_delay._headers as h
from rabbit_delay._connection import DEFAULT_BLOCKED_TIMEOUT_S, ConnectionSettings
from rabbit_delay._durations import DurationLike, format_ms, iso, parse_ms
from rabbit_delay._envelope import (
    Body,
    Outgoing,
    encode_body,
    now_ms,
    outgoing,
    text_header,
)
from rabbit_delay._errors import (
    ConfigError,
    DelayError,
    DurationError,
    PublishError,
    RabbitDelayError,
    StoreError,
    UnknownTargetError,
)
from rabbit_delay._idempotency.guard import StoreProgram
from rabbit_delay._publishing.confirms import (
    DEFAULT_RECOVERY_TIMEOUT_S,
    WORKER_BLOCKED_TIMEOUT_S,
    Ledger,
    Recovery,
    State,
    confirm_failure,
    log_lost,
    recoverable,
    seconds,
)
from rabbit_delay._schedule.messages import check_key, entry_of, payload_headers, send_list
from rabbit_delay._topology.delays import Route, Router
from rabbit_delay._topology.model import Topology

if TYPE_CHECKING:
    from rabbit_delay._observe.metrics import Metrics

__all__ = [
    "BLOCKED_BACKSTOP_S",
    "DEFAULT_WINDOW",
    "WORKER_BLOCKED_TIMEOUT_S",
    "DelayLike",
    "MessageOptions",
    "PublisherCore",
    "PublisherOptions",
    "RouteOptions",
    "URLs",
    "confirm_failure",
]

DelayLike = timedelta | int | float
DEFAULT_WINDOW = 256
# A call's keyed messages are recorded in chunks of this many, the next chunk's records
# written while the chunk before is sent (the store's I/O beside the broker's).
RECORD_CHUNK = 256
# pika closes a connection blocked this much longer than the publisher's blocked_timeout:
# a backstop for a wait that cannot end by itself (a socket buffer full of unread data).
BLOCKED_BACKSTOP_S = 2.0
URLs = str | Sequence[str]
# What a call returns: the ids themselves (pika), or a coroutine of them (aio-pika).
OneT = TypeVar("OneT")
ManyT = TypeVar("ManyT")


class PublishTracer(Protocol):
    """Spans of publish calls (rabbit_delay._observe.tracing.OpenTelemetry): handed in by
    the transport, so the core imports no tracing."""

    def start_publish(self, outs: Sequence[Outgoing]) -> tuple[list[Outgoing], Any]:
        """The call's span (or None) and the messages to send, trace context added."""
        ...

    def end_publish(self, span: Any, ledger: Ledger, failure: RabbitDelayError | None) -> None:
        """End the call's span (an error status when it failed)."""
        ...


# What a publisher asks, on each call, for the tracer to use (None: no spans).
TracerSource = Callable[[], PublishTracer | None]


def _no_tracer() -> None:
    return None


# What a publisher asks, the first time it records a keyed message, for the schedule
# to record it in (a `ScheduleBook`, or an `AsyncScheduleBook` for the async publisher).
BookSource = Callable[[], Any]
OnConflictName = Literal["replace", "keep"]


class PublisherOptions(TypedDict, total=False):
    """The keyword options of both publishers (`__init__` and `connect`); see
    docs/publishing.md."""

    settings: ConnectionSettings | None
    store: Any
    window: int
    metrics: Metrics | None
    recovery_timeout: DurationLike
    blocked_timeout: DurationLike | None


class RouteOptions(TypedDict, total=False):
    """Where and when a message goes, besides its tier: the keyword arguments of every
    publish call (`publish_delayed`, `publish_many`, `prepare`, `Outbox.add`), read by
    `PublisherCore.route`; see docs/publishing.md."""

    queue: str | None
    routing_key: str | None
    delay: DelayLike | None
    at: datetime | None


class MessageOptions(RouteOptions, total=False):
    """The keyword arguments of a call that publishes one message: its route, what it
    carries besides its body, and (a topology with [schedule]) its schedule key and
    what a publish does to the key when it is still scheduled."""

    message_id: str | None
    headers: Mapping[str, object] | None
    key: str | None
    on_conflict: OnConflictName | None


def _marked(out: Outgoing, key: str, on_conflict: str) -> Outgoing:
    """`out` to be recorded under `key` (a constructor call: `dataclasses.replace` costs
    several times more, per message)."""
    return Outgoing(
        out.exchange,
        out.routing_key,
        out.body,
        out.message_id,
        out.content_type,
        out.headers,
        out.mandatory,
        out.timestamp,
        key,
        on_conflict == "keep",
    )


class PublisherCore(Generic[OneT, ManyT]):
    """What both publishers decide: options, `publish_delayed` / `publish_many` (their
    arguments turned into `Outgoing` messages, or refused), how a call ends, metrics.

    The sync and async publishers inherit this and only implement `publish_outgoing`
    (send and wait, reconnect) and `_publish_one`: `PublisherCore[str, list[str]]` for
    pika, `PublisherCore[Coroutine[..., str], Coroutine[..., list[str]]]` for aio-pika,
    whose calls are then awaited.
    """

    def __init__(
        self,
        topology: Topology,
        url: URLs | None = None,
        *,
        borrowed: bool = False,
        settings: ConnectionSettings | None = None,
        window: int = DEFAULT_WINDOW,
        metrics: Metrics | None = None,
        recovery_timeout: DurationLike = DEFAULT_RECOVERY_TIMEOUT_S,
        blocked_timeout: DurationLike | None = None,
        tracer: TracerSource | None = None,
        store: Any = None,
        book: BookSource | None = None,
    ) -> None:
        if borrowed and url is not None:
            raise ConfigError(
                "give either a url (the publisher opens and owns its connection) or "
                "connection= (it publishes on yours), not both"
            )
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ConfigError(f"window must be a whole number of at least 1, got {window!r}")
        self.topology = topology
        self.router = Router(topology)
        # asked on each call: the application may import OpenTelemetry at any time
        self.tracer: TracerSource = tracer if tracer is not None else _no_tracer
        self.metrics = metrics
        self.url = url
        self.settings = settings
        self.window = window
        # A borrowed connection is its owner's to reconnect: the publisher only raises.
        self.owns_connection = not borrowed
        self._url_in_use: str | None = None  # the node its own connection is open to
        self.recovery_timeout_s = seconds(recovery_timeout, "recovery_timeout")
        if blocked_timeout is None:
            blocked_timeout = (
                settings.blocked_timeout_s if settings is not None else DEFAULT_BLOCKED_TIMEOUT_S
            )
        self.blocked_timeout_s = seconds(blocked_timeout, "blocked_timeout")
        # The schedule (a topology with [schedule]): the store given, else the topology's
        # [idempotency] store, opened by the transport (`book`) on the first keyed publish.
        self.store = store
        self._book_source = book
        self._book: Any = None

    # -- one call --------------------------------------------------------------------------

    def now(self) -> int:
        """The publisher's clock (UTC epoch ms): what `rd-due-at` counts from and `at=`
        is measured against. The wall clock; rabbit_delay.testing's publishers read its
        virtual clock instead."""
        return now_ms()

    @property
    def connected_url(self) -> str | None:
        """The URL of the node this publisher's own connection is open to (after a
        failover, the node it moved to); None before it connected, or on a borrowed
        connection. Contains the password: redact it before showing it."""
        return self._url_in_use

    def ledger(self, messages: Iterable[Outgoing]) -> Ledger:
        """The ledger of one call. Where the application uses OpenTelemetry, the call's
        publish span starts here and its trace context goes into every message that
        carries none yet (the `tracer` the transport handed in)."""
        outs = list(messages)
        span = None
        tracer = self.tracer()
        if tracer is not None and outs:
            outs, span = tracer.start_publish(outs)
        ledger = Ledger(outs)
        ledger.trace = span
        return ledger

    def recovery(self) -> Recovery:
        backoff = (self.settings or ConnectionSettings()).backoff
        return Recovery(self.recovery_timeout_s, backoff.delays)

    def after_loss(
        self, ledger: Ledger, recovery: Recovery | None, error: RabbitDelayError
    ) -> Recovery:
        """A call met `error`. Raise it unless it is a loss this publisher recovers from
        (a lost or unreachable broker, on a connection it owns); else every
        sent-unconfirmed message is to be sent again, and the outage (deadline, backoff)
        is returned for the transport to reconnect by."""
        if not (self.owns_connection and recoverable(error)):
            raise error
        ledger.channel_lost()
        recovery = recovery if recovery is not None else self.recovery()
        recovery.lost(time.monotonic(), ledger.confirmed)
        log_lost(error, ledger, recovery)
        return recovery

    def result(self, ledger: Ledger, error: RabbitDelayError | None = None) -> list[str]:
        """The end of a call: its ids once every message is confirmed; else the one
        error (UnroutableError / NackError / UnconfirmedError / BrokerBlocked naming
        exactly the ids concerned, or a refusal such as AccessRefused), counted in the
        metrics either way."""
        failure = self.settle(ledger, error)
        if failure is not None:
            raise failure
        return [o.message_id for o in ledger.outs]

    def settle(
        self, ledger: Ledger, error: RabbitDelayError | None = None
    ) -> RabbitDelayError | None:
        """The error a call ends with (None: every message confirmed), counted in the
        metrics; `result` raises it, a caller settling each message by its state in
        `ledger` (the outbox relay) reads it."""
        failure = ledger.failure() if error is None else ledger.error_for(error)
        self.record(ledger, failure)
        if ledger.trace is not None:
            tracer = self.tracer()
            if tracer is not None:
                tracer.end_publish(ledger.trace, ledger, failure)
            else:  # tracing turned off during the call: end the span all the same
                span: Any = ledger.trace
                span.end()
        return failure

    def record(self, ledger: Ledger, error: RabbitDelayError | None = None) -> None:
        """Count a call in the metrics, by target and tier: confirmed messages as
        published, every other one as failed with `error`. A no-op without metrics."""
        metrics = self.metrics
        if metrics is None:
            return
        sent: Counter[tuple[str, str]] = Counter()
        for out, state in zip(ledger.outs, ledger.states, strict=True):
            target = str(out.headers[h.H_TARGET])
            if state is State.CONFIRMED or error is None:
                sent[(target, str(out.headers[h.H_TIER]))] += 1
            else:
                metrics.publish_error(target, error)
        for (target, tier), count in sent.items():
            metrics.published(target, tier, count)

    # -- the public calls: arguments handled here, sending by the transport ---------------

    def publish_outgoing(self, messages: Iterable[Outgoing]) -> ManyT:
        """Publish prepared messages with up to `window` unconfirmed at once; the ids
        once every one is confirmed.

        Raises UnroutableError / NackError naming exactly the returned / nacked ids (the
        others were confirmed); UnconfirmedError (or BrokerBlocked) naming exactly the
        ids with no confirm; AccessRefused (403), MissingObjectError (404).
        """
        raise NotImplementedError

    def _publish_one(self, out: Outgoing) -> OneT:
        raise NotImplementedError

    def publish_delayed(
        self, msg: Body, tier: str | None = None, **options: Unpack[MessageOptions]
    ) -> OneT:
        """Publish one message due after `tier` (or `delay`, or at `at`); its message_id
        once the broker confirmed it.

        Raises DelayError / UnknownTargetError / EncodeError when called, before anything
        is sent; otherwise what publish_outgoing raises.
        """
        return self._publish_one(self.prepare(msg, tier, **options))

    def publish_many(
        self,
        messages: Iterable[Body],
        tier: str | None = None,
        *,
        keys: Sequence[str] | None = None,
        on_conflict: OnConflictName | None = None,
        **where: Unpack[RouteOptions],
    ) -> ManyT:
        """Publish many messages to one target and delay, confirms pipelined; the ids in
        order. Every message is validated and encoded when called, before the first is
        sent; otherwise what publish_outgoing raises. `keys` (one per message) are their
        schedule keys (a topology with [schedule]; default: their message_ids), recorded
        in one store transaction before the first is sent."""
        outs = self.prepare_many(messages, tier, keys=keys, on_conflict=on_conflict, **where)
        return self.publish_outgoing(outs)

    # -- validating and encoding -----------------------------------------------------------

    def prepare_many(
        self,
        messages: Iterable[Body],
        tier: str | None = None,
        *,
        keys: Sequence[str] | None = None,
        on_conflict: OnConflictName | None = None,
        **where: Unpack[RouteOptions],
    ) -> list[Outgoing]:
        """Validate and encode every message (one target and delay) before any is sent."""
        now = self.now()
        route = self.route(tier, now=now, **where)
        outs = [outgoing(route, *encode_body(m), now) for m in messages]
        if keys is not None and len(keys) != len(outs):
            raise ConfigError(f"give one key per message: {len(keys)} keys, {len(outs)} messages")
        if (self.topology.schedule is None and keys is None and on_conflict is None) or not outs:
            return outs
        # One target and one delay: the first is checked in full, the others only marked.
        first = self.keyed(outs[0], keys[0] if keys is not None else None, on_conflict)
        keep = "keep" if first.keep else "replace"
        marked = [first]
        for i in range(1, len(outs)):
            out = outs[i]
            key = check_key(keys[i]) if keys is not None else out.message_id
            marked.append(_marked(out, key, keep))
        return marked

    def route(
        self,
        tier: str | None = None,
        *,
        queue: str | None = None,
        routing_key: str | None = None,
        delay: DelayLike | None = None,
        at: datetime | None = None,
        now: int | None = None,
    ) -> Route:
        key = self.router.target_key(queue, routing_key)
        delay_ms: int | None = None
        if at is not None:
            if delay is not None:
                raise DelayError("give either delay= or at=, not both")
            if at.tzinfo is None or at.utcoffset() is None:
                raise DelayError(
                    f"at={at.isoformat(timespec='milliseconds')} has no timezone; pass an "
                    "aware datetime, e.g. datetime.now(UTC) + ..."
                )
            delay_ms = int(at.timestamp() * 1000) - (now if now is not None else self.now())
            if delay_ms <= 0:
                raise DelayError(
                    f"at={iso(at)} is {format_ms(-delay_ms)} in the past; a delayed "
                    "message must be due later"
                )
        elif delay is not None:
            try:
                delay_ms = parse_ms(delay)
            except DurationError as exc:
                raise DelayError(str(exc)) from None
        return self.router.resolve(key, tier=tier, delay_ms=delay_ms)

    def prepare(
        self,
        msg: Body,
        tier: str | None = None,
        *,
        message_id: str | None = None,
        headers: Mapping[str, object] | None = None,
        attempt: int = 1,
        key: str | None = None,
        on_conflict: OnConflictName | None = None,
        **where: Unpack[RouteOptions],
    ) -> Outgoing:
        """Validate and encode one message. Raises a PublishError subclass on bad input,
        ConfigError for `key`/`on_conflict` without a [schedule] table."""
        now = self.now()
        route = self.route(tier, now=now, **where)
        body, content_type = encode_body(msg)
        out = outgoing(route, body, content_type, now, message_id, headers, attempt)
        if self.topology.schedule is None and key is None and on_conflict is None:
            return out
        return self.keyed(out, key, on_conflict)

    # -- the schedule ----------------------------------------------------------------------

    def keyed(self, out: Outgoing, key: str | None, on_conflict: OnConflictName | None) -> Outgoing:
        """`out` marked to be recorded in the schedule under `key` (default: its
        message_id) before it is sent.

        Raises ConfigError for a key or on_conflict without a [schedule] table, or an
        unknown on_conflict; EncodeError for a bad key or headers that are not JSON
        values; UnknownTargetError for a routing key bound to several queues."""
        schedule = self.topology.schedule
        if schedule is None:
            raise ConfigError(
                "key= and on_conflict= need the schedule: add a [schedule] table to the "
                "topology (docs/schedule.md)"
            )
        if on_conflict is None:
            on_conflict = schedule.on_conflict
        if on_conflict not in ("replace", "keep"):
            raise ConfigError(f'on_conflict must be "replace" or "keep", got {on_conflict!r}')
        target = str(out.headers[h.H_TARGET])
        queues = self.router.queues_for_key(target)
        if len(queues) != 1:
            raise UnknownTargetError(
                f"a scheduled message goes to one queue, and routing key {target!r} reaches "
                f"{len(queues)} ({', '.join(queues)}): publish with queue=... (one per queue)"
            )
        payload_headers(out.headers)  # JSON values, or EncodeError now rather than later
        return _marked(out, check_key(key) if key is not None else out.message_id, on_conflict)

    def scheduled(self, out: Outgoing) -> Outgoing:
        """`out` marked for the schedule when the topology has one (the outbox relay, a
        transfer): under the key it carries (rd-key, from another schedule) or its
        message_id. Raises like `keyed`."""
        if self.topology.schedule is None:
            return out
        return self.keyed(out, text_header(out.headers.get(h.H_KEY)), None)

    @staticmethod
    def record_chunks(outs: Sequence[Outgoing]) -> list[list[Outgoing]]:
        """A call's messages in the chunks its records are written in."""
        return [list(outs[i : i + RECORD_CHUNK]) for i in range(0, len(outs), RECORD_CHUNK)]

    @staticmethod
    def unsent_too(failure: RabbitDelayError, unsent: Sequence[str]) -> RabbitDelayError:
        """`failure` of a chunk, naming the later messages of the call too: recorded in the
        schedule but not sent (the sweeper publishes them after the grace)."""
        if unsent and isinstance(failure, PublishError):
            failure.message_ids = (*failure.message_ids, *unsent)
            failure.args = (
                f"{failure.args[0] if failure.args else failure}; {len(unsent)} later "
                "message(s) of the call were recorded in the schedule but not sent: the "
                "sweeper publishes them after the grace, or publish them again",
            )
        return failure

    @staticmethod
    def sent_before(error: StoreError, sent: Sequence[str]) -> StoreError:
        """A store failure on a chunk after the first: the earlier ones were sent."""
        if not sent:
            return error
        return StoreError(
            f"{error}; the {len(sent)} earlier message(s) of the call were recorded and sent: "
            f"{', '.join(sent[:5])}{' ...' if len(sent) > 5 else ''}"
        )

    def schedule_book(self) -> Any:
        """The schedule the publisher records in; opened on first use. Raises ConfigError
        when the topology has no [schedule], StoreError when the store cannot be opened."""
        if self._book is None:
            if self.topology.schedule is None:
                raise ConfigError("the topology has no [schedule] table (docs/schedule.md)")
            if self.store is not None:
                book = getattr(self.store, "schedule", None)
                if book is None:
                    raise ConfigError(
                        f"the store {type(self.store).__name__} keeps no schedule: use the "
                        "SQLite, Redis, PostgreSQL or memory store"
                    )
                self._book = book
            elif self._book_source is not None:
                try:
                    self._book = self._book_source()
                except RabbitDelayError:
                    raise
                except Exception as exc:
                    raise StoreError(f"opening the schedule's store failed: {exc!r}") from exc
            else:
                raise ConfigError("this publisher has no store to record its schedule in")
        return self._book

    def recording(self, outs: Sequence[Outgoing]) -> StoreProgram[tuple[list[Outgoing], list[str]]]:
        """Record the keyed messages of `outs` in the schedule, in one store call,
        before any is sent: what to send (each stamped with its generation; a kept one
        left out), and the id each returns, in order. Raises StoreError when the store
        fails: then nothing was recorded, and nothing is to be sent."""
        keyed = [i for i, o in enumerate(outs) if o.key is not None]
        if not keyed:
            return list(outs), [o.message_id for o in outs]
        book = self.schedule_book()
        schedule = self.topology.schedule
        assert schedule is not None
        scope = self.topology.names.prefix
        entries = [
            entry_of(
                outs[i],
                scope,
                self.router.queues_for_key(str(outs[i].headers[h.H_TARGET]))[0],
                schedule.grace,
            )
            for i in keyed
        ]
        placed = yield partial(book.place_many, entries, now_ms=self.now())
        if isinstance(placed, Exception):
            raise StoreError(
                f"the schedule could not record {len(entries)} message(s), so none was sent: "
                f"{type(placed).__name__}: {placed}"
            ) from placed
        return send_list(outs, keyed, placed)
