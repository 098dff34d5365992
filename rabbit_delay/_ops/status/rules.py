"""What `rabbit-delay status` shows, and what needs a human. Pure: counts are passed in.

One row per queue of the topology (tier buffers, cascade levels, the holding queue,
business queues, parking lots, the catch-all), flagged by the attention rules below, with a hint for
each flag. The CLI renders a `Status` as a table or JSON; a dashboard renders the same
object (`rabbit_delay._ops.status.execute.read_status` reads the broker and builds it).

What needs attention (`Status.attention`, exit 3 under `status --check`):
  - an object of the topology the broker does not have (a queue or an exchange);
  - a parking lot or the catch-all that holds messages;
  - a tier buffer or cascade level with consumers (a bug: they take messages early);
  - a holding queue ([held]) with ready messages and no consumer: no holder runs, its
    messages wait past their due time;
  - a buffer whose oldest message is older than its TTL plus a margin: stuck;
  - a quorum buffer whose dead letters its destination has not confirmed, in two
    samples of the management API `DEAD_LETTER_RECHECK_S` apart, no fewer the second
    time: stalled (the RabbitMQ 3.10 stall after a partition, docs/reliability.md);
  - with [schedule]: a business queue with messages still scheduled past their due
    time plus the grace (overdue: the broker did not deliver them; the workers'
    sweeper republishes them);
  - a quorum queue with less than a majority of its members online.

A quorum queue the management API lists without any message figures (RabbitMQ 3.10
stops reporting them for the queues of a node after a partition) is noted: dead letters
stalled in it do not show there, only as overdue records of the schedule.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from rabbit_delay._broker import BrokerInfo, QueueCounts
from rabbit_delay._durations import format_ms, iso_ms
from rabbit_delay._names import CASCADE_KIND, HELD_KIND, TIER_KIND
from rabbit_delay._plan.desired import desired
from rabbit_delay._record import fields_json
from rabbit_delay._topology.model import QueueType, Topology


class QueueRole(StrEnum):
    """What a queue of the topology is for (a status row's `role`)."""

    BUFFER = "tier buffer"
    CASCADE = "cascade level"
    HOLDING = "holding queue"
    BUSINESS = "business"
    PARKING = "parking lot"
    CATCH_ALL = "catch-all"


_ROLE_OF_KIND = {
    "delay": QueueRole.BUFFER,
    "cascade": QueueRole.CASCADE,
    HELD_KIND: QueueRole.HOLDING,
    "q": QueueRole.BUSINESS,
    "parking": QueueRole.PARKING,
    "unroutable": QueueRole.CATCH_ALL,
}
_ORDER = list(QueueRole)
# Queues whose messages wait for a human.
HUMAN_ROLES = (QueueRole.PARKING, QueueRole.CATCH_ALL)
# Queues that must never have consumers: they hold messages until their TTL expires.
BUFFER_ROLES = (QueueRole.BUFFER, QueueRole.CASCADE)

# A buffer is stuck when its oldest message has been in it longer than its TTL plus
# this margin (or a tenth of the TTL, when longer): a burst of thousands of messages due
# at once legitimately drains over a few seconds, the age read from a message's AMQP
# `timestamp` is whole seconds, and the management API samples every 5 s.
STUCK_MARGIN_MS = 10_000


# How long `status` waits before reading the management API again when a buffer shows
# dead letters not yet confirmed (`messages_dlx`): longer than a quorum queue's metrics
# tick (5 s) plus the API's collection interval (5 s), so the second reading is another
# sample. A normal dead letter is confirmed within milliseconds; a burst drains.
DEAD_LETTER_RECHECK_S = 12.0


def stuck_after_ms(ttl_ms: int) -> int:
    """The age past which a buffer with this TTL counts as stuck."""
    return ttl_ms + max(STUCK_MARGIN_MS, ttl_ms // 10)


# Where the age of a buffer's oldest message came from.
AGE_FROM_PEEK = "peek"  # basic.get + requeue of the head: its x-death time or timestamp
AGE_FROM_API = "management API"  # head_message_timestamp (classic queues only)

DECLARE_HINT = "run `rabbit-delay declare` to create them"

# The most overdue records `status` counts per queue (one page of the schedule).
OVERDUE_LIMIT = 1000


@dataclass
class QueueRow:
    """One queue of the topology as `status` judges it: its role and TTL, whether it
    exists, the counts it shows (live where AMQP answered, else the management API's;
    unacked and placement from the API), the age of a buffer's oldest message, and the
    flags, notes and hints the rules below add. Not a `QueueCounts`: it merges the two
    sources' counts and carries the verdict on them."""

    role: QueueRole
    name: str
    ttl_ms: int | None
    exists: bool
    ready: int | None
    unacked: int | None
    consumers: int | None
    # Where a quorum queue's replicas are, as the management API says (None: not told).
    leader: str | None = None
    members: tuple[str, ...] | None = None
    online: tuple[str, ...] | None = None
    # Dead-lettered by this quorum queue, not yet confirmed by the target (management API).
    dead_lettering: int | None = None
    # The same, in a second sample of the API read DEAD_LETTER_RECHECK_S later (None: not
    # read again: none were pending the first time, or the API did not say).
    dead_lettering_again: int | None = None
    # A quorum queue the API lists without message figures (3.10 after a partition).
    no_figures: bool = False
    # Business queues with [schedule]: records still scheduled past due + grace (None:
    # not read), and the grace that was allowed.
    overdue: int | None = None
    overdue_grace_ms: int | None = None
    # Buffers: how long the oldest message has been in the queue (None: empty, or the
    # broker cannot tell), and from where that is known.
    oldest_age_ms: int | None = None
    age_source: str | None = None
    # The holding queue ([held]): messages held until their due time and the next of
    # those times (UTC ms), from the management API of RabbitMQ 4.3+.
    held: int | None = None
    next_due_at_ms: int | None = None
    notes: list[str] = field(default_factory=list)
    # One line per flag: what to do about it.
    hints: list[str] = field(default_factory=list)
    attention: bool = False

    @property
    def offline(self) -> tuple[str, ...]:
        """Members the API does not list as online (none when it does not say)."""
        if self.members is None or self.online is None:
            return ()
        return tuple(m for m in self.members if m not in self.online)

    @property
    def majority_lost(self) -> bool:
        """A quorum queue with fewer than a majority of its members online: it accepts,
        dead-letters and delivers nothing until enough of them are back."""
        if not self.members or self.online is None:
            return False
        return len(self.members) - len(self.offline) < len(self.members) // 2 + 1

    @property
    def dead_letters_stalled(self) -> bool:
        """Dead letters of a buffer its destination confirmed in neither of two samples,
        as many or more the second time (a burst being confirmed goes down)."""
        first, again = self.dead_lettering, self.dead_lettering_again
        return (
            self.role in BUFFER_ROLES
            and first is not None
            and again is not None
            and first > 0
            and again >= first
        )

    @property
    def stuck(self) -> bool:
        """A buffer whose oldest message has outstayed its TTL (plus the margin)."""
        if self.role not in BUFFER_ROLES or self.ttl_ms is None or self.oldest_age_ms is None:
            return False
        return self.oldest_age_ms > stuck_after_ms(self.ttl_ms)

    def as_json(self) -> dict[str, Any]:
        return {
            "role": self.role.value,
            "name": self.name,
            "ttl": format_ms(self.ttl_ms) if self.ttl_ms is not None else None,
            **fields_json(self, "ttl_ms", "exists", "ready", "unacked", "consumers", "leader"),
            "members": list(self.members) if self.members is not None else None,
            "online": list(self.online) if self.online is not None else None,
            "dead_lettering": self.dead_lettering,
            "dead_lettering_again": self.dead_lettering_again,
            "dead_letters_stalled": self.dead_letters_stalled,
            "no_figures": self.no_figures,
            "overdue": self.overdue,
            "held": self.held,
            "next_due_at": iso_ms(self.next_due_at_ms) if self.next_due_at_ms else None,
            "oldest_age_ms": self.oldest_age_ms,
            "oldest_age": format_ms(self.oldest_age_ms) if self.oldest_age_ms is not None else None,
            **fields_json(self, "age_source", "stuck", "attention", "notes", "hints"),
        }


def nonempty_buffers(topology: Topology, live: Mapping[str, QueueCounts | None]) -> list[str]:
    """The tier buffers and cascade levels that hold ready messages."""
    return [
        name
        for name, counts in live.items()
        if counts is not None
        and counts.ready
        and topology.names.parse(name)[0] in (TIER_KIND, CASCADE_KIND)
    ]


def may_peek_buffers(topology: Topology, info: BrokerInfo) -> bool:
    """Whether a buffer's head may be peeked on this broker: a classic queue has no
    delivery limit; a quorum one only where a requeue cannot dead-letter it early."""
    return topology.queue_type is QueueType.CLASSIC or info.peeks_quorum_buffers_freely


def status_rows(
    topology: Topology,
    live: Mapping[str, QueueCounts | None] | None,
    api: Mapping[str, QueueCounts] | None,
    *,
    heads: Mapping[str, int | None] | None = None,
    now_ms: int = 0,
    api_again: Mapping[str, QueueCounts] | None = None,
    overdue: Mapping[str, int] | None = None,
    overdue_grace_ms: int | None = None,
) -> list[QueueRow]:
    """One row per queue of the topology, flagged.

    `live` (passive declares) gives ready messages and consumers as they are now; `api`
    (management API, sampled) adds unacked messages and each quorum queue's leader,
    members and online members, and stands in when `live` is None. `heads` gives, per
    buffer whose head was peeked, when that oldest message entered it (epoch ms, None
    when the message does not say); without a peek a classic buffer's age comes from
    the API's `head_message_timestamp`. Ages count to `now_ms`. `api_again` is a later
    sample of the API (read when a buffer had dead letters pending); `overdue` the
    schedule's records past due + `overdue_grace_ms`, by logical queue name.
    """
    rows: list[QueueRow] = []
    for spec in desired(topology).queues:
        kind, _ = topology.names.parse(spec.name)
        role = _ROLE_OF_KIND[kind]
        ttl = spec.arguments.get("x-message-ttl")
        stats = api.get(spec.name) if api is not None else None
        if live is not None:
            counts = live.get(spec.name)
            exists = counts is not None
            ready = counts.ready if counts is not None else None
            consumers = counts.consumers if counts is not None else None
        else:
            exists = stats is not None
            ready = stats.ready if stats is not None else None
            consumers = stats.consumers if stats is not None else None
        row = QueueRow(
            role,
            spec.name,
            ttl if isinstance(ttl, int) else None,
            exists,
            ready,
            stats.unacked if stats is not None else None,
            consumers,
            stats.leader if stats is not None else None,
            stats.members if stats is not None else None,
            stats.online if stats is not None else None,
            stats.dead_lettering if stats is not None else None,
        )
        if api_again is not None and row.dead_lettering:
            again = api_again.get(spec.name)
            row.dead_lettering_again = again.dead_lettering if again is not None else None
        row.no_figures = (
            stats is not None
            and stats.members is not None
            and stats.ready is None
            and stats.dead_lettering is None
        )
        if role is QueueRole.BUSINESS and overdue is not None:
            row.overdue = overdue.get(topology.names.parse(spec.name)[1], 0)
            row.overdue_grace_ms = overdue_grace_ms
        if role in BUFFER_ROLES and exists and ready:
            _age(row, heads, stats, now_ms)
        if role is QueueRole.HOLDING and stats is not None and stats.delayed is not None:
            row.held, row.next_due_at_ms = stats.delayed, stats.next_delayed_at
            if row.held:
                nxt = f", the next due {iso_ms(row.next_due_at_ms)}" if row.next_due_at_ms else ""
                row.notes.append(f"{row.held} held{nxt}")
        _flag(topology, row)
        rows.append(row)
    rows.sort(key=lambda r: _ORDER.index(r.role))  # stable: tiers keep the topology's order
    return rows


def _age(
    row: QueueRow, heads: Mapping[str, int | None] | None, stats: QueueCounts | None, now: int
) -> None:
    queued: int | None = None
    if heads is not None and row.name in heads:
        queued, row.age_source = heads[row.name], AGE_FROM_PEEK
    elif row.role is QueueRole.BUFFER and stats is not None and stats.head_timestamp is not None:
        # Not for cascade levels: a message reaches a lower level long after it was
        # published, and the timestamp is the publish time.
        queued, row.age_source = stats.head_timestamp * 1000, AGE_FROM_API
    if queued is None:
        row.age_source = None
        return
    row.oldest_age_ms = max(0, now - queued)


def _flag(topology: Topology, row: QueueRow) -> None:
    def needs(note: str, hint: str) -> None:
        row.attention = True
        row.notes.append(note)
        row.hints.append(hint)

    if not row.exists:
        needs("missing: run `rabbit-delay declare`", DECLARE_HINT)
        return
    held = (row.ready or 0) + (row.unacked or 0)
    if row.role in HUMAN_ROLES and held:
        if row.role is QueueRole.CATCH_ALL:
            hint = "due messages that matched no queue; see `rabbit-delay replay --unroutable`"
        else:
            _, queue = topology.names.parse(row.name)
            hint = (
                f"parked messages; see `rabbit-delay parked list {queue}` and "
                f"`rabbit-delay replay {queue} --dry-run`"
            )
        needs(f"{held} message(s) need a human", hint)
    if row.role in BUFFER_ROLES and row.consumers:
        needs(
            f"BUG: {row.consumers} consumer(s) on a delay buffer",
            "a consumer on a delay buffer takes messages before they are due; find it with "
            "`rabbitmqctl list_consumers` and stop it",
        )
    if row.role is QueueRole.HOLDING and held and row.consumers == 0:
        # Held messages are not ready: ready ones in a holding queue wait for a holder.
        needs(
            f"no holder: {held} message(s) wait and nothing holds or releases them",
            "run `rabbit-delay hold` (docs/held.md); its messages are late, not lost",
        )
    if row.stuck:
        age, ttl = row.oldest_age_ms or 0, row.ttl_ms or 0
        over = format_ms(age - ttl)
        needs(
            f"stuck: oldest message {format_ms(age)} old, TTL {format_ms(ttl)}",
            f"its oldest message should have been dead-lettered {over} ago: check that its "
            "dead-letter exchange exists (`rabbit-delay plan`) and the broker's log (a quorum "
            "queue whose messages do not expire: rabbitmq-server issue #10718)",
        )
    if row.dead_letters_stalled:
        needs(
            f"stalled: {row.dead_lettering_again} dead-lettered and not confirmed by their "
            f"destination, {DEAD_LETTER_RECHECK_S:.0f}s apart",
            "dead letters its destination never confirmed: they wait in the buffer, not "
            "delivered (RabbitMQ 3.10 after a partition or a lost leader, "
            "docs/reliability.md#network-partitions). Check the destination queue exists "
            "and accepts messages; on 3.10 move this buffer's leadership to another node "
            "(its new leader sends them again), or let the schedule's sweeper republish "
            "them ([schedule])",
        )
    elif row.dead_lettering:
        row.notes.append(
            f"{row.dead_lettering} dead-lettered, not yet confirmed by their destination"
        )
    if row.no_figures:
        row.notes.append("no message figures in the management API")
    if row.overdue:
        grace = format_ms(row.overdue_grace_ms or 0)
        _, queue = topology.names.parse(row.name)
        shown = f"{row.overdue}+" if row.overdue >= OVERDUE_LIMIT else str(row.overdue)
        needs(
            f"overdue: {shown} scheduled message(s) not delivered {grace} past their due time",
            "the workers' sweeper republishes them (docs/schedule.md#the-sweeper); if they "
            "stay, no worker runs or the broker holds them (a stalled buffer: "
            "docs/reliability.md#network-partitions); see `rabbit-delay scheduled list "
            f"--queue {queue} --state scheduled --due-before -{grace}`",
        )
    if row.majority_lost:
        online = len(row.members or ()) - len(row.offline)
        needs(
            f"no majority: {online} of {len(row.members or ())} members online, "
            f"offline: {', '.join(row.offline)}",
            "a quorum queue needs a majority of its members online: start the stopped "
            "node(s) (`rabbitmqctl cluster_status` lists them); no message is lost meanwhile",
        )
    elif row.offline:
        row.notes.append(f"offline: {', '.join(row.offline)}")
    elif row.members and row.leader is None:
        row.notes.append("no leader reported")


def shows_placement(rows: list[QueueRow]) -> bool:
    """Whether the table gets the leader and members columns: only when the management
    API names more than one node (a cluster), so a single node's table stays as it was."""
    nodes = {row.leader for row in rows if row.leader is not None}
    for row in rows:
        nodes.update(row.members or ())
    return len(nodes) > 1


def placement_cells(row: QueueRow) -> tuple[str, str]:
    """The leader and members cells of a row: `rabbit@b`, `2/3 online`; `?` where the
    API did not say (a classic queue, or no API), `none` for a queue without a leader."""
    if row.members is None:
        return ("?" if row.leader is None else row.leader), "?"
    leader = row.leader if row.leader is not None else "none"
    if row.online is None:
        return leader, str(len(row.members))
    return leader, f"{len(row.members) - len(row.offline)}/{len(row.members)} online"


def oldest_cell(row: QueueRow) -> str:
    """The age of a buffer's oldest message: `4s`, `?` for a non-empty buffer whose age
    the broker cannot tell, empty for other queues and empty buffers."""
    if row.role not in BUFFER_ROLES or not row.exists or not row.ready:
        return ""
    return "?" if row.oldest_age_ms is None else format_ms(row.oldest_age_ms)


@dataclass(frozen=True, slots=True)
class PluginStore:
    """The delayed-message plugin's store: messages its exchange holds (None: the
    management API did not say, or was not used)."""

    exchange: str
    delayed: int | None

    def as_json(self) -> dict[str, Any]:
        return {"exchange": self.exchange, "delayed": self.delayed}


@dataclass(frozen=True, slots=True)
class Attention:
    """One line of what needs a human: what, and what to do."""

    subject: str
    hint: str


@dataclass
class Status:
    """Everything `status` says about one topology on one broker."""

    namespace: str
    broker: str  # the URL of the node that answered (redact it before showing it)
    broker_version: str | None
    broker_description: str | None  # 'RabbitMQ 4.3.6 (cluster ..., Erlang/OTP ...)'
    checked_at_ms: int
    rows: list[QueueRow]
    # Exchanges of the topology the broker does not have (None: not checked).
    missing_exchanges: tuple[str, ...] | None
    plugin: PluginStore | None
    sources: dict[str, str | None]
    management_api: str  # "ok", or why it was not used
    notes: list[str] = field(default_factory=list)

    @property
    def attention(self) -> bool:
        return bool(self.missing_exchanges) or any(r.attention for r in self.rows)

    def attention_items(self) -> list[Attention]:
        """What needs a human, one line each; missing objects in one line."""
        missing = [f"queue {r.name}" for r in self.rows if not r.exists]
        missing += [f"exchange {name}" for name in self.missing_exchanges or ()]
        items = [Attention("missing " + ", ".join(missing), DECLARE_HINT)] if missing else []
        for row in self.rows:
            if row.exists:
                items += [Attention(row.name, hint) for hint in row.hints]
        return items

    def as_json(self) -> dict[str, Any]:
        return {
            **fields_json(self, "namespace", "broker", "broker_version", "broker_description"),
            "checked_at": iso_ms(self.checked_at_ms),
            **fields_json(self, "sources", "management_api", "attention"),
            "attention_items": [
                {"subject": item.subject, "hint": item.hint} for item in self.attention_items()
            ],
            "missing_exchanges": (
                list(self.missing_exchanges) if self.missing_exchanges is not None else None
            ),
            "plugin_store": self.plugin.as_json() if self.plugin is not None else None,
            "notes": self.notes,
            "queues": [r.as_json() for r in self.rows],
        }


__all__ = [
    "AGE_FROM_API",
    "AGE_FROM_PEEK",
    "BUFFER_ROLES",
    "DEAD_LETTER_RECHECK_S",
    "HUMAN_ROLES",
    "OVERDUE_LIMIT",
    "STUCK_MARGIN_MS",
    "Attention",
    "PluginStore",
    "QueueRole",
    "QueueRow",
    "Status",
    "may_peek_buffers",
    "nonempty_buffers",
    "oldest_cell",
    "placement_cells",
    "shows_placement",
    "status_rows",
    "stuck_after_ms",
]
