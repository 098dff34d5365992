"""The worker's lifecycle and housekeeping programs (rabbit_delay._consumer.lifecycle,
.housekeeping): pure, driven here step by step as the three workers drive them."""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

import pytest

import rabbit_delay._consumer.lifecycle as lc
from rabbit_delay import BrokerUnavailable, IncompatibleBroker, MissingObjectError
from rabbit_delay._broker import BrokerInfo
from rabbit_delay._connection import ConnectionSettings, ReconnectBackoff
from rabbit_delay._consumer.housekeeping import PURGE, Renew, Sleep, housekeeping_program
from rabbit_delay._consumer.leases import LeaseBook
from rabbit_delay._consumer.settings import WorkerSettings
from rabbit_delay._idempotency.guard import ClaimResult

A, B, C = (f"amqp://guest:guest@node-{n}:5672/%2F" for n in "abc")
BROKER = BrokerInfo.from_server_properties({"version": "4.3.6"})


@dataclass
class Events:
    """Every event told, in order, as (name, args)."""

    told: list[tuple[str, tuple[Any, ...]]] = field(default_factory=list)

    def __getattr__(self, name: str) -> Callable[..., None]:
        def tell(*args: Any) -> None:
            self.told.append((name, args))

        return tell

    def names(self) -> list[str]:
        return [n for n, _ in self.told]


@dataclass
class Target:
    settings: WorkerSettings
    queues: list[str] = field(default_factory=lambda: ["shop.v1.q.a", "shop.v1.q.b"])
    refuse: bool = False

    def check_broker(self, broker: BrokerInfo) -> None:
        if self.refuse:
            raise IncompatibleBroker("too old")

    def queue_names(self) -> list[str]:
        return self.queues


def target(urls: tuple[str, ...] = (A, B, C), *, declare: bool = False, **kw: Any) -> Target:
    backoff = ReconnectBackoff(initial_s=1.0, max_s=4.0, jitter=0.0)
    settings = WorkerSettings.resolve(
        list(urls),
        default_concurrency=1,
        declare=declare,
        connection_settings=ConnectionSettings(backoff=backoff),
        shutdown_timeout=12.0,
    )
    return Target(settings, **kw)


Answer = Callable[[lc.LifecycleStep], object]
Program = Generator[lc.LifecycleStep, object, None]


def drive(program: Program, answer: Answer, limit: int = 100) -> list[lc.LifecycleStep]:
    """Run the program to its end, answering each step; the steps, in order."""
    steps: list[lc.LifecycleStep] = []
    reply: object = None
    for _ in range(limit):
        try:
            step = program.send(reply)
        except StopIteration:
            return steps
        steps.append(step)
        reply = answer(step)
    raise AssertionError(f"the program did not end: {steps}")


def broker_answers(**special: object) -> Answer:
    """What a healthy broker answers; `special` maps a step kind to a list of answers
    given in turn (then the healthy one)."""
    queues: dict[str, list[object]] = {k: list(v) for k, v in special.items()}  # type: ignore[call-overload]

    def answer(step: lc.LifecycleStep) -> object:
        key = step.name if isinstance(step, lc.Act) else type(step).__name__
        if isinstance(step, lc.Wait):
            key = f"Wait.{step.until.name}"
        if queues.get(key):
            return queues[key].pop(0)
        if isinstance(step, lc.Connect):
            return lc.Connected(step.urls[0], BROKER)
        if isinstance(step, lc.CheckQueue):
            return True
        if step is lc.SERVE:
            return lc.STOPPED
        if isinstance(step, lc.Wait):
            if step.until is lc.Until.SETTLED:
                return lc.Drained(0, False)
            return 0 if step.until is lc.Until.RECORDED else False
        return None

    return answer


def kinds(steps: list[lc.LifecycleStep]) -> list[str]:
    return [
        s.name
        if isinstance(s, lc.Act)
        else (f"Wait.{s.until.name}" if isinstance(s, lc.Wait) else type(s).__name__)
        for s in steps
    ]


def test_a_start_checks_the_broker_and_every_queue_before_consuming_then_stops_in_order() -> None:
    events = Events()
    steps = drive(lc.lifecycle_program(target(), events), broker_answers())
    assert kinds(steps) == [
        "Connect",
        "CheckQueue",
        "CheckQueue",
        "CONSUME",
        "SERVE",
        "CANCEL",
        "Wait.SETTLED",
        "CLOSE",
        "Wait.RECORDED",
    ]
    assert steps[0] == lc.Connect((A, B, C))
    assert [s.name for s in steps if isinstance(s, lc.CheckQueue)] == ["shop.v1.q.a", "shop.v1.q.b"]
    drain = steps[6]
    assert isinstance(drain, lc.Wait)
    assert drain.seconds == 12.0  # the shutdown timeout
    assert events.names() == ["consuming"]


def test_the_topology_is_declared_at_the_first_start_only() -> None:
    lost = lc.Lost("gone")
    steps = drive(
        lc.lifecycle_program(target(declare=True), Events()),
        broker_answers(SERVE=[lost]),
    )
    assert kinds(steps).count("DECLARE") == 1
    assert kinds(steps).index("DECLARE") < kinds(steps).index("CONSUME")


