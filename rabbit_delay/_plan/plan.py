"""What a topology needs on the broker, how that compares with what is there, and the
order in which to declare it. Pure: the transports execute, this module decides.

Declaring is a two-phase program written as a generator (sans-I/O): it yields
operations, the pika or aio-pika driver executes each one and sends back the result.
Phase 1 checks every existing object (no change to anything); only when no conflict was
found does phase 2 create what is missing and bind. So a conflict never leaves the
topology half-declared.
"""

from __future__ import annotations

import re
from collections.abc import Generator, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TypedDict

from rabbit_delay._broker import UNKNOWN, BrokerInfo, normalise_queue_arguments
from rabbit_delay._errors import ArgumentConflict, DeclarationConflict, IncompatibleBroker
from rabbit_delay._names import Names
from rabbit_delay._topology.model import (
    MAX_SHARDS,
    LeaderLocator,
    QueueType,
    RetryBackend,
    RetryPolicy,
    Topology,
)

# A broker without the delayed-message plugin refuses the exchange type: 3.x closes the
# whole connection (503 COMMAND_INVALID), 4.x only the channel (406 PRECONDITION_FAILED);
# the text says "unknown exchange type" on a clean node and "invalid exchange type" after
# the plugin was disabled.
PLUGIN_EXCHANGE_TYPE = "x-delayed-message"
UNKNOWN_EXCHANGE_TYPE = re.compile(r"(unknown|invalid) exchange type", re.I)
PLUGIN_HINT = (
    "the broker has no 'x-delayed-message' exchange type: enable the plugin with "
    "`rabbitmq-plugins enable rabbitmq_delayed_message_exchange` (docker-compose.yml "
    "builds a broker that has it), or replace the [plugin] table with [cascade]"
)


class QueueArguments(TypedDict, total=False):
    """The `x-arguments` rabbit-delay sets on queues."""

    # Queue-level TTL, never per-message expiration: RabbitMQ only expires the head of
    # a queue, so with one TTL per queue, FIFO order equals expiry order.
    x_message_ttl: int
    x_dead_letter_exchange: str
    x_dead_letter_strategy: str
    x_overflow: str
    x_queue_type: str
    x_delivery_limit: int
    # RabbitMQ 4.3+ quorum delayed retry (retry backend "broker")
    x_delayed_retry_type: str
    x_delayed_retry_min: int
    x_delayed_retry_max: int
    # Placement (`[scaling]`), read by the broker only when it creates the queue.
    x_queue_leader_locator: str
    x_quorum_initial_group_size: int


class ExchangeArguments(TypedDict, total=False):
    alternate_exchange: str
    x_delayed_type: str  # always fanout: see _add_plugin


def _wire(args: Mapping[str, object]) -> dict[str, object]:
    """TypedDict keys use '_' (Python identifiers); the broker's use '-'."""
    return {key.replace("_", "-"): value for key, value in args.items()}


class Kind(StrEnum):
    EXCHANGE = "exchange"
    QUEUE = "queue"
    BINDING = "binding"


@dataclass(frozen=True, slots=True)
class ExchangeSpec:
    name: str
    type: str
    arguments: Mapping[str, object] = field(default_factory=dict)
    durable: bool = True

    kind = Kind.EXCHANGE


@dataclass(frozen=True, slots=True)
class QueueSpec:
    name: str
    arguments: Mapping[str, object] = field(default_factory=dict)
    durable: bool = True

    kind = Kind.QUEUE


@dataclass(frozen=True, slots=True)
class BindingSpec:
    source: str  # exchange
    destination: str  # queue or exchange
    routing_key: str
    destination_type: Kind = Kind.QUEUE

    kind = Kind.BINDING

    @property
    def name(self) -> str:
        arrow = "->" if self.destination_type is Kind.QUEUE else "=>"
        return f"{self.source} {arrow} {self.destination} [{self.routing_key}]"


ObjectSpec = ExchangeSpec | QueueSpec


@dataclass(frozen=True, slots=True)
class Desired:
    exchanges: tuple[ExchangeSpec, ...]
    queues: tuple[QueueSpec, ...]
    bindings: tuple[BindingSpec, ...]
    # Each tier's shard count and the names to build shard names with: a plan reports
    # the buffers of shards past the count (left by a lowered count) as extra.
    tier_shards: Mapping[str, int] = field(default_factory=dict)
    names: Names | None = None

    @property
    def objects(self) -> tuple[ObjectSpec, ...]:
        # Exchanges first: a queue's dead-letter exchange should exist before the queue.
        return (*self.exchanges, *self.queues)


