"""How what a topology needs compares with what the broker has: a plan of changes,
with the arguments each broker version adds by itself made explicit on both sides.
Pure.

`make_plan` compares with what the management API reported (`Observed`);
`plan_from_presence` makes do with passive declares (present or missing). Neither ever
deletes: a placement argument that differs is a note, a retired shard is `extra`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum

from rabbit_delay._broker import normalise_queue_arguments
from rabbit_delay._errors import ArgumentConflict
from rabbit_delay._plan.desired import (
    CREATION_ONLY_ARGUMENTS,
    INITIAL_GROUP_SIZE,
    Desired,
    ExchangeSpec,
    Kind,
    ObjectSpec,
    QueueSpec,
)


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


class Change(StrEnum):
    """What declaring does, or would do, to one object (`rabbit-delay plan` shows the
    values)."""

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
    action: Change
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
        return tuple(i for i in self.items if i.action in (Change.CREATE, Change.CONFLICT))

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


def placement_value(argument: str, value: object) -> object:
    """A placement value read back from a 406 text, in the type the broker stored it
    with (the group size is a number even when the topology sets none)."""
    if argument == INITIAL_GROUP_SIZE and isinstance(value, str) and value.isdigit():
        return int(value)
    return value


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
            Change.EXTRA,
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
            items.append(PlanItem(spec.kind, spec.name, Change.CREATE))
        else:
            conflicts = compare(spec, existing)
            action = Change.CONFLICT if conflicts else Change.IN_PLACE
            notes = placement_notes(spec, existing)
            items.append(PlanItem(spec.kind, spec.name, action, conflicts, notes))
    for b in want.bindings:
        if observed.bindings is None:
            action = Change.ENSURE
        else:
            key = (b.source, b.destination, b.destination_type.value, b.routing_key)
            action = Change.IN_PLACE if key in observed.bindings else Change.CREATE
        items.append(PlanItem(Kind.BINDING, b.name, action))
    items.extend(retired_shards(want, observed.exchanges, observed.queues))
    return Plan(tuple(items))


def plan_from_presence(want: Desired, present: Mapping[tuple[Kind, str], bool]) -> Plan:
    """Plan from passive declares only: objects are present or missing, arguments
    unread, bindings unknown (binding is idempotent, so declare simply ensures them).

    `present` is keyed by (kind, name): a tier's exchange and its buffer queue share a name.
    """
    items = [
        PlanItem(s.kind, s.name, Change.PRESENT if present[(s.kind, s.name)] else Change.CREATE)
        for s in want.objects
    ]
    items += [PlanItem(Kind.BINDING, b.name, Change.ENSURE) for b in want.bindings]
    return Plan(tuple(items))
