"""The router and PublisherCore.route: everything that can be refused is refused before sending."""

from __future__ import annotations

import random
import uuid
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest

from rabbit_delay import DelayError, PublishError, Topology, UnknownTargetError, topology_from_dict
from rabbit_delay import _headers as h
from rabbit_delay._envelope import outgoing
from rabbit_delay._publishing.core import PublisherCore
from rabbit_delay._topology import delays
from rabbit_delay._topology.delays import Route, Router


@pytest.fixture
def topology() -> Topology:
    return topology_from_dict(
        {
            "namespace": "shop",
            "tiers": {"5m": "5m", "30m": "30m", "2h": "2h"},
            "queues": {
                "orders.cancel": {"tiers": ["30m"], "bindings": ["order.timeout", "shared"]},
                "push": {"bindings": ["shared"]},  # every tier
            },
        }
    )


@pytest.fixture
def core(topology: Topology) -> PublisherCore:
    return PublisherCore(topology)


def test_tier_route(core: PublisherCore) -> None:
    route = core.route("30m", queue="orders.cancel")
    assert route == Route(
        exchange="shop.v1.delay.30m",
        routing_key="shop.v1.q.orders.cancel",
        tier="30m",
        delay_ms=1_800_000,
        target="shop.v1.q.orders.cancel",
    )
    assert route.mandatory is True
    assert route.headers == {}


def test_binding_key_route(core: PublisherCore) -> None:
    route = core.route("30m", routing_key="order.timeout")
    assert (route.exchange, route.routing_key, route.target) == (
        "shop.v1.delay.30m",
        "order.timeout",
        "order.timeout",
    )


def test_unknown_tier(core: PublisherCore) -> None:
    with pytest.raises(
        DelayError, match=r"unknown tier '1h'; the topology's tiers are: 5m, 30m, 2h"
    ):
        core.route("1h", queue="push")


def test_unknown_queue(core: PublisherCore) -> None:
    with pytest.raises(
        UnknownTargetError, match=r"unknown queue 'orders'; .* has: orders.cancel, push"
    ):
        core.route("5m", queue="orders")


def test_unknown_routing_key(core: PublisherCore) -> None:
    with pytest.raises(
        UnknownTargetError, match=r"no queue is bound with routing key 'nope'.*order.timeout"
    ):
        core.route("5m", routing_key="nope")


@pytest.mark.parametrize(
    ("queue", "routing_key"),
    [(None, None), ("push", "shared")],
)
def test_exactly_one_target(
    core: PublisherCore, queue: str | None, routing_key: str | None
) -> None:
    with pytest.raises(UnknownTargetError, match="exactly one target"):
        core.route("5m", queue=queue, routing_key=routing_key)


def test_tier_not_allowed_for_the_queue(core: PublisherCore) -> None:
    with pytest.raises(
        DelayError, match=r"queue 'orders.cancel' does not accept tier '5m'; it accepts: 30m"
    ):
        core.route("5m", queue="orders.cancel")


def test_tier_not_allowed_for_one_queue_behind_a_shared_key(core: PublisherCore) -> None:
    assert core.route("30m", routing_key="shared").tier == "30m"
    with pytest.raises(DelayError, match=r"'orders\.cancel' does not accept tier '2h'"):
        core.route("2h", routing_key="shared")


@pytest.mark.parametrize(
    "delay", [timedelta(minutes=5), 300, 300.0, "5m", timedelta(seconds=299, microseconds=999_999)]
)
def test_delay_matching_a_tier(core: PublisherCore, delay: timedelta | float | str) -> None:
    route = core.route(queue="push", delay=delay)
    assert route.tier == "5m"
    assert route.exchange == "shop.v1.delay.5m"
    assert route.delay_ms == 300_000


def test_delay_matching_a_tier_the_queue_refuses(core: PublisherCore) -> None:
    with pytest.raises(DelayError, match=r"'orders\.cancel' does not accept tier '5m'"):
        core.route(queue="orders.cancel", delay=timedelta(minutes=5))


@pytest.mark.parametrize("delay", [timedelta(minutes=7), 1, 299.5, timedelta(0)])
def test_delay_matching_no_tier_lists_the_tiers(
    core: PublisherCore, delay: timedelta | float
) -> None:
    with pytest.raises(DelayError) as info:
        core.route(queue="push", delay=delay)
    message = str(info.value)
    assert "no tier has a delay of" in message
    assert "5m=5m" in message
    assert "30m=30m" in message
    assert "2h=2h" in message
    assert "[cascade]" in message


def test_tier_and_the_same_delay_agree(core: PublisherCore) -> None:
    assert core.route("5m", queue="push", delay=300).tier == "5m"
    with pytest.raises(DelayError, match="either a tier or a delay"):
        core.route("5m", queue="push", delay=60)


