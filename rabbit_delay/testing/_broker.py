"""The in-memory broker: RabbitMQ's routing, queues, TTL, dead-lettering, delivery limits
and delayed retry, as rabbit-delay uses them, on a virtual clock. No decision of
rabbit-delay's is made here: objects come from running the real declare program
(`plan.declare_program`) against this broker, messages from the real `PublisherCore`,
and the delivery program decides what the worker does with each delivery.

Emulated (the version given, 4.3 by default, decides where RabbitMQ versions differ,
through `BrokerInfo` as everywhere else):

* exchanges: direct, fanout, topic (AMQP wildcards: `*` one word, `#` zero or more),
  exchange-to-exchange bindings, `alternate-exchange`, the default exchange, and the
  delayed-message plugin's `x-delayed-message` type where the version can run it;
* queues: queue-level `x-message-ttl` (expiry at the head, in order), dead-lettering to
  `x-dead-letter-exchange` with `x-dead-letter-routing-key` or the message's own key,
  `x-death` and `x-first-death-*` (and `x-last-death-*` from 3.13) headers; quorum
  at-least-once dead-lettering (a dead-letter that routes nowhere waits in its queue,
  and holds back the expiry of the messages behind it) or classic at-most-once (dropped);
* quorum delivery counting: `x-delivery-count` on redeliveries, `x-delivery-limit`
  (20 by default from 4.0), what counts (a reject and a lost channel always, a
  nack-requeue before 4.3 only), `x-acquired-count` from 4.3, and 4.3's delayed retry
  (`x-delayed-retry-type = failed`);
* the [held] backend (4.3+): its holding queue behaves as if a holder were always
  attached: each message is held (aside, counted in `depth`) until the time
  `rabbit_delay._held.rules.decide` gives it, then dead-lettered, key kept, like the
  real holder's undeliverable-here settle;
* publishing: confirms (always positive), `mandatory` returns, 404 for a missing
  exchange; consuming: per-consumer prefetch, acks, nacks, rejects, channels whose loss
  returns their unacked deliveries.

Not emulated: permissions, vhosts other than "/", length limits and overflow, per-message
TTL (`expiration`), priorities, the headers exchange, streams, clustering, memory and
disk alarms, consumer timeouts.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
from collections import deque
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import lru_cache
from typing import Any, TypeVar

from pydantic import BaseModel

import rabbit_delay._headers as h
from rabbit_delay._broker import BrokerInfo, normalise_queue_arguments
from rabbit_delay._durations import DurationLike, format_ms, parse_ms
from rabbit_delay._envelope import Outgoing
from rabbit_delay._envelope import now_ms as wall_clock_ms
from rabbit_delay._errors import ConfigError, MissingPluginError, RabbitDelayError, broker_refusal
from rabbit_delay._held.rules import Hold, decide
from rabbit_delay._plan.desired import (
    DELAYED_RETRY_TYPE,
    PLUGIN_EXCHANGE_TYPE,
    BindingSpec,
    ExchangeSpec,
    Kind,
    QueueSpec,
    desired,
)
from rabbit_delay._plan.diff import Plan
from rabbit_delay._plan.program import (
    Bind,
    Declare,
    DeclareReport,
    Exists,
    Operation,
    RoutesEveryKey,
    SupportsType,
    declare_program,
    describe,
    plan_program,
)
from rabbit_delay._plan.refusals import PLUGIN_HINT
from rabbit_delay._topology.model import Topology
from rabbit_delay.testing._loop import VirtualLoop

DEFAULT_VERSION = "4.3.6"
VHOST = "/"
EMULATED_TYPES = frozenset({"direct", "fanout", "topic"})
QUORUM_DEFAULT_DELIVERY_LIMIT = 20  # RabbitMQ 4.0+, for a quorum queue that sets none
MAX_PLUGIN_DELAY_MS = 2**32 - 1  # the plugin routes any other x-delay at once
NO_ROUTE = "NO_ROUTE"
CLEANUP_S = 86_400.0  # virtual time cancelled tasks get to end, at close

P = TypeVar("P")
M = TypeVar("M", bound=BaseModel)


class KitError(RabbitDelayError, RuntimeError):
    """rabbit_delay.testing was asked for something it cannot honour: time advanced from
    inside a handler, a run still busy at its limit, an error in the kit itself."""


@dataclass(frozen=True, slots=True)
class Message:
    """A message as the in-memory broker holds or delivers it."""

    exchange: str  # the exchange it was (last) published or dead-lettered to
    routing_key: str
    body: bytes
    message_id: str | None
    content_type: str | None
    headers: Mapping[str, Any]
    timestamp: int | None = None  # seconds, the AMQP `timestamp` property
    redelivered: bool = False

    def header(self, name: str, default: Any = None) -> Any:
        """One header (`rd-error-type`, `x-death`, ...), or `default`."""
        return self.headers.get(name, default)

    def json(self) -> Any:
        """The body decoded as JSON. Raises ValueError when it is not JSON."""
        return json.loads(self.body)

    def decode(self, model: type[M]) -> M:
        """The body validated into a pydantic model. Raises pydantic's ValidationError."""
        return model.model_validate_json(self.body)


