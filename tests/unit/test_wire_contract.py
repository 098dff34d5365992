"""The wire contract page (docs/reference/wire-contract.md) states what the code does.

Services in other languages publish and consume by that page alone, so it is checked
against the project's own names (`rabbit_delay._names.Names`), header constants
(`rabbit_delay._headers`), the router (`rabbit_delay._topology.delays`), the envelope and
the retry/park decision: every name, routing key, shard and cascade key of its examples
is computed here and must be on the page, and every header the code writes must be in
its table, with the type of the value the code writes.
"""

from __future__ import annotations

import math
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest

import rabbit_delay._headers as h
from rabbit_delay import Reject, load_topology, topology_from_dict
from rabbit_delay._consumer.decide import Park, QueuePolicy, Republish, decide
from rabbit_delay._envelope import BINARY, JSON, MAX_MESSAGE_ID, Envelope, encode_body, outgoing
from rabbit_delay._idempotency.guard import ClaimResult
from rabbit_delay._names import Names
from rabbit_delay._topology.delays import Router, cascade_routing_key, shard_index

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "reference" / "wire-contract.md"
TEXT = PAGE.read_text(encoding="utf-8")
FLAT = " ".join(TEXT.split())  # prose as one line: a rewrap changes nothing
ORDERS = ROOT / "topology" / "orders.toml"
CASCADE = ROOT / "examples" / "topologies" / "cascade.toml"
QUEUE = "orders.cancel-unpaid"
BINDING = "order.payment-timeout"
NOW = 1_800_000_000_000


def states(fragment: str) -> None:
    assert f"`{fragment}`" in TEXT, f"the wire contract does not state `{fragment}`"


# -- names ------------------------------------------------------------------------------


def test_the_names_table_is_what_names_builds() -> None:
    n = Names("shop", 1)
    for name in (
        n.tier_exchange("30m"),
        n.tier_queue("30m"),
        n.tier_exchange("30m", 3),
        n.due_exchange(),
        n.business_queue(QUEUE),
        n.queue_key(QUEUE),
        n.unroutable_exchange(),
        n.unroutable_queue(),
        n.parking_exchange(),
        n.parking_queue(QUEUE),
        n.plugin_exchange(),
    ):
        states(name)
    c = Names("reminders", 1)
    for name in (c.cascade_exchange(6), c.cascade_entry_exchange(6), c.cascade_deliver_exchange()):
        states(name)
    # the patterns, with the names' own separators
    for pattern in (
        "{ns}.v{v}.delay.{tier}",
        "{ns}.v{v}.delay.{tier}.{i}",
        "{ns}.v{v}.due",
        "{ns}.v{v}.q.{queue}",
        "{ns}.v{v}.unroutable",
        "{ns}.v{v}.parking",
        "{ns}.v{v}.parking.{queue}",
        "{ns}.v{v}.cascade.{LL}",
        "{ns}.v{v}.cascade.{LL}.in",
        "{ns}.v{v}.cascade.deliver",
        "{ns}.v{v}.delayed",
    ):
        states(pattern)
    assert n.business_queue(QUEUE) == n.queue_key(QUEUE)  # "also its own routing key"


# -- routes -----------------------------------------------------------------------------


def test_a_tier_route_by_queue_and_by_binding_key() -> None:
    router = Router(load_topology(ORDERS))
    by_queue = router.resolve(router.target_key(QUEUE, None), tier="30m")
    states(by_queue.exchange)
    states(by_queue.routing_key)
    assert by_queue.mandatory
    by_key = router.resolve(router.target_key(None, BINDING), tier="30m")
    assert by_key.exchange == by_queue.exchange
    states(by_key.routing_key)


