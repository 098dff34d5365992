"""In-memory store: one process, no durability. For tests and single-process tools."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from rabbit_delay._idempotency.guard import (
    DEFAULT_PREFIX,
    ClaimItem,
    ClaimResult,
    FinishItem,
    claim_each,
    finish_each,
    run,
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
        self._lock = threading.Lock()

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

    def purge(self, *, now_ms: int) -> int:
        with self._lock:
            expired = [k for k, row in self._rows.items() if row[2] <= now_ms]
            for k in expired:
                del self._rows[k]
            return len(expired)

    def close(self) -> None:
        with self._lock:
            self._rows.clear()

    def __len__(self) -> int:
        return len(self._rows)
