"""rabbit_delay.testing.TestBroker, as a user's test drives it: publish, advance the
virtual clock, assert what the handler did. The shipped topology (topology/orders.toml)
and no RabbitMQ."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from pydantic import BaseModel

import rabbit_delay.testing
from rabbit_delay import (
    App,
    ConfigError,
    DurationError,
    HandlerContext,
    IncompatibleBroker,
    Reject,
    load_topology,
    topology_from_dict,
)
from rabbit_delay import _headers as h
from rabbit_delay.stores import MemoryStore, SQLiteStore
from rabbit_delay.testing import KitError, Outcome, TestBroker

ROOT = Path(__file__).resolve().parents[2]
ORDERS = ROOT / "topology" / "orders.toml"
QUEUE = "orders.cancel-unpaid"
START = datetime(2030, 6, 1, 12, 0, tzinfo=UTC)


class CancelOrder(BaseModel):
    order_id: int


class Orders:
    """Stands in for the application's orders table."""

    def __init__(self) -> None:
        self.cancelled: list[int] = []
        self.failing: set[int] = set()
        self.missing: set[int] = set()

    def cancel(self, msg: CancelOrder, ctx: HandlerContext) -> None:
        if msg.order_id in self.missing:
            raise Reject(f"no order {msg.order_id}")
        if msg.order_id in self.failing:
            raise ValueError(f"payment service down for {msg.order_id}")
        self.cancelled.append(msg.order_id)


@pytest.fixture
def orders() -> Orders:
    return Orders()


@pytest.fixture
def app(orders: Orders) -> App:
    made = App(ORDERS)
    made.add_consumer(QUEUE, orders.cancel, model=CancelOrder)
    return made


@pytest.fixture
def broker(app: App) -> Iterator[TestBroker]:
    with TestBroker(app, start=START) as made:
        yield made


def test_a_message_is_handled_when_due_and_not_a_millisecond_before(
    broker: TestBroker, orders: Orders
) -> None:
    message_id = broker.publisher.publish_delayed(CancelOrder(order_id=1), "30m", queue=QUEUE)
    [waiting] = broker.messages("30m")
    assert waiting.header(h.H_DUE_AT) == int(START.timestamp() * 1000) + 30 * 60_000
    assert broker.queue_depth("30m") == 1

    broker.advance(timedelta(minutes=30) - timedelta(milliseconds=1))
    assert broker.outcomes(QUEUE) == []
    broker.advance("1ms")
    assert broker.outcomes(QUEUE) == ["acked"]
    assert orders.cancelled == [1]
    [handled] = broker.handled(QUEUE)
    assert (handled.message_id, handled.attempt, handled.ran) == (message_id, 1, True)
    assert handled.error is None
    assert handled.context is not None
    assert handled.context.lateness_ms == 0  # virtual time: exactly on time
    assert handled.at == START + timedelta(minutes=30)
    assert broker.now == START + timedelta(minutes=30)
    assert broker.queue_depth(QUEUE) == broker.queue_depth("30m") == 0


def test_a_failing_handler_retries_through_its_tiers_then_is_parked(
    broker: TestBroker, orders: Orders
) -> None:
    orders.failing.add(2)
    broker.publisher.publish_delayed(CancelOrder(order_id=2), "30m", queue=QUEUE)
    took = broker.run_until_idle()

    # orders.toml: 4 attempts, retries after 5m, 5m, 30m
    assert took == timedelta(minutes=30 + 5 + 5 + 30)
    assert broker.outcomes(QUEUE) == ["retried", "retried", "retried", "parked"]
    handled = broker.handled(QUEUE)
    assert [r.attempt for r in handled] == [1, 2, 3, 4]
    assert all(isinstance(r.error, ValueError) for r in handled)
    assert handled[-1].reason == "max_attempts"
    assert [r.at - START for r in handled] == [timedelta(minutes=m) for m in (30, 35, 40, 70)]
    [parked] = broker.parked(QUEUE)
    assert parked.header(h.H_ERROR_TYPE) == "ValueError"
    assert parked.header(h.H_PARK_REASON) == "max_attempts"
    assert parked.header(h.H_ATTEMPT) == 4
    assert parked.decode(CancelOrder).order_id == 2
    assert broker.stats.retried == 3
    assert broker.stats.parked == 1


def test_reject_parks_at_once_and_a_binding_key_reaches_the_queue(
    broker: TestBroker, orders: Orders
) -> None:
    orders.missing.add(3)
    broker.publisher.publish_delayed({"order_id": 3}, "30m", routing_key="order.payment-timeout")
    broker.advance("30m")
    assert broker.outcomes(QUEUE) == ["parked"]
    assert broker.handled(QUEUE)[0].reason == "rejected"
    assert broker.parked(QUEUE)[0].header(h.H_ERROR_MESSAGE) == "no order 3"