def test_neither_tier_nor_delay(core: PublisherCore) -> None:
    with pytest.raises(DelayError, match="give a tier"):
        core.route(queue="push")


@pytest.mark.parametrize("delay", [-1, timedelta(seconds=-300), -0.001])
def test_negative_delay(core: PublisherCore, delay: timedelta | float) -> None:
    with pytest.raises(DelayError, match="negative"):
        core.route(queue="push", delay=delay)


def test_negative_delay_ms_at_the_router(topology: Topology) -> None:
    router = Router(topology)
    with pytest.raises(DelayError, match="negative"):
        router.resolve(router.target_key("push", None), delay_ms=-5)


@pytest.mark.parametrize("delay", [timedelta(days=60), 10**9])
def test_too_long_delay(core: PublisherCore, delay: timedelta | int) -> None:
    with pytest.raises(DelayError, match="no tier has a delay of"):
        core.route(queue="push", delay=delay)


@pytest.mark.parametrize("delay", [float("nan"), float("inf"), True, "5 minutes"])
def test_malformed_delay(core: PublisherCore, delay: object) -> None:
    with pytest.raises(DelayError, match="duration"):
        core.route(queue="push", delay=delay)  # type: ignore[arg-type]


def test_at_in_the_future_matching_a_tier(core: PublisherCore) -> None:
    now = 1_700_000_000_000
    at = datetime.fromtimestamp(now / 1000, UTC) + timedelta(minutes=30)
    assert core.route(queue="push", at=at, now=now).tier == "30m"


def test_at_in_the_past(core: PublisherCore) -> None:
    with pytest.raises(DelayError, match="in the past"):
        core.route(queue="push", at=datetime.now(UTC) - timedelta(seconds=1))


def test_at_naive(core: PublisherCore) -> None:
    with pytest.raises(DelayError, match="no timezone"):
        core.route(queue="push", at=datetime.now() + timedelta(minutes=5))


def test_at_and_delay(core: PublisherCore) -> None:
    with pytest.raises(DelayError, match="either delay= or at="):
        core.route(queue="push", delay=300, at=datetime.now(UTC) + timedelta(minutes=5))


def test_refusals_are_publish_errors_and_value_errors() -> None:
    for cls in (DelayError, UnknownTargetError):
        assert issubclass(cls, PublishError)
        assert issubclass(cls, ValueError)


def test_queues_for_key(topology: Topology) -> None:
    router = Router(topology)
    assert router.queues_for_key("shared") == ("orders.cancel", "push")
    assert router.queues_for_key("shop.v1.q.push") == ("push",)


# -- sharded tiers ------------------------------------------------------------------------------


@pytest.fixture
def sharded() -> Topology:
    return topology_from_dict(
        {
            "namespace": "shop",
            "tiers": {"5m": "5m", "30m": "30m"},
            "queues": {"push": {"bindings": ["shared"]}},
            "scaling": {"tier_shards": {"5m": 4}},
        }
    )


# crc32("order-0" .. "order-7") % 4
PINNED = [1, 3, 1, 3, 0, 2, 0, 2]
SHARDS_5M = ("shop.v1.delay.5m", "shop.v1.delay.5m.1", "shop.v1.delay.5m.2", "shop.v1.delay.5m.3")


def test_route_of_a_sharded_tier_carries_every_shard(sharded: Topology) -> None:
    route = PublisherCore(sharded).route("5m", queue="push")
    assert route.exchange == "shop.v1.delay.5m"
    assert route.shards == SHARDS_5M
    assert route.shards == sharded.tier_exchanges("5m")
    # routing key, tier, delay and target are the tier's, whatever the shard
    assert (route.routing_key, route.tier, route.delay_ms) == ("shop.v1.q.push", "5m", 300_000)
    unsharded = PublisherCore(sharded).route("30m", queue="push")
    assert unsharded.shards == ()
    assert unsharded.exchange_for("anything") == "shop.v1.delay.30m"


def test_shard_index_is_crc32_and_stable() -> None:
    import zlib

    for message_id in ("order-42-timeout", "a", "", "é-ü"):
        expected = zlib.crc32(message_id.encode()) % 4
        assert delays.shard_index(message_id, 4) == expected
        assert delays.shard_index(message_id, 1) == 0
    # Pinned: publishers of two versions side by side must agree on the shard.
    assert [delays.shard_index(f"order-{i}", 4) for i in range(8)] == PINNED


def _uuid4(i: int) -> uuid.UUID:
    """A random-looking UUID4, the same for `i` on every run: the bound cannot flake."""
    return uuid.UUID(int=random.Random(i).getrandbits(128), version=4)


