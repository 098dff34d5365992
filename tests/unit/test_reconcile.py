"""Reconcilers (_reconcile.py): registration, the schedule and the run program,
driven here against a MemoryStore and a fake clock, no broker."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from rabbit_delay import (
    App,
    ConfigError,
    ConnectionLost,
    NackError,
    ReconcileContext,
    Resubmit,
    topology_from_dict,
)
from rabbit_delay import _headers as h
from rabbit_delay._consumer.app import Transport
from rabbit_delay._envelope import Outgoing
from rabbit_delay._reconcile import (
    MAX_CHECK_MS,
    MIN_CHECK_MS,
    Call,
    Called,
    Open,
    ReconcileResult,
    ReconcileSchedule,
    Send,
    StoreClaim,
    StoreMark,
    StoreRelease,
    acollect,
    collect,
    reconcile_key,
    reconcile_program,
)
from rabbit_delay._topology.delays import IMMEDIATE
from rabbit_delay.stores import ClaimResult, MemoryStore

NOW = 1_800_000_000_000
LEASE = 30_000


def make_app() -> App:
    topology = topology_from_dict(
        {
            "namespace": "shop",
            "tiers": {"1s": "1s", "5m": "5m"},
            "queues": {"orders": {}, "mail": {"bindings": ["order.paid"]}},
        }
    )
    return App(topology, store=MemoryStore())


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> int:
        return self.now


class Driver:
    """Executes a run program's steps the way _sync/reconcile.py does, on a MemoryStore."""

    def __init__(self, app: App, store: MemoryStore, clock: Clock) -> None:
        self.app, self.store, self.clock = app, store, clock
        self.sent: list[Outgoing] = []
        self.steps: list[object] = []
        self.send_reply: Callable[[list[Outgoing]], object] = lambda outs: None
        self.calls = 0
        self.connect_ms = 0  # how long opening the run's publisher takes (virtual)
        self.open_reply: object = None
        self.call_delay_ms = 0
        self.reply_called = True  # reply to Call as the drivers do (False: the bare items)

    def run(self, name: str, owner: str, *, scheduled: bool = True) -> ReconcileResult:
        reconciler = self.app.reconcilers[name]
        program = reconcile_program(
            reconciler,
            self.app.topology,
            owner,
            lease_ms=LEASE,
            scheduled=scheduled,
            clock=self.clock,
        )
        reply: object = None
        while True:
            try:
                step = program.send(reply)
            except StopIteration as stop:
                result: ReconcileResult = stop.value
                return result
            self.steps.append(step)
            reply = self.execute(step)

    def execute(self, step: object) -> object:
        store, now = self.store, self.clock()
        if isinstance(step, StoreClaim):
            return store.claim(step.key, step.owner, now_ms=now, lease_ms=step.lease_ms)
        if isinstance(step, StoreRelease):
            store.release(step.key, step.owner)
            return None
        if isinstance(step, StoreMark):
            store.cancel(step.key, now_ms=now, retention_ms=step.retention_ms)
            return None
        if isinstance(step, Open):
            self.clock.now += self.connect_ms
            return self.open_reply
        if isinstance(step, Call):
            self.calls += 1
            self.clock.now += self.call_delay_ms  # e.g. a thread to start before the call
            ctx = ReconcileContext(step.reconciler.name, self.app, None, None)  # type: ignore[arg-type]
            started = self.clock.now
            try:
                items: object = collect(step.reconciler.fn(ctx))
            except Exception as exc:
                items = exc
            return Called(items, started) if self.reply_called else items
        assert isinstance(step, Send)
        reply = self.send_reply(step.outs)
        if reply is None:
            self.sent.extend(step.outs)
        return reply


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def app() -> App:
    return make_app()


@pytest.fixture
def store(app: App) -> MemoryStore:
    store = app.store()
    assert isinstance(store, MemoryStore)
    return store


@pytest.fixture
def driver(app: App, store: MemoryStore, clock: Clock) -> Driver:
    return Driver(app, store, clock)


# -- registration ---------------------------------------------------------------------------


