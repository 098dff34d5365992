"""What a pending message becomes in the target topology (`rabbit-delay transfer`). Pure.

A transfer moves the messages still waiting in one topology (its tier buffers and
cascade levels and, by default, the ready messages of its business queues that nobody
consumes: due already) into another topology, on the same broker (v1 -> v2, classic ->
quorum) or on another one (a 3.x -> 4.x upgrade), never early and never losing one. For
each message read from a source queue this module decides what is published in the
target (`Move`) or why the message stays where it is (`Leave`);
`rabbit_delay._ops.transfer.execute` reads, publishes, waits for the confirms and only then
acks the originals. `docs/transfer.md` tells the whole story.

What a moved message keeps: body, message_id, content type, the application's headers,
`rd-attempt`, `rd-due-at` and the delay first asked for (`rd-delay-ms`); the broker's
headers go (`_ops.replay.rules.replay_headers`). It waits what remains until `rd-due-at`
(`Router.resolve_remaining`): exactly through the target's cascade (rounded up to its
resolution) or plugin, else through the shortest tier its target accepts that is not
shorter; never early, and `Move.added_ms` is how late that makes it. Due already: to the
target's due exchange, now.

Where it goes: `rd-target` is a routing key of the SOURCE topology. A business queue's
own key (`{source prefix}.q.X`) becomes the target's key of queue X; a binding key stays
a binding key (declared in the target). A ready message of business queue X goes to the
target's queue X alone, by its own key: a shared binding key delivered a copy to every
queue it reaches, and each copy must reach only the queue it was in.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from rabbit_delay import _headers as h
from rabbit_delay._broker import BrokerInfo
from rabbit_delay._durations import format_ms, iso_ms
from rabbit_delay._envelope import BINARY, Envelope, Outgoing, outgoing
from rabbit_delay._errors import ConfigError, DecodeError, DelayError, UnknownTargetError
from rabbit_delay._ops.replay.rules import Leave, replay_headers
from rabbit_delay._ops.stored import Stored
from rabbit_delay._plan.desired import desired
from rabbit_delay._record import fields_json
from rabbit_delay._topology.delays import Router
from rabbit_delay._topology.model import QueueType, Topology

__all__ = [
    "DEFAULT_TRANSFER_BATCH",
    "Address",
    "Leave",
    "Move",
    "QueueTally",
    "Source",
    "SourceKind",
    "Transfer",
    "TransferReport",
    "check_distinct",
    "held_for_people",
    "same_vhost",
    "skip_reason",
    "sources",
    "stable_id",
    "target_queues",
    "transfer_notes",
]


# Messages read, published and acked at a time (`transfer --batch`).
DEFAULT_TRANSFER_BATCH = 500


class SourceKind(StrEnum):
    CASCADE = "cascade level"
    BUFFER = "tier buffer"
    READY = "business queue"


@dataclass(frozen=True, slots=True)
class Source:
    """One queue of the source topology that a transfer reads."""

    kind: SourceKind
    name: str  # the queue on the broker
    detail: str  # its tier, its cascade level, or the business queue's logical name
    ttl_ms: int | None = None

    @property
    def buffer(self) -> bool:
        """A tier buffer or a cascade level: it holds messages until they are due and
        must have no consumer (a consumer would take them early)."""
        return self.kind is not SourceKind.READY


def sources(topology: Topology, *, ready: bool = True) -> tuple[Source, ...]:
    """The queues of `topology` holding pending messages, in the order a transfer reads
    them: cascade levels from the top down (a message passes down the levels as it
    waits, so one read top-down finds one that moves meanwhile in a level still to be
    read), tier buffers shortest first (their heads are due soonest), every shard of
    each; then, with `ready`, the business queues, where whatever fell due before it
    was read has gone (read last, so the same run moves those too).
    """
    n = topology.names
    found: list[Source] = []
    if topology.cascade is not None:
        cfg = topology.cascade
        for level in reversed(range(cfg.levels)):
            ttl = (2**level) * cfg.resolution
            found.append(Source(SourceKind.CASCADE, n.cascade_queue(level), f"{level:02d}", ttl))
    for tier, ms in sorted(topology.tiers.items(), key=lambda item: item[1]):
        found.extend(Source(SourceKind.BUFFER, q, tier, ms) for q in topology.tier_queues(tier))
    if ready:
        found.extend(
            Source(SourceKind.READY, n.business_queue(queue), queue) for queue in topology.queues
        )
    return tuple(found)


def held_for_people(topology: Topology) -> tuple[str, ...]:
    """Parking lots and the catch-all: messages that wait for a human, not for a due
    time. A transfer never moves them (`rabbit-delay replay` does); it counts them."""
    n = topology.names
    return (*(n.parking_queue(q) for q in topology.queues), n.unroutable_queue())


def target_queues(target: Topology) -> tuple[str, ...]:
    """Every queue the target topology declares: a transfer checks they all exist
    before it moves anything (a copy for a missing business queue would be confirmed
    into the catch-all)."""
    return tuple(spec.name for spec in desired(target).queues)


Address = tuple[str, int, str]  # host, port, virtual host of a connection


def same_vhost(a: BrokerInfo, b: BrokerInfo, a_at: Address, b_at: Address) -> bool:
    """Whether two connections reach the same virtual host of the same broker: the same
    address, or the same cluster name (two addresses of one node) and vhost."""
    if a_at == b_at:
        return True
    return bool(a.cluster_name) and a.cluster_name == b.cluster_name and a_at[2] == b_at[2]


def check_distinct(source: Topology, target: Topology, *, same_broker: bool) -> None:
    """Raise ConfigError when the transfer would read and write the same queues (the
    same topology in the same virtual host): it would move messages in a circle."""
    if same_broker and source.names.prefix == target.names.prefix:
        raise ConfigError(
            f"source and target are the same topology {source.names.prefix!r} in the same "
            "virtual host of the same broker: give the target topology with --to FILE "
            "(another `version` or namespace), or the target broker with --to-url"
        )


def skip_reason(source: Source, ready: int | None, consumers: int) -> str | None:
    """Why `source` is not read (None: read it), from its live counts (`ready` None:
    the queue does not exist)."""
    if ready is None:
        return "does not exist on the source broker"
    if consumers and source.buffer:
        return (
            f"{consumers} consumer(s) on it take its messages before they are due: stop "
            "them (`rabbitmqctl list_consumers` names them) and run transfer again"
        )
    if consumers:
        return f"{consumers} consumer(s): its workers deliver these messages"
    return None


def transfer_notes(
    source: Topology, target: Topology, broker: BrokerInfo | None = None
) -> list[str]:
    """What an operator must know about this pair of topologies (and the source
    `broker`) before moving."""
    notes: list[str] = []
    limit = broker.default_delivery_limit if broker is not None else None
    quorum = source.queue_type is QueueType.QUORUM
    if limit and quorum and broker is not None and broker.nack_requeue_counts:
        notes.append(
            f"on RabbitMQ {broker.version_text or '(version unknown)'} each message a "
            "dry run reads, or a run leaves in place, counts as a delivery of its buffer, "
            f"whose delivery limit is {limit} (buffers set none): past it the broker "
            "dead-letters the message early into its business queue; keep dry runs and "
            "re-runs over the same messages few"
        )
    if source.plugin is not None:
        notes.append(
            f"{source.names.prefix} uses the delayed-message plugin: its pending messages "
            "are in the plugin's store on the node and cannot be read or moved. When due, "
            "the plugin delivers them to the old business queues: run transfer again after "
            "the longest delay in use to move them from there (queues without consumers)"
        )
    if target.cascade is None and target.plugin is None:
        notes.append(
            f"{target.names.prefix} has no [cascade]: a message waits in the shortest tier "
            "not shorter than what it has left, late by the difference (up to that tier's "
            "length); a [cascade] in the target makes every due time exact"
        )
    return notes


def stable_id(msg: Stored) -> str:
    """A message_id for a message published without one, the same each time it is read
    (a re-run after a crash publishes the same id again, which the guard absorbs)."""
    digest = hashlib.sha256()
    for part in (msg.content_type, msg.header(h.H_TARGET), msg.header(h.H_DUE_AT)):
        digest.update((part or "").encode() + b"\0")
    digest.update(msg.body)
    return "rd-transfer-" + digest.hexdigest()[:32]


@dataclass(frozen=True, slots=True)
class Move:
    """What one message becomes in the target: `outgoing`, through `tier` of the target
    (a tier name, "cascade", "plugin" or "now") for its routing key `target`."""

    outgoing: Outgoing
    tier: str
    target: str
    remaining_ms: int  # until its rd-due-at when it was read (<= 0: due already)
    added_ms: int  # how late the target's route makes it: its delay minus what remained

    @property
    def overdue_ms(self) -> int:
        """How long it was due already when read (a ready message, or one that fell due
        while waiting for the transfer)."""
        return max(0, -self.remaining_ms)

    @property
    def destination(self) -> str:
        return f"{self.target} ({self.tier})"

    @property
    def due_at_ms(self) -> int | None:
        due = self.outgoing.headers.get(h.H_DUE_AT)
        return due if isinstance(due, int) else None


class Transfer:
    """Decides what each pending message of `source` becomes in `target` (see the module
    docstring). Raises nothing for a message: what cannot move is a `Leave`."""

    def __init__(self, source: Topology, target: Topology) -> None:
        self.source = source
        self.target = target
        self.router = Router(target)
        # A run sees a handful of distinct targets over thousands of messages.
        self._keys: dict[tuple[SourceKind, str], str | Leave] = {}

    def decide(self, msg: Stored, source: Source, now_ms: int) -> Move | Leave:
        """The copy of `msg`, read from `source` at `now_ms`, for the target; or why it
        stays in `source`."""
        try:
            env = Envelope.from_headers(msg.message_id, msg.headers)
        except DecodeError as exc:
            return Leave(f"{exc}: cannot tell when it is due")
        key = self._target_key(msg, source)
        if isinstance(key, Leave):
            return key
        if source.kind is SourceKind.READY:
            remaining = 0  # in a business queue: due already, whatever its header says
        elif env.due_at_ms is None:
            return Leave(
                "no rd-due-at header (not published by rabbit-delay?): its due time is unknown"
            )
        else:
            remaining = env.due_at_ms - now_ms
        try:
            route = self.router.resolve_remaining(key, remaining)
        except DelayError:
            return Leave(
                f"due later than the longest tier that {key!r} accepts in "
                f"{self.target.names.prefix} (it would arrive early): add a longer tier or "
                "a [cascade] to the target topology"
            )
        except UnknownTargetError as exc:
            return Leave(str(exc))
        requested = msg.headers.get(h.H_DELAY_MS)
        out = outgoing(
            route,
            msg.body,
            msg.content_type or BINARY,
            now_ms,
            msg.message_id or stable_id(msg),
            replay_headers(msg.headers),
            env.attempt,
            due_at=env.due_at_ms,
            requested_ms=int(requested)
            if isinstance(requested, int) and not isinstance(requested, bool)
            else None,  # pika decodes large integers as its own `long` subclass
        )
        return Move(out, route.tier, key, remaining, max(0, route.delay_ms - max(remaining, 0)))

    def _target_key(self, msg: Stored, source: Source) -> str | Leave:
        """The target topology's routing key for `msg`."""
        if source.kind is SourceKind.READY:
            key = source.detail  # the business queue it is in
        else:
            # A tier route publishes with the target key itself; a cascade key spells bits.
            key = msg.target or (msg.routing_key if source.kind is SourceKind.BUFFER else "")
        found = self._keys.get((source.kind, key))
        if found is None:
            found = self._keys[(source.kind, key)] = self._map_key(source.kind, key)
        return found

    def _map_key(self, kind: SourceKind, key: str) -> str | Leave:
        """The target's key for a business queue's name (READY) or a source routing key."""
        names = self.target.names
        if kind is SourceKind.READY:
            queue: str | None = key
        else:
            if not key:
                return Leave("no rd-target header: its destination is unknown")
            queue = self._source_queue(key)
            if queue is None:  # a binding key: the same one in the target
                try:
                    return self.router.target_key(None, key)
                except UnknownTargetError:
                    return Leave(
                        f"binding key {key!r} is not in the target topology {names.prefix}"
                    )
        if queue not in self.target.queues:
            return Leave(f"queue {queue!r} is not in the target topology {names.prefix}")
        return names.queue_key(queue)

    def _source_queue(self, key: str) -> str | None:
        """The business queue whose own key `key` is in the source topology, if it is one."""
        try:
            kind, detail = self.source.names.parse(key)
        except ValueError:
            return None
        return detail if kind == "q" else None