@pytest.mark.parametrize(
    "make_id",
    [lambda i: _uuid4(i).hex, lambda i: str(_uuid4(i)), lambda i: f"order-{i}"],
    ids=["uuid-hex", "uuid", "sequential"],
)
def test_shards_are_spread_evenly(make_id: Callable[[int], str]) -> None:
    """10,000 ids over 4 shards: each within 5 % of a quarter."""
    counts = Counter(delays.shard_index(make_id(i), 4) for i in range(10_000))
    assert set(counts) == {0, 1, 2, 3}
    for shard, n in counts.items():
        assert abs(n - 2_500) <= 125, (shard, counts)


def test_publish_many_spreads_by_message_id(sharded: Topology) -> None:
    core = PublisherCore(sharded)
    outs = core.prepare_many([{"n": i} for i in range(2_000)], "5m", queue="push")
    by_exchange = Counter(o.exchange for o in outs)
    assert set(by_exchange) == set(SHARDS_5M)
    assert min(by_exchange.values()) > 400
    for out in outs:
        assert out.exchange == SHARDS_5M[delays.shard_index(out.message_id, 4)]
        assert out.headers[h.H_TIER] == "5m"  # handlers see the tier, never the shard
        assert out.routing_key == "shop.v1.q.push"


def test_the_same_id_takes_the_same_shard_every_time(sharded: Topology) -> None:
    core = PublisherCore(sharded)
    ids = [f"order-{i}" for i in range(50)]
    first = [core.prepare({}, "5m", queue="push", message_id=i).exchange for i in ids]
    again = [
        PublisherCore(sharded).prepare({}, "5m", routing_key="shared", message_id=i) for i in ids
    ]
    assert first == [o.exchange for o in again]
    assert len(set(first)) == 4


def test_worker_retries_and_replays_through_a_sharded_tier_shard_by_id(sharded: Topology) -> None:
    """Retries (_consumer/decide.py) and replays (replay.py) build their copies with
    PublisherCore.outgoing from a Router route: the id picks the shard there too."""
    from rabbit_delay._consumer.decide import QueuePolicy
    from rabbit_delay._ops.replay.rules import ParkedReplay
    from rabbit_delay._ops.stored import Stored

    policy = QueuePolicy(sharded, "push")
    retry = policy.retry_routes[0]
    assert (retry.tier, retry.shards) == ("5m", SHARDS_5M)  # the shortest tier: 5m
    replay = ParkedReplay(sharded, "push", tier="5m")
    for i in range(40):
        mid = f"m{i}"
        out = replay.outgoing(Stored(b"{}", mid, "application/json"), 1_000)
        assert out.exchange == SHARDS_5M[delays.shard_index(mid, 4)]
        retried = outgoing(retry, b"{}", "application/json", 1_000, mid)
        assert retried.exchange == out.exchange


# -- a due time fixed earlier: what remains of it (transfer, outbox relay) ---------------


def test_remaining_picks_the_shortest_accepted_tier_not_shorter(topology: Topology) -> None:
    router = Router(topology)
    key = topology.names.queue_key("push")
    assert router.resolve_remaining(key, 60_000).tier == "5m"  # 4 min late at most
    assert router.resolve_remaining(key, 300_000).tier == "5m"  # exact
    assert router.resolve_remaining(key, 300_001).tier == "30m"  # never early
    # orders.cancel accepts only 30m: a 5m tier would fit but is not its to use
    cancel = topology.names.queue_key("orders.cancel")
    assert router.resolve_remaining(cancel, 60_000).tier == "30m"


def test_remaining_due_already_goes_to_the_due_exchange(topology: Topology) -> None:
    router = Router(topology)
    key = topology.names.queue_key("push")
    for remaining in (0, -5_000):
        route = router.resolve_remaining(key, remaining)
        assert (route.exchange, route.routing_key, route.tier, route.delay_ms) == (
            "shop.v1.due",
            key,
            delays.IMMEDIATE,
            0,
        )


def test_remaining_longer_than_every_tier_is_refused(topology: Topology) -> None:
    router = Router(topology)
    with pytest.raises(DelayError, match=r"longer than every tier.*longest: 2h.*early"):
        router.resolve_remaining(topology.names.queue_key("push"), 3 * 3_600_000)


def test_remaining_is_exact_through_a_cascade() -> None:
    topology = topology_from_dict(
        {
            "namespace": "shop",
            "tiers": {"5m": "5m"},
            "cascade": {"levels": 10, "resolution": "1s"},
            "queues": {"push": {"bindings": ["shared"]}},
        }
    )
    router = Router(topology)
    route = router.resolve_remaining(topology.names.queue_key("push"), 61_500)
    assert (route.tier, route.delay_ms) == (delays.CASCADE, 62_000)  # rounded up, not a tier
    # a binding key cannot ride the cascade: the tiers serve it, never early
    assert router.resolve_remaining("shared", 61_500).tier == "5m"


