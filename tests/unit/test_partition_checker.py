"""The partition runs' checker (tests/partitions/checker.py): every verdict it can give."""

from __future__ import annotations

from partitions.checker import Published, Run, Window, check, quantile


def pub(mid: str, *, confirmed: bool = True, due_ms: int = 1000, park: bool = False) -> Published:
    return Published(mid, confirmed, due_ms, park)


def run(mid: str, attempt: int = 1, lateness_ms: int = 10, effect: bool = True) -> Run:
    return Run(mid, attempt, lateness_ms, effect)


def test_a_clean_run_is_ok() -> None:
    v = check(
        [pub("a"), pub("b"), pub("p", park=True)],
        [run("a"), run("b", lateness_ms=30), *(run("p", n, effect=False) for n in (1, 2, 3))],
        ["p"],
        left={"buffer": 0, "business": 0},
    )
    assert v.ok, v.problems()
    assert (v.published, v.confirmed, v.handled, v.parked, v.runs) == (3, 3, 2, 1, 5)
    assert v.duplicates == 0
    assert v.lateness_max_ms == 30


def test_a_confirmed_message_neither_handled_nor_parked_is_lost() -> None:
    v = check([pub("a"), pub("b"), pub("c", park=True)], [run("a")], [])
    assert (v.lost, v.ok) == (2, False)
    assert v.examples["lost"] == ["b", "c"]
    assert v.problems() == ["lost 2: ['b', 'c']"]


def test_an_unconfirmed_message_may_be_missing_or_arrive() -> None:
    v = check([pub("a", confirmed=False), pub("b", confirmed=False)], [run("b")], [])
    assert v.ok
    assert (v.confirmed, v.handled, v.lost) == (0, 1, 0)


def test_a_message_never_published_is_unexpected() -> None:
    v = check([pub("a")], [run("a"), run("x")], ["y"])
    assert v.unexpected == 2
    assert v.examples["unexpected"] == ["x", "y"]


def test_an_effect_done_twice_fails_and_a_duplicate_delivery_is_counted() -> None:
    twice = check([pub("a")], [run("a"), run("a")], [])
    assert twice.effects_twice == 1
    assert twice.duplicates == 1
    caught = check([pub("a")], [run("a")], [], guard_duplicates=4)
    assert caught.ok
    assert caught.duplicates == 4


def test_a_run_before_its_due_time_is_early() -> None:
    v = check([pub("a")], [run("a", lateness_ms=-1)], [])
    assert (v.early, v.ok) == (1, False)


def test_a_parked_message_the_workload_did_not_mean_to_park_is_misparked() -> None:
    v = check([pub("a"), pub("p", park=True)], [run("a", effect=False)], ["a", "p", "p"])
    assert v.misparked == 1
    assert v.lost == 0  # parked, so not lost: but in the wrong place
    assert v.duplicates == 1  # p parked twice


def test_messages_left_in_a_queue_are_stuck() -> None:
    v = check([pub("a")], [run("a")], [], left={"tier": 3, "catch-all": 1, "business": 0})
    assert v.stuck == 4
    assert v.examples["stuck"] == ["catch-all=1", "tier=3"]


def test_lateness_is_of_the_first_run_and_split_by_fault_windows() -> None:
    pubs = [pub(str(i), due_ms=1000 * i) for i in range(1, 11)]
    runs = [run(str(i), lateness_ms=10 * i) for i in range(1, 11)]
    runs.append(run("5", attempt=2, lateness_ms=99999, effect=True))
    v = check(pubs, runs, [], windows=[Window("isolate", 7000, 9000)])
    assert (v.lateness_p50_ms, v.lateness_p99_ms, v.lateness_max_ms) == (50, 100, 100)
    assert (v.fault_lateness_p50_ms, v.fault_lateness_max_ms) == (80, 90)
    assert v.effects_twice == 1


def test_quantile_is_nearest_rank() -> None:
    assert quantile([], 0.5) is None
    assert quantile([5], 0.99) == 5
    assert quantile(list(range(1, 101)), 0.5) == 50
    assert quantile(list(range(1, 101)), 0.99) == 99
    assert quantile(list(range(1, 101)), 1.0) == 100


def test_messages_a_sweeper_copy_settled_first() -> None:
    """A run with [schedule]: the messages whose first run to the end (the effect, or
    the last attempt) was the copy the sweeper republished; a late original after it is
    a duplicate the guard drops, never a second settling run."""
    from partitions.workload import Recorder

    rec = Recorder()
    for r in (
        Run("a", 1, 10, True),  # the original
        Run("b", 1, 40_000, True, swept=True),  # stalled: only the sweeper's copy came
        Run("c", 1, 10, False),  # failed once, then the retry...
        Run("c", 2, 35_000, True, swept=True),  # ... was stalled, the sweeper sent it
        Run("d", 1, 20_000, True),  # late, but its original came first
        Run("d", 1, 20_100, True, swept=True),  # (a copy the guard would drop)
        Run("p", 3, 30_000, False, swept=True),  # its last attempt: parked
    ):
        rec.run(r)
    assert rec.settled_by_sweeper() == {"b", "c", "p"}
    assert rec.settled() == {"a", "b", "c", "d", "p"}