def test_the_sharded_tier_example() -> None:
    data: dict[str, Any] = tomllib.loads(ORDERS.read_text())
    data["scaling"] = {"tier_shards": {"30m": 4}}
    assert 'tier_shards = { "30m" = 4 }' in TEXT
    router = Router(topology_from_dict(data))
    route = router.resolve(router.target_key(QUEUE, None), tier="30m")
    assert len(route.shards) == 4
    for shard in route.shards:
        states(shard)
    for message_id in ("order-42-timeout", "order-43-timeout"):
        index = shard_index(message_id, 4)
        exchange = route.exchange_for(message_id)
        assert f"`{message_id}` goes to shard {index}, `{exchange}`" in TEXT or (
            f"`{message_id}` to shard {index}, `{exchange}`" in TEXT
        ), f"the page does not say that {message_id} goes to shard {index} ({exchange})"
    assert "CRC-32" in TEXT
    assert "modulo the shard count" in TEXT


@pytest.mark.parametrize(("delay_ms", "units"), [(90_000, 90), (1_500, 2)])
def test_the_cascade_examples(delay_ms: int, units: int) -> None:
    topology = load_topology(CASCADE)
    assert topology.cascade is not None
    assert (topology.cascade.levels, topology.cascade.resolution) == (22, 1_000)
    assert "22 levels at 1 s" in TEXT
    router = Router(topology)
    route = router.resolve(router.target_key("reminders.send", None), delay_ms=delay_ms)
    assert math.ceil(delay_ms / topology.cascade.resolution) == units
    states(route.exchange)
    assert route.tier == "cascade"
    assert route.delay_ms == units * topology.cascade.resolution  # rounded up: never early
    assert route.routing_key == cascade_routing_key(units, 22, "rs")
    if delay_ms == 90_000:
        states(route.routing_key)
    level = units.bit_length() - 1
    assert route.exchange == topology.names.cascade_entry_exchange(level)


def test_the_plugin_route() -> None:
    data: dict[str, Any] = tomllib.loads(ORDERS.read_text())
    data["plugin"] = {}
    router = Router(topology_from_dict(data))
    route = router.resolve(router.target_key(QUEUE, None), delay_ms=90_000)
    states(route.exchange)
    assert route.routing_key == Names("shop", 1).queue_key(QUEUE)
    assert route.headers == {h.H_PLUGIN_DELAY: 90_000}
    states(h.H_PLUGIN_DELAY)
    assert not route.mandatory
    assert "cannot honour `mandatory`" in TEXT
    assert "4294967295" in TEXT


# -- properties -------------------------------------------------------------------------


def test_the_properties() -> None:
    from rabbit_delay._aio.publisher import PERSISTENT as ASYNC_PERSISTENT
    from rabbit_delay._sync.publisher import PERSISTENT

    assert PERSISTENT == ASYNC_PERSISTENT == 2
    assert "| `delivery_mode` | `2` (persistent)" in TEXT
    assert f"at most {MAX_MESSAGE_ID} bytes" in TEXT
    assert encode_body({"order_id": 42})[1] == JSON
    assert encode_body(b"x")[1] == BINARY
    states(JSON)
    states(BINARY)


# -- headers ----------------------------------------------------------------------------

_ROW = re.compile(r"^\| `(?P<header>[a-z][a-z0-9-]*)` \| (?P<type>[a-z]+) \|", re.MULTILINE)


def _table() -> dict[str, str]:
    section = TEXT.split("## Headers", 1)[1].split("\n## ", 1)[0]
    return {m["header"]: m["type"] for m in _ROW.finditer(section)}


