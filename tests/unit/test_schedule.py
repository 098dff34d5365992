"""The schedule: its store contract on MemoryStore and SQLiteStore (direct and on the
group-commit thread), and the rules' edges."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from schedule_contract import T0, NewStore, ScheduleContract

from rabbit_delay._idempotency.guard import SyncStoreAsAsync
from rabbit_delay._schedule import rules
from rabbit_delay._schedule.records import ScheduleState, Verdict
from rabbit_delay.stores import AsyncSQLiteStore, MemoryStore, SQLiteStore


class TestMemorySchedule(ScheduleContract):
    shared_backend = False

    @pytest.fixture
    def new_store(self) -> NewStore:
        return lambda: SyncStoreAsAsync(MemoryStore())


class TestSQLiteSchedule(ScheduleContract):
    @pytest.fixture
    def new_store(self, tmp_path: Path) -> Iterator[NewStore]:
        made: list[SQLiteStore] = []

        def make() -> Any:
            made.append(SQLiteStore(tmp_path / "idem.sqlite3"))
            return AsyncSQLiteStore(made[-1])

        yield make
        for store in made:
            store.close()


class TestSQLiteScheduleDirect(ScheduleContract):
    shared_backend = False  # SyncStoreAsAsync runs each call inline: no race to see

    @pytest.fixture
    def new_store(self, tmp_path: Path) -> Iterator[NewStore]:
        made: list[SQLiteStore] = []

        def make() -> Any:
            made.append(SQLiteStore(tmp_path / "idem.sqlite3"))
            return SyncStoreAsAsync(made[-1])

        yield make
        for store in made:
            store.close()


@pytest.mark.parametrize(
    ("record_gen", "state", "gen", "verdict"),
    [
        (2, ScheduleState.SCHEDULED, 1, Verdict.SUPERSEDED),
        (2, ScheduleState.HANDLED, 1, Verdict.SUPERSEDED),
        (2, ScheduleState.SCHEDULED, 2, None),
        (2, ScheduleState.PARKED, 2, None),
        (2, ScheduleState.CANCELLED, 2, Verdict.CANCELLED),
        (2, ScheduleState.HANDLED, 2, Verdict.HANDLED),
        (2, ScheduleState.CANCELLED, 3, None),
    ],
)
def test_check_state(
    record_gen: int, state: ScheduleState, gen: int, verdict: Verdict | None
) -> None:
    assert rules.check_state(record_gen, state, gen) is verdict


def test_the_grace_grows_with_the_workers_lateness_only() -> None:
    assert rules.effective_grace_ms(60_000, None) == 60_000
    assert rules.effective_grace_ms(60_000, 5_000) == 60_000
    assert rules.effective_grace_ms(60_000, 50_000) == 150_000


def test_a_record_republished_again_waits_twice_as_long_each_time() -> None:
    assert [rules.next_sweep_ms(T0, 1_000, n) - T0 for n in (1, 2, 3, 4)] == [
        1_000,
        2_000,
        4_000,
        8_000,
    ]
    assert rules.next_sweep_ms(T0, 1_000, 50) - T0 == 1_000 << rules.MAX_SWEEP_BACKOFF


@pytest.mark.parametrize(
    ("key", "gen", "ok"),
    [
        ("k", 1, True),
        (b"k", b"2", True),
        ("", 1, False),
        ("k", 0, False),
        ("k", "x", False),
        (None, 1, False),
        ("k", None, False),
    ],
)
def test_ref_of_headers(key: object, gen: object, ok: bool) -> None:
    ref = rules.ref_of("scope", key, gen)
    assert (ref is not None) is ok
    if ref is not None:
        assert ref.key == "k"


def test_the_sql_stores_new_row_is_the_rules_new_record() -> None:
    from rabbit_delay._schedule.records import Entry, OnConflict, Payload
    from rabbit_delay._stores.sql_schedule import _row, new_row

    for headers in ({}, {"traceparent": "00-1-2-01", "n": [1, 2]}):
        entry = Entry(
            "scope",
            "k",
            "orders",
            T0 + 5,
            "m-1",
            Payload(b"{}", "application/json", headers),
            OnConflict.KEEP,
            T0 + 65,
        )
        _placed, record = rules.place(None, entry, T0)
        assert record is not None
        assert new_row(entry, T0) == _row(record)


def test_sqlite_holds_a_scheduled_claim_on_the_record_and_writes_no_guard_row(
    tmp_path: Path,
) -> None:
    """The record as the claim: a delivery of the record's generation, its guard key made
    of its message_id, is claimed, renewed and finished on the record; the guard table
    gets no row. A consumer key function's key (not the message_id's) still gets one."""
    import sqlite3

    from rabbit_delay._idempotency.guard import ClaimResult
    from rabbit_delay._schedule.records import Entry, Finished, OnConflict, Payload, Ref, Update

    path = tmp_path / "idem.sqlite3"
    store = SQLiteStore(path, prefix="p:")
    try:
        payload = Payload(b"{}", "application/json", {})
        entries = [
            Entry("s", f"k{i}", "orders", T0, f"m{i}", payload, OnConflict.REPLACE, T0 + 60_000)
            for i in range(3)
        ]
        store.schedule.place_many(entries, now_ms=T0)
        refs = [Ref("s", f"k{i}", 1, f"m{i}") for i in range(2)]
        custom = Ref("s", "k2", 1, None)  # the consumer has a key function
        _, claimed = store.scheduled_batch(
            [],
            [("q:m0", "w0", refs[0]), ("q:m1", "w1", refs[1]), ("order-2", "w2", custom)],
            now_ms=T0,
            lease_ms=30_000,
            retention_ms=600_000,
        )
        assert claimed == [ClaimResult.CLAIMED] * 3
        assert store.renew("q:m0", "w0", now_ms=T0 + 10_000, lease_ms=30_000) is True

        def rows(sql: str) -> list[Any]:
            conn = sqlite3.connect(path)
            try:
                return conn.execute(sql).fetchall()
            finally:
                conn.close()

        guard = "SELECT key, state FROM rabbit_delay_idempotency ORDER BY key"
        held = "SELECT key, owner, lease_until FROM rabbit_delay_idempotency_schedule "
        assert rows(guard) == [("p:order-2", "claimed")]
        assert rows(held + "WHERE owner IS NOT NULL ORDER BY key") == [
            ("k0", "w0", T0 + 40_000),
            ("k1", "w1", T0 + 30_000),
        ]
        done = [
            ("q:m0", "w0", True, Update(refs[0], Finished.HANDLED, 600_000)),
            ("q:m1", "w1", False, None),  # released: the handler never started
            ("order-2", "w2", True, Update(custom, Finished.HANDLED, 600_000)),
        ]
        finished, _ = store.scheduled_batch(
            done, [], now_ms=T0 + 20_000, lease_ms=30_000, retention_ms=600_000
        )
        assert finished == [None, None, None]
        assert rows(guard) == [("p:order-2", "done")]
        assert rows(held + "WHERE owner IS NOT NULL") == []
        states = "SELECT key, state FROM rabbit_delay_idempotency_schedule ORDER BY key"
        assert rows(states) == [("k0", "handled"), ("k1", "scheduled"), ("k2", "handled")]
    finally:
        store.close()