def test_outgoing_keeps_a_fixed_due_time(topology: Topology) -> None:
    route = Router(topology).resolve_remaining(topology.names.queue_key("push"), 60_000)
    out = outgoing(
        route, b"{}", "application/json", 1_000, "id-1", due_at=61_000, requested_ms=90_000
    )
    assert out.headers[h.H_DUE_AT] == 61_000
    assert out.headers[h.H_DELAY_MS] == 90_000
    assert out.headers[h.H_TIER] == "5m"


# -- the due time asked for (rd-asked-due-at) -----------------------------------------------


def cascaded() -> Topology:
    return topology_from_dict(
        {
            "namespace": "shop",
            "tiers": {"5m": "5m"},
            "cascade": {"levels": 10, "resolution": "1s"},
            "queues": {"push": {}},
        }
    )


def test_a_tier_is_scheduled_exactly_as_asked(core: PublisherCore) -> None:
    out = outgoing(core.route("5m", queue="push"), b"x", "application/json", 1_000)
    assert out.headers[h.H_DUE_AT] == out.headers[h.H_ASKED_DUE_AT] == 301_000


def test_the_cascade_rounds_the_asked_due_time_up() -> None:
    core = PublisherCore(cascaded())
    route = core.route(queue="push", delay=1.2)
    assert (route.delay_ms, route.asked_ms, route.asked_delay_ms) == (2_000, 1_200, 1_200)
    out = outgoing(route, b"x", "application/json", 1_000)
    assert (out.headers[h.H_DUE_AT], out.headers[h.H_ASKED_DUE_AT]) == (3_000, 2_200)
    exact = core.route(queue="push", delay=3)
    assert (exact.delay_ms, exact.asked_ms) == (3_000, None)  # a whole number of units


def test_at_is_the_asked_due_time() -> None:
    core = PublisherCore(cascaded())
    at = datetime.now(UTC) + timedelta(seconds=3.5)
    out = core.prepare(b"x", queue="push", at=at)
    asked = out.headers[h.H_ASKED_DUE_AT]
    assert asked == int(at.timestamp() * 1000)
    assert out.headers[h.H_DUE_AT] - asked in range(0, 1_000)  # type: ignore[operator]


def test_a_longer_tier_for_what_remains_keeps_what_was_asked(topology: Topology) -> None:
    route = Router(topology).resolve_remaining(topology.names.queue_key("push"), 60_000)
    assert (route.tier, route.delay_ms, route.asked_ms) == ("5m", 300_000, 60_000)
    out = outgoing(route, b"x", "application/json", 1_000)
    assert (out.headers[h.H_DUE_AT], out.headers[h.H_ASKED_DUE_AT]) == (301_000, 61_000)


def test_a_fixed_due_time_keeps_the_first_publish_asked_due_time(topology: Topology) -> None:
    route = Router(topology).resolve_remaining(topology.names.queue_key("push"), 60_000)
    first = {h.H_ASKED_DUE_AT: 60_500}  # the original went through a cascade: rounded up
    moved = outgoing(route, b"x", "a/b", 1_000, "id", first, due_at=61_000)
    assert (moved.headers[h.H_DUE_AT], moved.headers[h.H_ASKED_DUE_AT]) == (61_000, 60_500)
    fresh = outgoing(route, b"x", "a/b", 1_000, "id", None, due_at=61_000)
    assert fresh.headers[h.H_ASKED_DUE_AT] == 61_000
    odd = outgoing(route, b"x", "a/b", 1_000, "id", {h.H_ASKED_DUE_AT: 99_000}, due_at=61_000)
    assert odd.headers[h.H_ASKED_DUE_AT] == 61_000  # never after the due time


def test_a_retry_is_asked_anew_from_its_failure() -> None:
    """A retry copy carries the original's headers: its asked due time is written again."""
    from rabbit_delay._consumer.decide import QueuePolicy, Republish, decide
    from rabbit_delay._envelope import Envelope

    topology = topology_from_dict(
        {
            "namespace": "shop",
            "tiers": {"5m": "5m"},
            "cascade": {"levels": 10, "resolution": "1s"},
            "queues": {"push": {"retry": {"backoff": {"initial": "1500ms", "factor": 2}}}},
        }
    )
    headers = {h.H_ATTEMPT: 1, h.H_DUE_AT: 500, h.H_ASKED_DUE_AT: 400, h.H_TRACEPARENT: "tp"}
    env = Envelope.from_headers("m-1", headers)
    action = decide(
        env,
        QueuePolicy(topology, "push"),
        RuntimeError("boom"),
        body=b"x",
        content_type="a/b",
        now_ms=10_000,
    )
    assert isinstance(action, Republish)
    out = action.outgoing.headers
    assert (out[h.H_DUE_AT], out[h.H_ASKED_DUE_AT]) == (12_000, 11_500)
    assert out[h.H_TRACEPARENT] == "tp"  # the trace context rides along unchanged