@dataclass(frozen=True, slots=True)
class Delivered:
    """One delivery to a consumer."""

    tag: int
    consumer_tag: str
    message: Message


@dataclass(slots=True, eq=False)
class _Entry:
    """A message in one queue, with that queue's bookkeeping."""

    message: Message
    expires_at: int | None  # queue TTL, epoch ms
    delivery_count: int = 0  # quorum: failed returns (x-delivery-count)
    acquired: int = 0  # every return (4.3's x-acquired-count)
    redelivered: bool = False


@dataclass(slots=True, eq=False)
class _Consumer:
    tag: str
    queue: _Queue
    channel: Channel
    prefetch: int
    deliver: Callable[[Delivered], None]
    unacked: int = 0


class _Queue:
    """One queue and what its arguments make it do."""

    def __init__(self, spec: QueueSpec, arguments: Mapping[str, object], info: BrokerInfo) -> None:
        self.name = spec.name
        self.durable = spec.durable
        self.arguments = dict(arguments)
        args = self.arguments
        self.quorum = args.get("x-queue-type") == "quorum"
        ttl = args.get("x-message-ttl")
        self.ttl = ttl if isinstance(ttl, int) else None
        self.dlx = _text(args.get("x-dead-letter-exchange"))
        self.dlrk = _text(args.get("x-dead-letter-routing-key"))
        self.at_least_once = (
            self.quorum
            and args.get("x-dead-letter-strategy") == "at-least-once"
            and args.get("x-overflow") == "reject-publish"
        )
        limit = args.get("x-delivery-limit")
        if isinstance(limit, int):
            self.limit: int | None = limit
        elif self.quorum and info.at_least(4, 0):
            self.limit = QUORUM_DEFAULT_DELIVERY_LIMIT
        else:
            self.limit = None
        self.retry_min: int | None = None
        self.retry_max: int | None = None
        retry_type = args.get(DELAYED_RETRY_TYPE)
        if retry_type not in (None, "disabled"):
            if retry_type != "failed":
                raise ConfigError(
                    f"queue {self.name!r}: {DELAYED_RETRY_TYPE} {retry_type!r} is not emulated "
                    "by rabbit_delay.testing (only 'failed', which rabbit-delay declares)"
                )
            self.retry_min = int(args.get("x-delayed-retry-min", 0))  # type: ignore[call-overload]
            maximum = args.get("x-delayed-retry-max")
            self.retry_max = int(maximum) if isinstance(maximum, int) else None
        self.ready: deque[_Entry] = deque()
        self.waiting = 0  # held back by delayed retry
        self.backlog: list[tuple[_Entry, str]] = []  # dead-letters that routed nowhere
        self.consumers: list[_Consumer] = []
        self.next_consumer = 0
        self.expiry: asyncio.TimerHandle | None = None
        self.expiry_at = 0
        self.holding = False  # the [held] backend's holding queue: a holder is attached

    def retry_delay_ms(self, delivery_count: int) -> int:
        assert self.retry_min is not None
        delay = self.retry_min * delivery_count
        return delay if self.retry_max is None else min(delay, self.retry_max)


class _Exchange:
    def __init__(self, spec: ExchangeSpec) -> None:
        self.name = spec.name
        self.type = spec.type
        self.durable = spec.durable
        self.arguments = dict(spec.arguments)
        self.alternate = _text(self.arguments.get("alternate-exchange"))
        self.plugin = spec.type == PLUGIN_EXCHANGE_TYPE
        # The plugin routes by its x-delayed-type once a message is due.
        self.routing = str(self.arguments.get("x-delayed-type")) if self.plugin else spec.type
        self.bindings: list[tuple[str, Kind, str]] = []
        self._cache: dict[str, tuple[tuple[Kind, str], ...]] = {}

    def bind(self, key: str, kind: Kind, destination: str) -> None:
        binding = (key, kind, destination)
        if binding not in self.bindings:
            self.bindings.append(binding)
            self._cache.clear()

    def unbind_destination(self, kind: Kind, destination: str) -> None:
        kept = [b for b in self.bindings if (b[1], b[2]) != (kind, destination)]
        if len(kept) != len(self.bindings):
            self.bindings = kept
            self._cache.clear()

    def destinations(self, key: str) -> tuple[tuple[Kind, str], ...]:
        found = self._cache.get(key)
        if found is None:
            found = self._cache[key] = tuple(self._match(key))
        return found

    def _match(self, key: str) -> list[tuple[Kind, str]]:
        routing = self.routing
        seen: dict[tuple[Kind, str], None] = {}
        for pattern, kind, destination in self.bindings:
            if routing == "fanout" or (
                pattern == key if routing == "direct" else topic_matches(pattern, key)
            ):
                seen.setdefault((kind, destination), None)
        return list(seen)