# Placement arguments: the broker reads them once, when it creates a quorum queue (where
# its leader goes, how many replicas it starts with); afterwards leadership moves with
# failures and membership with `rabbitmq-queues add_member/grow`. So they are declared
# on new queues and never compared: a topology that adds or changes them is in place on
# existing queues (the plan notes the difference), never a 406 (docs/scaling.md).
LEADER_LOCATOR = "x-queue-leader-locator"
INITIAL_GROUP_SIZE = "x-quorum-initial-group-size"
CREATION_ONLY_ARGUMENTS = (LEADER_LOCATOR, INITIAL_GROUP_SIZE)


def placement_args(topology: Topology) -> dict[str, object]:
    """The placement arguments of every quorum queue of the topology (none for classic)."""
    if topology.queue_type is not QueueType.QUORUM:
        return {}
    scaling = topology.scaling
    args: dict[str, object] = {}
    if scaling.leader_locator is not LeaderLocator.BROKER:
        args[LEADER_LOCATOR] = scaling.leader_locator.value
    if scaling.replicas is not None:
        args[INITIAL_GROUP_SIZE] = scaling.replicas
    return args


def _dead_letter_args(topology: Topology, dlx: str) -> dict[str, object]:
    args: dict[str, object] = {"x-dead-letter-exchange": dlx}
    if topology.queue_type is QueueType.QUORUM:
        # All three are needed for at-least-once dead-lettering; with the default
        # overflow, a quorum queue falls back to at-most-once without a word.
        args |= {
            "x-queue-type": "quorum",
            "x-dead-letter-strategy": "at-least-once",
            "x-overflow": "reject-publish",
        }
    return args | placement_args(topology)


# Parking lots and the catch-all hold messages for people. They have no dead-letter
# exchange, and RabbitMQ 4.0 drops a message after 20 requeues of a quorum queue that
# sets no limit: inspecting them (get + requeue) must never cost a message.
HUMAN_QUEUE_DELIVERY_LIMIT = 1_000_000


def _plain_queue_args(topology: Topology) -> dict[str, object]:
    if topology.queue_type is QueueType.QUORUM:
        return {
            "x-queue-type": "quorum",
            "x-delivery-limit": HUMAN_QUEUE_DELIVERY_LIMIT,
            **placement_args(topology),
        }
    return {}


# RabbitMQ 4.3+ quorum queue delayed retry: a requeued message comes back after
# min(min x x-delivery-count, max). Type "failed": only failed deliveries wait (basic.reject,
# a lost channel), so a nack (a delivery handed back unstarted at shutdown, or during an
# idempotency store outage) comes back at once and, on 4.3, uncounted.
DELAYED_RETRY_TYPE = "x-delayed-retry-type"


def _delayed_retry_args(retry: RetryPolicy) -> dict[str, object]:
    assert retry.min is not None  # RetryPolicy validates it for backend "broker"
    args: dict[str, object] = {DELAYED_RETRY_TYPE: "failed", "x-delayed-retry-min": retry.min}
    if retry.max is not None:
        args["x-delayed-retry-max"] = retry.max
    return args


