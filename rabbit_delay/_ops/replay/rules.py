"""Replaying parked and unroutable messages: what is read, what is re-published. Pure.

A parked message goes back to its business queue as a fresh first attempt: the
parking headers and the broker's `x-death` record are dropped, `rd-attempt` is 1 again,
and the due time, tier and target are those of the replay route (now, through the due
exchange by the queue's unique key, or after a tier). Body, message_id, content type
and every other header are kept, so the idempotency guard still recognises the message.

A message in the catch-all goes on to where it was headed: a due message to its
`rd-target` (a business queue key or binding key of the topology) through the due
exchange; a message that was on its way to a parking lot back to that parking lot (a
failed message is never turned into a live delivery by re-routing). Its headers are
kept (only the broker's are dropped): it never reached a handler.

The pika layer (`rabbit_delay._ops.replay.execute`) gets each message, publishes what this
module built, and acks the original only once the copy is confirmed; what it did is a
`ReplayReport`, what a dry run would do a `Preview` (both here: plain data).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rabbit_delay import _headers as h
from rabbit_delay._envelope import (
    BINARY,
    Outgoing,
    forward,
    new_message_id,
    outgoing,
    strip_broker_headers,
    text_header,
)
from rabbit_delay._errors import UnknownTargetError
from rabbit_delay._ops.stored import Stored
from rabbit_delay._topology.delays import IMMEDIATE, Route, Router
from rabbit_delay._topology.model import Topology

# Written when a message is parked; meaningless once it is replayed.
PARKING_HEADERS = (
    h.H_ERROR_TYPE,
    h.H_ERROR_MESSAGE,
    h.H_ERROR_TRACEBACK,
    h.H_ORIGINAL_QUEUE,
    h.H_FIRST_FAILURE,
    h.H_LAST_FAILURE,
    h.H_PARK_REASON,
)
# Describe the previous trip; the replay route writes them anew (_envelope.outgoing).
ROUTE_HEADERS = (h.H_DUE_AT, h.H_DELAY_MS, h.H_TIER, h.H_ATTEMPT, h.H_TARGET, h.H_PLUGIN_DELAY)


def replay_headers(headers: Mapping[str, object]) -> dict[str, object]:
    """The headers a replayed parked message keeps: all but the broker's, the parking
    ones and those of its previous route."""
    dropped = {*PARKING_HEADERS, *ROUTE_HEADERS}
    return {k: v for k, v in strip_broker_headers(headers).items() if k not in dropped}


def resolve_queue(topology: Topology, queue: str) -> str:
    """The logical queue name for `queue`, also given as its business or parking-lot name.

    Raises UnknownTargetError when the topology has no such queue.
    """
    n = topology.names
    if queue not in topology.queues:
        try:
            kind, detail = n.parse(queue)
        except ValueError:
            kind, detail = "", ""
        if kind in ("q", "parking") and detail in topology.queues:
            return detail
        known = ", ".join(sorted(topology.queues))
        raise UnknownTargetError(f"unknown queue {queue!r}; the topology {n.prefix!r} has: {known}")
    return queue


class ParkedReplay:
    """Builds the copy of each message replayed from one queue's parking lot.

    `tier=None` replays at once: to the due exchange with the queue's unique key, so
    only this queue gets it (never every queue bound to a shared binding key). With a
    tier, through that tier's buffer like `publish_delayed(queue=...)`: for a sharded
    tier, the shard the message's id picks (`_envelope.outgoing`).

    Raises UnknownTargetError for a queue outside the topology and DelayError for a
    tier it does not have or the queue does not accept.
    """

    def __init__(self, topology: Topology, queue: str, tier: str | None = None) -> None:
        self.topology = topology
        self.queue = resolve_queue(topology, queue)
        n = topology.names
        self.parking_queue = n.parking_queue(self.queue)
        self.business_queue = n.business_queue(self.queue)
        key = n.queue_key(self.queue)
        router = Router(topology)
        self.route: Route = (
            router.immediate(key) if tier is None else router.resolve(key, tier=tier)
        )

    @property
    def destination(self) -> str:
        when = "now" if self.route.tier == IMMEDIATE else f"after tier {self.route.tier}"
        return f"{self.business_queue} ({when})"

    def outgoing(self, msg: Stored, now_ms: int) -> Outgoing:
        """The replayed copy: attempt 1, parking and broker headers dropped."""
        return outgoing(
            self.route,
            msg.body,
            msg.content_type or BINARY,
            now_ms,
            msg.message_id or new_message_id(),
            replay_headers(msg.headers),
            attempt=1,
        )


@dataclass(frozen=True, slots=True)
class Reroute:
    """Where a catch-all message goes: `outgoing`, reaching the business `queues`
    (whose parking lots, when `to_parking`)."""

    outgoing: Outgoing
    queues: tuple[str, ...]
    to_parking: bool = False


@dataclass(frozen=True, slots=True)
class Leave:
    """A catch-all message that stays where it is, and why."""

    reason: str


class UnroutableReplay:
    """Decides where each catch-all message goes (see the module docstring).

    `queue` limits the replay to messages headed for that queue (others are left).
    Raises UnknownTargetError for a `queue` outside the topology.
    """

    def __init__(self, topology: Topology, queue: str | None = None) -> None:
        self.topology = topology
        self.router = Router(topology)
        self.only = resolve_queue(topology, queue) if queue is not None else None
        self.catch_all = topology.names.unroutable_queue()

    def _parked_queue(self, msg: Stored) -> str | None:
        """The business queue a message on its way to a parking lot was parked from."""
        original = msg.header(h.H_ORIGINAL_QUEUE)
        if original in self.topology.queues:
            return original
        n = self.topology.names
        death = msg.first_death
        candidates = [text_header(death.get("queue")) if death else None, msg.routing_key]
        for name in candidates:
            try:
                kind, detail = n.parse(name or "")
            except ValueError:
                continue
            if kind == "q" and detail in self.topology.queues:
                return detail
        return None

    def decide(self, msg: Stored, now_ms: int) -> Reroute | Leave:
        n = self.topology.names
        headers = strip_broker_headers(msg.headers)
        if msg.exchange == n.parking_exchange():
            queue = self._parked_queue(msg)
            if queue is None:
                return Leave(f"parked for a queue not in the topology ({msg.routing_key!r})")
            if self.only is not None and queue != self.only:
                return Leave(f"headed for the parking lot of {queue!r}")
            exchange, key, to_parking = n.parking_exchange(), n.queue_key(queue), True
            queues: tuple[str, ...] = (queue,)
        else:
            key = msg.target or msg.routing_key
            try:
                self.router.target_key(None, key)
            except UnknownTargetError:
                return Leave(f"target {key!r} is not in the topology {n.prefix!r}")
            queues = self.router.queues_for_key(key)
            if self.only is not None and self.only not in queues:
                return Leave(f"target {key!r} is not queue {self.only!r}")
            exchange, to_parking = n.due_exchange(), False
        timestamp = msg.timestamp if msg.timestamp is not None else now_ms // 1000
        out = forward(exchange, key, msg.body, msg.content_type, msg.message_id, headers, timestamp)
        return Reroute(out, queues, to_parking)


# -- what a replay did (or, dry, would do) ------------------------------------------------


@dataclass(frozen=True, slots=True)
class Moved:
    message_id: str
    exchange: str
    routing_key: str


@dataclass
class ReplayReport:
    """What a replay did. `error` is set when it stopped on a failure (the message that
    failed is back in `source`); everything in `moved` was confirmed, then acked."""

    source: str
    destination: str
    moved: list[Moved] = field(default_factory=list)
    left: list[tuple[str | None, str]] = field(default_factory=list)  # (message_id, why)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def as_json(self) -> dict[str, Any]:
        """What `replay --json` prints (and the dashboard answers)."""
        return {
            "dry_run": False,
            "ok": self.ok,
            "source": self.source,
            "destination": self.destination,
            "moved": len(self.moved),
            "message_ids": [m.message_id for m in self.moved],
            "left": [{"message_id": mid, "reason": why} for mid, why in self.left],
            "error": self.error,
        }


@dataclass(frozen=True, slots=True)
class Previewed:
    message: Stored
    action: str  # "exchange [routing key]", or why it would be left in place
    moves: bool


@dataclass(frozen=True, slots=True)
class Preview:
    """What a replay would do, read without consuming anything."""

    source: str
    destination: str
    held: int  # ready messages in `source` at the start
    via: str
    messages: tuple[Previewed, ...]


__all__ = [
    "IMMEDIATE",
    "PARKING_HEADERS",
    "ROUTE_HEADERS",
    "Leave",
    "Moved",
    "ParkedReplay",
    "Preview",
    "Previewed",
    "ReplayReport",
    "Reroute",
    "UnroutableReplay",
    "replay_headers",
    "resolve_queue",
]