def _outside_other_loops(run: Callable[[], None]) -> None:
    """Run `run` (which runs the kit's loop) here, or, when an event loop already runs on
    this thread (an `async def` test), on a thread of its own while this one waits: two
    loops cannot run on one thread. Raises what `run` raised."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        run()
        return
    failed: list[BaseException] = []

    def target() -> None:
        try:
            run()
        except BaseException as exc:
            failed.append(exc)

    thread = threading.Thread(target=target, name="rabbit-delay-testing", daemon=True)
    thread.start()
    thread.join()
    if failed:
        raise failed[0]


def topic_matches(pattern: str, key: str) -> bool:
    """AMQP topic matching: words separated by dots, `*` matches exactly one word, `#`
    zero or more. An empty key has no words."""
    return _match_words(_words(pattern), _words(key))


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split(".")) if text else ()


@lru_cache(maxsize=65_536)
def _match_words(pattern: tuple[str, ...], key: tuple[str, ...]) -> bool:
    if not pattern:
        return not key
    head, rest = pattern[0], pattern[1:]
    if head == "#":
        return any(_match_words(rest, key[i:]) for i in range(len(key) + 1))
    if not key:
        return False
    return (head == "*" or head == key[0]) and _match_words(rest, key[1:])


def _text(value: object) -> str | None:
    return None if value is None else str(value)


def _with_death(
    headers: Mapping[str, Any],
    queue: str,
    reason: str,
    exchange: str,
    routing_key: str,
    now_ms: int,
    last_death: bool,
) -> dict[str, Any]:
    """The headers of a dead-lettered copy: RabbitMQ's `x-death` (newest first, one entry
    per queue and reason, counted) and its first/last death summary."""
    out = dict(headers)
    deaths: list[dict[str, Any]] = [dict(d) for d in out.get("x-death") or ()]
    same = next((d for d in deaths if (d.get("queue"), d.get("reason")) == (queue, reason)), None)
    if same is not None:
        deaths.remove(same)
        same["count"] = int(same.get("count", 0)) + 1
    else:
        same = {
            "count": 1,
            "reason": reason,
            "queue": queue,
            "time": datetime.fromtimestamp(now_ms // 1000, UTC),
            "exchange": exchange,
            "routing-keys": [routing_key],
        }
    out["x-death"] = [same, *deaths]
    for part, value in (("exchange", exchange), ("queue", queue), ("reason", reason)):
        out.setdefault(f"x-first-death-{part}", value)
        if last_death:
            out[f"x-last-death-{part}"] = value
    return out


def _shown(value: object) -> str:
    """A value the way RabbitMQ's 406 text shows it (parsed by plan.conflict_from_reply)."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return f"the value '{str(value).lower()}' of type 'bool'"
    if isinstance(value, int):
        return f"the value '{value}' of type 'long'"
    return f"the value '{value}' of type 'longstr'"


def _inequivalent(
    kind: str,
    name: str,
    have: Mapping[str, object],
    want: Mapping[str, object],
) -> str | None:
    """The 406 text RabbitMQ answers a re-declare with other properties, or None."""
    for arg in ("type", "durable", *sorted(set(have) - {"type", "durable"} | set(want))):
        if arg in ("type", "durable") and arg not in want:
            continue
        current, received = have.get(arg), want.get(arg)
        if current == received:
            continue
        if arg in ("type", "durable"):
            shown = f"received '{_plain(received)}' but current is '{_plain(current)}'"
        else:
            shown = f"received {_shown(received)} but current is {_shown(current)}"
        return (
            f"PRECONDITION_FAILED - inequivalent arg '{arg}' for {kind} '{name}' in vhost "
            f"'{VHOST}': {shown}"
        )
    return None