def _written_headers() -> dict[str, object]:
    """Every header the code writes on a publish, a retry, a deferral and a park."""
    topology = load_topology(ORDERS)
    policy = QueuePolicy(topology, QUEUE)
    route = policy.router.resolve(policy.key, tier="30m")
    published = outgoing(route, b"{}", JSON, NOW, "order-42-timeout")
    written: dict[str, object] = dict(published.headers)
    env = Envelope.from_headers("order-42-timeout", published.headers)
    retry = decide(env, policy, ValueError("boom"), body=b"{}", content_type=JSON, now_ms=NOW)
    assert isinstance(retry, Republish)
    written.update(retry.outgoing.headers)
    deferred = decide(
        env, policy, ClaimResult.IN_PROGRESS, body=b"{}", content_type=JSON, now_ms=NOW, crashes=1
    )
    assert isinstance(deferred, Republish)
    written.update(deferred.outgoing.headers)
    last = Envelope.from_headers(
        "order-42-timeout", {**published.headers, h.H_ATTEMPT: policy.max_attempts}
    )
    parked = decide(last, policy, ValueError("boom"), body=b"{}", content_type=JSON, now_ms=NOW)
    assert isinstance(parked, Park)
    written.update(parked.outgoing.headers)
    rejected = decide(env, policy, Reject("no"), body=b"{}", content_type=JSON, now_ms=NOW)
    assert isinstance(rejected, Park)
    written.update(rejected.outgoing.headers)
    return written


def test_every_rd_header_is_in_the_table() -> None:
    table = _table()
    constants = {
        value for name, value in vars(h).items() if name.startswith("H_") and isinstance(value, str)
    }
    assert {c for c in constants if c.startswith("rd-")} == {
        k for k in table if k.startswith("rd-")
    }, "the header table and rabbit_delay._headers name different rd-* headers"
    for other in (h.H_PLUGIN_DELAY, h.H_TRACEPARENT, h.H_TRACESTATE):
        assert other in table
    for prefix in h.BROKER_HEADER_PREFIXES:
        assert prefix.rstrip("-") in TEXT


def test_each_header_has_the_type_of_what_the_code_writes() -> None:
    table = _table()
    written = _written_headers()
    assert {h.H_CRASHES, h.H_DEFERRALS, h.H_ERROR_TRACEBACK, h.H_PARK_REASON} <= set(written)
    words = {int: "integer", str: "string"}
    for header, value in written.items():
        assert header in table, f"the code writes {header}, the contract does not list it"
        assert table[header] == words[type(value)], (
            f"{header}: the page says {table[header]}, the code writes a {type(value).__name__}"
        )
    assert table[h.H_PLUGIN_DELAY] == "integer"
    assert table[h.H_TRACEPARENT] == table[h.H_TRACESTATE] == "string"


def test_what_a_worker_does_without_the_headers() -> None:
    """Absent headers: attempt 1, no due time; malformed ones are a decode error."""
    env = Envelope.from_headers(None, {})
    assert (env.attempt, env.due_at_ms, env.tier, env.message_id) == (1, None, None, None)
    assert "absent means 1" in FLAT
    policy = QueuePolicy(load_topology(ORDERS), QUEUE)
    copy = decide(env, policy, ValueError("boom"), body=b"{}", content_type=JSON, now_ms=NOW)
    assert isinstance(copy, Republish)
    assert copy.outgoing.message_id
    assert "gets a generated `message_id`" in FLAT


@pytest.mark.parametrize(
    ("headers", "body", "reason"),
    [
        ({h.H_ATTEMPT: "two"}, b'{"order_id": 1}', "decode_error"),
        ({h.H_DUE_AT: "soon"}, b'{"order_id": 1}', "decode_error"),
        ({}, b"not json", "decode_error"),
        ({}, b'{"order": "x"}', "validation_error"),
    ],
)
def test_what_is_parked_before_the_handler(
    headers: dict[str, object], body: bytes, reason: str
) -> None:
    from pydantic import BaseModel

    from rabbit_delay import App

    class CancelOrder(BaseModel):
        order_id: int

    app = App(load_topology(ORDERS))
    consumer = app.add_consumer(QUEUE, lambda msg: None, model=CancelOrder)
    action = consumer.prepare("m-1", headers, False, body, JSON, NOW)
    assert isinstance(action, Park)
    assert action.reason.value == reason
    assert f"`{reason}`" in TEXT
    assert "parked at once, reason `decode_error`, without running the handler" in FLAT