def test_cancel_drops_a_scheduled_message_and_duplicates_run_once(
    broker: TestBroker, app: App, orders: Orders
) -> None:
    broker.publisher.publish_delayed(
        CancelOrder(order_id=4), "30m", queue=QUEUE, message_id="order-4-timeout"
    )
    broker.publisher.publish_delayed(
        CancelOrder(order_id=5), "30m", queue=QUEUE, message_id="order-5-timeout"
    )
    app.cancel("order-4-timeout")  # paid: the kit's store, on its clock
    broker.advance("30m")
    broker.publisher.publish_delayed(
        CancelOrder(order_id=5), "30m", queue=QUEUE, message_id="order-5-timeout"
    )
    broker.advance("30m")
    assert broker.outcomes(QUEUE) == ["cancelled", "acked", "duplicate"]
    assert orders.cancelled == [5]


def test_async_handlers_take_virtual_time_and_run_side_by_side() -> None:
    app = App(ORDERS)
    spans: list[tuple[int, int, int]] = []

    @app.consumer(QUEUE, model=CancelOrder)
    async def slow(msg: CancelOrder, ctx: HandlerContext) -> None:
        begin = broker.now_ms()
        await asyncio.sleep(90)  # a minute and a half of virtual time
        spans.append((msg.order_id, begin, broker.now_ms()))

    with TestBroker(app, start=START, concurrency=2) as broker:
        broker.publisher.publish_many(
            [CancelOrder(order_id=n) for n in (1, 2, 3)], "30m", queue=QUEUE
        )
        started = time.monotonic()
        broker.advance("40m")
        assert time.monotonic() - started < 10
        due = int(START.timestamp() * 1000) + 30 * 60_000
        # two at a time: 1 and 2 at once, 3 when a slot is free
        assert spans == [
            (1, due, due + 90_000),
            (2, due, due + 90_000),
            (3, due + 90_000, due + 180_000),
        ]
        assert broker.outcomes(QUEUE) == ["acked"] * 3


def test_the_app_gets_its_own_guard_back_and_an_explicit_store_is_used(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "guard.sqlite3")
    app = App(ORDERS, store=store)
    app.add_consumer(QUEUE, lambda msg: None, model=CancelOrder)
    before = app.guard()
    with TestBroker(app, start=START) as broker:
        assert app.guard() is not before  # the kit's: same store, virtual clock
        assert app.guard().store is store
        broker.publisher.publish_delayed({"order_id": 6}, "30m", queue=QUEUE, message_id="six")
        broker.advance("30m")
    assert app.guard() is before
    with TestBroker(app, start=START) as again:  # the same file: already done
        again.publisher.publish_delayed({"order_id": 6}, "30m", queue=QUEUE, message_id="six")
        again.advance("30m")
        assert again.outcomes(QUEUE) == ["duplicate"]
    store.close()


def test_one_open_kit_per_app(broker: TestBroker, app: App) -> None:
    with pytest.raises(ConfigError, match="already runs on an in-memory broker"):
        TestBroker(app)
    broker.close()
    TestBroker(app).close()  # once closed, the app is free again


def test_by_default_each_test_gets_a_fresh_store(app: App) -> None:
    for _ in range(2):
        with TestBroker(app, start=START) as broker:
            broker.publisher.publish_delayed({"order_id": 7}, "30m", queue=QUEUE, message_id="m7")
            broker.advance("30m")
            assert broker.outcomes(QUEUE) == ["acked"]  # never a duplicate of the last test
    assert not (ORDERS.parent / "rabbit-delay-idempotency.sqlite3").exists()


def test_an_async_store_is_refused_with_what_to_use_instead(app: App) -> None:
    from rabbit_delay._idempotency.guard import SyncStoreAsAsync

    with pytest.raises(ConfigError, match="MemoryStore, SQLiteStore or RedisStore"):
        TestBroker(app, store=SyncStoreAsAsync(MemoryStore()))  # type: ignore[arg-type]


def test_the_emulated_version_decides_what_the_topology_may_use() -> None:
    native = topology_from_dict(
        {
            "namespace": "shop",
            "tiers": {"5m": "5m"},
            "queues": {QUEUE: {"retry": {"backend": "broker", "min": "1s", "max": "1m"}}},
        }
    )
    with pytest.raises(IncompatibleBroker, match="needs quorum queue delayed retry"):
        TestBroker(native, version="3.10.8")
    TestBroker(native).close()  # 4.3 has it


async def test_an_async_test_drives_the_kit_too(app: App, orders: Orders) -> None:
    # Two loops cannot run on one thread: the kit's runs on a thread of its own meanwhile.
    with TestBroker(app, start=START) as broker:
        await broker.async_publisher.publish_delayed(CancelOrder(order_id=10), "30m", queue=QUEUE)
        broker.advance("30m")  # blocks this loop while the kit's runs
        assert orders.cancelled == [10]
    async with TestBroker(app, start=START) as broker:
        orders.failing.add(11)
        broker.publisher.publish_delayed(CancelOrder(order_id=11), "30m", queue=QUEUE)
        assert await broker.arun_until_idle() == timedelta(minutes=70)  # this loop runs on
        await broker.aadvance("1h")
        assert broker.outcomes(QUEUE) == ["retried", "retried", "retried", "parked"]