def desired(topology: Topology) -> Desired:
    """Every exchange, queue and binding the topology needs, with its arguments."""
    n = topology.names
    catch_all = n.unroutable_exchange()
    exchanges = [
        ExchangeSpec(catch_all, "fanout"),
        ExchangeSpec(n.due_exchange(), "direct", {"alternate-exchange": catch_all}),
        ExchangeSpec(n.parking_exchange(), "direct", {"alternate-exchange": catch_all}),
    ]
    queues = [QueueSpec(n.unroutable_queue(), _plain_queue_args(topology))]
    bindings = [BindingSpec(catch_all, n.unroutable_queue(), "")]

    for tier, ms in topology.tiers.items():
        # The tier exchange is what publishers target: a fanout into the buffer, so a
        # publish is unroutable (and returned under `mandatory`) only if the buffer is gone.
        # A sharded tier has one such pair per shard, all with the same TTL and the same
        # dead-letter exchange: the Router spreads messages over them by message_id.
        args = _dead_letter_args(topology, n.due_exchange()) | {"x-message-ttl": ms}
        for exchange, queue in zip(
            topology.tier_exchanges(tier), topology.tier_queues(tier), strict=True
        ):
            exchanges.append(ExchangeSpec(exchange, "fanout"))
            queues.append(QueueSpec(queue, args))
            bindings.append(BindingSpec(exchange, queue, ""))

    for queue, cfg in topology.queues.items():
        name = n.business_queue(queue)
        args = _dead_letter_args(topology, n.parking_exchange())
        # Whatever key the message arrived with (a shared binding key, a cascade key), a
        # dead-lettered one (delivery limit, a reject) goes to THIS queue's parking lot.
        args["x-dead-letter-routing-key"] = n.queue_key(queue)
        if topology.queue_type is QueueType.QUORUM:
            args["x-delivery-limit"] = cfg.delivery_limit
        if cfg.retry.backend is RetryBackend.BROKER:  # quorum only (Topology validates it)
            args |= _delayed_retry_args(cfg.retry)
        queues.append(QueueSpec(name, args))
        queues.append(QueueSpec(n.parking_queue(queue), _plain_queue_args(topology)))
        for key in (n.queue_key(queue), *cfg.bindings):
            bindings.append(BindingSpec(n.due_exchange(), name, key))
        parking = BindingSpec(n.parking_exchange(), n.parking_queue(queue), n.queue_key(queue))
        bindings.append(parking)

    if topology.cascade is not None:
        _add_cascade(topology, exchanges, queues, bindings)
    if topology.plugin is not None:
        _add_plugin(topology, exchanges, bindings)
    shards = {tier: topology.shards(tier) for tier in topology.tiers}
    return Desired(tuple(exchanges), tuple(queues), tuple(bindings), shards, n)


def _add_cascade(
    topology: Topology,
    exchanges: list[ExchangeSpec],
    queues: list[QueueSpec],
    bindings: list[BindingSpec],
) -> None:
    """Level L: a topic exchange and a queue holding messages 2^L units, dead-lettering
    into level L-1 (level 0 into the delivery exchange). A key's bit for level L decides:
    1 parks the message in queue L, 0 passes it straight to the next exchange."""
    cfg = topology.cascade
    assert cfg is not None
    n = topology.names
    catch_all = n.unroutable_exchange()
    deliver = n.cascade_deliver_exchange()
    exchanges.append(ExchangeSpec(deliver, "topic", {"alternate-exchange": catch_all}))
    for level in range(cfg.levels):
        exchange = n.cascade_exchange(level)
        exchanges.append(ExchangeSpec(exchange, "topic", {"alternate-exchange": catch_all}))
        next_hop = n.cascade_exchange(level - 1) if level else deliver
        ttl = (2**level) * cfg.resolution
        args = _dead_letter_args(topology, next_hop) | {"x-message-ttl": ttl}
        queues.append(QueueSpec(n.cascade_queue(level), args))
        # Publishers enter at their highest set bit, always a 1: a fanout straight into
        # the queue, so the publish path pays no topic match (no AE: under `mandatory`,
        # a missing queue is returned to the publisher rather than hidden).
        entry = n.cascade_entry_exchange(level)
        exchanges.append(ExchangeSpec(entry, "fanout"))
        bindings.append(BindingSpec(entry, n.cascade_queue(level), ""))
        skip = "*." * (cfg.levels - 1 - level)  # the more significant bits
        bindings.append(BindingSpec(exchange, n.cascade_queue(level), f"{skip}1.#"))
        bindings.append(BindingSpec(exchange, next_hop, f"{skip}0.#", Kind.EXCHANGE))
    every_bit = "*." * cfg.levels
    for queue, qcfg in topology.queues.items():
        dest = qcfg.alias or queue
        bindings.append(BindingSpec(deliver, n.business_queue(queue), f"{every_bit}{dest}"))


def _add_plugin(
    topology: Topology, exchanges: list[ExchangeSpec], bindings: list[BindingSpec]
) -> None:
    """The x-delayed-message exchange: a pure delay stage, fanout into the due exchange.

    `x-delayed-type = fanout` with one binding to the due exchange, so routing by key
    happens only there: a due message whose key matches no business queue reaches the
    catch-all through the due exchange's alternate exchange, and no per-key binding of
    the plugin exchange can be missing (the plugin cannot honour `mandatory`, so a
    publish could not tell). No alternate-exchange on the plugin exchange itself: while
    the plugin holds a message its route returns no queue, so the broker would ALSO hand
    every message to the alternate exchange at publish time (plugin issue #36).
    """
    n = topology.names
    name = n.plugin_exchange()
    # First of all objects, so that even without the type probe a missing plugin (503,
    # connection closed) stops `declare` before anything was created.
    exchanges.insert(0, ExchangeSpec(name, PLUGIN_EXCHANGE_TYPE, {"x-delayed-type": "fanout"}))
    bindings.append(BindingSpec(name, n.due_exchange(), "", Kind.EXCHANGE))


