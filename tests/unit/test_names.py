"""Names: pure, deterministic, versioned, and `Names.parse` inverts every builder."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest

from rabbit_delay import _headers as h
from rabbit_delay._names import Names

N = Names("shop", 1)

# (builder, argument or None, expected name, parsed (kind, detail))
CASES: list[tuple[Callable[..., str], object, str, tuple[str, str]]] = [
    (N.tier_exchange, "5m", "shop.v1.delay.5m", ("delay", "5m")),
    (N.tier_queue, "30m", "shop.v1.delay.30m", ("delay", "30m")),
    (N.due_exchange, None, "shop.v1.due", ("due", "")),
    (N.unroutable_exchange, None, "shop.v1.unroutable", ("unroutable", "")),
    (N.unroutable_queue, None, "shop.v1.unroutable", ("unroutable", "")),
    (N.business_queue, "orders.cancel", "shop.v1.q.orders.cancel", ("q", "orders.cancel")),
    (N.queue_key, "push", "shop.v1.q.push", ("q", "push")),
    (N.parking_exchange, None, "shop.v1.parking", ("parking", "")),
    (
        N.parking_queue,
        "orders.cancel",
        "shop.v1.parking.orders.cancel",
        ("parking", "orders.cancel"),
    ),
    (N.cascade_exchange, 3, "shop.v1.cascade.03", ("cascade", "03")),
    (N.cascade_queue, 17, "shop.v1.cascade.17", ("cascade", "17")),
    (N.cascade_entry_exchange, 5, "shop.v1.cascade.05.in", ("cascade", "05.in")),
    (N.cascade_deliver_exchange, None, "shop.v1.cascade.deliver", ("cascade", "deliver")),
    (N.plugin_exchange, None, "shop.v1.delayed", ("delayed", "")),
    (N.held_exchange, None, "shop.v1.held", ("held", "")),
    (N.held_queue, None, "shop.v1.held", ("held", "")),
    # Sharded tiers: shard 0 is the tier's own name, shard i > 0 `{tier}.{i}`.
    (N.tier_queue, ("3s", 0), "shop.v1.delay.3s", ("delay", "3s")),
    (N.tier_queue, ("3s", 1), "shop.v1.delay.3s.1", ("delay", "3s.1")),
    (N.tier_exchange, ("3s", 7), "shop.v1.delay.3s.7", ("delay", "3s.7")),
    (N.tier_queue, ("1h30m", 31), "shop.v1.delay.1h30m.31", ("delay", "1h30m.31")),
]


def build(builder: Callable[..., str], arg: object) -> str:
    if arg is None:
        return builder()
    return builder(*arg) if isinstance(arg, tuple) else builder(arg)


@pytest.mark.parametrize(("builder", "arg", "expected", "parsed"), CASES)
def test_builders_and_parse_round_trip(
    builder: Callable[..., str], arg: object, expected: str, parsed: tuple[str, str]
) -> None:
    name = build(builder, arg)
    assert name == expected
    assert build(builder, arg) == name  # deterministic
    assert N.parse(name) == parsed


def test_parse_round_trips_every_public_builder() -> None:
    """A builder added later without a CASES row fails here."""
    builders = {
        attr
        for attr in dir(Names)
        if not attr.startswith("_")
        and callable(getattr(Names, attr))
        and attr not in ("parse", "parse_tier")
    }
    covered = {builder.__name__ for builder, *_ in CASES}
    assert builders == covered


def test_same_inputs_same_names_in_another_instance() -> None:
    other = Names("shop", 1)
    assert other == N
    assert hash(other) == hash(N)
    for builder, arg, expected, _ in CASES:
        assert build(getattr(other, builder.__name__), arg) == expected


def test_version_segment_separates_topologies() -> None:
    v2 = Names("shop", 2)
    assert v2.prefix == "shop.v2"
    assert v2.tier_queue("5m") == "shop.v2.delay.5m"
    assert v2.tier_queue("5m") != N.tier_queue("5m")
    with pytest.raises(ValueError, match=r"not in namespace 'shop\.v1'"):
        N.parse(v2.due_exchange())
    # v1 must not claim v10's names.
    with pytest.raises(ValueError, match="not in namespace"):
        N.parse(Names("shop", 10).due_exchange())


def test_default_version_is_one() -> None:
    assert Names("shop").prefix == "shop.v1"


def test_names_are_immutable() -> None:
    with pytest.raises(AttributeError):
        N.namespace = "other"  # type: ignore[misc]


@pytest.mark.parametrize(
    "name",
    [
        "other.v1.due",
        "shop.v1",
        "shop.v1.",
        "shop.v1.due.extra",
        "shop.v1.delayed.x",
        "shop.v1.unroutable.x",
        "shop.v1.delay",
        "shop.v1.q",
        "shop.v1.cascade",
        "shop.v1.nonsense.x",
    ],
)
def test_parse_refuses_foreign_names(name: str) -> None:
    with pytest.raises(ValueError, match=re.escape(repr(name))):
        N.parse(name)


def test_headers_are_the_projects_own_not_x() -> None:
    # x-delay is the plugin's; traceparent / tracestate are the W3C's
    theirs = ("H_PLUGIN_DELAY", "H_TRACEPARENT", "H_TRACESTATE")
    ours = [value for key, value in vars(h).items() if key.startswith("H_") and key not in theirs]
    assert ours, "no header constants found"
    assert all(value.startswith("rd-") for value in ours)
    assert len(set(ours)) == len(ours)
    assert h.H_DUE_AT == "rd-due-at"
    assert h.H_TIER == "rd-tier"
    assert h.H_ATTEMPT == "rd-attempt"
    assert h.H_PLUGIN_DELAY == "x-delay"
    assert h.TRACE_HEADERS == ("traceparent", "tracestate")


# -- tier shards ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tier", "shard"),
    [("5m", 0), ("5m", 1), ("5m", 9), ("5m", 10), ("5m", 31), ("1h30m", 2), ("a_b-c", 3)],
)
def test_tier_shard_names_round_trip(tier: str, shard: int) -> None:
    queue, exchange = N.tier_queue(tier, shard), N.tier_exchange(tier, shard)
    assert queue == exchange  # a buffer and its fanout share a name, as before shards
    assert N.parse_tier(queue) == (tier, shard)
    assert N.parse(queue)[0] == "delay"


def test_shard_zero_is_the_unsharded_name() -> None:
    """Adding shards to an existing tier keeps its buffer: shard 0 is today's name."""
    assert N.tier_queue("5m", 0) == N.tier_queue("5m") == "shop.v1.delay.5m"
    assert N.tier_exchange("5m", 0) == N.tier_exchange("5m") == "shop.v1.delay.5m"


def test_shard_names_are_distinct_from_every_other_tier() -> None:
    """Tier names have no dot, so `{tier}.{i}` can never be another tier's name."""
    names = {N.tier_queue(t, i) for t in ("5m", "5m1", "5", "1") for i in range(12)}
    assert len(names) == 4 * 12


def test_negative_shard_is_refused() -> None:
    with pytest.raises(ValueError, match="shards count from 0"):
        N.tier_queue("5m", -1)


@pytest.mark.parametrize(
    "name",
    [
        "shop.v1.q.orders",
        "shop.v1.due",
        "shop.v1.cascade.03",
        "shop.v1.delay.5m.0",  # shard 0 has no suffix
        "shop.v1.delay.5m.01",
        "shop.v1.delay.5m.x",
        "shop.v1.delay.5m.1.2",
        "shop.v2.delay.5m",
    ],
)
def test_parse_tier_refuses_other_names(name: str) -> None:
    with pytest.raises(ValueError, match=re.escape(repr(name))):
        N.parse_tier(name)
