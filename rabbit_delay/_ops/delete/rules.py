"""What `rabbit-delay delete` removes, and what stops it. Pure.

Only the objects the topology declares (`plan.desired`: every exchange and queue, each
tier's shards included) and the buffers of shards past a tier's count that are still on
the broker (`extra` in a plan). Every one of those names is built by `names.py` for the
topology's namespace and version, so nothing of another namespace or version is ever
touched (`shop.v1` never reaches `shop.v2.*` or `shop.v10.*`).

A queue that holds messages (ready, unacked, being dead-lettered) or has consumers
blocks the whole delete, unless forced: nothing is deleted then, and the blockers are
listed. The order: first the exchanges publishers and replays enter by (tier
exchanges, cascade entry exchanges, the plugin exchange), so that nothing new arrives;
then the queues, tier buffers first, the catch-all last; then the other exchanges.
Just before each queue goes, the executor looks again (`still_idle`): a message that
arrived since the survey stops the run there.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rabbit_delay._broker import QueueCounts
from rabbit_delay._errors import RabbitDelayError
from rabbit_delay._names import CASCADE_KIND, HELD_KIND, TIER_KIND, Names
from rabbit_delay._plan.desired import Desired, Kind
from rabbit_delay._plan.diff import PlanItem


@dataclass(frozen=True, slots=True)
class Target:
    """One object to delete."""

    kind: Kind  # Kind.EXCHANGE or Kind.QUEUE
    name: str
    extra: bool = False  # a shard past its tier's count (a lowered count left it)

    def as_json(self) -> dict[str, Any]:
        return {"kind": self.kind.value, "name": self.name, "extra": self.extra}


@dataclass(frozen=True, slots=True)
class Blocker:
    """A queue that holds messages or is in use: deleting it would lose them."""

    name: str
    state: QueueCounts  # live ready and consumers; unacked, dead-lettering from the API

    @property
    def reason(self) -> str:
        s = self.state
        parts = [f"{s.ready} ready"] if s.ready else []
        if s.unacked:
            parts.append(f"{s.unacked} unacked")
        if s.dead_lettering:
            parts.append(f"{s.dead_lettering} being dead-lettered")
        held = f"{s.held} message(s) ({', '.join(parts)})" if parts else ""
        used = f"{s.consumers} consumer(s)" if s.consumers else ""
        return " and ".join(p for p in (held, used) if p)

    def as_json(self) -> dict[str, Any]:
        s = self.state
        return {
            "name": self.name,
            "messages": s.held,
            "ready": s.ready,
            "unacked": s.unacked,
            "dead_lettering": s.dead_lettering,
            "consumers": s.consumers,
        }


def blocks(state: QueueCounts | None) -> bool:
    """Whether a queue in this state may not be deleted without --force."""
    return state is not None and (state.held > 0 or bool(state.consumers))


def still_idle(state: QueueCounts | None) -> bool:
    """The last look before a queue is deleted: gone already, or empty and unused."""
    return not blocks(state)


@dataclass(frozen=True, slots=True)
class Found:
    """What the broker has of a topology: each queue's state (None: absent), whether
    each exchange exists, and the retired shards found (`plan.retired_shards`)."""

    queues: Mapping[str, QueueCounts | None]
    exchanges: Mapping[str, bool]
    retired: tuple[PlanItem, ...] = ()


def _entry(names: Names, exchange: str) -> bool:
    """An exchange messages enter the topology by (publishers, replays)."""
    kind, detail = names.parse(exchange)
    entry_kinds = (TIER_KIND, "delayed", HELD_KIND)
    return kind in entry_kinds or (kind == CASCADE_KIND and detail.endswith(".in"))


def targets(want: Desired, retired: Iterable[PlanItem] = ()) -> list[Target]:
    """Every object of the topology and its retired shards, in the order to delete them
    (see the module docstring)."""
    assert want.names is not None  # desired() always names its objects
    names = want.names
    extra = [Target(item.kind, item.name, extra=True) for item in retired]
    entries = [Target(Kind.EXCHANGE, e.name) for e in want.exchanges if _entry(names, e.name)]
    entries += [t for t in extra if t.kind is Kind.EXCHANGE]
    queues = [Target(Kind.QUEUE, q.name) for q in want.queues]
    queues += [t for t in extra if t.kind is Kind.QUEUE]
    order = {TIER_KIND: 0, CASCADE_KIND: 1, HELD_KIND: 1, "q": 2, "parking": 3, "unroutable": 4}
    queues.sort(key=lambda t: order[names.parse(t.name)[0]])  # stable: topology order kept
    rest = [Target(Kind.EXCHANGE, e.name) for e in want.exchanges if not _entry(names, e.name)]
    return [*entries, *queues, *rest]


@dataclass(frozen=True, slots=True)
class DeletePlan:
    """What a delete would do: `delete` the objects present, in order; `missing` the
    ones already gone; `blocked` the queues that stop it (unless `force`)."""

    namespace: str
    delete: tuple[Target, ...]
    missing: tuple[Target, ...]
    blocked: tuple[Blocker, ...]
    force: bool

    @property
    def refused(self) -> bool:
        return bool(self.blocked) and not self.force


def decide(want: Desired, found: Found, *, force: bool = False) -> DeletePlan:
    """The delete of `want` given what the broker has (`found`)."""
    assert want.names is not None
    present: list[Target] = []
    missing: list[Target] = []
    blocked: list[Blocker] = []
    for target in targets(want, found.retired):
        if target.kind is Kind.QUEUE:
            state = found.queues.get(target.name)
            exists = state is not None
            if blocks(state):
                assert state is not None
                blocked.append(Blocker(target.name, state))
        else:
            exists = found.exchanges.get(target.name, False)
        (present if exists else missing).append(target)
    return DeletePlan(want.names.prefix, tuple(present), tuple(missing), tuple(blocked), force)


@dataclass
class DeleteReport:
    """What a delete did: `deleted` in order; `error` when it stopped on a failure or
    on a queue that was no longer idle (what was deleted before stays deleted)."""

    plan: DeletePlan
    dry_run: bool
    deleted: list[Target] = field(default_factory=list)
    error: str | None = None
    failure: RabbitDelayError | None = None  # the error that stopped it, if one did

    @property
    def ok(self) -> bool:
        return self.error is None and not self.plan.refused

    def as_json(self) -> dict[str, Any]:
        p = self.plan
        done = not self.dry_run and not p.refused
        return {
            "namespace": p.namespace,
            "dry_run": self.dry_run,
            "force": p.force,
            "ok": self.ok,
            "refused": p.refused,
            "deleted": [t.as_json() for t in self.deleted],
            "would_delete": [] if done else [t.as_json() for t in p.delete],
            "missing": [t.as_json() for t in p.missing],
            "blocked": [b.as_json() for b in p.blocked],
            "error": self.error,
        }


__all__ = [
    "Blocker",
    "DeletePlan",
    "DeleteReport",
    "Found",
    "Target",
    "blocks",
    "decide",
    "still_idle",
    "targets",
]