# -- comparing with the broker ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ExistingObject:
    """An object as the broker reports it (management API)."""

    arguments: Mapping[str, object]
    durable: bool = True
    type: str | None = None  # exchanges only


@dataclass(frozen=True, slots=True)
class Observed:
    """What the management API reported. `bindings` is None when it was not read."""

    exchanges: Mapping[str, ExistingObject]
    queues: Mapping[str, ExistingObject]
    bindings: frozenset[tuple[str, str, str, str]] | None = None


class Action(StrEnum):
    CREATE = "create"  # missing: declare will create it
    IN_PLACE = "in place"  # exists as wanted
    CONFLICT = "conflict"  # exists with other arguments
    PRESENT = "present"  # exists; arguments not readable (no management API)
    ENSURE = "ensure"  # binding whose presence cannot be read; binding is idempotent
    EXTRA = "extra"  # a tier shard past the topology's count: left alone, never deleted


@dataclass(frozen=True, slots=True)
class PlanItem:
    kind: Kind
    name: str
    action: Action
    conflicts: tuple[ArgumentConflict, ...] = ()
    # For people, changing nothing: a placement argument the existing queue was created
    # without (or with another value), what to do with an extra shard.
    notes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Plan:
    items: tuple[PlanItem, ...]

    @property
    def conflicts(self) -> tuple[ArgumentConflict, ...]:
        return tuple(c for item in self.items for c in item.conflicts)

    @property
    def pending(self) -> tuple[PlanItem, ...]:
        return tuple(i for i in self.items if i.action in (Action.CREATE, Action.CONFLICT))

    @property
    def in_sync(self) -> bool:
        return not self.pending


def compare(spec: ObjectSpec, existing: ExistingObject) -> tuple[ArgumentConflict, ...]:
    """Arguments whose value on the broker differs from the one wanted, with the
    arguments the broker adds by itself (4.x: x-queue-type=classic) filled in on both
    sides, so a re-declare is a no-op on every version."""
    kind = spec.kind.value
    found: list[ArgumentConflict] = []
    if isinstance(spec, ExchangeSpec) and existing.type is not None and existing.type != spec.type:
        found.append(ArgumentConflict(kind, spec.name, "type", existing.type, spec.type))
    if existing.durable != spec.durable:
        found.append(ArgumentConflict(kind, spec.name, "durable", existing.durable, spec.durable))
    wanted = dict(spec.arguments)
    have = dict(existing.arguments)
    if isinstance(spec, QueueSpec):
        wanted, have = normalise_queue_arguments(wanted), normalise_queue_arguments(have)
    for arg in sorted(set(wanted) | set(have)):
        if isinstance(spec, QueueSpec) and arg in CREATION_ONLY_ARGUMENTS:
            continue  # see placement_notes
        if wanted.get(arg) != have.get(arg):
            found.append(ArgumentConflict(kind, spec.name, arg, have.get(arg), wanted.get(arg)))
    return tuple(found)


def placement_notes(spec: ObjectSpec, existing: ExistingObject) -> tuple[str, ...]:
    """Placement arguments an existing queue has otherwise than the topology says: not
    a conflict (the broker reads them only at creation), but worth saying, in one note."""
    if not isinstance(spec, QueueSpec):
        return ()
    differences = [
        f"{arg} {_shown(existing.arguments.get(arg))} on the broker, "
        f"{_shown(spec.arguments.get(arg))} in the topology"
        for arg in CREATION_ONLY_ARGUMENTS
        if existing.arguments.get(arg) != spec.arguments.get(arg)
    ]
    if not differences:
        return ()
    return (
        "; ".join(differences)
        + " (placement applies to new queues only: docs/scaling.md#placement)",
    )


def _shown(value: object) -> str:
    return "unset" if value is None else repr(value)


RETIRED_SHARD_NOTE = (
    "tier {tier!r} now has {count} shard(s): this one still dead-letters what it holds on "
    "time and takes no new messages; delete it once empty (docs/scaling.md#sharded-tiers)"
)


