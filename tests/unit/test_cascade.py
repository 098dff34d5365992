"""The binary cascade, without a broker: routes, limits, and the declared graph walked
by a small topic-exchange simulator (every delay must park exactly its units and end in
its business queue)."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from rabbit_delay import (
    DelayError,
    Topology,
    TopologyError,
    UnknownTargetError,
    load_topology,
    topology_from_dict,
)
from rabbit_delay import _headers as h
from rabbit_delay._envelope import outgoing
from rabbit_delay._plan.desired import BindingSpec, Desired, ExchangeSpec, Kind, QueueSpec, desired
from rabbit_delay._publishing.core import PublisherCore
from rabbit_delay._topology import delays
from rabbit_delay._topology.delays import (
    CASCADE,
    MAX_ROUTING_KEY_BYTES,
    Router,
    cascade_routing_key,
)

ROOT = Path(__file__).resolve().parents[2]


def make(cascade: dict[str, Any] | None = None, **overrides: Any) -> Topology:
    data: dict[str, Any] = {
        "namespace": "shop",
        "tiers": {"5s": "5s", "30m": "30m"},
        "queues": {
            "orders.cancel": {"tiers": ["30m"]},
            "push": {"bindings": ["push.any"], "alias": "p"},
        },
        "cascade": cascade if cascade is not None else {},
    }
    data.update(overrides)
    return topology_from_dict(data)


# -- a topic exchange simulator over the planned declarations ----------------------------


def topic_match(pattern: str, key: str) -> bool:
    def match(p: list[str], k: list[str]) -> bool:
        if not p:
            return not k
        if p[0] == "#":
            return any(match(p[1:], k[i:]) for i in range(len(k) + 1))
        if not k:
            return False
        return (p[0] == "*" or p[0] == k[0]) and match(p[1:], k[1:])

    return match(pattern.split("."), key.split("."))


class Broker:
    """Routes like RabbitMQ for the exchange types the topology uses (direct, fanout,
    topic, alternate exchanges, exchange-to-exchange bindings, TTL + dead-lettering)."""

    def __init__(self, want: Desired) -> None:
        self.exchanges: dict[str, ExchangeSpec] = {e.name: e for e in want.exchanges}
        self.queues: dict[str, QueueSpec] = {q.name: q for q in want.queues}
        self.bindings: dict[str, list[BindingSpec]] = {}
        for b in want.bindings:
            self.bindings.setdefault(b.source, []).append(b)

    def route(self, exchange: str, key: str) -> set[str]:
        """Queues a publish to `exchange` with `key` reaches."""
        x = self.exchanges[exchange]
        found: set[str] = set()
        for b in self.bindings.get(exchange, []):
            if (
                x.type == "fanout"
                or (x.type == "direct" and b.routing_key == key)
                or (x.type == "topic" and topic_match(b.routing_key, key))
            ):
                if b.destination_type is Kind.QUEUE:
                    found.add(b.destination)
                else:
                    found |= self.route(b.destination, key)
        alternate = x.arguments.get("alternate-exchange")
        if not found and isinstance(alternate, str):
            found = self.route(alternate, key)
        return found

    def deliver(self, exchange: str, key: str) -> tuple[str, int, list[str]]:
        """Follow a message through TTL queues until one without TTL: (queue, ms held, path)."""
        held = 0
        path: list[str] = []
        while True:
            reached = self.route(exchange, key)
            assert len(reached) == 1, f"{key!r} at {exchange!r} reached {sorted(reached)}"
            queue = reached.pop()
            path.append(queue)
            args = self.queues[queue].arguments
            ttl = args.get("x-message-ttl")
            if ttl is None:
                return queue, held, path
            assert isinstance(ttl, int)
            held += ttl
            dlx = args["x-dead-letter-exchange"]
            assert isinstance(dlx, str)
            exchange = dlx


def test_topic_simulator_matches_like_rabbitmq() -> None:
    assert topic_match("*.1.#", "0.1.q")
    assert topic_match("*.1.#", "0.1")
    assert not topic_match("*.1.#", "1.0.q")
    assert topic_match("*.*.orders.cancel", "1.0.orders.cancel")
    assert not topic_match("*.*.orders", "1.0.orders.cancel")


# -- routes -------------------------------------------------------------------------------


def test_routing_key_spells_the_delay_most_significant_bit_first() -> None:
    assert cascade_routing_key(0b1011, 6, "q") == "0.0.1.0.1.1.q"
    assert cascade_routing_key(0, 3, "orders.cancel") == "0.0.0.orders.cancel"


@pytest.mark.parametrize(
    ("delay_ms", "level"),
    [
        (1_000, 0),
        (1_001, 1),
        (2_000, 1),
        (3_000, 1),
        (4_000, 2),
        (90_000, 6),
        (30 * 86_400_000, 21),
    ],
)
def test_publishing_starts_at_the_highest_set_bit(delay_ms: int, level: int) -> None:
    topology = make()
    route = Router(topology).resolve(topology.names.queue_key("push"), delay_ms=delay_ms)
    assert route.exchange == topology.names.cascade_entry_exchange(level)
    assert route.tier == CASCADE
    assert route.mandatory
    assert route.routing_key.endswith(".p")  # the alias, not the queue name


def test_zero_delay_goes_straight_to_the_delivery_exchange() -> None:
    topology = make()
    route = Router(topology).resolve(topology.names.queue_key("orders.cancel"), delay_ms=0)
    assert route.exchange == topology.names.cascade_deliver_exchange()
    assert route.delay_ms == 0
    assert route.routing_key == "0." * 22 + "orders.cancel"


@pytest.mark.parametrize(
    ("resolution", "delay_ms", "applied"),
    [
        ("1s", 1, 1_000),
        ("1s", 1_000, 1_000),
        ("1s", 1_001, 2_000),
        ("100ms", 1_001, 1_100),
        ("100ms", 250, 300),
    ],
)
def test_delays_are_rounded_up_to_the_resolution(
    resolution: str, delay_ms: int, applied: int
) -> None:
    topology = make({"resolution": resolution, "levels": 12})
    route = Router(topology).resolve(topology.names.queue_key("push"), delay_ms=delay_ms)
    assert route.delay_ms == applied  # never shorter than asked: late by < 1 unit, never early


def test_an_exact_tier_is_preferred_and_a_refused_tier_falls_back_to_the_cascade() -> None:
    topology = make()
    router = Router(topology)
    assert router.resolve(topology.names.queue_key("push"), delay_ms=5_000).tier == "5s"
    # orders.cancel accepts only the 30m tier: an exact 5 s goes through the cascade.
    assert router.resolve(topology.names.queue_key("orders.cancel"), delay_ms=5_000).tier == CASCADE


def test_default_levels_reach_thirty_days_at_one_second() -> None:
    cfg = make().cascade
    assert cfg is not None
    assert (cfg.levels, cfg.resolution) == (22, 1_000)
    assert cfg.max_delay_ms >= 30 * 86_400_000


def test_maximum_delay_is_accepted_and_one_more_millisecond_is_refused() -> None:
    topology = make({"levels": 5})  # 31 s
    router = Router(topology)
    key = topology.names.queue_key("push")
    assert router.resolve(key, delay_ms=31_000).exchange == topology.names.cascade_entry_exchange(4)
    with pytest.raises(
        DelayError, match=r"exceeds the cascade maximum 31s .*raise `cascade.levels`"
    ):
        router.resolve(key, delay_ms=31_001)


def test_negative_past_and_naive_times_are_refused_before_sending() -> None:
    core = PublisherCore(make())
    with pytest.raises(DelayError, match="negative"):
        core.route(queue="push", delay=-1)
    with pytest.raises(DelayError, match="negative"):
        core.route(queue="push", delay=timedelta(seconds=-5))
    with pytest.raises(DelayError, match="in the past"):
        core.route(queue="push", at=datetime.now(UTC) - timedelta(seconds=1))
    with pytest.raises(DelayError, match="no timezone"):
        core.route(queue="push", at=datetime.now() + timedelta(hours=1))
    with pytest.raises(DelayError, match="exceeds the cascade maximum"):
        core.route(queue="push", delay=timedelta(days=60))


def test_at_is_turned_into_a_rounded_up_delay() -> None:
    core = PublisherCore(make())
    now = 1_700_000_000_123
    at = datetime.fromtimestamp((now + 2_500) / 1000, UTC)
    route = core.route(queue="push", at=at, now=now)
    assert route.delay_ms == 3_000


def test_the_cascade_targets_one_queue_not_a_binding_key() -> None:
    core = PublisherCore(make())
    with pytest.raises(UnknownTargetError, match="queue="):
        core.route(routing_key="push.any", delay=7)


def test_long_destinations_need_an_alias(monkeypatch: pytest.MonkeyPatch) -> None:
    # With levels <= 32 and queue names <= 120 characters a key is at most 184 bytes, so
    # the 255-byte check is a guard; shrink the limit to exercise it and its remedy.
    longest = 2 * 32 + 120
    assert longest <= MAX_ROUTING_KEY_BYTES
    monkeypatch.setattr(delays, "MAX_ROUTING_KEY_BYTES", 60)
    name = "orders." + "x" * 30
    plain = make(queues={name: {}})
    with pytest.raises(DelayError, match=r"give the queue a short `alias`"):
        Router(plain).resolve(plain.names.queue_key(name), delay_ms=1_000)
    aliased = make(queues={name: {"alias": "oc"}})
    route = Router(aliased).resolve(aliased.names.queue_key(name), delay_ms=1_000)
    assert route.routing_key == "0." * 21 + "1.oc"


def test_outgoing_headers_carry_the_due_time_and_the_applied_delay() -> None:
    core = PublisherCore(make())
    route = core.route(queue="push", delay=1.2)
    out = outgoing(route, b"x", "application/octet-stream", now=1_000)
    assert out.headers[h.H_DUE_AT] == 3_000
    assert out.headers[h.H_DELAY_MS] == 2_000
    assert out.headers[h.H_TIER] == CASCADE
    assert out.headers[h.H_TARGET] == make().names.queue_key("push")
    assert out.mandatory


# -- the declared graph -------------------------------------------------------------------


def test_levels_are_quorum_queues_with_doubling_ttl_and_at_least_once_dead_lettering() -> None:
    topology = make({"levels": 4, "resolution": "100ms"})
    n = topology.names
    want = desired(topology)
    queues = {q.name: q for q in want.queues}
    exchanges = {e.name: e for e in want.exchanges}
    for level in range(4):
        args = queues[n.cascade_queue(level)].arguments
        assert args["x-message-ttl"] == 100 * 2**level
        assert args["x-queue-type"] == "quorum"
        assert args["x-dead-letter-strategy"] == "at-least-once"
        assert args["x-overflow"] == "reject-publish"
        nxt = n.cascade_exchange(level - 1) if level else n.cascade_deliver_exchange()
        assert args["x-dead-letter-exchange"] == nxt
        assert "x-dead-letter-routing-key" not in args  # the key must survive each hop
        x = exchanges[n.cascade_exchange(level)]
        assert (x.type, x.arguments["alternate-exchange"]) == ("topic", n.unroutable_exchange())
    deliver = exchanges[n.cascade_deliver_exchange()]
    assert (deliver.type, deliver.arguments["alternate-exchange"]) == (
        "topic",
        n.unroutable_exchange(),
    )
    assert n.cascade_queue(4) not in queues


def test_publishers_enter_each_level_through_a_fanout_into_its_queue() -> None:
    # The highest set bit is always 1: no topic match is needed on the publish path.
    topology = make({"levels": 3})
    n = topology.names
    want = desired(topology)
    for level in range(3):
        (entry,) = [e for e in want.exchanges if e.name == n.cascade_entry_exchange(level)]
        assert (entry.type, dict(entry.arguments)) == ("fanout", {})  # no AE: mandatory works
        bound = [
            (b.destination, b.destination_type) for b in want.bindings if b.source == entry.name
        ]
        assert bound == [(n.cascade_queue(level), Kind.QUEUE)]


def test_classic_topology_uses_plain_dead_lettering() -> None:
    topology = make({"levels": 3}, queue_type="classic")
    args = {q.name: q for q in desired(topology).queues}[topology.names.cascade_queue(2)].arguments
    assert args == {
        "x-dead-letter-exchange": topology.names.cascade_exchange(1),
        "x-message-ttl": 4_000,
    }


def test_every_delay_parks_exactly_its_units_and_lands_in_its_queue() -> None:
    topology = make({"levels": 10})
    broker = Broker(desired(topology))
    router = Router(topology)
    n = topology.names
    rng = random.Random(4)
    units = [0, 1, 2, 3, 511, 512, 1023, *rng.sample(range(1024), 60)]
    for queue in ("orders.cancel", "push"):
        for u in units:
            route = router.resolve(n.queue_key(queue), delay_ms=u * 1_000)
            final, held, path = broker.deliver(route.exchange, route.routing_key)
            assert final == n.business_queue(queue)
            assert held == u * 1_000 == route.delay_ms
            assert (
                len(path) == bin(u).count("1") + 1
            )  # one queue per set bit, then the business queue


def test_a_due_message_for_a_missing_queue_goes_to_the_catch_all() -> None:
    topology = make({"levels": 4})
    n = topology.names
    want = desired(topology)
    gone = n.business_queue("push")
    broker = Broker(
        Desired(
            want.exchanges, want.queues, tuple(b for b in want.bindings if b.destination != gone)
        )
    )
    route = Router(topology).resolve(n.queue_key("push"), delay_ms=5_000)
    final, held, _ = broker.deliver(route.exchange, route.routing_key)
    assert (final, held) == (n.unroutable_queue(), 5_000)  # never stuck at the head of level 0


def test_ttl_of_the_top_level_must_fit_rabbitmq_timers() -> None:
    make({"levels": 23})  # 2^22 s is under 2^32-1 ms
    with pytest.raises(
        TopologyError, match=r"cascade: the top level would hold messages .* lower `levels`"
    ):
        make({"levels": 24})
    with pytest.raises(TopologyError, match="over RabbitMQ's TTL maximum"):
        make({"levels": 27, "resolution": "100ms"})


def test_cascade_and_plugin_are_exclusive() -> None:
    with pytest.raises(TopologyError, match="not both"):
        make(plugin={})


def test_example_topology_loads() -> None:
    topology = load_topology(ROOT / "examples" / "topologies" / "cascade.toml")
    assert topology.cascade is not None
    assert topology.cascade.max_delay_ms >= 30 * 86_400_000
    for queue in topology.queues:
        route = Router(topology).resolve(
            topology.names.queue_key(queue), delay_ms=topology.cascade.max_delay_ms
        )
        assert len(route.routing_key.encode()) <= MAX_ROUTING_KEY_BYTES
