"""In-memory store: one process, no durability. For tests and single-process tools."""

from __future__ import annotations

import bisect
import threading
from collections.abc import Sequence
from dataclasses import replace as dataclasses_replace

from rabbit_delay._idempotency.guard import (
    DEFAULT_PREFIX,
    VERDICT_RESULT,
    ClaimItem,
    ClaimResult,
    FinishItem,
    ScheduledClaim,
    ScheduledFinish,
    claim_each,
    finish_each,
    run,
)
from rabbit_delay._schedule import rules
from rabbit_delay._schedule.book import SweptItem
from rabbit_delay._schedule.records import (
    MAX_PAGE,
    Entry,
    Placed,
    Query,
    Ref,
    ScheduleRecord,
    ScheduleState,
    Update,
    Verdict,
)

_CLAIMED = "claimed"
_DONE = "done"
_CANCELLED = "cancelled"


class MemoryStore:
    """A dict behind a lock. Same semantics as the durable stores, lost on exit."""

    needs_purge = True
    never_blocks = True  # no I/O: a worker may call it on its connection thread

    def __init__(self, *, prefix: str = DEFAULT_PREFIX) -> None:
        self.prefix = prefix
        # key -> (state, owner, expires_at_ms)
        self._rows: dict[str, tuple[str, str | None, int]] = {}
        self._lock = threading.RLock()
        self.schedule = MemorySchedule(self._lock)

    def claim(self, key: str, owner: str, *, now_ms: int, lease_ms: int) -> ClaimResult:
        k = self.prefix + key
        with self._lock:
            row = self._rows.get(k)
            if row is not None and row[2] > now_ms:
                state, holder, _ = row
                if state == _DONE:
                    return ClaimResult.DONE
                if state == _CANCELLED:
                    return ClaimResult.CANCELLED
                if holder != owner:
                    return ClaimResult.IN_PROGRESS
            self._rows[k] = (_CLAIMED, owner, now_ms + lease_ms)
            return ClaimResult.CLAIMED

    def complete(self, key: str, owner: str, *, now_ms: int, retention_ms: int) -> None:
        k = self.prefix + key
        with self._lock:
            row = self._rows.get(k)
            if row is not None and row[0] != _CLAIMED and row[2] > now_ms:
                return
            self._rows[k] = (_DONE, owner, now_ms + retention_ms)

    def release(self, key: str, owner: str) -> None:
        k = self.prefix + key
        with self._lock:
            row = self._rows.get(k)
            if row is not None and row[0] == _CLAIMED and row[1] == owner:
                del self._rows[k]

    def renew(self, key: str, owner: str, *, now_ms: int, lease_ms: int) -> bool:
        k = self.prefix + key
        with self._lock:
            row = self._rows.get(k)
            if row is None or row[0] != _CLAIMED or row[1] != owner:
                return False
            self._rows[k] = (_CLAIMED, owner, now_ms + lease_ms)
            return True

    def claim_many(
        self, items: Sequence[ClaimItem], *, now_ms: int, lease_ms: int
    ) -> list[ClaimResult | Exception]:
        # one item after the other: a key that is not a str fails its slot only
        return run(claim_each(self, items, now_ms=now_ms, lease_ms=lease_ms))

    def finish_many(
        self, items: Sequence[FinishItem], *, now_ms: int, retention_ms: int
    ) -> list[Exception | None]:
        return run(finish_each(self, items, now_ms=now_ms, retention_ms=retention_ms))

    def cancel(self, key: str, *, now_ms: int, retention_ms: int) -> None:
        k = self.prefix + key
        until = now_ms + retention_ms
        with self._lock:
            row = self._rows.get(k)
            if row is not None and row[0] == _CANCELLED:
                until = max(until, row[2])
            self._rows[k] = (_CANCELLED, None, until)

    def scheduled_batch(
        self,
        finishes: Sequence[ScheduledFinish],
        claims: Sequence[ScheduledClaim],
        *,
        now_ms: int,
        lease_ms: int,
        retention_ms: int,
    ) -> tuple[list[Exception | None], list[ClaimResult | Exception]]:
        """See `SchedulingStore.scheduled_batch`: under the store's lock, item by item."""
        book = self.schedule
        finished: list[Exception | None] = []
        claimed: list[ClaimResult | Exception] = []
        with self._lock:
            for key, owner, succeeded, update in finishes:
                try:
                    if succeeded:
                        self.complete(key, owner, now_ms=now_ms, retention_ms=retention_ms)
                    else:
                        self.release(key, owner)
                    if update is not None:
                        book.finish(update, now_ms)
                    finished.append(None)
                except Exception as exc:
                    finished.append(exc)
            for key, owner, ref in claims:
                try:
                    verdict = book.check(ref, now_ms) if ref is not None else None
                    if verdict is not None:
                        claimed.append(VERDICT_RESULT[verdict])
                    else:
                        claimed.append(self.claim(key, owner, now_ms=now_ms, lease_ms=lease_ms))
                except Exception as exc:
                    claimed.append(exc)
        return finished, claimed

    def purge(self, *, now_ms: int) -> int:
        with self._lock:
            expired = [k for k, row in self._rows.items() if row[2] <= now_ms]
            for k in expired:
                del self._rows[k]
            return len(expired) + self.schedule.purge(now_ms=now_ms)

    def close(self) -> None:
        with self._lock:
            self._rows.clear()
            self.schedule.clear()

    def __len__(self) -> int:
        return len(self._rows)