def retired_shards(
    want: Desired, exchanges: Iterable[str], queues: Iterable[str]
) -> tuple[PlanItem, ...]:
    """Buffers (and their exchanges) of a tier's shards past its count in `want`, among
    the names found on the broker: extra, reported and left alone (a lowered shard count
    must not delete a buffer that still holds messages)."""
    if want.names is None:
        return ()
    found: list[tuple[str, int, Kind, str]] = []
    for kind, names in ((Kind.EXCHANGE, exchanges), (Kind.QUEUE, queues)):
        for name in names:
            try:
                tier, shard = want.names.parse_tier(name)
            except ValueError:
                continue
            count = want.tier_shards.get(tier)
            if count is not None and shard >= count:
                found.append((tier, shard, kind, name))
    order = list(want.tier_shards)
    found.sort(key=lambda f: (order.index(f[0]), f[1], f[2] is Kind.QUEUE))
    return tuple(
        PlanItem(
            kind,
            name,
            Action.EXTRA,
            notes=(RETIRED_SHARD_NOTE.format(tier=tier, count=want.tier_shards[tier]),),
        )
        for tier, _shard, kind, name in found
    )


def make_plan(want: Desired, observed: Observed) -> Plan:
    items: list[PlanItem] = []
    for spec in want.objects:
        table = observed.exchanges if isinstance(spec, ExchangeSpec) else observed.queues
        existing = table.get(spec.name)
        if existing is None:
            items.append(PlanItem(spec.kind, spec.name, Action.CREATE))
        else:
            conflicts = compare(spec, existing)
            action = Action.CONFLICT if conflicts else Action.IN_PLACE
            notes = placement_notes(spec, existing)
            items.append(PlanItem(spec.kind, spec.name, action, conflicts, notes))
    for b in want.bindings:
        if observed.bindings is None:
            action = Action.ENSURE
        else:
            key = (b.source, b.destination, b.destination_type.value, b.routing_key)
            action = Action.IN_PLACE if key in observed.bindings else Action.CREATE
        items.append(PlanItem(Kind.BINDING, b.name, action))
    items.extend(retired_shards(want, observed.exchanges, observed.queues))
    return Plan(tuple(items))


def plan_from_presence(want: Desired, present: Mapping[tuple[Kind, str], bool]) -> Plan:
    """Plan from passive declares only: objects are present or missing, arguments
    unread, bindings unknown (binding is idempotent, so declare simply ensures them).

    `present` is keyed by (kind, name): a tier's exchange and its buffer queue share a name.
    """
    items = [
        PlanItem(s.kind, s.name, Action.PRESENT if present[(s.kind, s.name)] else Action.CREATE)
        for s in want.objects
    ]
    items += [PlanItem(Kind.BINDING, b.name, Action.ENSURE) for b in want.bindings]
    return Plan(tuple(items))


# -- the declaration program ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Exists:
    """Passive declare: does the object exist? The driver answers a bool.

    `optional`: a probe of an object the topology does not need (a retired shard): a
    user whose permissions do not cover it is refused (403 on 4.3+), which answers False.
    """

    spec: ObjectSpec
    optional: bool = False


@dataclass(frozen=True, slots=True)
class Declare:
    """Active declare on a throwaway channel. The driver answers None, or the text of a
    406 PRECONDITION_FAILED reply."""

    spec: ObjectSpec


@dataclass(frozen=True, slots=True)
class Bind:
    spec: BindingSpec


# Declaring a reserved `amq.` name is refused (403) only AFTER the broker has checked the
# exchange type, which it refuses with 503 when unknown: so this declare tells whether a
# type is supported, and can never create anything.
TYPE_PROBE_EXCHANGE = "amq.rabbit-delay.type-probe"
# A message routed by an exchange reaches a queue bound to it within milliseconds.
ROUTING_PROBE_TIMEOUT_S = 3.0
BUILTIN_EXCHANGE_TYPES = frozenset({"direct", "fanout", "topic", "headers"})


@dataclass(frozen=True, slots=True)
class SupportsType:
    """Does the broker know this exchange type (a plugin's)? The driver answers True, or
    raises MissingPluginError."""

    exchange_type: str


@dataclass(frozen=True, slots=True)
class RoutesEveryKey:
    """Does `exchange` pass a message with ANY routing key on, right away? The driver
    answers a bool, changing nothing that outlives the probe.

    For the plugin exchange when its `x-delayed-type` cannot be read (no management API):
    the plugin's equivalence check ignores that argument, so a re-declare accepts an
    exchange of another inner type, which then drops every due message. The driver binds
    a temporary exclusive queue to `exchange` with one key (and, when `due` is given, to
    `due` with a second key), publishes with the second key and no `x-delay` (routed at
    once), and answers whether the queue got it: a fanout (or key-blind) exchange passes
    it on, a direct or topic one does not. Routed to our own queue either way, the probe
    never reaches the catch-all or a business queue.
    """

    exchange: str
    due: str | None


