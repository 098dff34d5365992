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