class MemorySchedule:
    """The memory store's schedule: records in a dict, the rules applied as they are
    (`rabbit_delay._schedule.rules`): the reference the other stores are tested against."""

    def __init__(self, lock: threading.RLock) -> None:
        self._lock = lock
        self._records: dict[tuple[str, str], ScheduleRecord] = {}

    # -- the worker's side (called by MemoryStore.scheduled_batch, under the lock) -------

    def check(self, ref: Ref, now_ms: int) -> Verdict | None:
        at = (ref.scope, ref.key)
        record = self._records.get(at)
        verdict = rules.check(record, ref.generation)
        if record is not None and verdict in (Verdict.SUPERSEDED, Verdict.CANCELLED):
            self._records[at] = rules.dropped(record, now_ms)
        return verdict

    def finish(self, update: Update, now_ms: int) -> None:
        at = (update.ref.scope, update.ref.key)
        written = rules.finish(self._records.get(at), update, now_ms)
        if written is not None:
            self._records[at] = written

    # -- ScheduleBook ------------------------------------------------------------------

    def place_many(self, entries: Sequence[Entry], *, now_ms: int) -> list[Placed]:
        placed: list[Placed] = []
        with self._lock:
            for entry in entries:
                at = (entry.scope, entry.key)
                answer, record = rules.place(self._records.get(at), entry, now_ms)
                if record is not None:
                    self._records[at] = record
                placed.append(answer)
        return placed

    def lookup(self, scope: str, key: str) -> ScheduleRecord | None:
        with self._lock:
            return self._records.get((scope, key))

    def select(self, query: Query) -> list[ScheduleRecord]:
        limit = min(max(query.limit, 1), MAX_PAGE)
        with self._lock:
            rows = [
                r
                for (scope, _), r in self._records.items()
                if scope == query.scope
                and (query.queue is None or r.queue == query.queue)
                and (query.state is None or r.state is query.state)
                and (query.due_before_ms is None or r.due_ms < query.due_before_ms)
                and (query.due_after_ms is None or r.due_ms >= query.due_after_ms)
                and (query.after is None or (r.due_ms, r.key) > query.after)
            ]
        rows.sort(key=lambda r: (r.due_ms, r.key))
        return [dataclasses_replace(r, payload=None) for r in rows[:limit]]

    def cancel(
        self, scope: str, key: str, *, now_ms: int, hold_ms: int
    ) -> tuple[ScheduleState | None, ScheduleRecord | None]:
        with self._lock:
            record = self._records.get((scope, key))
            found, written = rules.cancel(record, now_ms, hold_ms)
            if written is not None:
                self._records[(scope, key)] = written
            return found, written if written is not None else record

    def reschedule(
        self, scope: str, key: str, *, due_ms: int, message_id: str, now_ms: int, sweep_ms: int
    ) -> tuple[ScheduleState | None, ScheduleRecord | None]:
        with self._lock:
            record = self._records.get((scope, key))
            found, written = rules.reschedule(record, due_ms, message_id, now_ms, sweep_ms)
            if written is not None:
                self._records[(scope, key)] = written
            return found, written if written is not None else record

    def overdue(self, scope: str, *, now_ms: int, limit: int) -> list[ScheduleRecord]:
        with self._lock:
            rows = [
                r
                for (s, _), r in self._records.items()
                if s == scope
                and r.state is ScheduleState.SCHEDULED
                and r.sweep_ms is not None
                and r.sweep_ms <= now_ms
            ]
        rows.sort(key=lambda r: (r.sweep_ms or 0, r.key))
        return rows[:limit]

    def swept(self, scope: str, items: Sequence[SweptItem], *, now_ms: int) -> None:
        with self._lock:
            for key, generation, next_ms in items:
                written = rules.swept(self._records.get((scope, key)), generation, next_ms, now_ms)
                if written is not None:
                    self._records[(scope, key)] = written

    def lateness(self, scope: str, *, since_ms: int, sample: int) -> int | None:
        with self._lock:
            handled = [
                r
                for (s, _), r in self._records.items()
                if s == scope and r.state is ScheduleState.HANDLED and r.updated_ms >= since_ms
            ]
        handled.sort(key=lambda r: r.updated_ms, reverse=True)
        late = [r.updated_ms - r.due_ms for r in handled[:sample]]
        return max(late) if late else None

    def count_due(self, scope: str, queue: str | None, edges: Sequence[int]) -> list[int]:
        counts = [0] * max(len(edges) - 1, 0)
        with self._lock:
            dues = [
                r.due_ms
                for (s, _), r in self._records.items()
                if s == scope
                and r.state is ScheduleState.SCHEDULED
                and (queue is None or r.queue == queue)
            ]
        for due in dues:
            i = bisect.bisect_right(edges, due) - 1
            if 0 <= i < len(counts):
                counts[i] += 1
        return counts

    def purge(self, *, now_ms: int) -> int:
        with self._lock:
            gone = [
                at
                for at, r in self._records.items()
                if r.expires_ms is not None and r.expires_ms <= now_ms
            ]
            for at in gone:
                del self._records[at]
            return len(gone)

    def clear(self) -> None:
        with self._lock:
            self._records.clear()

    def __len__(self) -> int:
        return len(self._records)