Operation = Exists | Declare | Bind | SupportsType | RoutesEveryKey


def describe(op: Operation) -> str:
    """What an operation was doing, for error messages."""
    if isinstance(op, SupportsType):
        return f"probing exchange type {op.exchange_type!r}"
    if isinstance(op, RoutesEveryKey):
        return f"probing how exchange {op.exchange!r} routes"
    return f"{type(op).__name__.lower()} {op.spec.kind.value} {op.spec.name!r}"


def permission(op: Operation) -> str:
    """The permission an operation needs, named in an access refusal (RabbitMQ's own
    reply text, when it names one, wins: a bind needs write on its destination and read
    on its source, the routing probe all three on a temporary queue)."""
    if isinstance(op, Exists):
        return ""  # a passive declare needs no permission
    if isinstance(op, Bind):
        return "write"
    return "configure"


# -- what the broker's version can do ---------------------------------------------------


def broker_requirements(want: Desired, broker: BrokerInfo) -> list[str]:
    """Why this broker cannot hold `want`, one reason per line; empty when it can.

    Checked before anything is declared (and by workers at start), so a topology the
    broker cannot serve never half-exists on it.
    """
    reasons: list[str] = []
    if not broker.supports_plugin and any(e.type == PLUGIN_EXCHANGE_TYPE for e in want.exchanges):
        reasons.append(
            f"the [plugin] backend needs rabbitmq_delayed_message_exchange, which cannot run on "
            f"{broker.describe()}: RabbitMQ 4.3 removed Mnesia, which the plugin stores its "
            "messages in (the plugin was archived in January 2026). Replace the [plugin] table "
            "with [cascade] (plugin-free, replicated) and declare it as a new topology `version`"
        )
    native = [q.name for q in want.queues if DELAYED_RETRY_TYPE in q.arguments]
    if native and not broker.supports_delayed_retry:
        reasons.append(
            f'retry backend = "broker" (queue {", ".join(native)}) needs quorum queue delayed '
            f"retry (x-delayed-retry-*), which RabbitMQ added in 4.3; {broker.describe()} does "
            'not have it. Retry through the tiers (backend = "tiers", the default) on this '
            "broker, or upgrade it to 4.3+"
        )
    return reasons


def check_broker(want: Desired, broker: BrokerInfo) -> None:
    """Raise IncompatibleBroker when `broker_requirements` finds a reason."""
    reasons = broker_requirements(want, broker)
    if reasons:
        raise IncompatibleBroker("; ".join(reasons))


def _probe_types(want: Desired) -> Generator[Operation, object, None]:
    for exchange_type in sorted({e.type for e in want.exchanges} - BUILTIN_EXCHANGE_TYPES):
        yield SupportsType(exchange_type)


def _verify_all_routing(
    want: Desired, present: Mapping[tuple[Kind, str], bool]
) -> Generator[Operation, object, dict[tuple[Kind, str], ArgumentConflict]]:
    """Existing plugin exchanges whose arguments could not be read: probe that each
    routes every key (x-delayed-type fanout). A conflict for each that does not."""
    found: dict[tuple[Kind, str], ArgumentConflict] = {}
    for spec in want.exchanges:
        if spec.type != PLUGIN_EXCHANGE_TYPE or not present.get((spec.kind, spec.name)):
            continue
        due = next(
            (
                b.destination
                for b in want.bindings
                if b.source == spec.name and b.destination_type is Kind.EXCHANGE
            ),
            None,
        )
        if due is not None and not present.get((Kind.EXCHANGE, due), False):
            due = None  # then no binding into it can exist either
        if (yield RoutesEveryKey(spec.name, due)):
            continue
        found[(spec.kind, spec.name)] = ArgumentConflict(
            spec.kind.value,
            spec.name,
            "x-delayed-type",
            "not fanout (a probe published through it with a key it is not bound with was dropped)",
            spec.arguments.get("x-delayed-type"),
        )
    return found


