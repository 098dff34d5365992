"""rabbit_delay.testing's MemoryBroker emulates what rabbit-delay relies on in RabbitMQ
(shared/RABBITMQ_NOTES.md, measured there on 3.10.8, 4.0.5 and 4.3.6): routing, queue
TTL and dead-lettering, quorum delivery counting per version, delayed retry, confirms and
returns, and the virtual clock. No RabbitMQ: each test builds its broker."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from rabbit_delay import (
    DeclarationConflict,
    IncompatibleBroker,
    MissingObjectError,
    Topology,
    UnroutableError,
    topology_from_dict,
)
from rabbit_delay import _headers as h
from rabbit_delay._envelope import Outgoing
from rabbit_delay._plan.desired import BindingSpec, ExchangeSpec, Kind, QueueSpec, desired
from rabbit_delay._plan.diff import Change
from rabbit_delay.testing import (
    Delivered,
    KitError,
    MemoryBroker,
    MemoryPublisher,
    topic_matches,
)

START = datetime(2030, 1, 1, tzinfo=UTC)
START_MS = int(START.timestamp() * 1000)


@pytest.fixture
def broker() -> Iterator[MemoryBroker]:
    made = MemoryBroker(start=START)
    yield made
    made.close()


def make(version: str = "4.3.6") -> MemoryBroker:
    return MemoryBroker(version, start=START)


def shop(**overrides: Any) -> Topology:
    data: dict[str, Any] = {
        "namespace": "shop",
        "tiers": {"1s": "1s", "5s": "5s"},
        "queues": {"orders": {"delivery_limit": 2}, "mail": {"bindings": ["order.paid"]}},
    }
    data.update(overrides)
    return topology_from_dict(data)


def message(exchange: str, key: str, body: bytes = b"{}", **headers: Any) -> Outgoing:
    return Outgoing(exchange, key, body, f"m-{key}-{body!r}", "application/json", headers, True, 0)


def declare(broker: MemoryBroker, *specs: ExchangeSpec | QueueSpec | BindingSpec) -> None:
    """Objects outside any topology, through the same executor the declare program uses."""
    from rabbit_delay._plan.program import Bind, Declare

    for spec in specs:
        op = Bind(spec) if isinstance(spec, BindingSpec) else Declare(spec)
        assert broker._execute(op) is None


QUORUM = {"x-queue-type": "quorum"}
AT_LEAST_ONCE = {
    "x-queue-type": "quorum",
    "x-dead-letter-strategy": "at-least-once",
    "x-overflow": "reject-publish",
}


# -- topic matching -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pattern", "key", "matches"),
    [
        ("a.b", "a.b", True),
        ("a.b", "a.b.c", False),
        ("*.b", "a.b", True),
        ("*.b", "b", False),
        ("*", "", False),  # an empty key has no words
        ("#", "", True),
        ("#", "a.b.c", True),
        ("a.#", "a", True),  # '#' matches zero words
        ("a.#", "a.b.c", True),
        ("#.c", "a.b.c", True),
        ("#.c", "c", True),
        ("a.*.c", "a.b.c", True),
        ("a.*.c", "a.c", False),
        ("a.#.c", "a.c", True),
        ("a.#.c", "a.x.y.c", True),
        ("*.*.1.#", "0.1.1.0.q", True),  # the cascade's level patterns
        ("*.*.1.#", "0.1.0.1.q", False),
        ("*.*.*.q", "0.0.1.q", True),
        ("a..b", "a..b", True),  # empty words are words
        ("a.*.b", "a..b", True),
    ],
)
def test_topic_matching_follows_the_amqp_wildcards(pattern: str, key: str, matches: bool) -> None:
    assert topic_matches(pattern, key) is matches


# -- routing ---------------------------------------------------------------------------------


def test_direct_fanout_topic_exchange_bindings_and_each_queue_once(broker: MemoryBroker) -> None:
    declare(
        broker,
        ExchangeSpec("d", "direct"),
        ExchangeSpec("f", "fanout"),
        ExchangeSpec("t", "topic"),
        QueueSpec("q1"),
        QueueSpec("q2"),
        BindingSpec("d", "q1", "k1"),
        BindingSpec("d", "q2", "k2"),
        BindingSpec("f", "q1", "ignored"),
        BindingSpec("f", "t", "", Kind.EXCHANGE),
        BindingSpec("t", "q2", "order.*"),
        BindingSpec("t", "q1", "#"),
    )
    assert broker.publish(message("d", "k1"))
    assert [broker.depth("q1"), broker.depth("q2")] == [1, 0]  # direct: the exact key only
    assert not broker.publish(message("d", "k3"))
    # fanout reaches q1 directly and via the topic exchange: one copy; the topic one q2
    assert broker.publish(message("f", "order.paid"))
    assert [broker.depth("q1"), broker.depth("q2")] == [2, 1]
    assert broker.publish(message("f", "invoice"))  # '#' only
    assert [broker.depth("q1"), broker.depth("q2")] == [3, 1]


def test_the_alternate_exchange_takes_only_what_routes_nowhere(broker: MemoryBroker) -> None:
    declare(
        broker,
        ExchangeSpec("ae", "fanout"),
        ExchangeSpec("x", "direct", {"alternate-exchange": "ae"}),
        QueueSpec("bound"),
        QueueSpec("catch-all"),
        BindingSpec("x", "bound", "k"),
        BindingSpec("ae", "catch-all", ""),
    )
    assert broker.publish(message("x", "k"))
    assert broker.publish(message("x", "other"))  # routed: to the alternate exchange
    assert (broker.depth("bound"), broker.depth("catch-all")) == (1, 1)
    [caught] = broker.peek("catch-all")
    assert (caught.exchange, caught.routing_key) == ("x", "other")


def test_the_default_exchange_routes_by_queue_name(broker: MemoryBroker) -> None:
    declare(broker, QueueSpec("q"))
    assert broker.publish(message("", "q"))
    assert not broker.publish(message("", "nope"))
    assert broker.depth("q") == 1


def test_publishing_to_a_missing_exchange_is_a_404(broker: MemoryBroker) -> None:
    with pytest.raises(MissingObjectError, match=r"404 NOT_FOUND - no exchange 'nope'"):
        broker.publish(message("nope", "k"))


# -- declaring with the real declare program -------------------------------------------------


def test_the_declare_program_builds_exactly_the_desired_objects(broker: MemoryBroker) -> None:
    topology = shop(scaling={"tier_shards": {"1s": 3}})
    report = broker.declare(topology)
    want = desired(topology)
    assert {i.name for i in report.created} == {s.name for s in want.objects}
    for queue in want.queues:
        assert broker.queue_arguments(queue.name) == dict(queue.arguments), queue.name
    for exchange in want.exchanges:
        assert broker.has_exchange(exchange.name)
    # Declaring again changes nothing; the plan says in place.
    again = broker.declare(topology)
    assert again.created == ()
    assert {i.action for i in again.items if i.kind is not Kind.BINDING} == {Change.IN_PLACE}
    assert broker.plan(topology).in_sync


def test_a_conflicting_topology_is_refused_before_anything_changes(broker: MemoryBroker) -> None:
    broker.declare(shop())
    other = shop(tiers={"1s": "2s", "5s": "5s", "9s": "9s"})  # same names, another TTL
    with pytest.raises(DeclarationConflict) as caught:
        broker.declare(other)
    [conflict] = caught.value.conflicts
    assert (conflict.name, conflict.argument) == ("shop.v1.delay.1s", "x-message-ttl")
    assert (conflict.on_broker, conflict.wanted) == (1_000, 2_000)
    assert not broker.has_queue("shop.v1.delay.9s")  # nothing was created
    plan = broker.plan(other)
    assert not plan.in_sync


def test_classic_queues_carry_x_queue_type_from_4_0() -> None:
    topology = shop(queue_type="classic")
    for version, stored in (("3.10.8", None), ("4.0.5", "classic")):
        broker = make(version)
        try:
            broker.declare(topology)
            arguments = broker.queue_arguments("shop.v1.q.orders")
            assert arguments.get("x-queue-type") == stored, version
            assert broker.declare(topology).created == ()  # normalised: no conflict
        finally:
            broker.close()


def test_what_a_version_cannot_hold_is_refused() -> None:
    native = shop(queues={"orders": {"retry": {"backend": "broker", "min": "1s"}}})
    plugin = shop(plugin={})
    old, new = make("3.10.8"), make("4.3.6")
    try:
        with pytest.raises(IncompatibleBroker, match="needs quorum queue delayed retry"):
            old.declare(native)
        with pytest.raises(IncompatibleBroker, match="Mnesia"):
            new.declare(plugin)
        old.declare(plugin)  # 3.10 can run the plugin: emulated
        new.declare(native)
    finally:
        old.close()
        new.close()


# -- TTL and dead-lettering ------------------------------------------------------------------


def tier_flow(version: str = "4.3.6") -> tuple[MemoryBroker, Topology, MemoryPublisher]:
    broker = make(version)
    topology = shop()
    broker.declare(topology)
    return broker, topology, MemoryPublisher(topology, broker)


def test_a_tier_holds_a_message_exactly_its_ttl_then_dead_letters_it_with_x_death() -> None:
    broker, topology, publisher = tier_flow()
    n = topology.names
    try:
        message_id = publisher.publish_delayed({"order": 1}, "5s", queue="orders")
        [waiting] = broker.peek(n.tier_queue("5s"))
        assert waiting.headers[h.H_DUE_AT] == START_MS + 5_000  # the publisher's virtual clock
        broker.advance(timedelta(milliseconds=4_999))
        assert broker.depth(n.business_queue("orders")) == 0
        broker.advance("1ms")
        assert broker.depth(n.tier_queue("5s")) == 0
        [due] = broker.peek(n.business_queue("orders"))
        assert due.message_id == message_id
        assert due.routing_key == n.queue_key("orders")  # kept: the buffer sets no DL key
        assert due.exchange == n.due_exchange()
        [death] = due.headers["x-death"]
        assert death["queue"] == n.tier_queue("5s")
        assert death["reason"] == "expired"
        assert death["count"] == 1
        assert death["exchange"] == n.tier_exchange("5s")
        assert death["routing-keys"] == [n.queue_key("orders")]
        assert due.headers["x-first-death-reason"] == "expired"
        assert due.headers["x-last-death-queue"] == n.tier_queue("5s")
    finally:
        broker.close()


def test_x_last_death_headers_appear_with_3_13() -> None:
    broker, topology, publisher = tier_flow("3.10.8")
    try:
        publisher.publish_delayed({"order": 1}, "1s", queue="orders")
        broker.advance("1s")
        [due] = broker.peek(topology.names.business_queue("orders"))
        assert "x-first-death-queue" in due.headers
        assert not any(k.startswith("x-last-death-") for k in due.headers)
    finally:
        broker.close()


def test_messages_expire_in_fifo_order_and_a_binding_key_reaches_every_bound_queue() -> None:
    broker, topology, publisher = tier_flow()
    n = topology.names
    try:
        first = publisher.publish_delayed({"n": 1}, "1s", routing_key="order.paid")
        broker.advance("500ms")
        second = publisher.publish_delayed({"n": 2}, "1s", queue="mail")
        broker.advance("500ms")
        assert [m.message_id for m in broker.peek(n.business_queue("mail"))] == [first]
        broker.advance("500ms")
        assert [m.message_id for m in broker.peek(n.business_queue("mail"))] == [first, second]
        # a shared binding key: orders is not bound with it, mail is
        assert broker.depth(n.business_queue("orders")) == 0
    finally:
        broker.close()


def test_an_unroutable_at_least_once_dead_letter_waits_and_holds_back_the_rest(
    broker: MemoryBroker,
) -> None:
    declare(
        broker,
        ExchangeSpec("dlx", "direct"),
        QueueSpec(
            "buffer", {**AT_LEAST_ONCE, "x-message-ttl": 1_000, "x-dead-letter-exchange": "dlx"}
        ),
        QueueSpec("target"),
    )
    declare(broker, ExchangeSpec("in", "fanout"), BindingSpec("in", "buffer", ""))
    broker.publish(message("in", "k", b"1"))
    broker.publish(message("in", "k", b"2"))
    broker.advance("1h")
    assert broker.depth("buffer") == 2  # no route: kept (at-least-once), the second behind
    assert broker.idle()  # nothing can happen until the topology changes
    declare(broker, BindingSpec("dlx", "target", "k"))
    assert [m.body for m in broker.peek("target")] == [b"1", b"2"]
    assert broker.depth("buffer") == 0


def test_classic_dead_lettering_drops_what_routes_nowhere(broker: MemoryBroker) -> None:
    declare(
        broker,
        ExchangeSpec("dlx", "direct"),
        QueueSpec("buffer", {"x-message-ttl": 1_000, "x-dead-letter-exchange": "dlx"}),
    )
    broker.publish(message("", "buffer"))
    broker.advance("1s")
    assert broker.depth("buffer") == 0  # gone without a word: at-most-once


def test_a_dead_letter_routing_key_overrides_the_messages_own(broker: MemoryBroker) -> None:
    declare(
        broker,
        ExchangeSpec("dlx", "direct"),
        QueueSpec("parked"),
        BindingSpec("dlx", "parked", "mine"),
        QueueSpec(
            "work",
            {**AT_LEAST_ONCE, "x-dead-letter-exchange": "dlx", "x-dead-letter-routing-key": "mine"},
        ),
    )
    broker.publish(message("", "work"))
    taken = consume_one(broker, "work")
    taken.reject(requeue=False)
    [parked] = broker.peek("parked")
    assert parked.routing_key == "mine"
    assert parked.headers["x-death"][0]["reason"] == "rejected"


# -- quorum delivery counting, per version ----------------------------------------------------


class Consumed:
    def __init__(self, broker: MemoryBroker, queue: str, prefetch: int = 10) -> None:
        self.broker = broker
        self.channel = broker.channel()
        self.got: list[Delivered] = []
        self.tag = self.channel.consume(queue, self.got.append, prefetch=prefetch)

    def take(self) -> Delivered:
        assert self.got, "no delivery"
        return self.got.pop(0)


class One:
    def __init__(self, consumed: Consumed, delivered: Delivered) -> None:
        self.consumed, self.delivered = consumed, delivered

    @property
    def headers(self) -> dict[str, Any]:
        return dict(self.delivered.message.headers)

    def reject(self, requeue: bool) -> None:
        self.consumed.channel.reject(self.delivered.tag, requeue=requeue)

    def nack(self) -> None:
        self.consumed.channel.nack(self.delivered.tag)


def consume_one(broker: MemoryBroker, queue: str) -> One:
    consumed = Consumed(broker, queue)
    one = One(consumed, consumed.take())
    consumed.channel.cancel(consumed.tag)
    return one


def limited(broker: MemoryBroker, limit: int | None = 2, **extra: Any) -> None:
    arguments = {**AT_LEAST_ONCE, "x-dead-letter-exchange": "dlx", **extra}
    if limit is not None:
        arguments["x-delivery-limit"] = limit
    declare(
        broker,
        ExchangeSpec("dlx", "fanout"),
        QueueSpec("parked"),
        BindingSpec("dlx", "parked", ""),
        QueueSpec("work", arguments),
    )
    broker.publish(message("", "work"))


@pytest.mark.parametrize("version", ["3.10.8", "4.0.5", "4.3.6"])
def test_rejects_count_and_past_the_limit_the_message_is_dead_lettered(version: str) -> None:
    broker = make(version)
    try:
        limited(broker, limit=2)
        consumed = Consumed(broker, "work")
        counts = []
        for _ in range(3):  # delivered LIMIT + 1 times, then dead-lettered
            delivered = consumed.take()
            counts.append(delivered.message.headers.get(h.DELIVERY_COUNT_HEADER))
            assert delivered.message.redelivered is (len(counts) > 1)
            consumed.channel.reject(delivered.tag, requeue=True)
        assert counts == [None, 1, 2]
        assert consumed.got == []
        [parked] = broker.peek("parked")
        assert parked.headers["x-death"][0]["reason"] == "delivery_limit"
    finally:
        broker.close()


@pytest.mark.parametrize(("version", "counts"), [("4.0.5", True), ("4.3.6", False)])
def test_a_nack_counts_towards_the_limit_before_4_3_only(version: str, counts: bool) -> None:
    broker = make(version)
    try:
        limited(broker, limit=1)
        consumed = Consumed(broker, "work")
        consumed.channel.nack(consumed.take().tag)
        again = consumed.take()
        assert again.message.redelivered
        assert again.message.headers.get(h.DELIVERY_COUNT_HEADER) == (1 if counts else None)
        if not counts:  # 4.3 counts every hand-out apart (x-acquired-count)
            assert again.message.headers.get("x-acquired-count") == 1
        consumed.channel.nack(again.tag)
        assert broker.depth("parked") == (1 if counts else 0)
    finally:
        broker.close()


def test_a_lost_channel_returns_unacked_deliveries_in_order_counted(broker: MemoryBroker) -> None:
    declare(broker, QueueSpec("work", QUORUM))
    for body in (b"1", b"2", b"3"):
        broker.publish(message("", "work", body))
    consumed = Consumed(broker, "work", prefetch=2)
    assert [d.message.body for d in consumed.got] == [b"1", b"2"]  # the prefetch
    consumed.channel.close()
    again = Consumed(broker, "work", prefetch=10)
    bodies = [(d.message.body, d.message.headers.get(h.DELIVERY_COUNT_HEADER)) for d in again.got]
    assert bodies == [(b"1", 1), (b"2", 1), (b"3", None)]


def test_quorum_queues_default_to_a_limit_of_20_from_4_0() -> None:
    for version, limit in (("3.10.8", None), ("4.0.5", 20)):
        broker = make(version)
        try:
            limited(broker, limit=None)
            consumed = Consumed(broker, "work")
            rejects = 0
            while consumed.got and rejects < 30:
                consumed.channel.reject(consumed.take().tag, requeue=True)
                rejects += 1
            assert rejects == (30 if limit is None else limit + 1), version
        finally:
            broker.close()


def test_delayed_retry_holds_a_rejected_message_back_min_times_count_capped() -> None:
    broker = make("4.3.6")
    try:
        declare(
            broker,
            QueueSpec(
                "work",
                {
                    **QUORUM,
                    "x-delayed-retry-type": "failed",
                    "x-delayed-retry-min": 1_000,
                    "x-delayed-retry-max": 1_500,
                },
            ),
        )
        broker.publish(message("", "work"))
        consumed = Consumed(broker, "work")
        waited = []
        for _ in range(3):
            delivered = consumed.take()
            start = broker.now_ms()
            consumed.channel.reject(delivered.tag, requeue=True)
            assert broker.depth("work") == 1  # held back, still in the queue
            assert broker.run_until(lambda: bool(consumed.got), "10s")
            waited.append(broker.now_ms() - start)
        assert waited == [1_000, 1_500, 1_500]
        consumed.channel.nack(consumed.take().tag)  # not a failure: back at once
        assert consumed.got
    finally:
        broker.close()


# -- publishing ---------------------------------------------------------------------------


def test_a_publish_that_routes_nowhere_is_returned_as_unroutable() -> None:
    broker, topology, publisher = tier_flow()
    try:
        broker.delete_queue(topology.names.tier_queue("5s"))  # its fanout now routes nowhere
        with pytest.raises(UnroutableError) as caught:
            publisher.publish_delayed({"order": 1}, "5s", queue="orders", message_id="lost-1")
        assert caught.value.message_ids == ("lost-1",)
        assert caught.value.replies == {"lost-1": "NO_ROUTE"}
        # A batch names exactly the returned ones.
        with pytest.raises(UnroutableError) as batch:
            publisher.publish_many([{"n": 1}, {"n": 2}], "5s", queue="orders")
        assert len(batch.value.message_ids) == 2
        assert publisher.publish_many([{"n": 3}], "1s", queue="orders")  # the 1s tier is fine
    finally:
        broker.close()


def test_a_cascade_delivers_an_arbitrary_delay_exactly_never_early() -> None:
    broker = make()
    topology = shop(cascade={"levels": 12, "resolution": "1s"})
    broker.declare(topology)
    publisher = MemoryPublisher(topology, broker)
    business = topology.names.business_queue("orders")
    try:
        for seconds in (13, 2, 2_049):  # none is a tier (1s, 5s)
            start = broker.now_ms()
            publisher.publish_delayed(
                {"s": seconds}, queue="orders", delay=timedelta(seconds=seconds)
            )
            assert broker.run_until(lambda: broker.depth(business) > 0, "2h")
            assert broker.now_ms() - start == seconds * 1_000
            [arrived] = broker.peek(business)
            assert arrived.headers[h.H_TIER] == "cascade"
            assert broker.get(business) is not None
    finally:
        broker.close()


def test_the_plugin_exchange_is_emulated_where_the_version_runs_it() -> None:
    broker = make("4.0.5")
    topology = shop(plugin={})
    broker.declare(topology)
    publisher = MemoryPublisher(topology, broker)
    business = topology.names.business_queue("orders")
    try:
        publisher.publish_delayed({"n": 1}, queue="orders", delay=timedelta(milliseconds=1_234))
        broker.advance("1233ms")
        assert broker.depth(business) == 0
        broker.advance("1ms")
        assert broker.depth(business) == 1
    finally:
        broker.close()


def test_a_sharded_tier_spreads_by_id_and_delivers_everything_on_time() -> None:
    broker = make()
    topology = shop(scaling={"tier_shards": {"1s": 4}})
    broker.declare(topology)
    publisher = MemoryPublisher(topology, broker)
    try:
        publisher.publish_many([{"n": n} for n in range(200)], "1s", queue="orders")
        shards = [broker.depth(q) for q in topology.tier_queues("1s")]
        assert sum(shards) == 200
        assert all(n > 20 for n in shards), shards
        broker.advance("1s")
        assert broker.depth(topology.names.business_queue("orders")) == 200
    finally:
        broker.close()


# -- the virtual clock ---------------------------------------------------------------------


def test_the_clock_moves_only_when_told_and_async_sleeps_take_virtual_time(
    broker: MemoryBroker,
) -> None:
    assert broker.now == START
    woke: list[int] = []

    async def sleeper(seconds: float) -> None:
        await asyncio.sleep(seconds)
        woke.append(broker.now_ms() - START_MS)

    for seconds in (3.0, 0.5, 3600.0):
        broker.loop.create_task(sleeper(seconds))
    started = time.monotonic()
    broker.advance("2h")
    assert time.monotonic() - started < 5  # an hour of asyncio.sleep, in no real time
    assert woke == [500, 3_000, 3_600_000]
    assert broker.now_ms() - START_MS == 7_200_000


def test_work_in_threads_is_waited_for_with_the_clock_stopped(broker: MemoryBroker) -> None:
    seen: list[int] = []

    async def uses_a_thread() -> None:
        await asyncio.to_thread(time.sleep, 0.05)
        seen.append(broker.now_ms() - START_MS)

    broker.loop.create_task(uses_a_thread())
    broker.advance("10s")
    assert seen == [0]  # not "10 s later": the thread's result came back at once


def test_run_until_idle_stops_as_soon_as_nothing_is_left() -> None:
    broker, topology, publisher = tier_flow()
    try:
        publisher.publish_delayed({"n": 1}, "5s", queue="orders")
        publisher.publish_delayed({"n": 2}, "1s", queue="orders")
        assert broker.run_until_idle() == 5_000
        assert broker.depth(topology.names.business_queue("orders")) == 2
        assert broker.run_until_idle() == 0
    finally:
        broker.close()


def test_run_until_idle_says_what_is_still_pending_at_its_limit(broker: MemoryBroker) -> None:
    def again() -> None:
        broker.call_later(1_000, again)

    again()
    with pytest.raises(KitError, match="still busy after 1m"):
        broker.run_until_idle("1m")


def test_time_cannot_be_advanced_from_inside_the_loop(broker: MemoryBroker) -> None:
    failures: list[BaseException] = []

    def nested() -> None:
        try:
            broker.advance("1s")
        except KitError as exc:
            failures.append(exc)

    broker.call_later(10, nested)
    with pytest.raises(KitError, match="from inside a handler"):
        broker.advance("1s")  # a handler catching it does not hide it
    assert len(failures) == 1


def test_bad_versions_and_starts_are_refused() -> None:
    with pytest.raises(ValueError, match="not a RabbitMQ version"):
        MemoryBroker("latest")
    with pytest.raises(ValueError, match="no timezone"):
        MemoryBroker(start=datetime(2030, 1, 1))


def test_timers_due_at_the_same_instant_fire_in_the_order_they_were_set(
    broker: MemoryBroker,
) -> None:
    # asyncio orders timers by time alone: at equal times its heap may pop them in any
    # order, which would make which handler wakes first vary between runs.
    order: list[int] = []

    async def wake(n: int) -> None:
        await asyncio.sleep(1)
        order.append(n)

    for n in range(50):
        broker.loop.create_task(wake(n))
    broker.advance("1s")
    assert order == list(range(50))


def test_an_expired_head_stuck_behind_a_dead_letter_backlog_is_not_delivered(
    broker: MemoryBroker,
) -> None:
    declare(
        broker,
        ExchangeSpec("dlx", "direct"),
        QueueSpec(
            "work", {**AT_LEAST_ONCE, "x-message-ttl": 1_000, "x-dead-letter-exchange": "dlx"}
        ),
        QueueSpec("target"),
    )
    broker.publish(message("", "work", b"1"))
    broker.publish(message("", "work", b"2"))
    broker.advance("1s")  # both expired: the first waits for a route, the second behind it
    consumed = Consumed(broker, "work")
    assert consumed.got == []  # an expired message is never handed out
    declare(broker, BindingSpec("dlx", "target", "work"))
    assert [m.body for m in broker.peek("target")] == [b"1", b"2"]