# -- what a run did (or, dry, would do) ---------------------------------------------------


@dataclass
class QueueTally:
    """One source queue in a transfer: what it held, what moved where, what stayed.

    In a dry run `moved` counts what would move. `left` holds the reasons of the last
    read (a re-read finds the same messages again)."""

    source: Source
    ready: int | None = None  # ready messages when first looked at (None: no such queue)
    consumers: int = 0
    skipped: str | None = None  # why it was not read
    moved: int = 0
    left: Counter[str] = field(default_factory=Counter)
    destinations: Counter[str] = field(default_factory=Counter)
    added_max_ms: int = 0
    added_total_ms: int = 0
    later: int = 0  # moves that the target's route makes later than due
    overdue_max_ms: int = 0
    first_due_ms: int | None = None
    last_due_ms: int | None = None
    remaining: int | None = None  # ready messages at the end (None: not counted)

    def record(self, decision: Move | Leave) -> None:
        """Count one decision (a move once its copy is confirmed and the original acked)."""
        if isinstance(decision, Leave):
            self.left[decision.reason] += 1
            return
        self.moved += 1
        self.destinations[decision.destination] += 1
        self.added_max_ms = max(self.added_max_ms, decision.added_ms)
        self.added_total_ms += decision.added_ms
        self.later += decision.added_ms > 0
        self.overdue_max_ms = max(self.overdue_max_ms, decision.overdue_ms)
        due = decision.due_at_ms
        if due is not None:
            self.first_due_ms = due if self.first_due_ms is None else min(self.first_due_ms, due)
            self.last_due_ms = due if self.last_due_ms is None else max(self.last_due_ms, due)

    def skip(self, reason: str, ready: int | None) -> None:
        """Not read, for `reason`, holding `ready` messages: a buffer's count as left
        (they stay where a consumer takes them early); a business queue's are its
        consumers' to deliver."""
        self.skipped = reason
        self.left.clear()
        if self.source.buffer and ready:
            self.left[reason] = ready

    @property
    def left_count(self) -> int:
        return sum(self.left.values())

    @property
    def pending_after(self) -> int:
        """Messages still in the queue at the end, that a transfer should have moved."""
        if self.remaining is None or (self.skipped is not None and not self.source.buffer):
            return 0
        return self.remaining

    def as_json(self) -> dict[str, Any]:
        return {
            "queue": self.source.name,
            "role": self.source.kind.value,
            "ttl": format_ms(self.source.ttl_ms) if self.source.ttl_ms is not None else None,
            **fields_json(self, "ready", "consumers", "skipped", "moved"),
            "left": [{"reason": r, "count": n} for r, n in self.left.most_common()],
            "destinations": dict(self.destinations.most_common()),
            "added_lateness_max": format_ms(self.added_max_ms),
            "added_lateness_max_ms": self.added_max_ms,
            "later_than_due": self.later,
            "overdue_max_ms": self.overdue_max_ms,
            "first_due": iso_ms(self.first_due_ms),
            "last_due": iso_ms(self.last_due_ms),
            "remaining": self.remaining,
        }


