"""How the async worker hands its claims and finishes to the idempotency store: the
ones issued in one loop turn go as one batch (one transaction or round trip)."""

from __future__ import annotations

import asyncio
from typing import Any

from rabbit_delay._idempotency.guard import AsyncGuard
from rabbit_delay._schedule.records import Ref, Update


class StoreBatches:
    """The claims (and finishes) issued in one loop turn go to the store as one batch;
    while a batch runs, the next one gathers."""

    def __init__(self, guard: AsyncGuard) -> None:
        self.guard = guard
        self._claims: list[tuple[str, str, Ref | None, asyncio.Future[object]]] = []
        self._finishes: list[tuple[str, str, bool, Update | None, asyncio.Future[object]]] = []
        self._scheduled = 0  # items with a schedule Ref or Update in the gathering batch
        self._busy = False
        self._task: asyncio.Future[None] | None = None

    def claim(self, key: str, owner: str, ref: Ref | None = None) -> asyncio.Future[object]:
        future: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        self._claims.append((key, owner, ref, future))
        self._scheduled += ref is not None
        self._schedule()
        return future

    def finish(
        self, key: str, owner: str, succeeded: bool, update: Update | None = None
    ) -> asyncio.Future[object]:
        future: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        self._finishes.append((key, owner, succeeded, update, future))
        self._scheduled += update is not None
        self._schedule()
        return future

    def _schedule(self) -> None:
        if not self._busy:
            self._busy = True
            asyncio.get_running_loop().call_soon(self._start)

    def _start(self) -> None:
        # The loop keeps only weak references to tasks: hold this one until it ends.
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        try:
            while self._claims or self._finishes:
                finishes, self._finishes = self._finishes, []
                claims, self._claims = self._claims, []
                if self._scheduled:  # with the schedule: one store call for both
                    self._scheduled = 0
                    await self._resolve_both(finishes, claims)
                    continue
                if finishes:
                    items = [(k, o, ok) for k, o, ok, _, _ in finishes]
                    await self._resolve(self.guard.finish_many(items), [f[4] for f in finishes])
                if claims:
                    pairs = [(k, o) for k, o, _, _ in claims]
                    await self._resolve(self.guard.claim_many(pairs), [c[3] for c in claims])
        finally:
            self._busy = False

    async def _resolve_both(
        self,
        finishes: list[tuple[str, str, bool, Update | None, asyncio.Future[object]]],
        claims: list[tuple[str, str, Ref | None, asyncio.Future[object]]],
    ) -> None:
        finished, claimed = await self.guard.batch(
            [(k, o, ok, u) for k, o, ok, u, _ in finishes], [(k, o, r) for k, o, r, _ in claims]
        )
        for future, result in zip(
            [f[4] for f in finishes] + [c[3] for c in claims], [*finished, *claimed], strict=True
        ):
            if not future.done():
                future.set_result(result)

    @staticmethod
    async def _resolve(batch: Any, futures: list[asyncio.Future[object]]) -> None:
        try:
            results = await batch
        except Exception as exc:  # the whole batch failed: each op with that error
            results = [exc] * len(futures)
        for future, result in zip(futures, results, strict=True):
            if not future.done():
                future.set_result(result)


__all__ = ["StoreBatches"]