_INEQUIVALENT = re.compile(
    r"inequivalent arg '(?P<arg>[^']+)' for (?P<kind>queue|exchange) '(?P<name>[^']*)'.*?"
    r"received (?:the value '(?P<recv>[^']*)'|'(?P<recv2>[^']*)'|none).*?"
    r"current is (?:the value '(?P<cur>[^']*)'|'(?P<cur2>[^']*)'|none)",
    re.S,
)


def conflict_from_reply(spec: ObjectSpec, reply: str) -> ArgumentConflict:
    """Turn the broker's 406 text into a structured conflict (best effort)."""
    m = _INEQUIVALENT.search(reply)
    if m is None:
        return ArgumentConflict(spec.kind.value, spec.name, "?", reply, "see topology")
    arg = m["arg"]
    current = m["cur"] if m["cur"] is not None else m["cur2"]
    wanted: object = spec.arguments.get(arg)
    if arg == "type" and isinstance(spec, ExchangeSpec):
        wanted = spec.type
    elif arg == "durable":
        wanted = spec.durable
    on_broker = _as_wanted_type(current, wanted)
    return ArgumentConflict(spec.kind.value, spec.name, arg, on_broker, wanted)


def _as_wanted_type(text: str | None, wanted: object) -> object:
    """The reply spells every value as text ('5000', 'true'): give it the wanted value's
    type, so a conflict reads the same whether it came from a 406 or the management API."""
    if text is None:
        return None
    if isinstance(wanted, bool):
        return {"true": True, "false": False}.get(text, text)
    if isinstance(wanted, int):
        try:
            return int(text)
        except ValueError:
            return text
    return text


@dataclass(frozen=True, slots=True)
class DeclareReport:
    """What `declare` did, per object."""

    items: tuple[PlanItem, ...]

    @property
    def created(self) -> tuple[PlanItem, ...]:
        return tuple(i for i in self.items if i.action is Action.CREATE)

    @property
    def changed(self) -> bool:
        return bool(self.created)


def _redeclare(
    spec: ObjectSpec,
) -> Generator[Operation, object, tuple[str | None, tuple[str, ...]]]:
    """Re-declare an existing object to check its arguments: (None when the broker took
    it unchanged, else its 406 text; notes). A 406 on a placement argument (the queue was
    created without it, or with another value) is not a conflict (see
    CREATION_ONLY_ARGUMENTS): the declare is repeated with the broker's value, so that
    only the other arguments are compared, and the difference becomes a note."""
    original = spec
    reply: object = None
    for _ in range(len(CREATION_ONLY_ARGUMENTS) + 1):
        reply = yield Declare(spec)
        if reply is None:
            return None, placement_notes(original, ExistingObject(spec.arguments))
        conflict = conflict_from_reply(spec, str(reply))
        if not isinstance(spec, QueueSpec) or conflict.argument not in CREATION_ONLY_ARGUMENTS:
            break
        args = dict(spec.arguments)
        if conflict.on_broker is None:
            args.pop(conflict.argument, None)
        else:
            args[conflict.argument] = _placement_value(conflict.argument, conflict.on_broker)
        spec = QueueSpec(spec.name, args, spec.durable)
    return str(reply), ()


def _placement_value(argument: str, value: object) -> object:
    """A placement value read back from a 406 text, in the type the broker stored it
    with (the group size is a number even when the topology sets none)."""
    if argument == INITIAL_GROUP_SIZE and isinstance(value, str) and value.isdigit():
        return int(value)
    return value


DeclareProgram = Generator[Operation, object, DeclareReport]
PlanProgram = Generator[Operation, object, Plan]


def plan_program(
    want: Desired, observed: Observed | None = None, broker: BrokerInfo = UNKNOWN
) -> PlanProgram:
    """What `declare` would do, changing nothing: compared with `observed` (management
    API) when given, else probed with passive declares (present or missing; a plugin
    exchange is also probed for how it routes, see RoutesEveryKey).

    Raises IncompatibleBroker when the broker's version cannot hold the topology.
    """
    check_broker(want, broker)
    yield from _probe_types(want)
    if observed is not None:
        return make_plan(want, observed)
    present: dict[tuple[Kind, str], bool] = {}
    for spec in want.objects:
        present[(spec.kind, spec.name)] = bool((yield Exists(spec)))
    routing = yield from _verify_all_routing(want, present)
    plan = plan_from_presence(want, present)
    extra = yield from probe_retired_shards(want)
    return Plan(
        (
            *(
                PlanItem(i.kind, i.name, Action.CONFLICT, (routing[(i.kind, i.name)],))
                if (i.kind, i.name) in routing
                else i
                for i in plan.items
            ),
            *extra,
        )
    )