@pytest.mark.parametrize(
    ("special", "error", "closed"),
    [
        ({"Connect": [BrokerUnavailable("nobody home")]}, BrokerUnavailable, False),
        ({"CheckQueue": [True, False]}, MissingObjectError, True),
        ({"CONSUME": [BrokerUnavailable("channel refused")]}, BrokerUnavailable, True),
    ],
)
def test_what_stops_a_start_is_raised_the_connection_closed_first(
    special: dict[str, list[object]], error: type[Exception], closed: bool
) -> None:
    steps: list[lc.LifecycleStep] = []
    answer = broker_answers(**special)

    def record(step: lc.LifecycleStep) -> object:
        steps.append(step)
        return answer(step)

    with pytest.raises(error) as raised:
        drive(lc.lifecycle_program(target(), Events()), record)
    assert (steps[-1] is lc.CLOSE) is closed
    if error is MissingObjectError:
        assert "shop.v1.q.b" in str(raised.value)
        assert "rabbit-delay declare" in str(raised.value)


def test_an_incompatible_broker_is_refused_before_any_queue_is_checked() -> None:
    steps: list[lc.LifecycleStep] = []
    answer = broker_answers()

    def record(step: lc.LifecycleStep) -> object:
        steps.append(step)
        return answer(step)

    with pytest.raises(IncompatibleBroker):
        drive(lc.lifecycle_program(target(refuse=True), Events()), record)
    assert kinds(steps) == ["Connect", "CLOSE"]


def test_a_lost_connection_is_reconnected_over_the_other_nodes_first_with_backoff() -> None:
    events = Events()
    failed = BrokerUnavailable("still down")
    answers = broker_answers(
        SERVE=[lc.Lost("connection reset")], Connect=[lc.Connected(B, BROKER), failed, failed]
    )
    steps = drive(lc.lifecycle_program(target(), events), answers)
    connects = [s for s in steps if isinstance(s, lc.Connect)]
    # the start went to B (the first answer); after losing B, C then A are tried first
    assert [c.urls for c in connects] == [(A, B, C), (C, A, B), (C, A, B), (C, A, B)]
    backoffs = [s.seconds for s in steps if isinstance(s, lc.Wait) and s.until is lc.Until.STOP]
    assert backoffs == [1.0, 2.0]  # doubling, no jitter here
    assert events.names() == [
        "consuming",
        "connection_lost",
        "reconnect_failed",
        "reconnect_failed",
        "reconnected",
    ]
    assert events.told[2][1] == ("still down", 1.0, 3)
    # the lost connection is closed before the next round; the new one drained at the stop
    assert kinds(steps)[kinds(steps).index("SERVE") + 1] == "CLOSE"
    assert "CANCEL" in kinds(steps)


def test_a_stop_asked_during_the_backoff_ends_the_run_without_a_drain() -> None:
    events = Events()
    answers = broker_answers(
        SERVE=[lc.Lost("gone")],
        Connect=[lc.Connected(A, BROKER), BrokerUnavailable("down")],
        **{"Wait.STOP": [True]},
    )
    steps = drive(lc.lifecycle_program(target(), events), answers)
    assert "CANCEL" not in kinds(steps)  # nothing to drain on: not connected
    assert kinds(steps)[-1] == "Wait.RECORDED"  # running handlers still record


def test_a_drain_past_the_timeout_and_handlers_still_running_are_told() -> None:
    events = Events()
    answers = broker_answers(**{"Wait.SETTLED": [lc.Drained(3, False)], "Wait.RECORDED": [2, 1]})
    steps = drive(lc.lifecycle_program(target(), events), answers)
    assert kinds(steps)[-3:] == ["Wait.RECORDED", "Wait.RECORDED", "Wait.RECORDED"]
    assert ("shutdown_timeout", (3, False)) in events.told
    assert [a for n, a in events.told if n == "still_running"] == [(2,), (1,)]


def test_a_connection_lost_while_stopping_skips_the_drain() -> None:
    events = Events()
    steps = drive(lc.lifecycle_program(target(), events), broker_answers(CANCEL=[lc.Lost("reset")]))
    assert kinds(steps)[-3:] == ["CANCEL", "CLOSE", "Wait.RECORDED"]
    assert ("connection_lost_at_stop", ("reset",)) in events.told


# -- housekeeping -----------------------------------------------------------------------


def test_housekeeping_renews_what_is_due_reports_a_lost_lease_and_purges_on_its_cadence() -> None:
    events = Events()
    book = LeaseBook(30_000)
    book.claimed("k1", "o1", ClaimResult.CLAIMED, 0)
    book.claimed("k2", "o2", ClaimResult.CLAIMED, 0)
    now = {"ms": 0, "s": 0.0}
    program = housekeeping_program(
        book, events, clock=lambda: now["ms"], monotonic=lambda: now["s"], purges=True
    )
    step = next(program)
    assert step == Sleep(5.0)  # half a renewal period (30 s lease: renewed every 10 s)
    now["ms"], now["s"] = 10_000, 10.0
    step = program.send(False)
    assert step == Renew("k1", "o1")
    step = program.send(True)  # still held
    assert step == Renew("k2", "o2")
    step = program.send(False)  # another owner took it: a second copy may run
    assert step == Sleep(5.0)
    assert events.names() == ["lease_lost"]
    now["ms"], now["s"] = 20_000, 600.0  # the purge is due now
    step = program.send(False)
    assert step == Renew("k1", "o1")
    step = program.send(RuntimeError("store down"))
    assert step is PURGE
    assert events.told[-1] == ("renewal_failed", ("k1", events.told[-1][1][1]))
    step = program.send(OSError("disk"))
    assert step == Sleep(5.0)
    assert events.names()[-1] == "purge_failed"
    with pytest.raises(StopIteration):
        program.send(True)  # the worker stops


def test_housekeeping_until_idle_ends_when_no_lease_is_held() -> None:
    book = LeaseBook(30_000)
    program = housekeeping_program(
        book, Events(), clock=lambda: 0, monotonic=lambda: 0.0, purges=False, until_idle=True
    )
    with pytest.raises(StopIteration):
        next(program)
