"""The behaviour every idempotency store must have, run against each implementation.

Not a test module itself: tests/unit/test_idempotency.py (memory, SQLite),
tests/integration/test_idempotency_redis.py (sync and async Redis) and
tests/integration/test_idempotency_postgres.py (sync and async PostgreSQL, on the
caller's clock and the server's) subclass `StoreContract` and provide `new_store`, a
factory of `AsyncIdempotencyStore`s that share one backend (one SQLite file, one Redis
server, one PostgreSQL table). Synchronous stores run through
`SyncStoreAsAsync`, which calls them directly, so the contract exercises their own code.

Times come from a fake clock (T0 + offsets), never from sleeping. A store that judges
expiry by its server's clock (Redis, PostgreSQL by default) sets `caller_clock = False`:
the tests that make time pass by handing a later `now_ms` skip for it, and its own
module tests expiry.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable

import pytest

from rabbit_delay.stores import AsyncIdempotencyStore, ClaimResult

T0 = 1_700_000_000_000
LEASE = 60_000
RETENTION = 600_000

NewStore = Callable[..., AsyncIdempotencyStore]  # new_store(prefix: str | None = None)

CLAIMED = ClaimResult.CLAIMED
DONE = ClaimResult.DONE
IN_PROGRESS = ClaimResult.IN_PROGRESS
CANCELLED = ClaimResult.CANCELLED


def new_key() -> str:
    return uuid.uuid4().hex


class StoreContract:
    # False for a backend that cannot be opened twice (MemoryStore): skips the tests of
    # several stores on one backend.
    shared_backend = True
    # False for a store that ignores `now_ms` and reads its server's clock (Redis).
    caller_clock = True

    def needs_caller_clock(self) -> None:
        if not self.caller_clock:
            pytest.skip("this store ignores now_ms (server clock): its own tests cover expiry")

    @pytest.fixture
    def store(self, new_store: NewStore) -> AsyncIdempotencyStore:
        return new_store()

    async def test_first_claim_runs_and_done_makes_every_copy_a_duplicate(
        self, store: AsyncIdempotencyStore
    ) -> None:
        key = new_key()
        assert await store.claim(key, "a", now_ms=T0, lease_ms=LEASE) is CLAIMED
        await store.complete(key, "a", now_ms=T0 + 5, retention_ms=RETENTION)
        assert await store.claim(key, "b", now_ms=T0 + 10, lease_ms=LEASE) is DONE
        assert await store.claim(key, "a", now_ms=T0 + 10, lease_ms=LEASE) is DONE

    async def test_keys_are_independent(self, store: AsyncIdempotencyStore) -> None:
        k1, k2 = new_key(), new_key()
        assert await store.claim(k1, "a", now_ms=T0, lease_ms=LEASE) is CLAIMED
        assert await store.claim(k2, "b", now_ms=T0, lease_ms=LEASE) is CLAIMED

    async def test_live_claim_of_another_owner_is_in_progress(
        self, store: AsyncIdempotencyStore
    ) -> None:
        key = new_key()
        assert await store.claim(key, "a", now_ms=T0, lease_ms=LEASE) is CLAIMED
        assert await store.claim(key, "b", now_ms=T0 + 1, lease_ms=LEASE) is IN_PROGRESS
        assert await store.claim(key, "b", now_ms=T0 + LEASE - 1, lease_ms=LEASE) is IN_PROGRESS

    async def test_expired_lease_lets_a_new_owner_claim(self, store: AsyncIdempotencyStore) -> None:
        self.needs_caller_clock()
        key = new_key()
        assert await store.claim(key, "crashed", now_ms=T0, lease_ms=LEASE) is CLAIMED
        assert await store.claim(key, "b", now_ms=T0 + LEASE, lease_ms=LEASE) is CLAIMED
        # The new owner now holds it; the old one is the stranger.
        late = T0 + LEASE + 1
        assert await store.claim(key, "crashed", now_ms=late, lease_ms=LEASE) is IN_PROGRESS
        await store.release(key, "crashed")  # not the holder: no effect
        assert await store.claim(key, "c", now_ms=T0 + LEASE + 2, lease_ms=LEASE) is IN_PROGRESS

    async def test_reclaim_by_the_same_owner_is_reentrant_and_renews_the_lease(
        self, store: AsyncIdempotencyStore
    ) -> None:
        self.needs_caller_clock()
        key = new_key()
        half = LEASE // 2
        assert await store.claim(key, "a", now_ms=T0, lease_ms=LEASE) is CLAIMED
        assert await store.claim(key, "a", now_ms=T0 + half, lease_ms=LEASE) is CLAIMED
        # Past the first lease, within the renewed one.
        assert await store.claim(key, "b", now_ms=T0 + LEASE + 1, lease_ms=LEASE) is IN_PROGRESS
        assert await store.claim(key, "b", now_ms=T0 + half + LEASE, lease_ms=LEASE) is CLAIMED

    async def test_release_after_failure_lets_the_retry_claim(
        self, store: AsyncIdempotencyStore
    ) -> None:
        key = new_key()
        assert await store.claim(key, "a", now_ms=T0, lease_ms=LEASE) is CLAIMED
        await store.release(key, "a")
        assert await store.claim(key, "retry", now_ms=T0 + 1, lease_ms=LEASE) is CLAIMED
        assert await store.claim(key, "other", now_ms=T0 + 2, lease_ms=LEASE) is IN_PROGRESS

    async def test_release_never_drops_a_done_record(self, store: AsyncIdempotencyStore) -> None:
        key = new_key()
        assert await store.claim(key, "a", now_ms=T0, lease_ms=LEASE) is CLAIMED
        await store.complete(key, "a", now_ms=T0, retention_ms=RETENTION)
        await store.release(key, "a")
        assert await store.claim(key, "b", now_ms=T0 + 1, lease_ms=LEASE) is DONE

    async def test_done_outlives_the_lease_until_retention_ends(
        self, store: AsyncIdempotencyStore
    ) -> None:
        self.needs_caller_clock()
        key = new_key()
        assert await store.claim(key, "a", now_ms=T0, lease_ms=LEASE) is CLAIMED
        await store.complete(key, "a", now_ms=T0, retention_ms=RETENTION)
        assert await store.claim(key, "b", now_ms=T0 + RETENTION - 1, lease_ms=LEASE) is DONE
        assert await store.claim(key, "b", now_ms=T0 + RETENTION, lease_ms=LEASE) is CLAIMED

    async def test_complete_by_a_stale_owner_still_records_done(
        self, store: AsyncIdempotencyStore
    ) -> None:
        self.needs_caller_clock()
        # The handler did succeed, even if its lease ran out and another owner took it.
        key = new_key()
        assert await store.claim(key, "slow", now_ms=T0, lease_ms=LEASE) is CLAIMED
        assert await store.claim(key, "b", now_ms=T0 + LEASE, lease_ms=LEASE) is CLAIMED
        await store.complete(key, "slow", now_ms=T0 + LEASE + 1, retention_ms=RETENTION)
        assert await store.claim(key, "c", now_ms=T0 + LEASE + 2, lease_ms=LEASE) is DONE
        await store.release(key, "b")  # b's failure cannot undo the done-record
        assert await store.claim(key, "c", now_ms=T0 + LEASE + 3, lease_ms=LEASE) is DONE

    async def test_complete_on_a_live_done_record_changes_nothing(
        self, store: AsyncIdempotencyStore
    ) -> None:
        self.needs_caller_clock()
        # What makes the worker's complete() after an inbox mark_done harmless.
        key = new_key()
        await store.complete(key, "inbox", now_ms=T0, retention_ms=RETENTION)
        await store.complete(key, "worker", now_ms=T0 + RETENTION // 2, retention_ms=RETENTION)
        assert await store.claim(key, "b", now_ms=T0 + RETENTION - 1, lease_ms=LEASE) is DONE
        assert await store.claim(key, "b", now_ms=T0 + RETENTION, lease_ms=LEASE) is CLAIMED

    async def test_cancel_leaves_a_tombstone(self, store: AsyncIdempotencyStore) -> None:
        self.needs_caller_clock()
        key = new_key()
        await store.cancel(key, now_ms=T0, retention_ms=RETENTION)
        assert await store.claim(key, "a", now_ms=T0 + 1, lease_ms=LEASE) is CANCELLED
        await store.complete(key, "a", now_ms=T0 + 2, retention_ms=RETENTION)
        assert await store.claim(key, "a", now_ms=T0 + 3, lease_ms=LEASE) is CANCELLED
        assert await store.claim(key, "a", now_ms=T0 + RETENTION, lease_ms=LEASE) is CLAIMED

    async def test_cancel_overrides_a_claim_in_progress(self, store: AsyncIdempotencyStore) -> None:
        key = new_key()
        assert await store.claim(key, "a", now_ms=T0, lease_ms=LEASE) is CLAIMED
        await store.cancel(key, now_ms=T0 + 1, retention_ms=RETENTION)
        assert await store.claim(key, "b", now_ms=T0 + 2, lease_ms=LEASE) is CANCELLED
        await store.release(key, "a")
        await store.complete(key, "a", now_ms=T0 + 3, retention_ms=RETENTION)
        assert await store.claim(key, "b", now_ms=T0 + 4, lease_ms=LEASE) is CANCELLED

    async def test_cancel_overrides_a_done_record(self, store: AsyncIdempotencyStore) -> None:
        key = new_key()
        await store.complete(key, "a", now_ms=T0, retention_ms=RETENTION)
        await store.cancel(key, now_ms=T0 + 1, retention_ms=RETENTION)
        assert await store.claim(key, "b", now_ms=T0 + 2, lease_ms=LEASE) is CANCELLED

    async def test_a_second_cancel_never_shortens_the_tombstone(
        self, store: AsyncIdempotencyStore
    ) -> None:
        self.needs_caller_clock()
        key = new_key()
        await store.cancel(key, now_ms=T0, retention_ms=2 * RETENTION)
        await store.cancel(key, now_ms=T0 + 1, retention_ms=RETENTION)
        assert await store.claim(key, "a", now_ms=T0 + RETENTION + 2, lease_ms=LEASE) is CANCELLED
        assert await store.claim(key, "a", now_ms=T0 + 2 * RETENTION, lease_ms=LEASE) is CLAIMED

    async def test_a_reconcile_run_claim_and_its_period_record(
        self, store: AsyncIdempotencyStore
    ) -> None:
        """What reconcilers rely on (_reconcile.py): a run claim one owner holds
        at a time and gives back, and a period tombstone that overrides the period
        claim of the run that wrote it and turns later looks away."""
        running, period = new_key(), new_key()
        assert await store.claim(period, "w1:1", now_ms=T0, lease_ms=LEASE) is CLAIMED
        assert await store.claim(running, "w1:1", now_ms=T0, lease_ms=LEASE) is CLAIMED
        # another worker's look meanwhile: both are taken
        assert await store.claim(period, "w2:1", now_ms=T0 + 1, lease_ms=LEASE) is IN_PROGRESS
        assert await store.claim(running, "w2:1", now_ms=T0 + 1, lease_ms=LEASE) is IN_PROGRESS
        # the run ends: its period recorded, its run claim given back
        await store.cancel(period, now_ms=T0 + 2, retention_ms=RETENTION)
        await store.release(running, "w1:1")
        assert await store.claim(period, "w2:2", now_ms=T0 + 3, lease_ms=LEASE) is CANCELLED
        # `rabbit-delay reconcile` runs whatever the period, never beside a run
        assert await store.claim(running, "cli:1", now_ms=T0 + 3, lease_ms=LEASE) is CLAIMED
        assert await store.claim(running, "w2:3", now_ms=T0 + 4, lease_ms=LEASE) is IN_PROGRESS
        await store.cancel(period, now_ms=T0 + 5, retention_ms=RETENTION)
        await store.release(running, "cli:1")
        assert await store.claim(running, "w2:4", now_ms=T0 + 6, lease_ms=LEASE) is CLAIMED

    async def test_a_reconcile_period_record_lapses_after_its_retention(
        self, store: AsyncIdempotencyStore
    ) -> None:
        self.needs_caller_clock()
        period = new_key()
        await store.cancel(period, now_ms=T0, retention_ms=RETENTION)
        assert (
            await store.claim(period, "w", now_ms=T0 + RETENTION - 1, lease_ms=LEASE) is CANCELLED
        )
        assert await store.claim(period, "w", now_ms=T0 + RETENTION, lease_ms=LEASE) is CLAIMED

    async def test_purge_deletes_exactly_the_expired_records(
        self, store: AsyncIdempotencyStore
    ) -> None:
        self.needs_caller_clock()
        done, tomb, claim, live_done, live_claim = (new_key() for _ in range(5))
        await store.complete(done, "a", now_ms=T0, retention_ms=RETENTION)
        await store.cancel(tomb, now_ms=T0, retention_ms=RETENTION)
        assert await store.claim(claim, "a", now_ms=T0, lease_ms=LEASE) is CLAIMED
        later = T0 + RETENTION
        await store.complete(live_done, "a", now_ms=later, retention_ms=RETENTION)
        assert await store.claim(live_claim, "a", now_ms=later, lease_ms=LEASE) is CLAIMED

        assert await store.purge(now_ms=later - 1) == 1  # only the claim's lease is over
        assert await store.purge(now_ms=later) == 2
        assert await store.purge(now_ms=later) == 0
        assert await store.claim(live_done, "b", now_ms=later + 1, lease_ms=LEASE) is DONE
        assert await store.claim(live_claim, "b", now_ms=later + 1, lease_ms=LEASE) is IN_PROGRESS
        assert await store.claim(done, "b", now_ms=later + 1, lease_ms=LEASE) is CLAIMED

    async def test_prefixes_separate_namespaces(self, new_store: NewStore) -> None:
        if not self.shared_backend:
            pytest.skip("each store of this kind is its own backend")
        tag = uuid.uuid4().hex[:8]
        one, two = new_store(prefix=f"one-{tag}:"), new_store(prefix=f"two-{tag}:")
        key = new_key()
        assert await one.claim(key, "a", now_ms=T0, lease_ms=LEASE) is CLAIMED
        await one.complete(key, "a", now_ms=T0, retention_ms=RETENTION)
        assert await two.claim(key, "b", now_ms=T0, lease_ms=LEASE) is CLAIMED
        assert await one.claim(key, "b", now_ms=T0, lease_ms=LEASE) is DONE

    async def test_two_stores_on_one_backend_share_claims(self, new_store: NewStore) -> None:
        if not self.shared_backend:
            pytest.skip("each store of this kind is its own backend")
        prefix = f"shared-{uuid.uuid4().hex[:8]}:"
        one, two = new_store(prefix=prefix), new_store(prefix=prefix)
        key = new_key()
        assert await one.claim(key, "a", now_ms=T0, lease_ms=LEASE) is CLAIMED
        assert await two.claim(key, "b", now_ms=T0, lease_ms=LEASE) is IN_PROGRESS
        await one.complete(key, "a", now_ms=T0, retention_ms=RETENTION)
        assert await two.claim(key, "b", now_ms=T0, lease_ms=LEASE) is DONE

    async def test_concurrent_claims_have_one_winner(self, store: AsyncIdempotencyStore) -> None:
        key = new_key()
        results = await asyncio.gather(
            *(store.claim(key, f"owner-{i}", now_ms=T0, lease_ms=LEASE) for i in range(8))
        )
        assert sorted(results) == sorted([CLAIMED] + [IN_PROGRESS] * 7)

    async def test_owner_and_key_may_contain_separators(self, store: AsyncIdempotencyStore) -> None:
        key = f"order|42|{new_key()}:é"
        owner = "host:1|pid 7|\n"
        assert await store.claim(key, owner, now_ms=T0, lease_ms=LEASE) is CLAIMED
        assert await store.claim(key, owner, now_ms=T0 + 1, lease_ms=LEASE) is CLAIMED
        assert await store.claim(key, owner + "x", now_ms=T0 + 1, lease_ms=LEASE) is IN_PROGRESS
        await store.release(key, owner)
        assert await store.claim(key, "b", now_ms=T0 + 2, lease_ms=LEASE) is CLAIMED

    # -- renew -----------------------------------------------------------------------

    async def test_renew_keeps_the_holders_claim(self, store: AsyncIdempotencyStore) -> None:
        key = new_key()
        assert await store.claim(key, "a", now_ms=T0, lease_ms=LEASE) is CLAIMED
        assert await store.renew(key, "a", now_ms=T0 + 1, lease_ms=LEASE) is True
        assert await store.claim(key, "b", now_ms=T0 + 2, lease_ms=LEASE) is IN_PROGRESS
        assert await store.renew(key, "a", now_ms=T0 + 3, lease_ms=LEASE) is True

    async def test_renew_never_creates_a_claim(self, store: AsyncIdempotencyStore) -> None:
        key = new_key()
        assert await store.renew(key, "a", now_ms=T0, lease_ms=LEASE) is False
        assert await store.claim(key, "b", now_ms=T0 + 1, lease_ms=LEASE) is CLAIMED

    async def test_renew_by_another_owner_fails_and_changes_nothing(
        self, store: AsyncIdempotencyStore
    ) -> None:
        key = new_key()
        assert await store.claim(key, "a", now_ms=T0, lease_ms=LEASE) is CLAIMED
        assert await store.renew(key, "b", now_ms=T0 + 1, lease_ms=LEASE) is False
        assert await store.claim(key, "b", now_ms=T0 + 2, lease_ms=LEASE) is IN_PROGRESS
        await store.release(key, "a")
        assert await store.claim(key, "b", now_ms=T0 + 3, lease_ms=LEASE) is CLAIMED

    async def test_renew_fails_once_released_done_or_cancelled(
        self, store: AsyncIdempotencyStore
    ) -> None:
        released, done, cancelled = new_key(), new_key(), new_key()
        for key in (released, done, cancelled):
            assert await store.claim(key, "a", now_ms=T0, lease_ms=LEASE) is CLAIMED
        await store.release(released, "a")
        await store.complete(done, "a", now_ms=T0 + 1, retention_ms=RETENTION)
        await store.cancel(cancelled, now_ms=T0 + 1, retention_ms=RETENTION)
        for key in (released, done, cancelled):
            assert await store.renew(key, "a", now_ms=T0 + 2, lease_ms=LEASE) is False
        assert await store.claim(released, "b", now_ms=T0 + 3, lease_ms=LEASE) is CLAIMED
        assert await store.claim(done, "b", now_ms=T0 + 3, lease_ms=LEASE) is DONE
        assert await store.claim(cancelled, "b", now_ms=T0 + 3, lease_ms=LEASE) is CANCELLED

    async def test_renew_extends_the_lease_from_now(self, store: AsyncIdempotencyStore) -> None:
        self.needs_caller_clock()
        key = new_key()
        half = LEASE // 2
        assert await store.claim(key, "a", now_ms=T0, lease_ms=LEASE) is CLAIMED
        assert await store.renew(key, "a", now_ms=T0 + half, lease_ms=LEASE) is True
        assert await store.claim(key, "b", now_ms=T0 + LEASE + 1, lease_ms=LEASE) is IN_PROGRESS
        assert await store.claim(key, "b", now_ms=T0 + half + LEASE, lease_ms=LEASE) is CLAIMED

    async def test_renew_of_a_lapsed_lease_nobody_took_succeeds(
        self, store: AsyncIdempotencyStore
    ) -> None:
        self.needs_caller_clock()
        key = new_key()
        assert await store.claim(key, "a", now_ms=T0, lease_ms=LEASE) is CLAIMED
        late = T0 + LEASE + 10
        assert await store.renew(key, "a", now_ms=late, lease_ms=LEASE) is True
        assert await store.claim(key, "b", now_ms=late + 1, lease_ms=LEASE) is IN_PROGRESS

    async def test_renew_after_a_takeover_fails(self, store: AsyncIdempotencyStore) -> None:
        self.needs_caller_clock()
        key = new_key()
        assert await store.claim(key, "a", now_ms=T0, lease_ms=LEASE) is CLAIMED
        assert await store.claim(key, "b", now_ms=T0 + LEASE, lease_ms=LEASE) is CLAIMED
        assert await store.renew(key, "a", now_ms=T0 + LEASE + 1, lease_ms=LEASE) is False
        assert await store.claim(key, "c", now_ms=T0 + LEASE + 2, lease_ms=LEASE) is IN_PROGRESS

    # -- batches ---------------------------------------------------------------------

    async def test_claim_many_answers_each_item_in_order(
        self, store: AsyncIdempotencyStore
    ) -> None:
        free, done, held, tomb, mine = (new_key() for _ in range(5))
        await store.complete(done, "x", now_ms=T0, retention_ms=RETENTION)
        assert await store.claim(held, "x", now_ms=T0, lease_ms=LEASE) is CLAIMED
        await store.cancel(tomb, now_ms=T0, retention_ms=RETENTION)
        assert await store.claim(mine, "a", now_ms=T0, lease_ms=LEASE) is CLAIMED
        items = [(free, "a"), (done, "a"), (held, "a"), (tomb, "a"), (mine, "a")]
        results = await store.claim_many(items, now_ms=T0 + 1, lease_ms=LEASE)
        assert results == [CLAIMED, DONE, IN_PROGRESS, CANCELLED, CLAIMED]
        assert await store.claim(free, "b", now_ms=T0 + 2, lease_ms=LEASE) is IN_PROGRESS

    async def test_claim_many_one_key_twice_in_a_batch_has_one_winner(
        self, store: AsyncIdempotencyStore
    ) -> None:
        key = new_key()
        items = [(key, "a"), (key, "b"), (key, "a")]
        results = await store.claim_many(items, now_ms=T0, lease_ms=LEASE)
        assert results == [CLAIMED, IN_PROGRESS, CLAIMED]

    async def test_finish_many_completes_and_releases(self, store: AsyncIdempotencyStore) -> None:
        ok, failed, stolen = new_key(), new_key(), new_key()
        claims = [(ok, "a"), (failed, "a"), (stolen, "b")]
        assert await store.claim_many(claims, now_ms=T0, lease_ms=LEASE) == [CLAIMED] * 3
        # "a" releasing a claim it does not hold changes nothing.
        items = [(ok, "a", True), (failed, "a", False), (stolen, "a", False)]
        assert await store.finish_many(items, now_ms=T0 + 1, retention_ms=RETENTION) == [
            None,
            None,
            None,
        ]
        assert await store.claim(ok, "c", now_ms=T0 + 2, lease_ms=LEASE) is DONE
        assert await store.claim(failed, "c", now_ms=T0 + 2, lease_ms=LEASE) is CLAIMED
        assert await store.claim(stolen, "c", now_ms=T0 + 2, lease_ms=LEASE) is IN_PROGRESS

    async def test_finish_many_keeps_a_tombstone(self, store: AsyncIdempotencyStore) -> None:
        key = new_key()
        assert await store.claim(key, "a", now_ms=T0, lease_ms=LEASE) is CLAIMED
        await store.cancel(key, now_ms=T0 + 1, retention_ms=RETENTION)
        items = [(key, "a", True)]
        assert await store.finish_many(items, now_ms=T0 + 2, retention_ms=RETENTION) == [None]
        assert await store.claim(key, "b", now_ms=T0 + 3, lease_ms=LEASE) is CANCELLED

    async def test_empty_batches_do_nothing(self, store: AsyncIdempotencyStore) -> None:
        assert await store.claim_many([], now_ms=T0, lease_ms=LEASE) == []
        assert await store.finish_many([], now_ms=T0, retention_ms=RETENTION) == []

    async def test_a_large_batch(self, store: AsyncIdempotencyStore) -> None:
        keys = [new_key() for _ in range(300)]
        claims = [(k, f"o-{k}") for k in keys]
        assert await store.claim_many(claims, now_ms=T0, lease_ms=LEASE) == [CLAIMED] * 300
        finishes = [(k, f"o-{k}", i % 2 == 0) for i, k in enumerate(keys)]
        assert await store.finish_many(finishes, now_ms=T0, retention_ms=RETENTION) == [None] * 300
        again = await store.claim_many(claims, now_ms=T0 + 1, lease_ms=LEASE)
        assert again == [DONE if i % 2 == 0 else CLAIMED for i in range(300)]

    async def test_batches_share_records_with_single_calls(self, new_store: NewStore) -> None:
        if not self.shared_backend:
            pytest.skip("each store of this kind is its own backend")
        prefix = f"batch-{uuid.uuid4().hex[:8]}:"
        one, two = new_store(prefix=prefix), new_store(prefix=prefix)
        key = new_key()
        assert await one.claim_many([(key, "a")], now_ms=T0, lease_ms=LEASE) == [CLAIMED]
        assert await two.claim(key, "b", now_ms=T0, lease_ms=LEASE) is IN_PROGRESS
        assert await two.renew(key, "a", now_ms=T0, lease_ms=LEASE) is True
        await one.finish_many([(key, "a", True)], now_ms=T0, retention_ms=RETENTION)
        assert await two.claim_many([(key, "b")], now_ms=T0, lease_ms=LEASE) == [DONE]