def probe_retired_shards(want: Desired) -> Generator[Operation, object, tuple[PlanItem, ...]]:
    """Without a listing (no management API), look for each tier's shards past its count
    with passive declares: shard `count`, then on while they exist (a lowered count
    leaves a contiguous run). One probe per tier when there are none."""
    if want.names is None:
        return ()
    exchanges: list[str] = []
    queues: list[str] = []
    for tier, count in want.tier_shards.items():
        for shard in range(count, MAX_SHARDS):
            queue = QueueSpec(want.names.tier_queue(tier, shard))
            if not (yield Exists(queue, optional=True)):
                break
            queues.append(queue.name)
            exchange = ExchangeSpec(want.names.tier_exchange(tier, shard), "fanout")
            if (yield Exists(exchange, optional=True)):
                exchanges.append(exchange.name)
    return retired_shards(want, exchanges, queues)


def declare_program(
    want: Desired, observed: Observed | None = None, broker: BrokerInfo = UNKNOWN
) -> DeclareProgram:
    """Yield the operations that bring the broker to `want`; return what was done.

    With `observed` (management API) the check phase needs no round trips; without it,
    each object is probed with a passive declare and, if present, re-declared on a
    throwaway channel, which the broker accepts unchanged or refuses with 406 (and an
    existing plugin exchange is probed for how it routes, see RoutesEveryKey).

    Raises IncompatibleBroker (the broker's version cannot hold the topology) or
    DeclarationConflict, before creating anything.
    """
    check_broker(want, broker)
    # A missing plugin may close the connection: find out before anything is created.
    yield from _probe_types(want)
    # Keyed by (kind, name): a tier's exchange and its buffer queue share one name.
    present: dict[tuple[Kind, str], bool] = {}
    conflicts: list[ArgumentConflict] = []
    items: dict[tuple[Kind, str], PlanItem] = {}
    if observed is not None:
        plan = make_plan(want, observed)
        for item in plan.items:
            items[(item.kind, item.name)] = item
            present[(item.kind, item.name)] = item.action is not Action.CREATE
        conflicts.extend(plan.conflicts)
    else:
        for spec in want.objects:
            exists = yield Exists(spec)
            present[(spec.kind, spec.name)] = bool(exists)
            action = Action.CREATE
            notes: tuple[str, ...] = ()
            if exists:
                reply, notes = yield from _redeclare(spec)
                if reply is None:
                    action = Action.IN_PLACE
                else:
                    conflicts.append(conflict_from_reply(spec, reply))
                    action = Action.CONFLICT
            items[(spec.kind, spec.name)] = PlanItem(spec.kind, spec.name, action, notes=notes)
        # After every object's presence is known (the probe needs to know the due exchange's).
        routing = yield from _verify_all_routing(want, present)
        for key, conflict in routing.items():
            if items[key].action is Action.IN_PLACE:
                items[key] = PlanItem(key[0], key[1], Action.CONFLICT, (conflict,))
                conflicts.append(conflict)
    if conflicts:
        raise DeclarationConflict(conflicts)

    for spec in want.objects:
        if not present[(spec.kind, spec.name)]:
            created = yield Declare(spec)
            if created is not None:  # created concurrently by someone else, differently
                raise DeclarationConflict([conflict_from_reply(spec, str(created))])
    for binding in want.bindings:
        known = items.get((Kind.BINDING, binding.name))
        if known is None or known.action is not Action.IN_PLACE:
            yield Bind(binding)
            if known is None:
                known = PlanItem(Kind.BINDING, binding.name, Action.ENSURE)
            items[(Kind.BINDING, binding.name)] = known
    ordered = [items[(s.kind, s.name)] for s in want.objects]
    ordered += [items[(Kind.BINDING, b.name)] for b in want.bindings]
    return DeclareReport(tuple(ordered))


NOT_ANSWERED = object()


def refusal_answer(op: Operation, code: int | None, text: str) -> object:
    """What a channel the broker closed with `code` / `text` answers for `op` (the same
    for both transports' declarers), or NOT_ANSWERED when it is an error of the call."""
    if isinstance(op, Exists) and (code == 404 or (code == 403 and op.optional)):
        return False
    if isinstance(op, Declare) and code == 406:
        return text
    if isinstance(op, SupportsType) and code == 403:
        return True  # the type passed the check; the reserved name was refused
    return NOT_ANSWERED