def test_registering_a_reconciler(app: App) -> None:
    @app.reconcile(every="10m")
    def overdue(ctx: ReconcileContext) -> None:
        return None

    @app.reconcile(every=30, name="coupons.expired-v2")
    async def other(ctx: Any) -> None:
        return None

    first, second = app.select_reconcilers()
    assert (first.name, first.every_ms, first.is_async, first.fn) == (
        "overdue",
        600_000,
        False,
        overdue,
    )
    assert (second.name, second.every_ms, second.is_async) == ("coupons.expired-v2", 30_000, True)
    assert app.select_reconcilers(["overdue"]) == [first]
    with pytest.raises(ConfigError, match=r"no reconciler named 'nope'; registered: coupons"):
        app.select_reconcilers(["nope"])


def test_an_async_generator_is_an_async_reconciler(app: App) -> None:
    async def gen(ctx: Any) -> Any:
        yield Resubmit(b"x", "m", queue="orders")

    assert app.add_reconciler(gen, every="1m").is_async


@pytest.mark.parametrize(
    ("every", "name", "match"),
    [
        ("0s", None, r"every='0s'.*longer than zero"),
        ("soon", None, r"every='soon'"),
        ("1m", "has space", r"name 'has space': use letters"),
        ("1m", ".hidden", r"name '.hidden'"),
        ("1m", "x" * 101, r"at most 100"),
    ],
)
def test_bad_registrations_are_refused(app: App, every: str, name: str | None, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        app.add_reconciler(lambda ctx: None, every=every, name=name)
    assert not app.reconcilers


def test_a_name_is_registered_once(app: App) -> None:
    app.add_reconciler(lambda ctx: None, every="1m", name="r")
    with pytest.raises(ConfigError, match=r"'r' is already registered; give this one another"):
        app.add_reconciler(lambda ctx: None, every="1m", name="r")


def test_a_reconciler_takes_the_context(app: App) -> None:
    def no_args() -> None:
        return None

    with pytest.raises(ConfigError, match=r"must take the context: def no_args\(ctx\)"):
        app.add_reconciler(no_args, every="1m")


def test_the_sync_worker_refuses_an_async_reconciler(app: App) -> None:
    app.add_consumer("orders", lambda msg: None)

    async def late(ctx: Any) -> None:
        return None

    app.add_reconciler(late, every="1m")
    app.check_runnable(app.select(), Transport.ASYNC)
    with pytest.raises(ConfigError, match=r"cannot run async reconcilers: late; run the async"):
        app.check_runnable(app.select(), Transport.SYNC)


@pytest.mark.parametrize(
    ("every_ms", "check_ms"),
    [(1_000, MIN_CHECK_MS), (5_000, 500), (600_000, MAX_CHECK_MS), (86_400_000, MAX_CHECK_MS)],
)
def test_how_often_a_worker_looks(app: App, every_ms: int, check_ms: int) -> None:
    reconciler = app.add_reconciler(lambda ctx: None, every=every_ms / 1000, name="r")
    assert reconciler.check_ms == check_ms


def test_the_schedule_looks_at_start_then_every_check(app: App) -> None:
    fast = app.add_reconciler(lambda ctx: None, every="2s", name="fast")  # looks every 0.2 s
    slow = app.add_reconciler(lambda ctx: None, every="1h", name="slow")  # every 60 s
    schedule = ReconcileSchedule(app.select_reconcilers(), 100.0)
    assert schedule.due(100.0) == [fast, slow]
    assert schedule.wait_s(100.0) == 0.0
    schedule.looked(fast, 100.0)
    schedule.looked(slow, 100.0)
    assert schedule.due(100.1) == []
    assert schedule.wait_s(100.1) == pytest.approx(0.1)
    assert schedule.due(100.2) == [fast]
    assert schedule.due(160.0) == [fast, slow]


def test_store_keys_are_scoped_to_the_topology(app: App) -> None:
    assert reconcile_key(app.topology, "overdue", "running") == "shop.v1.reconcile.overdue:running"
    assert reconcile_key(app.topology, "overdue", "period") == "shop.v1.reconcile.overdue:period"


def test_collect_runs_generators_to_their_end() -> None:
    def gen() -> Iterator[int]:
        yield 1
        yield 2

    assert collect(gen()) == [1, 2]
    assert collect(None) is None
    assert collect("no") == "no"  # refused by the run, not iterated

    async def agen() -> Any:
        yield 3

    async def coro() -> list[int]:
        return [4]

    import asyncio

    assert asyncio.run(acollect(agen())) == [3]
    assert asyncio.run(acollect(coro())) == [4]


# -- the run program ------------------------------------------------------------------------


def resubmit_two(app: App) -> None:
    @app.reconcile(every="10m")
    def overdue(ctx: ReconcileContext) -> Iterator[Resubmit]:
        yield Resubmit({"order_id": 1}, "order-1", queue="orders")
        yield Resubmit(b"raw", "mail-7", routing_key="order.paid", tier="1s")


def test_a_run_publishes_what_it_returns_and_records_its_period(
    app: App, driver: Driver, store: MemoryStore, clock: Clock
) -> None:
    resubmit_two(app)
    result = driver.run("overdue", "w1:1")
    assert (result.ran, result.ok) == (True, True)
    assert result.resubmitted == ["order-1", "mail-7"]
    now, later = driver.sent
    # no tier: to its queue now, through the due exchange
    assert (now.exchange, now.routing_key) == ("shop.v1.due", "shop.v1.q.orders")
    assert now.headers[h.H_TIER] == IMMEDIATE
    assert now.body == b'{"order_id":1}'
    assert (later.exchange, later.headers[h.H_TIER], later.message_id) == (
        "shop.v1.delay.1s",
        "1s",
        "mail-7",
    )
    kinds = [type(s).__name__ for s in driver.steps]
    assert kinds == [
        "StoreClaim",
        "StoreClaim",
        "Open",
        "Call",
        "Send",
        "StoreMark",
        "StoreRelease",
    ]
    # the run claim is free again, the period record lives on
    running = reconcile_key(app.topology, "overdue", "running")
    period = reconcile_key(app.topology, "overdue", "period")
    assert store.claim(running, "other", now_ms=clock.now, lease_ms=LEASE) is ClaimResult.CLAIMED
    assert store.claim(period, "other", now_ms=clock.now, lease_ms=LEASE) is ClaimResult.CANCELLED


def test_workers_skip_it_until_the_period_lapses_from_the_start_of_the_run(
    app: App, driver: Driver, clock: Clock
) -> None:
    resubmit_two(app)
    assert driver.run("overdue", "w1:1").ran
    clock.now += 600_000 - 1
    skipped = driver.run("overdue", "w2:1")
    assert not skipped.ran
    assert skipped.skipped == "ran within the last 10m"
    assert not skipped.failed
    clock.now += 1
    assert driver.run("overdue", "w2:2").ran
    assert driver.calls == 2


def test_a_long_run_makes_the_next_one_due_once_it_ends(
    app: App, driver: Driver, clock: Clock
) -> None:
    @app.reconcile(every="1s")
    def slow(ctx: ReconcileContext) -> None:
        clock.now += 5_000  # ran longer than its period

    driver.run("slow", "w1:1")
    clock.now += 1  # the period record lasts 1 ms past the run's end
    assert driver.run("slow", "w1:2").ran


def test_one_run_at_a_time(app: App, driver: Driver, store: MemoryStore, clock: Clock) -> None:
    resubmit_two(app)
    running = reconcile_key(app.topology, "overdue", "running")
    store.claim(running, "cli", now_ms=clock.now, lease_ms=LEASE)  # `rabbit-delay reconcile`
    result = driver.run("overdue", "w1:1")
    assert (result.ran, result.skipped, result.failed) == (False, "running elsewhere", False)
    assert driver.calls == 0
    # the period claim was given back: the next worker to look is not held up by it
    period = reconcile_key(app.topology, "overdue", "period")
    assert store.claim(period, "w2:1", now_ms=clock.now, lease_ms=LEASE) is ClaimResult.CLAIMED


def test_a_look_while_another_worker_holds_the_period_claim(
    app: App, driver: Driver, store: MemoryStore, clock: Clock
) -> None:
    resubmit_two(app)
    period = reconcile_key(app.topology, "overdue", "period")
    store.claim(period, "w2:1", now_ms=clock.now, lease_ms=LEASE)
    assert driver.run("overdue", "w1:1").skipped == "running elsewhere"


def test_the_cli_runs_it_now_whatever_its_period(app: App, driver: Driver, clock: Clock) -> None:
    resubmit_two(app)
    assert driver.run("overdue", "w1:1").ran
    clock.now += 1_000
    cli = driver.run("overdue", "cli:1", scheduled=False)
    assert cli.ran
    kinds = [type(s).__name__ for s in driver.steps[-6:]]
    assert kinds == ["StoreClaim", "Open", "Call", "Send", "StoreMark", "StoreRelease"]
    # and it counts for the workers: a period from its own start
    clock.now += 600_000 - 1
    assert not driver.run("overdue", "w1:2").ran
    clock.now += 1
    assert driver.run("overdue", "w1:3").ran


def test_the_cli_waits_for_no_one_but_never_runs_beside_a_run(
    app: App, driver: Driver, store: MemoryStore, clock: Clock
) -> None:
    resubmit_two(app)
    running = reconcile_key(app.topology, "overdue", "running")
    store.claim(running, "w1:1", now_ms=clock.now, lease_ms=LEASE)
    assert driver.run("overdue", "cli:1", scheduled=False).skipped == "running elsewhere"
    clock.now += LEASE  # the worker died mid-run: its claim lapses
    assert driver.run("overdue", "cli:2", scheduled=False).ran


def test_a_failing_function_is_recorded_and_its_period_kept(
    app: App, driver: Driver, store: MemoryStore, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    @app.reconcile(every="1m")
    def broken(ctx: ReconcileContext) -> Iterator[Resubmit]:
        yield Resubmit(b"x", "first", queue="orders")
        raise RuntimeError("the orders database is down")

    result = driver.run("broken", "w1:1")
    assert (result.ran, result.failed, result.ok) == (True, True, False)
    assert result.error == "RuntimeError: the orders database is down"
    assert driver.sent == []  # a generator that raised: nothing of it is sent
    assert "reconciler broken failed" in caplog.text
    assert "the orders database is down" in caplog.text  # with its traceback
    assert not driver.run("broken", "w2:1").ran  # next period, not at once
    running = reconcile_key(app.topology, "broken", "running")
    assert store.claim(running, "x", now_ms=clock.now, lease_ms=LEASE) is ClaimResult.CLAIMED


def test_items_that_are_no_message_are_refused_and_the_rest_sent(
    app: App, driver: Driver, caplog: pytest.LogCaptureFixture
) -> None:
    @app.reconcile(every="1m")
    def mixed(ctx: ReconcileContext) -> list[object]:
        return [
            Resubmit(b"ok", "good", queue="orders"),
            {"order_id": 2},
            Resubmit(b"x", "bad-queue", queue="nope"),
            Resubmit(b"x", "bad-tier", queue="orders", tier="2h"),
            Resubmit(b"x", "", queue="orders"),
            Resubmit(object(), "bad-body", queue="orders"),  # type: ignore[arg-type]
        ]

    result = driver.run("mixed", "w1:1")
    assert result.resubmitted == ["good"]
    assert len(result.refused) == 5
    refused = "\n".join(result.refused)
    assert "{'order_id': 2} is a dict, not a Resubmit" in refused
    assert "'bad-queue': unknown queue 'nope'" in refused
    assert "'bad-tier': unknown tier '2h'" in refused
    assert "message_id must be a non-empty string" in refused
    assert "'bad-body': cannot publish a object" in refused
    assert result.failed
    assert "not re-submitted" in caplog.text


def test_a_value_that_is_not_an_iterable_is_refused(app: App, driver: Driver) -> None:
    app.add_reconciler(lambda ctx: "order-1", every="1m", name="wrong")
    result = driver.run("wrong", "w1:1")
    assert result.refused == ["returned a str: return or yield Resubmit(...) items, or None"]
    assert driver.sent == []


def test_unconfirmed_resubmissions_are_reported(app: App, driver: Driver) -> None:
    resubmit_two(app)
    driver.send_reply = lambda outs: NackError("nacked", message_ids=["mail-7"])
    result = driver.run("overdue", "w1:1")
    assert result.resubmitted == ["order-1"]
    assert result.error is not None
    assert result.error.startswith("1 re-submission(s) not confirmed: nacked")


def test_a_slow_connect_does_not_bring_the_next_run_closer_than_every(
    app: App, driver: Driver, clock: Clock
) -> None:
    """The period counts from the function's start, after the publisher is open: a
    connect that takes 5 s must not let the next run start 5 s early (seen as two runs
    0.72 s apart with every=1s on a loaded machine)."""
    starts: list[int] = []
    app.add_reconciler(lambda ctx: starts.append(clock.now), every="1m", name="timed")
    driver.connect_ms = 5_000
    assert driver.run("timed", "w1:1").ran
    clock.now = starts[0] + 60_000 - 1  # before the connect: 5 s past the period
    driver.connect_ms = 0
    assert not driver.run("timed", "w2:1").ran
    clock.now = starts[0] + 60_000
    assert driver.run("timed", "w2:1").ran
    assert starts[1] - starts[0] >= 60_000


def test_the_period_counts_from_when_the_function_was_called(
    app: App, driver: Driver, clock: Clock
) -> None:
    """`Called.started_ms` is the run's start: a call that begins 5 s after the program
    asked for it (a thread pool starting on a loaded machine: two runs of every=1s were
    seen 0.85 s apart) still keeps the next run `every` after the function's start."""
    starts: list[int] = []
    app.add_reconciler(lambda ctx: starts.append(clock.now), every="1m", name="timed")
    driver.call_delay_ms = 5_000
    assert driver.run("timed", "w1:1").ran
    driver.call_delay_ms = 0
    clock.now = starts[0] + 60_000 - 1
    assert not driver.run("timed", "w2:1").ran
    clock.now = starts[0] + 60_000
    assert driver.run("timed", "w2:1").ran
    # a driver that replies with the bare items: the start is the program's own
    driver.reply_called = False
    clock.now += 60_000
    assert driver.run("timed", "w1:1").ok


def test_a_publisher_that_cannot_connect_fails_the_run_and_keeps_the_period(
    app: App, driver: Driver, clock: Clock
) -> None:
    resubmit_two(app)
    driver.open_reply = ConnectionLost("connection refused")
    result = driver.run("overdue", "w1:1")
    assert (result.ran, result.failed, driver.calls) == (True, True, 0)
    assert result.error == "ConnectionLost: connection refused"
    kinds = [type(s).__name__ for s in driver.steps]
    assert kinds == ["StoreClaim", "StoreClaim", "Open", "StoreMark", "StoreRelease"]
    clock.now += 1_000
    assert driver.run("overdue", "w2:1").skipped == "ran within the last 10m"


def test_a_failing_store_skips_the_run_and_says_why(app: App, driver: Driver) -> None:
    resubmit_two(app)

    def broken(step: object) -> object:
        if isinstance(step, StoreClaim):
            return OSError("disk I/O error")
        return Driver.execute(driver, step)

    driver.execute = broken  # type: ignore[method-assign]
    result = driver.run("overdue", "w1:1")
    assert not result.ran
    assert result.failed
    assert result.skipped == "the idempotency store failed: OSError('disk I/O error')"
    assert driver.calls == 0


def test_a_run_with_nothing_to_resubmit_sends_nothing(app: App, driver: Driver) -> None:
    app.add_reconciler(lambda ctx: None, every="1m", name="quiet")
    result = driver.run("quiet", "w1:1")
    assert result.ok
    assert result.resubmitted == []
    assert not any(isinstance(s, Send) for s in driver.steps)


def test_result_as_dict(app: App, driver: Driver) -> None:
    resubmit_two(app)
    data = driver.run("overdue", "w1:1").as_dict()
    assert data["name"] == "overdue"
    assert (data["ran"], data["ok"], data["failed"]) == (True, True, False)
    assert data["resubmitted"] == ["order-1", "mail-7"]
