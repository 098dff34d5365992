"""In what order declaring and planning talk to the broker, and what each answer means:
sans-I/O programs the transports drive. Pure.

Each program is a generator: it yields operations (`Exists`, `Declare`, `Bind`,
`SupportsType`, `RoutesEveryKey`), the pika, aio-pika or in-memory driver executes each
one and sends back its answer (`accepted` when the broker did it, `refused` when it
closed the channel), and the program returns what it found. `declare_program` has two
phases: phase 1 checks every existing object (no change to anything); only when no
conflict was found does phase 2 create what is missing and bind. So a conflict never
leaves the topology half-declared.
"""

from __future__ import annotations

import uuid
from collections.abc import Generator, Mapping
from dataclasses import dataclass
from typing import Protocol

from rabbit_delay._broker import UNKNOWN, BrokerInfo
from rabbit_delay._errors import ArgumentConflict, DeclarationConflict
from rabbit_delay._plan.desired import (
    CREATION_ONLY_ARGUMENTS,
    PLUGIN_EXCHANGE_TYPE,
    BindingSpec,
    Desired,
    ExchangeSpec,
    Kind,
    ObjectSpec,
    QueueSpec,
)
from rabbit_delay._plan.diff import (
    Change,
    ExistingObject,
    Observed,
    Plan,
    PlanItem,
    make_plan,
    placement_notes,
    placement_value,
    plan_from_presence,
    retired_shards,
)
from rabbit_delay._plan.refusals import check_broker, conflict_from_reply, missing_plugin
from rabbit_delay._topology.model import MAX_SHARDS

# -- the operations ----------------------------------------------------------------------


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
    """Bind (idempotent). The driver answers None."""

    spec: BindingSpec


# Declaring a reserved `amq.` name is refused (403) only AFTER the broker has checked the
# exchange type, which it refuses with 503 when unknown: so this declare tells whether a
# type is supported, and can never create anything.
TYPE_PROBE_EXCHANGE = "amq.rabbit-delay.type-probe"
# A message routed by an exchange reaches a queue bound to it within milliseconds: the
# driver polls the probe's queue this often, until this deadline.
ROUTING_PROBE_TIMEOUT_S = 3.0
ROUTING_PROBE_POLL_S = 0.02
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

    def probe_keys(self) -> tuple[str, str]:
        """(the key the temporary queue is bound to `exchange` with, the key the probe is
        published with and bound to `due` with): new names for each probe."""
        probe = f"rabbit-delay.routing-probe.{uuid.uuid4().hex}"
        return f"{probe}.bound", f"{probe}.sent"


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


# -- the programs ---------------------------------------------------------------------


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


@dataclass(frozen=True, slots=True)
class DeclareReport:
    """What `declare` did, per object."""

    items: tuple[PlanItem, ...]

    @property
    def created(self) -> tuple[PlanItem, ...]:
        return tuple(i for i in self.items if i.action is Change.CREATE)

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
            args[conflict.argument] = placement_value(conflict.argument, conflict.on_broker)
        spec = QueueSpec(spec.name, args, spec.durable)
    return str(reply), ()


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
                PlanItem(i.kind, i.name, Change.CONFLICT, (routing[(i.kind, i.name)],))
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
            present[(item.kind, item.name)] = item.action is not Change.CREATE
        conflicts.extend(plan.conflicts)
    else:
        for spec in want.objects:
            exists = yield Exists(spec)
            present[(spec.kind, spec.name)] = bool(exists)
            action = Change.CREATE
            notes: tuple[str, ...] = ()
            if exists:
                reply, notes = yield from _redeclare(spec)
                if reply is None:
                    action = Change.IN_PLACE
                else:
                    conflicts.append(conflict_from_reply(spec, reply))
                    action = Change.CONFLICT
            items[(spec.kind, spec.name)] = PlanItem(spec.kind, spec.name, action, notes=notes)
        # After every object's presence is known (the probe needs to know the due exchange's).
        routing = yield from _verify_all_routing(want, present)
        for key, conflict in routing.items():
            if items[key].action is Change.IN_PLACE:
                items[key] = PlanItem(key[0], key[1], Change.CONFLICT, (conflict,))
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
        if known is None or known.action is not Change.IN_PLACE:
            yield Bind(binding)
            if known is None:
                known = PlanItem(Kind.BINDING, binding.name, Change.ENSURE)
            items[(Kind.BINDING, binding.name)] = known
    ordered = [items[(s.kind, s.name)] for s in want.objects]
    ordered += [items[(Kind.BINDING, b.name)] for b in want.bindings]
    return DeclareReport(tuple(ordered))


# -- what the broker answered: read by every driver -----------------------------------


class Translate(Protocol):
    """A transport's map from its client library's exceptions to the project's errors."""

    def __call__(self, exc: BaseException, *, doing: str, permission: str) -> Exception: ...


def accepted(op: Operation) -> object:
    """What `op` answers when the broker did it without a word."""
    return True if isinstance(op, Exists | SupportsType) else None


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


def refused(
    op: Operation, exc: BaseException, translate: Translate, code: int | None, text: str
) -> object:
    """What `op` answers when the broker closed the channel with `code` / `text` (`exc`,
    as the client raised it): see `refusal_answer`. Raises MissingPluginError (4.x refuses
    an unknown exchange type on the channel), or `failure(...)` when the refusal is an
    error of the call."""
    missing = missing_plugin(text)
    if missing is not None:
        raise missing from None
    answer = refusal_answer(op, code, text)
    if answer is NOT_ANSWERED:
        raise failure(op, exc, translate) from None
    return answer


def failure(op: Operation, exc: BaseException, translate: Translate, reply: str = "") -> Exception:
    """The error to raise for `exc`, raised by the client while executing `op` (`reply`:
    the broker's text when it closed the channel or the connection): MissingPluginError
    when the broker does not know an exchange type (3.x closes the connection, 4.x the
    channel), else what `translate` makes of it, naming the operation and its permission."""
    missing = missing_plugin(reply)
    if missing is not None:
        return missing
    return translate(exc, doing=describe(op), permission=permission(op))
