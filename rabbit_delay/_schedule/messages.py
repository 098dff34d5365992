"""Between messages and records: what a keyed publish records, what it then sends, and
the message a record is published again as (a sweep, a reschedule). Pure."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import rabbit_delay._headers as h
from rabbit_delay._envelope import MAX_MESSAGE_ID, Outgoing, outgoing
from rabbit_delay._errors import EncodeError
from rabbit_delay._schedule.records import (
    Entry,
    OnConflict,
    Payload,
    Placed,
    Placement,
    ScheduleRecord,
)
from rabbit_delay._topology.delays import Router

# The headers every publish computes again (the route's, the schedule's): not kept in
# the record, whose payload holds only the sender's own (trace context, yours).
_ROUTE_HEADERS = frozenset(
    {
        h.H_DUE_AT,
        h.H_ASKED_DUE_AT,
        h.H_DELAY_MS,
        h.H_TIER,
        h.H_ATTEMPT,
        h.H_TARGET,
        h.H_PLUGIN_DELAY,
        h.H_KEY,
        h.H_GENERATION,
    }
)
MAX_KEY = MAX_MESSAGE_ID  # bytes, like a message_id


class Scheduled(str):
    """What a publish recorded in the schedule returns: its message_id (a `str`, so code
    that expects the id keeps working), and what the schedule made of it.

    `placement` is "created" (the key was not scheduled), "replaced" (it was: this is its
    next generation, the older copy will be dropped) or "kept" (on_conflict="keep" and
    the key was scheduled: nothing was sent, and this is the scheduled message's id).
    """

    key: str
    generation: int
    placement: Placement
    due_ms: int

    def __new__(cls, placed: Placed, key: str) -> Scheduled:
        self = super().__new__(cls, placed.message_id)
        self.key = key
        self.generation = placed.generation
        self.placement = placed.placement
        self.due_ms = placed.due_ms
        return self

    @property
    def message_id(self) -> str:
        return str.__str__(self)

    @property
    def kept(self) -> bool:
        """True when nothing was sent: the key was already scheduled (on_conflict="keep")."""
        return self.placement is Placement.KEPT

    @property
    def due_at(self) -> datetime:
        return datetime.fromtimestamp(self.due_ms / 1000, UTC)

    def __repr__(self) -> str:
        return (
            f"Scheduled({self.message_id!r}, key={self.key!r}, generation={self.generation}, "
            f"placement={self.placement.value!r})"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        placed = Placed(self.placement, self.generation, self.message_id, self.due_ms)
        return (Scheduled, (placed, self.key))


def check_key(key: object) -> str:
    """A schedule key: a non-empty string of at most 255 bytes. Raises EncodeError."""
    if not isinstance(key, str) or not key or len(key.encode()) > MAX_KEY:
        raise EncodeError(
            f"a schedule key must be a non-empty string of at most {MAX_KEY} bytes, got {key!r}"
        )
    return key


def payload_headers(headers: Mapping[str, object]) -> dict[str, Any]:
    """The headers a record keeps: the sender's own, which must be JSON values (a
    scheduled message is published again from its record). Raises EncodeError."""
    kept = {k: v for k, v in headers.items() if k not in _ROUTE_HEADERS and not k.startswith("x-")}
    if not kept:
        return kept
    try:
        json.dumps(kept, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise EncodeError(
            f"the headers of a scheduled message must be JSON values (str, int, float, bool, "
            f"None, lists, dicts): {exc}"
        ) from None
    return kept


def entry_of(out: Outgoing, scope: str, queue: str, grace_ms: int) -> Entry:
    """The record of a keyed message about to be published (`out.key` set; `out.keep`:
    on_conflict "keep")."""
    assert out.key is not None
    due = out.headers.get(h.H_DUE_AT)
    due_ms = int(due) if isinstance(due, int) else 0  # outgoing() always sets it
    return Entry(
        scope=scope,
        key=out.key,
        queue=queue,
        due_ms=due_ms,
        message_id=out.message_id,
        payload=Payload(out.body, out.content_type, payload_headers(out.headers)),
        on_conflict=OnConflict.KEEP if out.keep else OnConflict.REPLACE,
        sweep_ms=due_ms + grace_ms,
    )


def stamped(out: Outgoing, placed: Placed) -> Outgoing:
    """`out` as the generation the schedule gave it: its headers (a dict of its own,
    made by `outgoing()` for this call) get rd-key and rd-generation."""
    out.headers[h.H_KEY] = out.key
    out.headers[h.H_GENERATION] = placed.generation
    return out


def send_list(
    outs: Sequence[Outgoing], keyed: Sequence[int], placed: Sequence[Placed]
) -> tuple[list[Outgoing], list[str]]:
    """What to send after the schedule answered for the keyed messages (indexes
    `keyed` of `outs`), and the id each publish returns, in order (a `Scheduled` for a
    recorded one; a kept one is not sent)."""
    ids: list[str] = [o.message_id for o in outs]
    answers = dict(zip(keyed, placed, strict=True))
    send: list[Outgoing] = []
    for i, out in enumerate(outs):
        answer = answers.get(i)
        if answer is None:
            send.append(out)
            continue
        assert out.key is not None
        ids[i] = Scheduled(answer, out.key)
        if answer.placement is not Placement.KEPT:
            send.append(stamped(out, answer))
    return send, ids


def republished(
    record: ScheduleRecord,
    router: Router,
    queue_key: str,
    now_ms: int,
    *,
    due_ms: int | None = None,
) -> Outgoing:
    """The message of `record`'s current generation, published again: to its queue now
    (a sweep: it is overdue), or through the delays for what remains until `due_ms`
    (a reschedule). Under the record's message_id, key and generation."""
    payload = record.payload
    assert payload is not None
    due = record.due_ms if due_ms is None else due_ms
    headers: dict[str, object] = dict(payload.headers)
    headers[h.H_KEY] = record.key
    headers[h.H_GENERATION] = record.generation
    if due <= now_ms:
        route = router.immediate(queue_key)
    else:
        route = router.resolve_remaining(queue_key, due - now_ms)
    return outgoing(
        route,
        payload.body,
        payload.content_type,
        now_ms,
        record.message_id,
        headers,
        record.attempts + 1,
        due_at=due,
    )
