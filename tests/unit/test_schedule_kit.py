"""The schedule on the test kit's virtual clock: the cancel that was lost on day 30, a
reschedule, the sweeper; and a cancel without the schedule that outlives its message."""

from __future__ import annotations

from typing import Any

import pytest

from rabbit_delay import App, ConfigError, HandlerContext, ScheduleState, topology_from_dict
from rabbit_delay.testing import TestBroker

QUEUE = "orders"


def topology(**extra: Any) -> Any:
    return topology_from_dict(
        {
            "namespace": "kit",
            "tiers": {"1s": "1s", "1m": "1m"},
            "queues": {QUEUE: {}},
            "cascade": {"levels": 22},  # up to 48 days, 1 s resolution
            "idempotency": {"store": "memory"},
            **extra,
        }
    )


def app_of(topo: Any) -> tuple[App, list[bytes]]:
    app = App(topo)
    seen: list[bytes] = []

    @app.consumer(QUEUE)
    def handle(msg: bytes, ctx: HandlerContext) -> None:
        seen.append(msg)

    return app, seen


def test_a_30_day_message_cancelled_at_once_is_dropped_on_day_30() -> None:
    app, seen = app_of(topology(schedule={}))
    with TestBroker(app) as broker:
        broker.publisher.publish_delayed({"o": 1}, delay="30d", queue=QUEUE, key="order-1")
        broker.publisher.publish_delayed({"o": 2}, delay="2d", queue=QUEUE, key="order-2")
        assert app.cancel("order-1") is ScheduleState.SCHEDULED
        assert app.cancel("order-2") is ScheduleState.SCHEDULED
        broker.advance("29d")
        assert broker.schedule.lookup("order-1").state is ScheduleState.CANCELLED  # still held
        broker.advance("2d")
        assert seen == []
        assert broker.outcomes(QUEUE) == ["cancelled", "cancelled"]
        record = broker.schedule.lookup("order-1")
        assert (record.state, record.dropped) == (ScheduleState.CANCELLED, 1)


def test_without_the_schedule_the_tombstone_outlives_the_longest_delay() -> None:
    """The observed failure: a tombstone that lived the app's retention (7 days) was gone
    when the 30-day message came due, and it ran."""
    app, seen = app_of(topology())
    with TestBroker(app) as broker:
        cancelled = broker.publisher.publish_delayed({"o": 1}, delay="30d", queue=QUEUE)
        broker.publisher.publish_delayed({"o": 2}, delay="30d", queue=QUEUE)
        assert app.cancel(cancelled) is None
        assert app.tombstone_ms() > 48 * 86_400_000  # the cascade's longest delay
        broker.advance("31d")
        assert seen == [b'{"o":2}']
        assert sorted(broker.outcomes(QUEUE)) == ["acked", "cancelled"]


def test_reschedule_moves_the_key_and_the_old_copy_is_dropped() -> None:
    app, seen = app_of(topology(schedule={}))
    with TestBroker(app) as broker:
        broker.publisher.publish_delayed({"o": 1}, delay="1h", queue=QUEUE, key="trial-9")
        assert broker.schedule.reschedule("trial-9", "3d") is ScheduleState.SCHEDULED
        broker.advance("2d")
        assert seen == []
        assert broker.outcomes(QUEUE) == ["superseded"]
        broker.advance("1d")
        assert seen == [b'{"o":1}']
        record = broker.schedule.lookup("trial-9")
        assert (record.state, record.generation) == (ScheduleState.HANDLED, 2)
        assert broker.schedule.reschedule("trial-9", "1d") is ScheduleState.HANDLED
        assert broker.schedule.reschedule("unknown", "1d") is None


def test_the_sweeper_republishes_what_the_broker_lost_on_the_virtual_clock() -> None:
    app, seen = app_of(topology(schedule={"grace": "1m"}))
    with TestBroker(app) as broker:
        broker.publisher.publish_delayed({"o": 1}, delay="1h", queue=QUEUE, key="lost")
        lost = 0
        for level in range(22):  # the broker loses it, wherever in the cascade it waits
            while broker.memory.get(broker.topology.names.cascade_queue(level)) is not None:
                lost += 1
        assert lost == 1
        broker.advance("1h")
        assert seen == []
        assert broker.schedule.sweep().republished == []  # within the grace
        broker.advance("2m")
        assert broker.schedule.sweep().republished == ["lost"]
        broker.advance("1s")
        assert seen == [b'{"o":1}']


def test_a_key_needs_the_schedule() -> None:
    app, _ = app_of(topology())
    with TestBroker(app) as broker, pytest.raises(ConfigError, match=r"\[schedule\]"):
        broker.publisher.publish_delayed({"o": 1}, "1s", queue=QUEUE, key="k")


def test_a_store_failure_sends_nothing_and_raises_store_error() -> None:
    import sqlite3

    from rabbit_delay import StoreError
    from rabbit_delay.stores import MemoryStore

    class Broken(MemoryStore):
        def __init__(self) -> None:
            super().__init__()

            def fail(*_args: Any, **_kwargs: Any) -> Any:
                raise sqlite3.OperationalError("database is locked")

            self.schedule.place_many = fail  # type: ignore[method-assign]

    app, seen = app_of(topology(schedule={}))
    with TestBroker(app, store=Broken()) as broker:
        with pytest.raises(StoreError, match=r"none was sent.*database is locked"):
            broker.publisher.publish_delayed({"o": 1}, "1s", queue=QUEUE, key="k")
        broker.advance("1m")
        assert seen == []
        assert broker.outcomes(QUEUE) == []