def _plain(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


class Channel:
    """A consumer's channel on the in-memory broker: its delivery tags, its consumers,
    and what it acks, nacks and rejects. Closing it (a lost connection) returns every
    unacked delivery to its queue, counted as a failed delivery."""

    def __init__(self, broker: MemoryBroker) -> None:
        self.broker = broker
        self.unacked: dict[int, tuple[_Queue, _Entry, _Consumer]] = {}
        self.consumers: dict[str, _Consumer] = {}
        self.closed = False
        self._tags = itertools.count(1)
        self._consumer_tags = itertools.count(1)

    def next_tag(self) -> int:
        return next(self._tags)

    def consume(self, queue: str, deliver: Callable[[Delivered], None], *, prefetch: int) -> str:
        """basic.consume (manual acks): `deliver` is called for each delivery, on the
        broker's loop. Raises MissingObjectError for a missing queue."""
        self._check_open()
        found = self.broker._queue_or_404(queue, doing=f"consuming from queue {queue!r}")
        tag = f"ctag-{id(self):x}.{next(self._consumer_tags)}"
        consumer = _Consumer(tag, found, self, prefetch, deliver)
        self.consumers[tag] = consumer
        found.consumers.append(consumer)
        self.broker._dispatch(found)
        return tag

    def cancel(self, consumer_tag: str) -> None:
        """basic.cancel: no more deliveries; those unacked stay with the channel."""
        consumer = self.consumers.pop(consumer_tag, None)
        if consumer is not None and consumer in consumer.queue.consumers:
            consumer.queue.consumers.remove(consumer)

    def ack(self, tag: int) -> None:
        queue, _entry, consumer = self._take(tag)
        consumer.unacked -= 1
        self.broker._dispatch(queue)

    def nack(self, tag: int, *, requeue: bool = True) -> None:
        """basic.nack: requeued (counted towards the delivery limit before 4.3 only)."""
        queue, entry, consumer = self._take(tag)
        consumer.unacked -= 1
        if requeue:
            counted = self.broker.nack_counts
            self.broker._return(queue, entry, counted=counted, failed=False)
        else:
            self.broker._dead_letter_or_drop(queue, entry, "rejected")
        self.broker._dispatch(queue)

    def reject(self, tag: int, *, requeue: bool) -> None:
        """basic.reject: requeued and counted, or dead-lettered with reason rejected."""
        queue, entry, consumer = self._take(tag)
        consumer.unacked -= 1
        if requeue:
            self.broker._return(queue, entry, counted=True, failed=True)
        else:
            self.broker._dead_letter_or_drop(queue, entry, "rejected")
        self.broker._dispatch(queue)

    def close(self) -> None:
        """The channel is gone: its consumers too, and every unacked delivery goes back
        to its queue as a failed delivery (in delivery order), as on a lost connection."""
        if self.closed:
            return
        self.closed = True
        self.broker._channels.discard(self)
        for tag in list(self.consumers):
            self.cancel(tag)
        returned = list(self.unacked.items())
        self.unacked.clear()
        touched: dict[str, _Queue] = {}
        for _tag, (queue, entry, consumer) in reversed(returned):  # the earliest ends first
            consumer.unacked -= 1
            self.broker._return(queue, entry, counted=True, failed=True)
            touched[queue.name] = queue
        for queue in touched.values():
            self.broker._dispatch(queue)

    def _take(self, tag: int) -> tuple[_Queue, _Entry, _Consumer]:
        self._check_open()
        found = self.unacked.pop(tag, None)
        if found is None:
            # RabbitMQ closes the channel (406): a driver acked twice, or a stale tag.
            raise KitError(f"PRECONDITION_FAILED - unknown delivery tag {tag}")
        return found

    def _check_open(self) -> None:
        if self.closed:
            raise KitError("the channel is closed")


class MemoryBroker:
    """An in-memory RabbitMQ of `version` (4.3 by default), on a virtual clock that starts
    at `start` (default: now) and moves only when told (`advance`, `run_until`,
    `run_until_idle`). See the module docstring for what is emulated.

    Raises ConfigError for a version that is not a RabbitMQ version number.
    """

    def __init__(self, version: str = DEFAULT_VERSION, *, start: datetime | None = None) -> None:
        self.info = BrokerInfo(
            product="RabbitMQ",
            version_text=version,
            cluster_name="rabbit_delay.testing",
            platform="in-memory broker",
        )
        if self.info.version is None:
            raise ConfigError(f"version {version!r} is not a RabbitMQ version such as '4.3.6'")
        # The version rules used per message, read once (BrokerInfo parses on each call).
        self.nack_counts = self.info.nack_requeue_counts  # towards x-delivery-limit
        self._last_death = self.info.at_least(3, 13)  # x-last-death-* headers
        self._acquired_header = self.info.at_least(4, 3)  # x-acquired-count
        if start is not None and (start.tzinfo is None or start.utcoffset() is None):
            raise ConfigError(f"start={start!r} has no timezone; pass an aware datetime")
        self.loop = VirtualLoop()
        self._origin_ms = int(start.timestamp() * 1000) if start is not None else wall_clock_ms()
        self._exchanges: dict[str, _Exchange] = {}
        self._queues: dict[str, _Queue] = {}
        self._timers: set[asyncio.TimerHandle] = set()
        self._busy: list[Callable[[], bool]] = []
        self._channels: set[Channel] = set()
        self._errors: list[BaseException] = []
        self.closed = False

    # -- the clock -------------------------------------------------------------------------

    def now_ms(self) -> int:
        """Virtual time, UTC epoch milliseconds."""
        return self._origin_ms + round(self.loop.time() * 1000)

    @property
    def now(self) -> datetime:
        """Virtual time, as an aware UTC datetime."""
        return datetime.fromtimestamp(self.now_ms() / 1000, UTC)

    def advance(self, duration: DurationLike) -> None:
        """Let `duration` of virtual time pass ("30m", a timedelta, seconds): everything due
        by then happens, in order, and so does what it leads to by then (TTL expiries,
        dead-letters, deliveries, handlers, retries, parks).

        Raises DurationError for a negative or unreadable duration, KitError when called
        from inside a handler, and the kit's own errors met on the way.
        """
        self._run(self.now_ms() + parse_ms(duration))

    def run_until(self, predicate: Callable[[], object], timeout: DurationLike) -> bool:
        """Advance until `predicate()` holds (checked each time the broker has settled
        at a virtual instant), at most `timeout`; whether it holds. Raises like
        `advance`."""
        if predicate():
            return True
        self._run(self.now_ms() + parse_ms(timeout), stop_if=lambda: bool(predicate()))
        return bool(predicate())

    def run_until_idle(self, limit: DurationLike = "30d") -> int:
        """Advance until nothing more can happen (no message waiting for a TTL or a
        delayed retry, no delivery in progress); the virtual milliseconds that took.

        Raises KitError when something is still pending after `limit` (a handler that
        always defers, a message re-published for ever), and like `advance`.
        """
        start = self.now_ms()
        limit_ms = parse_ms(limit)
        if not self.idle():
            self._run(start + limit_ms, stop_if=self.idle)
        if not self.idle():
            raise KitError(
                f"still busy after {format_ms(limit_ms)} of virtual time ({self.pending()}); "
                "advance() for a while instead, or look for a handler that never settles"
            )
        return self.now_ms() - start

    def idle(self) -> bool:
        """Nothing can happen any more without a publish: no timer pending (TTL, delayed
        retry, plugin delay) and no worker busy."""
        return not self._timers and not any(busy() for busy in self._busy)

    def pending(self) -> str:
        """What is still going on, for error messages."""
        parts = [
            f"{len(q.ready)} message(s) waiting in {q.name}"
            for q in self._queues.values()
            if q.expiry is not None and q.ready
        ]
        delayed = sum(q.waiting for q in self._queues.values())
        if delayed:
            parts.append(f"{delayed} delayed retry(ies)")
        if any(busy() for busy in self._busy):
            parts.append("deliveries in progress")
        return ", ".join(parts) or f"{len(self._timers)} timer(s)"

    def register_busy(self, busy: Callable[[], bool]) -> Callable[[], None]:
        """A worker tells the broker when it is busy (for `idle`); returns the undo."""
        self._busy.append(busy)
        return lambda: self._busy.remove(busy)

    def call_later(self, ms: int, callback: Callable[..., None], *args: Any) -> None:
        """Run `callback(*args)` after `ms` of virtual time (an error in it is raised by
        the run it happens in)."""
        self._call_at(self.now_ms() + ms, callback, *args)

    def _run(self, until_ms: int, stop_if: Callable[[], bool] | None = None) -> None:
        if self.closed:
            raise KitError("this in-memory broker is closed")
        if self.loop.is_running():
            misuse = KitError(
                "virtual time cannot be advanced from inside a handler or a callback of the "
                "kit: advance it from the test"
            )
            self.record_error(misuse)  # a handler would take it for a failure: the test sees it
            raise misuse
        until = (until_ms - self._origin_ms) / 1000
        _outside_other_loops(lambda: self.loop.run_until(until, stop_if))
        self.raise_errors()

    def raise_errors(self) -> None:
        """Raise the first error met by the kit's own callbacks since the last call."""
        if self._errors:
            first, self._errors = self._errors[0], []
            raise first

    def record_error(self, exc: BaseException) -> None:
        self._errors.append(exc)

    def _call_at(
        self, at_ms: int, callback: Callable[..., None], *args: Any
    ) -> asyncio.TimerHandle:
        def fire() -> None:
            self._timers.discard(handle)
            try:
                callback(*args)
            except Exception as exc:
                self.record_error(exc)

        handle = self.loop.call_at((at_ms - self._origin_ms) / 1000, fire)
        self._timers.add(handle)
        return handle

    def _cancel(self, handle: asyncio.TimerHandle) -> None:
        handle.cancel()
        self._timers.discard(handle)

    # -- objects: the declare program ------------------------------------------------------

    def declare(self, topology: Topology) -> DeclareReport:
        """Declare `topology` by running the real declare program against this broker.

        Raises IncompatibleBroker (the version cannot hold it), DeclarationConflict (an
        object exists with other arguments: nothing changed), MissingPluginError.
        """
        report = self.run_program(declare_program(desired(topology), None, self.info))
        if topology.held is not None:
            self._queues[topology.names.held_queue()].holding = True
        return report

    def plan(self, topology: Topology) -> Plan:
        """What `declare` would do, changing nothing (the real plan program, probing with
        passive declares). Raises IncompatibleBroker, MissingPluginError."""
        return self.run_program(plan_program(desired(topology), None, self.info))

    def run_program(self, program: Generator[Operation, object, P]) -> P:
        """Drive a sans-I/O declaration program (plan.declare_program / plan_program)."""
        try:
            op = next(program)
            while True:
                op = program.send(self._execute(op))
        except StopIteration as stop:
            result: P = stop.value
            return result

    def _execute(self, op: Operation) -> object:
        if isinstance(op, SupportsType):
            return self._supports(op.exchange_type)
        if isinstance(op, RoutesEveryKey):
            exchange = self._exchanges.get(op.exchange)
            return exchange is not None and exchange.routing == "fanout"
        if isinstance(op, Exists):
            table: Mapping[str, object] = (
                self._exchanges if isinstance(op.spec, ExchangeSpec) else self._queues
            )
            return op.spec.name in table
        if isinstance(op, Declare):
            if isinstance(op.spec, ExchangeSpec):
                return self._declare_exchange(op.spec)
            return self._declare_queue(op.spec)
        assert isinstance(op, Bind)
        self._bind(op.spec, describe(op))
        return None

    def _supports(self, exchange_type: str) -> bool:
        if exchange_type in EMULATED_TYPES:
            return True
        if exchange_type == PLUGIN_EXCHANGE_TYPE:
            if self.info.supports_plugin:
                return True  # emulated as a broker with the plugin enabled
            raise MissingPluginError(
                f"PRECONDITION_FAILED - unknown exchange type '{exchange_type}': {PLUGIN_HINT}"
            )
        raise ConfigError(
            f"exchange type {exchange_type!r} is not emulated by rabbit_delay.testing "
            f"(it emulates {', '.join(sorted(EMULATED_TYPES))} and {PLUGIN_EXCHANGE_TYPE})"
        )

    def _declare_exchange(self, spec: ExchangeSpec) -> str | None:
        existing = self._exchanges.get(spec.name)
        if existing is not None:
            have = {"type": existing.type, "durable": existing.durable, **existing.arguments}
            want = {"type": spec.type, "durable": spec.durable, **spec.arguments}
            return _inequivalent("exchange", spec.name, have, want)
        self._supports(spec.type)
        if spec.type == PLUGIN_EXCHANGE_TYPE and spec.arguments.get("x-delayed-type") not in (
            EMULATED_TYPES
        ):
            raise ConfigError(
                f"exchange {spec.name!r}: x-delayed-type must be one of "
                f"{', '.join(sorted(EMULATED_TYPES))}"
            )
        self._exchanges[spec.name] = _Exchange(spec)
        self._retry_backlogs()
        return None

    def _declare_queue(self, spec: QueueSpec) -> str | None:
        arguments: Mapping[str, object] = spec.arguments
        if self.info.at_least(4, 0):  # 4.x records x-queue-type classic when none is given
            arguments = normalise_queue_arguments(arguments)
        existing = self._queues.get(spec.name)
        if existing is not None:
            have = {"durable": existing.durable, **existing.arguments}
            want = {"durable": spec.durable, **arguments}
            return _inequivalent("queue", spec.name, have, want)
        self._queues[spec.name] = _Queue(spec, arguments, self.info)
        self._retry_backlogs()
        return None

    def _bind(self, spec: BindingSpec, doing: str) -> None:
        source = self._exchanges.get(spec.source)
        if source is None:
            raise self._not_found("exchange", spec.source, doing)
        table: Mapping[str, object] = (
            self._queues if spec.destination_type is Kind.QUEUE else self._exchanges
        )
        if spec.destination not in table:
            raise self._not_found(spec.destination_type.value, spec.destination, doing)
        source.bind(spec.routing_key, spec.destination_type, spec.destination)
        self._retry_backlogs()

    @staticmethod
    def _not_found(kind: str, name: str, doing: str) -> RabbitDelayError:
        return broker_refusal(
            404, f"NOT_FOUND - no {kind} '{name}' in vhost '{VHOST}'", doing=doing
        )

    def _queue_or_404(self, name: str, *, doing: str) -> _Queue:
        queue = self._queues.get(name)
        if queue is None:
            raise self._not_found("queue", name, doing)
        return queue

    def delete_queue(self, name: str) -> int:
        """queue.delete: the queue, its messages and its bindings go (its consumers are
        cancelled); how many ready messages it held. Raises MissingObjectError."""
        queue = self._queue_or_404(name, doing=f"deleting queue {name!r}")
        for consumer in list(queue.consumers):
            consumer.channel.cancel(consumer.tag)
        if queue.expiry is not None:
            self._cancel(queue.expiry)
        for exchange in self._exchanges.values():
            exchange.unbind_destination(Kind.QUEUE, name)
        del self._queues[name]
        return len(queue.ready)

    # -- inspecting --------------------------------------------------------------------------

    def has_queue(self, name: str) -> bool:
        return name in self._queues

    def has_exchange(self, name: str) -> bool:
        return name in self._exchanges

    def queue_arguments(self, name: str) -> Mapping[str, object]:
        """A queue's arguments as the broker stores them. Raises MissingObjectError."""
        return dict(self._queue_or_404(name, doing=f"reading queue {name!r}").arguments)

    def depth(self, name: str) -> int:
        """Messages a queue holds that no consumer has: ready ones, those its delayed
        retry holds back, and dead-letters waiting for a route. Raises MissingObjectError."""
        queue = self._queue_or_404(name, doing=f"reading queue {name!r}")
        return len(queue.ready) + queue.waiting + len(queue.backlog)

    def unacked(self, name: str) -> int:
        """Deliveries of a queue not yet acked. Raises MissingObjectError."""
        queue = self._queue_or_404(name, doing=f"reading queue {name!r}")
        return sum(
            1 for channel in self._channels for q, _e, _c in channel.unacked.values() if q is queue
        )

    def peek(self, name: str) -> list[Message]:
        """The ready messages of a queue, head first, as a basic.get would hand them out,
        without taking them. Raises MissingObjectError."""
        queue = self._queue_or_404(name, doing=f"reading queue {name!r}")
        return [self._as_delivered(queue, entry) for entry in queue.ready]

    def get(self, name: str) -> Message | None:
        """basic.get with automatic ack: the head message, taken; None when the queue
        has none ready. Raises MissingObjectError."""
        queue = self._queue_or_404(name, doing=f"getting from queue {name!r}")
        self._expire_head(queue)
        if not queue.ready:
            return None
        entry = queue.ready.popleft()
        self._schedule_expiry(queue)
        return self._as_delivered(queue, entry)

    def _as_delivered(self, queue: _Queue, entry: _Entry) -> Message:
        message = entry.message
        headers = dict(message.headers)
        if queue.quorum and entry.delivery_count:
            headers[h.DELIVERY_COUNT_HEADER] = entry.delivery_count
        if queue.quorum and entry.acquired and self._acquired_header:
            headers["x-acquired-count"] = entry.acquired
        return Message(
            message.exchange,
            message.routing_key,
            message.body,
            message.message_id,
            message.content_type,
            headers,
            message.timestamp,
            entry.redelivered,
        )

    # -- publishing and routing ---------------------------------------------------------------

    def publish(self, out: Outgoing) -> bool:
        """Route one message; True when it reached a queue (or the delayed-message plugin
        holds it), False when it routed nowhere (the caller returns it under `mandatory`).

        Raises MissingObjectError for a missing exchange (404, as RabbitMQ closes the
        channel).
        """
        message = Message(
            out.exchange,
            out.routing_key,
            out.body,
            out.message_id,
            out.content_type,
            dict(out.headers),
            out.timestamp,
        )
        return self.publish_message(message)

    def publish_message(self, message: Message) -> bool:
        """`publish` for a Message (its `exchange` and `routing_key` say where)."""
        doing = f"publishing to exchange {message.exchange!r}"
        if message.exchange:
            exchange = self._exchanges.get(message.exchange)
            if exchange is None:
                raise self._not_found("exchange", message.exchange, doing)
            if exchange.plugin:
                delay = message.headers.get(h.H_PLUGIN_DELAY)
                valid = isinstance(delay, int) and not isinstance(delay, bool)
                if valid and 1 <= delay <= MAX_PLUGIN_DELAY_MS:  # type: ignore[operator]
                    self.call_later(int(delay), self._plugin_due, exchange, message)  # type: ignore[arg-type]
                    return True
        targets = self._route(message.exchange, message.routing_key)
        for queue in targets:
            self._enqueue(queue, message)
        return bool(targets)

    def _plugin_due(self, exchange: _Exchange, message: Message) -> None:
        if self._exchanges.get(exchange.name) is exchange:  # not deleted meanwhile
            for queue in self._route(exchange.name, message.routing_key):
                self._enqueue(queue, message)

    def _route(self, exchange_name: str, key: str) -> list[_Queue]:
        """The queues a message published to `exchange_name` with `key` reaches, each once,
        through exchange-to-exchange bindings and alternate exchanges."""
        if not exchange_name:  # the default exchange: the queue named by the key
            queue = self._queues.get(key)
            return [queue] if queue is not None else []
        found: dict[str, _Queue] = {}
        exchange = self._exchanges.get(exchange_name)
        if exchange is not None:
            self._visit(exchange, key, found, set())
        return list(found.values())

    def _visit(
        self, exchange: _Exchange, key: str, found: dict[str, _Queue], seen: set[str]
    ) -> None:
        if exchange.name in seen:
            return
        seen.add(exchange.name)
        destinations = exchange.destinations(key)
        if not destinations:
            alternate = self._exchanges.get(exchange.alternate) if exchange.alternate else None
            if alternate is not None:
                self._visit(alternate, key, found, seen)
            return
        for kind, name in destinations:
            if kind is Kind.QUEUE:
                queue = self._queues.get(name)
                if queue is not None:
                    found.setdefault(name, queue)
            else:
                bound = self._exchanges.get(name)
                if bound is not None:
                    self._visit(bound, key, found, seen)

    # -- queues: TTL, dead-letters, returns ---------------------------------------------------

    def _enqueue(self, queue: _Queue, message: Message) -> None:
        if queue.holding:
            self._hold(queue, _Entry(message, None))
            return
        expires = self.now_ms() + queue.ttl if queue.ttl is not None else None
        queue.ready.append(_Entry(message, expires))
        if queue.ttl is not None:
            self._schedule_expiry(queue)
        if queue.consumers:
            self._dispatch(queue)

    def _hold(self, queue: _Queue, entry: _Entry) -> None:
        """What a holder does with a delivery of the holding queue (the real decision):
        held aside until its due time, then decided again; released: dead-lettered."""
        decision = decide(entry.message.headers, self.now_ms())
        if isinstance(decision, Hold):
            queue.waiting += 1
            self._call_at(decision.until_ms, self._held_due, queue, entry)
            return
        self._dead_letter_or_drop(queue, entry, "rejected")

    def _held_due(self, queue: _Queue, entry: _Entry) -> None:
        queue.waiting -= 1
        if self._queues.get(queue.name) is queue:  # not deleted meanwhile
            self._hold(queue, entry)

    def _schedule_expiry(self, queue: _Queue) -> None:
        if queue.ttl is None:
            return
        head = queue.ready[0].expires_at if queue.ready and not queue.backlog else None
        if queue.expiry is not None:
            if head is not None and queue.expiry_at <= head:
                return  # fires no later than the head is due; it looks again then
            self._cancel(queue.expiry)
            queue.expiry = None
        if head is not None:
            queue.expiry_at = head
            queue.expiry = self._call_at(head, self._expire, queue)

    def _expire(self, queue: _Queue) -> None:
        queue.expiry = None
        self._expire_head(queue)
        self._schedule_expiry(queue)

    def _expire_head(self, queue: _Queue) -> None:
        """Dead-letter the messages at the head whose TTL ran out (RabbitMQ expires only
        at the head; a queue-level TTL keeps FIFO order equal to expiry order)."""
        now = self.now_ms()
        ready = queue.ready
        while ready and not queue.backlog:
            expires = ready[0].expires_at
            if expires is None or expires > now:
                return
            self._dead_letter_or_drop(queue, ready.popleft(), "expired")

    def _dead_letter_or_drop(self, queue: _Queue, entry: _Entry, reason: str) -> None:
        """Dead-letter `entry` to the queue's DLX (keeping its routing key unless the
        queue names one), or drop it without a DLX. A dead-letter that routes nowhere is
        dropped (at-most-once), or kept until a route exists (quorum at-least-once)."""
        if queue.dlx is None:
            return
        message = entry.message
        key = queue.dlrk if queue.dlrk is not None else message.routing_key
        headers = _with_death(
            message.headers,
            queue.name,
            reason,
            message.exchange,
            message.routing_key,
            self.now_ms(),
            self._last_death,
        )
        dead = Message(
            queue.dlx,
            key,
            message.body,
            message.message_id,
            message.content_type,
            headers,
            message.timestamp,
        )
        targets = self._route(queue.dlx, key)
        if not targets:
            if queue.at_least_once:
                queue.backlog.append((entry, reason))
            return
        for target in targets:
            self._enqueue(target, dead)

    def _retry_backlogs(self) -> None:
        """The topology changed: dead-letters waiting for a route try again, in order."""
        for queue in list(self._queues.values()):
            if not queue.backlog:
                continue
            waiting, queue.backlog = queue.backlog, []
            for index, (entry, reason) in enumerate(waiting):
                self._dead_letter_or_drop(queue, entry, reason)
                if queue.backlog:  # still no route: the rest waits behind it
                    queue.backlog.extend(waiting[index + 1 :])
                    break
            if not queue.backlog:
                self._expire_head(queue)
                self._schedule_expiry(queue)

    def _return(self, queue: _Queue, entry: _Entry, *, counted: bool, failed: bool) -> None:
        """A delivery came back (nack, reject or lost channel): counted towards the
        delivery limit if `counted` (quorum queues), held back by delayed retry if
        `failed`, else back at the head of the queue."""
        entry.redelivered = True
        entry.acquired += 1
        if queue.quorum and counted:
            entry.delivery_count += 1
            if queue.limit is not None and entry.delivery_count > queue.limit:
                self._dead_letter_or_drop(queue, entry, "delivery_limit")
                return
        if failed and queue.retry_min is not None:
            queue.waiting += 1
            self.call_later(queue.retry_delay_ms(entry.delivery_count), self._retried, queue, entry)
            return
        queue.ready.appendleft(entry)
        self._schedule_expiry(queue)

    def _retried(self, queue: _Queue, entry: _Entry) -> None:
        queue.waiting -= 1
        if self._queues.get(queue.name) is queue:
            queue.ready.appendleft(entry)
            self._dispatch(queue)

    # -- consuming ------------------------------------------------------------------------------

    def channel(self) -> Channel:
        """A new channel to consume on (closed with `Channel.close`)."""
        channel = Channel(self)
        self._channels.add(channel)
        return channel

    def _dispatch(self, queue: _Queue) -> None:
        """Hand ready messages to consumers with room under their prefetch, round robin."""
        consumers = queue.consumers
        ready = queue.ready
        while ready and consumers:
            consumer = self._next_consumer(queue)
            if consumer is None:
                return
            expires = ready[0].expires_at
            if expires is not None and expires <= self.now_ms():
                if queue.backlog:
                    return  # expired, and its dead-lettering waits behind the backlog
                self._expire_head(queue)
                continue
            entry = ready.popleft()
            channel = consumer.channel
            tag = channel.next_tag()
            channel.unacked[tag] = (queue, entry, consumer)
            consumer.unacked += 1
            consumer.deliver(Delivered(tag, consumer.tag, self._as_delivered(queue, entry)))
        self._schedule_expiry(queue)

    @staticmethod
    def _next_consumer(queue: _Queue) -> _Consumer | None:
        consumers = queue.consumers
        for offset in range(len(consumers)):
            index = (queue.next_consumer + offset) % len(consumers)
            consumer = consumers[index]
            if consumer.unacked < consumer.prefetch:
                queue.next_consumer = index + 1
                return consumer
        return None

    # -- closing ------------------------------------------------------------------------------

    def close(self) -> None:
        """End every task still running on the broker's loop, and close it."""
        if self.closed:
            return
        _outside_other_loops(self._close)

    def _close(self) -> None:
        loop = self.loop
        tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            gathered = asyncio.gather(*tasks, return_exceptions=True)
            end = loop.time() + CLEANUP_S
            loop.run_until(end, stop_if=gathered.done)
        for handle in list(self._timers):
            self._cancel(handle)
        loop.run_until(loop.time(), stop_if=None)
        loop.close()
        self.closed = True


__all__ = [
    "DEFAULT_VERSION",
    "Channel",
    "Delivered",
    "KitError",
    "MemoryBroker",
    "Message",
    "topic_matches",
]