@dataclass
class TransferReport:
    """A whole transfer: every source queue's tally, and how the run ended. Everything
    counted in `moved` was confirmed in the target before its original was acked."""

    source: str  # the source topology's prefix
    target: str
    dry_run: bool
    queues: list[QueueTally]
    notes: list[str] = field(default_factory=list)
    people: dict[str, int] = field(default_factory=dict)  # parking lots, catch-all: held
    passes: int = 0
    error: str | None = None
    elapsed_s: float = 0.0
    limit: int | None = None  # --limit: at most this many to move

    @classmethod
    def start(
        cls,
        transfer: Transfer,
        *,
        dry_run: bool,
        ready: bool = True,
        broker: BrokerInfo | None = None,
        limit: int | None = None,
    ) -> TransferReport:
        """An empty report of a run of `transfer` that reads from `broker`."""
        return cls(
            transfer.source.names.prefix,
            transfer.target.names.prefix,
            dry_run,
            [QueueTally(s) for s in sources(transfer.source, ready=ready)],
            transfer_notes(transfer.source, transfer.target, broker),
            limit=limit,
        )

    @property
    def moved(self) -> int:
        return sum(q.moved for q in self.queues)

    @property
    def left(self) -> int:
        return sum(q.left_count for q in self.queues)

    @property
    def pending_after(self) -> int:
        return sum(q.pending_after for q in self.queues)

    @property
    def added_max_ms(self) -> int:
        return max((q.added_max_ms for q in self.queues), default=0)

    @property
    def added_mean_ms(self) -> float:
        moved = self.moved
        return sum(q.added_total_ms for q in self.queues) / moved if moved else 0.0

    @property
    def later(self) -> int:
        return sum(q.later for q in self.queues)

    @property
    def overdue_max_ms(self) -> int:
        """How long the most overdue moved message was due already when it was read."""
        return max((q.overdue_max_ms for q in self.queues), default=0)

    @property
    def limit_reached(self) -> bool:
        return self.limit is not None and self.moved >= self.limit

    @property
    def complete(self) -> bool:
        """Everything pending moved (dry run: would move), or as many as the limit
        asked, and nothing was left in place."""
        done = self.pending_after == 0 or self.limit_reached
        return self.error is None and self.left == 0 and done

    @property
    def rate(self) -> float:
        """Messages moved per second of the run."""
        return self.moved / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def left_lines(self) -> list[str]:
        """`N in QUEUE: reason`, one per queue and reason, most first."""
        return [
            f"{count} in {q.source.name}: {reason}"
            for q in self.queues
            for reason, count in q.left.most_common()
        ]

    def as_json(self) -> dict[str, Any]:
        return {
            "dry_run": self.dry_run,
            "ok": self.complete,
            **fields_json(self, "source", "target", "moved", "left"),
            "still_in_source": self.pending_after,
            **fields_json(self, "limit", "limit_reached", "passes"),
            "elapsed_s": round(self.elapsed_s, 3),
            "rate_msg_s": round(self.rate, 1),
            "added_lateness": {
                "max": format_ms(self.added_max_ms),
                "max_ms": self.added_max_ms,
                "mean_ms": round(self.added_mean_ms, 1),
                "later_than_due": self.later,
            },
            "overdue_when_read_max_ms": self.overdue_max_ms,
            "not_moved_held_for_people": self.people,
            "notes": self.notes,
            "error": self.error,
            "queues": [q.as_json() for q in self.queues if q.ready or q.moved or q.skipped],
        }
