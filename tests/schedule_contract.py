"""The behaviour every store's schedule must have, run against each implementation.

Not a test module itself: tests/unit/test_schedule.py (memory, SQLite),
tests/integration/test_schedule_redis.py and test_schedule_postgres.py subclass
`ScheduleContract` and provide `new_store`: a factory of async stores (an
`AsyncIdempotencyStore` with `schedule`, an `AsyncScheduleBook`, and `scheduled_batch`)
sharing one backend. Times come from a fake clock (T0 + offsets); the schedule always
goes by the caller's clock.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from rabbit_delay._schedule.records import (
    Entry,
    Finished,
    OnConflict,
    Payload,
    Placement,
    Query,
    Ref,
    ScheduleState,
    Update,
)
from rabbit_delay.stores import ClaimResult

T0 = 1_700_000_000_000
LEASE = 60_000
RETENTION = 600_000
KEEP = 3_600_000
GRACE = 60_000

NewStore = Callable[..., Any]  # new_store() -> an async store with .schedule


def new_key() -> str:
    return "order-" + uuid.uuid4().hex[:12]


def entry(
    scope: str,
    key: str,
    *,
    due: int = T0 + 30_000,
    queue: str = "orders",
    message_id: str | None = None,
    on_conflict: OnConflict = OnConflict.REPLACE,
    body: bytes = b'{"order": 42}',
    headers: dict[str, Any] | None = None,
) -> Entry:
    return Entry(
        scope=scope,
        key=key,
        queue=queue,
        due_ms=due,
        message_id=message_id or uuid.uuid4().hex,
        payload=Payload(body, "application/json", headers or {"traceparent": "00-abc-def-01"}),
        on_conflict=on_conflict,
        sweep_ms=due + GRACE,
    )


class ScheduleContract:
    shared_backend = True
    # False for a store whose guard judges leases by its server's clock (Redis): the
    # record's claims then too (on a guard key), so a lease cannot be run out by `now`.
    caller_clock = True

    @pytest.fixture
    def store(self, new_store: NewStore) -> Any:
        return new_store()

    @pytest.fixture
    def scope(self) -> str:
        return "rd-test-" + uuid.uuid4().hex[:8]

    async def place(self, store: Any, *entries: Entry, now: int = T0) -> list[Any]:
        return list(await store.schedule.place_many(list(entries), now_ms=now))

    async def claim_all(self, store: Any, items: list[Any], now: int = T0) -> list[Any]:
        """One worker batch of claims (guard key, owner, ref or None): their outcomes."""
        _, claimed = await store.scheduled_batch(
            [], items, now_ms=now, lease_ms=LEASE, retention_ms=RETENTION
        )
        return list(claimed)

    async def claim(self, store: Any, ref: Ref, owner: str = "w1", now: int = T0) -> Any:
        _, claimed = await store.scheduled_batch(
            [],
            [(f"q:{ref.key}:{ref.generation}", owner, ref)],
            now_ms=now,
            lease_ms=LEASE,
            retention_ms=RETENTION,
        )
        return claimed[0]

    async def finish(self, store: Any, update: Update, owner: str = "w1", now: int = T0) -> Any:
        ref = update.ref
        finished, _ = await store.scheduled_batch(
            [(f"q:{ref.key}:{ref.generation}", owner, update.finished is Finished.HANDLED, update)],
            [],
            now_ms=now,
            lease_ms=LEASE,
            retention_ms=RETENTION,
        )
        return finished[0]

    # -- placing ----------------------------------------------------------------------

    async def test_a_new_key_is_generation_1_with_its_payload(self, store: Any, scope: str) -> None:
        key = new_key()
        e = entry(scope, key, headers={"traceparent": "00-1-2-01", "tenant": "eu"})
        [placed] = await self.place(store, e)
        assert placed.placement is Placement.CREATED
        assert (placed.generation, placed.message_id, placed.due_ms) == (1, e.message_id, e.due_ms)
        record = await store.schedule.lookup(scope, key)
        assert record is not None
        assert record.state is ScheduleState.SCHEDULED
        assert (record.generation, record.queue, record.due_ms) == (1, "orders", e.due_ms)
        assert record.sweep_ms == e.due_ms + GRACE
        assert record.expires_ms is None
        assert record.payload is not None
        assert record.payload.body == e.payload.body
        assert record.payload.content_type == "application/json"
        assert dict(record.payload.headers) == {"traceparent": "00-1-2-01", "tenant": "eu"}
        assert (record.created_ms, record.updated_ms) == (T0, T0)

    async def test_replace_makes_the_next_generation_and_keep_changes_nothing(
        self, store: Any, scope: str
    ) -> None:
        key = new_key()
        await self.place(store, entry(scope, key))
        later = entry(scope, key, due=T0 + 90_000, body=b'{"v": 2}')
        [replaced] = await self.place(store, later, now=T0 + 5)
        assert replaced.placement is Placement.REPLACED
        assert (replaced.generation, replaced.message_id) == (2, later.message_id)
        kept_entry = entry(scope, key, due=T0 + 1_000, on_conflict=OnConflict.KEEP)
        [kept] = await self.place(store, kept_entry, now=T0 + 6)
        assert kept.placement is Placement.KEPT
        assert (kept.generation, kept.message_id, kept.due_ms) == (2, later.message_id, T0 + 90_000)
        record = await store.schedule.lookup(scope, key)
        assert (record.generation, record.due_ms, record.replaced) == (2, T0 + 90_000, 1)
        assert record.payload.body == b'{"v": 2}'
        assert record.created_ms == T0  # the key's first scheduling

    async def test_a_finished_key_is_scheduled_again_under_the_next_generation(
        self, store: Any, scope: str
    ) -> None:
        key = new_key()
        await self.place(store, entry(scope, key))
        assert await self.claim(store, Ref(scope, key, 1)) is ClaimResult.CLAIMED
        assert await self.finish(store, Update(Ref(scope, key, 1), Finished.HANDLED, KEEP)) is None
        [again] = await self.place(
            store, entry(scope, key, on_conflict=OnConflict.KEEP), now=T0 + 9
        )
        assert (again.placement, again.generation) == (Placement.CREATED, 2)
        record = await store.schedule.lookup(scope, key)
        assert (record.state, record.expires_ms, record.attempts) == (
            ScheduleState.SCHEDULED,
            None,
            0,
        )

    async def test_one_batch_places_in_order(self, store: Any, scope: str) -> None:
        k1, k2 = new_key(), new_key()
        placed = await self.place(
            store, entry(scope, k1), entry(scope, k2), entry(scope, k1, due=T0 + 99_000)
        )
        assert [(p.placement, p.generation) for p in placed] == [
            (Placement.CREATED, 1),
            (Placement.CREATED, 1),
            (Placement.REPLACED, 2),
        ]
        assert (await store.schedule.lookup(scope, k1)).due_ms == T0 + 99_000

    async def test_scopes_do_not_see_each_other(self, store: Any, scope: str) -> None:
        key = new_key()
        await self.place(store, entry(scope, key))
        assert await store.schedule.lookup(scope + "-other", key) is None
        [other] = await self.place(store, entry(scope + "-other", key))
        assert other.generation == 1

    # -- the worker's side ------------------------------------------------------------

    async def test_the_current_generation_is_claimed_and_older_ones_dropped(
        self, store: Any, scope: str
    ) -> None:
        key = new_key()
        await self.place(store, entry(scope, key))
        await self.place(store, entry(scope, key, due=T0 + 50_000))
        assert await self.claim(store, Ref(scope, key, 1)) is ClaimResult.SUPERSEDED
        assert await self.claim(store, Ref(scope, key, 1), owner="w2") is ClaimResult.SUPERSEDED
        assert await self.claim(store, Ref(scope, key, 2)) is ClaimResult.CLAIMED
        record = await store.schedule.lookup(scope, key)
        assert record.dropped == 2

    async def test_unknown_keys_and_newer_generations_are_claimed_as_usual(
        self, store: Any, scope: str
    ) -> None:
        assert await self.claim(store, Ref(scope, new_key(), 1)) is ClaimResult.CLAIMED
        key = new_key()
        await self.place(store, entry(scope, key))
        assert await self.claim(store, Ref(scope, key, 5)) is ClaimResult.CLAIMED

    async def test_claims_without_a_ref_are_plain_claims(self, store: Any, scope: str) -> None:
        claimed = await self.claim_all(store, [("plain-a", "w1", None), ("plain-a", "w2", None)])
        assert claimed == [ClaimResult.CLAIMED, ClaimResult.IN_PROGRESS]

    async def test_handled_is_recorded_with_the_guard_and_a_copy_is_a_duplicate(
        self, store: Any, scope: str
    ) -> None:
        key = new_key()
        await self.place(store, entry(scope, key, due=T0 + 10))
        ref = Ref(scope, key, 1)
        assert await self.claim(store, ref) is ClaimResult.CLAIMED
        assert await self.finish(store, Update(ref, Finished.HANDLED, KEEP), now=T0 + 40) is None
        record = await store.schedule.lookup(scope, key)
        assert record.state is ScheduleState.HANDLED
        assert (record.updated_ms, record.expires_ms, record.sweep_ms) == (
            T0 + 40,
            T0 + 40 + KEEP,
            None,
        )
        assert await self.claim(store, ref, owner="w9", now=T0 + 50) is ClaimResult.DONE

    async def test_a_retry_moves_the_due_time_and_counts_the_failure(
        self, store: Any, scope: str
    ) -> None:
        key = new_key()
        await self.place(store, entry(scope, key))
        ref = Ref(scope, key, 1)
        await self.claim(store, ref)
        retry = Update(ref, Finished.RETRY, KEEP, "ValueError: boom", T0 + 90_000, T0 + 150_000)
        assert await self.finish(store, retry, now=T0 + 31_000) is None
        record = await store.schedule.lookup(scope, key)
        assert record.state is ScheduleState.SCHEDULED
        assert (record.attempts, record.last_error) == (1, "ValueError: boom")
        assert (record.due_ms, record.sweep_ms, record.expires_ms) == (
            T0 + 90_000,
            T0 + 150_000,
            None,
        )
        assert await self.claim(store, ref, owner="w2", now=T0 + 91_000) is ClaimResult.CLAIMED

    async def test_parked_keeps_the_reason_and_a_replay_can_still_run(
        self, store: Any, scope: str
    ) -> None:
        key = new_key()
        await self.place(store, entry(scope, key))
        ref = Ref(scope, key, 1)
        await self.claim(store, ref)
        parked = Update(ref, Finished.PARKED, KEEP, "max_attempts: ValueError: boom")
        await self.finish(store, parked, now=T0 + 100)
        record = await store.schedule.lookup(scope, key)
        assert (record.state, record.attempts) == (ScheduleState.PARKED, 1)
        assert record.last_error == "max_attempts: ValueError: boom"
        assert record.expires_ms == T0 + 100 + KEEP
        # a replayed copy runs, and is then handled
        assert await self.claim(store, ref, owner="replay", now=T0 + 200) is ClaimResult.CLAIMED
        await self.finish(store, Update(ref, Finished.HANDLED, KEEP), owner="replay", now=T0 + 300)
        assert (await store.schedule.lookup(scope, key)).state is ScheduleState.HANDLED

    async def test_a_stale_generation_s_result_changes_nothing(
        self, store: Any, scope: str
    ) -> None:
        key = new_key()
        await self.place(store, entry(scope, key))
        await self.place(store, entry(scope, key, due=T0 + 70_000))
        await self.finish(store, Update(Ref(scope, key, 1), Finished.HANDLED, KEEP))
        record = await store.schedule.lookup(scope, key)
        assert (record.state, record.generation) == (ScheduleState.SCHEDULED, 2)

    # -- the record as the claim (a delivery whose guard key is its message_id's) -----
    # SQLite and PostgreSQL hold such a claim on the record itself (no guard row); the
    # other stores on a guard row. What a worker sees is the same on every store.

    def held_ref(self, scope: str, key: str, e: Entry, generation: int = 1) -> Ref:
        return Ref(scope, key, generation, e.message_id)

    async def claim_as(self, store: Any, ref: Ref, owner: str = "w1", now: int = T0) -> Any:
        _, claimed = await store.scheduled_batch(
            [],
            [(f"q:{ref.message_id}", owner, ref)],
            now_ms=now,
            lease_ms=LEASE,
            retention_ms=RETENTION,
        )
        return claimed[0]

    async def finish_as(
        self,
        store: Any,
        ref: Ref,
        update: Update | None,
        owner: str = "w1",
        now: int = T0,
        succeeded: bool | None = None,
    ) -> Any:
        ok = (
            (update is not None and update.finished is Finished.HANDLED)
            if succeeded is None
            else succeeded
        )
        finished, _ = await store.scheduled_batch(
            [(f"q:{ref.message_id}", owner, ok, update)],
            [],
            now_ms=now,
            lease_ms=LEASE,
            retention_ms=RETENTION,
        )
        return finished[0]

    async def test_a_record_claim_is_held_until_its_lease_runs_out(
        self, store: Any, scope: str
    ) -> None:
        key, e = new_key(), None
        e = entry(scope, key)
        await self.place(store, e)
        ref = self.held_ref(scope, key, e)
        assert await self.claim_as(store, ref) is ClaimResult.CLAIMED
        assert await self.claim_as(store, ref, owner="w1", now=T0 + 10) is ClaimResult.CLAIMED
        assert await self.claim_as(store, ref, owner="w2", now=T0 + 20) is ClaimResult.IN_PROGRESS
        if self.caller_clock:
            later = T0 + 10 + LEASE + 1  # w1's re-entrant claim renewed the lease at T0 + 10
            assert await self.claim_as(store, ref, owner="w2", now=later) is ClaimResult.CLAIMED
        record = await store.schedule.lookup(scope, key)
        assert record.state is ScheduleState.SCHEDULED  # a claim is not a state change

    async def test_two_copies_in_one_batch_one_runs(self, store: Any, scope: str) -> None:
        key = new_key()
        e = entry(scope, key)
        await self.place(store, e)
        ref = self.held_ref(scope, key, e)
        guard_key = f"q:{e.message_id}"
        claimed = await self.claim_all(store, [(guard_key, "w1", ref), (guard_key, "w2", ref)])
        assert claimed == [ClaimResult.CLAIMED, ClaimResult.IN_PROGRESS]

    async def test_a_record_claim_handled_makes_copies_duplicates(
        self, store: Any, scope: str
    ) -> None:
        key = new_key()
        e = entry(scope, key)
        await self.place(store, e)
        ref = self.held_ref(scope, key, e)
        assert await self.claim_as(store, ref) is ClaimResult.CLAIMED
        assert (
            await self.finish_as(store, ref, Update(ref, Finished.HANDLED, KEEP), now=T0 + 5)
            is None
        )
        record = await store.schedule.lookup(scope, key)
        assert (record.state, record.expires_ms) == (ScheduleState.HANDLED, T0 + 5 + KEEP)
        assert await self.claim_as(store, ref, owner="w2", now=T0 + 6) is ClaimResult.DONE
        # and the lease is gone with it: renewing it finds nothing
        gone = await store.renew(f"q:{e.message_id}", "w1", now_ms=T0 + 7, lease_ms=LEASE)
        assert gone is False

    async def test_a_record_claim_released_or_retried_is_free_again(
        self, store: Any, scope: str
    ) -> None:
        key = new_key()
        e = entry(scope, key)
        await self.place(store, e)
        ref = self.held_ref(scope, key, e)
        assert await self.claim_as(store, ref) is ClaimResult.CLAIMED
        # the handler did not start (the worker stopping): given back, no record change
        assert await self.finish_as(store, ref, None, succeeded=False, now=T0 + 1) is None
        assert await self.claim_as(store, ref, owner="w2", now=T0 + 2) is ClaimResult.CLAIMED
        retry = Update(ref, Finished.RETRY, KEEP, "ValueError: boom", T0 + 90_000, T0 + 150_000)
        assert await self.finish_as(store, ref, retry, owner="w2", now=T0 + 3) is None
        record = await store.schedule.lookup(scope, key)
        assert (record.state, record.attempts, record.due_ms) == (
            ScheduleState.SCHEDULED,
            1,
            T0 + 90_000,
        )
        assert await self.claim_as(store, ref, owner="w3", now=T0 + 4) is ClaimResult.CLAIMED

    async def test_a_record_claim_is_renewed_by_its_owner(self, store: Any, scope: str) -> None:
        key = new_key()
        e = entry(scope, key)
        await self.place(store, e)
        ref = self.held_ref(scope, key, e)
        assert await self.claim_as(store, ref) is ClaimResult.CLAIMED
        renewed = await store.renew(
            f"q:{e.message_id}", "w1", now_ms=T0 + LEASE - 1, lease_ms=LEASE
        )
        assert renewed is True
        assert await store.renew(f"q:{e.message_id}", "w9", now_ms=T0, lease_ms=LEASE) is False
        # past the first lease, inside the renewed one: still held
        after = T0 + LEASE + 100
        assert await self.claim_as(store, ref, owner="w2", now=after) is ClaimResult.IN_PROGRESS

    async def test_a_guard_row_of_the_key_still_decides(self, store: Any, scope: str) -> None:
        key = new_key()
        e = entry(scope, key)
        await self.place(store, e)
        ref = self.held_ref(scope, key, e)
        # a tombstone written by the guard's own cancel (no schedule)
        await store.cancel(f"q:{e.message_id}", now_ms=T0, retention_ms=KEEP)
        assert await self.claim_as(store, ref, now=T0 + 1) is ClaimResult.CANCELLED

    async def test_a_new_generation_is_not_held_by_the_old_one_s_claim(
        self, store: Any, scope: str
    ) -> None:
        key = new_key()
        first = entry(scope, key)
        await self.place(store, first)
        old = self.held_ref(scope, key, first)
        assert await self.claim_as(store, old) is ClaimResult.CLAIMED
        second = entry(scope, key, due=T0 + 90_000)
        await self.place(store, second, now=T0 + 1)
        new = self.held_ref(scope, key, second, generation=2)
        assert await self.claim_as(store, new, owner="w2", now=T0 + 2) is ClaimResult.CLAIMED
        assert await self.claim_as(store, old, owner="w3", now=T0 + 3) is ClaimResult.SUPERSEDED
        # the old handler's result changes nothing; the new one's is recorded
        handled_old = Update(old, Finished.HANDLED, KEEP)
        assert await self.finish_as(store, old, handled_old, now=T0 + 4) is None
        assert (await store.schedule.lookup(scope, key)).state is ScheduleState.SCHEDULED
        handled_new = Update(new, Finished.HANDLED, KEEP)
        assert await self.finish_as(store, new, handled_new, owner="w2", now=T0 + 5) is None
        assert (await store.schedule.lookup(scope, key)).state is ScheduleState.HANDLED

    # -- cancel and reschedule --------------------------------------------------------

    async def test_cancel_holds_until_past_the_due_time(self, store: Any, scope: str) -> None:
        key = new_key()
        due = T0 + 30 * 86_400_000
        await self.place(store, entry(scope, key, due=due))
        found, record = await store.schedule.cancel(scope, key, now_ms=T0 + 1, hold_ms=KEEP)
        assert found is ScheduleState.SCHEDULED
        assert record.state is ScheduleState.CANCELLED
        assert (record.expires_ms, record.sweep_ms) == (due + KEEP, None)
        # purging before that keeps it; the copy arriving on day 30 is dropped
        await store.schedule.purge(now_ms=due)
        assert await self.claim(store, Ref(scope, key, 1), now=due + 5) is ClaimResult.CANCELLED
        again, _ = await store.schedule.cancel(scope, key, now_ms=T0 + 2, hold_ms=KEEP)
        assert again is ScheduleState.CANCELLED
        assert (await store.schedule.lookup(scope, key)).dropped == 1

    async def test_cancel_of_an_overdue_record_holds_from_now(self, store: Any, scope: str) -> None:
        key = new_key()
        await self.place(store, entry(scope, key, due=T0 + 10))
        _, record = await store.schedule.cancel(scope, key, now_ms=T0 + 5_000, hold_ms=KEEP)
        assert record.expires_ms == T0 + 5_000 + KEEP

    async def test_cancel_says_what_it_found(self, store: Any, scope: str) -> None:
        found, record = await store.schedule.cancel(scope, new_key(), now_ms=T0, hold_ms=KEEP)
        assert (found, record) == (None, None)
        key = new_key()
        await self.place(store, entry(scope, key))
        await self.claim(store, Ref(scope, key, 1))
        await self.finish(store, Update(Ref(scope, key, 1), Finished.HANDLED, KEEP))
        found, record = await store.schedule.cancel(scope, key, now_ms=T0, hold_ms=KEEP)
        assert found is ScheduleState.HANDLED
        assert record.state is ScheduleState.HANDLED

    async def test_reschedule_publishes_the_next_generation(self, store: Any, scope: str) -> None:
        key = new_key()
        e = entry(scope, key)
        await self.place(store, e)
        found, record = await store.schedule.reschedule(
            scope, key, due_ms=T0 + 10_000, message_id="m-2", now_ms=T0 + 1, sweep_ms=T0 + 70_000
        )
        assert found is ScheduleState.SCHEDULED
        assert (record.generation, record.due_ms, record.message_id) == (2, T0 + 10_000, "m-2")
        assert (record.sweep_ms, record.replaced) == (T0 + 70_000, 1)
        assert record.payload is not None
        assert record.payload.body == e.payload.body
        assert await self.claim(store, Ref(scope, key, 1)) is ClaimResult.SUPERSEDED

    async def test_reschedule_of_a_finished_or_unknown_key_publishes_nothing(
        self, store: Any, scope: str
    ) -> None:
        found, record = await store.schedule.reschedule(
            scope, new_key(), due_ms=T0, message_id="x", now_ms=T0, sweep_ms=T0
        )
        assert (found, record) == (None, None)
        key = new_key()
        await self.place(store, entry(scope, key))
        await store.schedule.cancel(scope, key, now_ms=T0, hold_ms=KEEP)
        found, record = await store.schedule.reschedule(
            scope, key, due_ms=T0, message_id="x", now_ms=T0, sweep_ms=T0
        )
        assert found is ScheduleState.CANCELLED
        assert record.generation == 1

    # -- listing ----------------------------------------------------------------------

    async def test_pages_in_due_order_with_filters_and_a_cursor(
        self, store: Any, scope: str
    ) -> None:
        keys = [f"k{i:02d}" for i in range(12)]
        entries = [
            entry(scope, k, due=T0 + 1_000 * (i % 6), queue="orders" if i % 2 else "mail")
            for i, k in enumerate(keys)
        ]
        await self.place(store, *entries)
        await store.schedule.cancel(scope, "k03", now_ms=T0, hold_ms=KEEP)
        first = await store.schedule.select(Query(scope, limit=5))
        assert [(r.due_ms - T0, r.key) for r in first] == [
            (0, "k00"),
            (0, "k06"),
            (1_000, "k01"),
            (1_000, "k07"),
            (2_000, "k02"),
        ]
        assert all(r.payload is None for r in first)
        second = await store.schedule.select(
            Query(scope, limit=5, after=(first[-1].due_ms, first[-1].key))
        )
        assert [r.key for r in second] == ["k08", "k03", "k09", "k04", "k10"]
        orders = await store.schedule.select(
            Query(scope, queue="orders", state=ScheduleState.SCHEDULED, due_before_ms=T0 + 4_000)
        )
        assert [r.key for r in orders] == ["k01", "k07", "k09"]
        cancelled = await store.schedule.select(Query(scope, state=ScheduleState.CANCELLED))
        assert [r.key for r in cancelled] == ["k03"]
        late = await store.schedule.select(Query(scope, due_after_ms=T0 + 5_000))
        assert [r.key for r in late] == ["k05", "k11"]

    async def test_count_due_per_interval(self, store: Any, scope: str) -> None:
        await self.place(
            store,
            *(
                entry(scope, f"c{i}", due=T0 + 10 * i, queue="orders" if i < 7 else "mail")
                for i in range(10)
            ),
        )
        await store.schedule.cancel(scope, "c0", now_ms=T0, hold_ms=KEEP)
        edges = [T0, T0 + 30, T0 + 60, T0 + 90, T0 + 120]
        assert await store.schedule.count_due(scope, None, edges) == [2, 3, 3, 1]
        assert await store.schedule.count_due(scope, "orders", edges) == [2, 3, 1, 0]

    # -- the sweeper's side -----------------------------------------------------------

    async def test_overdue_and_swept(self, store: Any, scope: str) -> None:
        await self.place(store, *(entry(scope, f"s{i}", due=T0 + i * 1_000) for i in range(5)))
        now = T0 + 2_500 + GRACE
        overdue = await store.schedule.overdue(scope, now_ms=now, limit=10)
        assert [r.key for r in overdue] == ["s0", "s1", "s2"]
        assert all(r.payload is not None for r in overdue)
        assert [r.key for r in await store.schedule.overdue(scope, now_ms=now, limit=2)] == [
            "s0",
            "s1",
        ]
        await store.schedule.swept(
            scope, [("s0", 1, now + 120_000), ("s1", 7, now + 1)], now_ms=now
        )
        after = await store.schedule.overdue(scope, now_ms=now, limit=10)
        assert [r.key for r in after] == ["s1", "s2"]
        s0 = await store.schedule.lookup(scope, "s0")
        assert (s0.republished, s0.sweep_ms) == (1, now + 120_000)
        # a handled record is never overdue
        await self.claim(store, Ref(scope, "s1", 1))
        await self.finish(store, Update(Ref(scope, "s1", 1), Finished.HANDLED, KEEP), now=now)
        assert [r.key for r in await store.schedule.overdue(scope, now_ms=now, limit=10)] == ["s2"]

    async def test_lateness_of_recently_handled_records(self, store: Any, scope: str) -> None:
        assert await store.schedule.lateness(scope, since_ms=T0, sample=100) is None
        await self.place(store, *(entry(scope, f"l{i}", due=T0 + 1_000) for i in range(3)))
        for i, late in enumerate((50, 700, 20)):
            ref = Ref(scope, f"l{i}", 1)
            await self.claim(store, ref)
            await self.finish(store, Update(ref, Finished.HANDLED, KEEP), now=T0 + 1_000 + late)
        assert await store.schedule.lateness(scope, since_ms=T0, sample=100) == 700
        assert await store.schedule.lateness(scope, since_ms=T0 + 1_100, sample=100) == 700
        assert await store.schedule.lateness(scope, since_ms=T0 + 1_800, sample=100) is None

    async def test_purge_deletes_expired_finished_records_only(
        self, store: Any, scope: str
    ) -> None:
        await self.place(store, entry(scope, "p-handled"), entry(scope, "p-waiting"))
        ref = Ref(scope, "p-handled", 1)
        await self.claim(store, ref)
        await self.finish(store, Update(ref, Finished.HANDLED, 1_000), now=T0)
        await store.schedule.purge(now_ms=T0 + 999)
        assert await store.schedule.lookup(scope, "p-handled") is not None
        await store.schedule.purge(now_ms=T0 + 1_000)
        assert await store.schedule.lookup(scope, "p-handled") is None
        assert await store.schedule.lookup(scope, "p-waiting") is not None

    # -- several stores on one backend --------------------------------------------------

    async def test_racing_publishes_of_one_key_get_distinct_generations(
        self, new_store: NewStore, scope: str
    ) -> None:
        if not self.shared_backend:
            pytest.skip("one store per backend")
        stores = [new_store() for _ in range(4)]
        key = new_key()
        placed = await asyncio.gather(
            *(s.schedule.place_many([entry(scope, key)], now_ms=T0) for s in stores)
        )
        generations = sorted(p[0].generation for p in placed)
        assert generations == [1, 2, 3, 4]
        assert (await stores[0].schedule.lookup(scope, key)).generation == 4