def test_a_topology_alone_gives_a_broker_and_publishers_without_a_worker() -> None:
    topology = load_topology(ORDERS)
    with TestBroker(topology, start=START) as broker:
        assert broker.worker is None

        async def publish() -> str:
            return await broker.async_publisher.publish_delayed(
                {"coupon": "X"}, "5m", queue="coupons.expire"
            )

        message_id = asyncio.run(publish())
        broker.advance("5m")
        [due] = broker.messages("coupons.expire")
        assert due.message_id == message_id
        assert due.json() == {"coupon": "X"}
        assert broker.outcomes() == []


def test_names_are_checked_with_a_helpful_error(broker: TestBroker) -> None:
    with pytest.raises(ConfigError, match="unknown queue 'orders'; the topology's queues are"):
        broker.parked("orders")
    with pytest.raises(ConfigError, match=r"a tier \(5m, 30m, 2h\)"):
        broker.queue_depth("nope")
    with pytest.raises(DurationError):
        broker.advance("-5m")
    assert broker.queue_depth("shop.v1.parking.push.send") == 0  # any broker queue by name


def test_what_a_handler_cannot_hide_reaches_the_test(app: App) -> None:
    def fails_the_test(msg: CancelOrder) -> None:
        pytest.fail("the handler saw something impossible")

    def advances(msg: CancelOrder) -> None:
        broker.advance("1m")  # a KitError the handler "catches" as a failure

    for handler, expected in ((fails_the_test, pytest.fail.Exception), (advances, KitError)):
        app.consumers.clear()
        app.add_consumer(QUEUE, handler, model=CancelOrder)
        with TestBroker(app, start=START) as broker:
            broker.publisher.publish_delayed({"order_id": 8}, "30m", queue=QUEUE)
            with pytest.raises(expected):
                broker.advance("30m")


def test_run_until_idle_gives_up_on_a_message_that_never_settles(app: App) -> None:
    app.consumers.clear()

    @app.consumer(QUEUE, model=CancelOrder)
    def again(msg: CancelOrder) -> None:  # a new timeout for every one handled
        broker.publisher.publish_delayed(msg, "30m", queue=QUEUE)

    with TestBroker(app, start=START) as broker:
        broker.publisher.publish_delayed({"order_id": 9}, "30m", queue=QUEUE)
        with pytest.raises(KitError, match=r"still busy after 1d .*message\(s\) waiting"):
            broker.run_until_idle("1d")
        assert broker.outcomes(QUEUE) == ["acked"] * 48


def test_a_thousand_messages_through_a_30_minute_tier_take_well_under_a_second(app: App) -> None:
    # Loose on purpose (a shared 2-core machine): measured about 0.1-0.5 s; a slip into
    # per-message sleeps or quadratic work would take many times the bound.
    with TestBroker(app, start=START) as broker:
        started = time.perf_counter()
        broker.publisher.publish_many(
            [CancelOrder(order_id=n) for n in range(1_000)], "30m", queue=QUEUE
        )
        broker.advance("30m")
        took = time.perf_counter() - started
        assert broker.stats.acked == 1_000
    assert took < 5.0, f"{took:.2f}s"


def test_the_kits_public_surface() -> None:
    assert sorted(rabbit_delay.testing.__all__) == [
        "AsyncMemoryPublisher",
        "Channel",
        "DEFAULT_VERSION",
        "Delivered",
        "Handled",
        "KitError",
        "MemoryBroker",
        "MemoryPublisher",
        "MemoryWorker",
        "Message",
        "Outcome",
        "TestBroker",
        "topic_matches",
    ]
    assert Outcome.ACKED == "acked"
    assert TestBroker.__test__ is False  # type: ignore[attr-defined]


def test_the_pytest_fixture(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(
        "import pytest\n"
        "from rabbit_delay import App\n"
        "pytest_plugins = ['rabbit_delay.testing.pytest_plugin']\n"
        "seen = []\n"
        f"app = App({str(ORDERS)!r})\n"
        "app.add_consumer('push.send', lambda msg: seen.append(msg))\n"
        "@pytest.fixture\n"
        "def rabbit_delay_app():\n"
        "    return app\n"
    )
    (tmp_path / "test_push.py").write_text(
        "from conftest import seen\n"
        "def test_push(rabbit_delay_broker):\n"
        "    rabbit_delay_broker.publisher.publish_delayed({'u': 1}, '2h', queue='push.send')\n"
        "    rabbit_delay_broker.advance('2h')\n"
        "    assert seen == [b'{\"u\":1}']\n"
        "    assert rabbit_delay_broker.outcomes('push.send') == ['acked']\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed" in done.stdout
