"""The pure side of `rabbit-delay transfer`: what each pending message becomes in the
target topology (rabbit_delay/_ops/transfer/rules.py), and what the report says."""

from __future__ import annotations

import random
from typing import Any

import pytest

from rabbit_delay import ConfigError, Topology, topology_from_dict
from rabbit_delay import _headers as h
from rabbit_delay._broker import BrokerInfo
from rabbit_delay._durations import iso_ms
from rabbit_delay._envelope import BINARY, JSON
from rabbit_delay._ops.stored import Stored
from rabbit_delay._ops.transfer.rules import (
    Leave,
    Move,
    QueueTally,
    Source,
    SourceKind,
    Transfer,
    TransferReport,
    check_distinct,
    held_for_people,
    same_vhost,
    skip_reason,
    sources,
    stable_id,
    target_queues,
    transfer_notes,
)
from rabbit_delay._topology.delays import CASCADE, IMMEDIATE, shard_index

NOW = 1_800_000_000_000


def topo(version: int = 1, **overrides: Any) -> Topology:
    data: dict[str, Any] = {
        "namespace": "shop",
        "version": version,
        "tiers": {"10s": "10s", "1m": "1m", "5m": "5m"},
        "queues": {
            "orders.cancel": {},
            "push": {"bindings": ["push.any"]},
            "mail": {"bindings": ["push.any"]},
        },
    }
    data.update(overrides)
    return topology_from_dict(data)


@pytest.fixture
def v1() -> Topology:
    return topo(1)


@pytest.fixture
def v2() -> Topology:
    return topo(2, tiers={"5s": "5s", "30s": "30s", "2m": "2m", "10m": "10m"})


def pending(due_in_ms: int, *, target: str = "shop.v1.q.orders.cancel", **fields: Any) -> Stored:
    """A message in a v1 buffer, due `due_in_ms` after NOW, as the broker hands it out."""
    headers: dict[str, object] = {
        h.H_DUE_AT: NOW + due_in_ms,
        h.H_DELAY_MS: 300_000,
        h.H_TIER: "5m",
        h.H_ATTEMPT: 2,
        h.H_TARGET: target,
        h.H_CRASHES: 1,
        "tenant": "acme",
        "x-delivery-count": 3,
        "x-acquired-count": 4,
    }
    headers.update(fields.pop("headers", {}))
    base: dict[str, Any] = {
        "body": b'{"order_id": 42}',
        "message_id": "m-1",
        "content_type": JSON,
        "headers": headers,
        "exchange": "shop.v1.delay.5m",
        "routing_key": target,
        "timestamp": NOW // 1000 - 120,
    }
    base.update(fields)
    return Stored(**base)


BUFFER = Source(SourceKind.BUFFER, "shop.v1.delay.5m", "5m", 300_000)


def moved(decision: Move | Leave) -> Move:
    assert isinstance(decision, Move), decision
    return decision


def left(decision: Move | Leave) -> str:
    assert isinstance(decision, Leave), decision
    return decision.reason


# -- which queues are read, in which order ---------------------------------------------


def test_sources_cascade_top_down_then_tiers_shortest_first_then_business_queues() -> None:
    t = topo(
        tiers={"5m": "5m", "10s": "10s"},
        cascade={"levels": 3, "resolution": "1s"},
        scaling={"tier_shards": {"10s": 2}},
    )
    found = sources(t)
    assert [s.name for s in found] == [
        "shop.v1.cascade.02",
        "shop.v1.cascade.01",
        "shop.v1.cascade.00",
        "shop.v1.delay.10s",
        "shop.v1.delay.10s.1",
        "shop.v1.delay.5m",
        "shop.v1.q.orders.cancel",
        "shop.v1.q.push",
        "shop.v1.q.mail",
    ]
    assert [s.ttl_ms for s in found[:6]] == [4000, 2000, 1000, 10_000, 10_000, 300_000]
    assert [s.buffer for s in found] == [True] * 6 + [False] * 3
    assert found[-1].detail == "mail"
    assert all(s.kind is not SourceKind.READY for s in sources(t, ready=False))


def test_people_queues_and_target_queues(v2: Topology) -> None:
    assert held_for_people(v2) == (
        "shop.v2.parking.orders.cancel",
        "shop.v2.parking.push",
        "shop.v2.parking.mail",
        "shop.v2.unroutable",
    )
    wanted = target_queues(v2)
    assert "shop.v2.delay.5s" in wanted
    assert "shop.v2.q.mail" in wanted
    assert "shop.v2.unroutable" in wanted


# -- what a pending message becomes ------------------------------------------------------


def test_a_buffered_message_keeps_everything_and_waits_the_shortest_tier_not_shorter(
    v1: Topology, v2: Topology
) -> None:
    move = moved(Transfer(v1, v2).decide(pending(100_000), BUFFER, NOW))
    out = move.outgoing
    # 100 s remain: 2m is the shortest v2 tier not shorter, 20 s late
    assert (out.exchange, out.routing_key) == ("shop.v2.delay.2m", "shop.v2.q.orders.cancel")
    assert (move.tier, move.remaining_ms, move.added_ms, move.overdue_ms) == (
        "2m",
        100_000,
        20_000,
        0,
    )
    assert out.message_id == "m-1"
    assert out.body == b'{"order_id": 42}'
    assert out.content_type == JSON
    assert out.mandatory
    assert out.headers == {
        "tenant": "acme",
        h.H_CRASHES: 1,
        h.H_DUE_AT: NOW + 100_000,  # the due time is kept...
        h.H_DELAY_MS: 300_000,  # ...and the delay first asked for
        h.H_ATTEMPT: 2,
        h.H_TIER: "2m",  # the route in the target
        h.H_TARGET: "shop.v2.q.orders.cancel",
        h.H_ASKED_DUE_AT: NOW + 100_000,  # none carried: the due time is what was asked
    }
    assert out.timestamp == NOW // 1000  # when it entered the target (a buffer's age)
    assert move.destination == "shop.v2.q.orders.cancel (2m)"
    assert move.due_at_ms == NOW + 100_000


def test_an_exact_tier_adds_no_lateness(v1: Topology, v2: Topology) -> None:
    move = moved(Transfer(v1, v2).decide(pending(30_000), BUFFER, NOW))
    assert (move.tier, move.added_ms) == ("30s", 0)


def test_through_the_targets_cascade_the_due_time_is_exact(v1: Topology) -> None:
    target = topo(2, tiers={"1h": "1h"}, cascade={"levels": 20, "resolution": "1s"})
    move = moved(Transfer(v1, target).decide(pending(100_500), BUFFER, NOW))
    assert move.tier == CASCADE
    assert move.outgoing.exchange == "shop.v2.cascade.06.in"  # 101 units: highest bit 2^6
    assert move.added_ms == 500  # rounded up to the resolution, never down
    assert move.outgoing.headers[h.H_DUE_AT] == NOW + 100_500


def test_due_already_goes_to_the_due_exchange_now(v1: Topology, v2: Topology) -> None:
    move = moved(Transfer(v1, v2).decide(pending(-2_500), BUFFER, NOW))
    out = move.outgoing
    assert (out.exchange, out.routing_key) == ("shop.v2.due", "shop.v2.q.orders.cancel")
    assert (move.tier, move.added_ms, move.overdue_ms) == (IMMEDIATE, 0, 2_500)
    assert out.headers[h.H_DUE_AT] == NOW - 2_500


def test_never_early_whatever_remains(v1: Topology, v2: Topology) -> None:
    rules = Transfer(v1, v2)
    rng = random.Random(7)
    for remaining in [0, 1, 4_999, 5_000, 5_001, 599_999, 600_000] + [
        rng.randrange(-10_000, 600_000) for _ in range(500)
    ]:
        move = moved(rules.decide(pending(remaining), BUFFER, NOW))
        delay = 0 if move.tier == IMMEDIATE else v2.tiers[move.tier]
        assert delay >= remaining, (remaining, move.tier)
        assert move.added_ms == max(0, delay - max(remaining, 0))


def test_longer_than_every_target_tier_stays(v1: Topology) -> None:
    target = topo(2, tiers={"5s": "5s", "30s": "30s"})
    reason = left(Transfer(v1, target).decide(pending(200_000), BUFFER, NOW))
    assert "longest tier" in reason
    assert "it would arrive early" in reason
    assert "[cascade]" in reason
    assert str(NOW) not in reason  # one reason for all such messages: they are counted by it


def test_a_queue_the_target_does_not_have_stays(v1: Topology) -> None:
    target = topo(2, queues={"push": {"bindings": ["push.any"]}})
    reason = left(Transfer(v1, target).decide(pending(1_000), BUFFER, NOW))
    assert reason == "queue 'orders.cancel' is not in the target topology shop.v2"


def test_a_binding_key_stays_a_binding_key(v1: Topology, v2: Topology) -> None:
    move = moved(Transfer(v1, v2).decide(pending(20_000, target="push.any"), BUFFER, NOW))
    assert (move.outgoing.exchange, move.outgoing.routing_key) == ("shop.v2.delay.30s", "push.any")
    assert move.outgoing.headers[h.H_TARGET] == "push.any"
    target = topo(2, queues={"orders.cancel": {}})
    reason = left(Transfer(v1, target).decide(pending(20_000, target="push.any"), BUFFER, NOW))
    assert reason == "binding key 'push.any' is not in the target topology shop.v2"


def test_a_binding_key_with_a_target_cascade_uses_the_tiers(v1: Topology) -> None:
    # the cascade carries one queue's key only: a binding key waits in a tier
    target = topo(2, tiers={"1m": "1m"}, cascade={"levels": 10, "resolution": "1s"})
    move = moved(Transfer(v1, target).decide(pending(20_000, target="push.any"), BUFFER, NOW))
    assert (move.tier, move.added_ms) == ("1m", 40_000)


def test_a_tier_the_queue_does_not_accept_is_never_chosen(v1: Topology) -> None:
    target = topo(
        2,
        tiers={"5s": "5s", "30s": "30s", "2m": "2m"},
        queues={"orders.cancel": {"tiers": ["2m"]}, "push": {}, "mail": {}},
    )
    move = moved(Transfer(v1, target).decide(pending(20_000), BUFFER, NOW))
    assert move.tier == "2m"


def test_the_same_prefix_on_another_broker_maps_to_itself(v1: Topology) -> None:
    move = moved(Transfer(v1, v1).decide(pending(10_000), BUFFER, NOW))
    assert move.outgoing.routing_key == "shop.v1.q.orders.cancel"
    assert (move.tier, move.added_ms) == ("10s", 0)


def test_sharded_target_tier_picks_the_shard_of_the_id(v1: Topology) -> None:
    target = topo(2, tiers={"30s": "30s"}, scaling={"tier_shards": {"30s": 4}})
    for message_id in ("a", "b", "c", "d", "e"):
        move = moved(
            Transfer(v1, target).decide(pending(20_000, message_id=message_id), BUFFER, NOW)
        )
        shard = shard_index(message_id, 4)
        assert move.outgoing.exchange == target.names.tier_exchange("30s", shard)


def test_a_ready_message_goes_to_its_own_queue_alone_now(v1: Topology, v2: Topology) -> None:
    # a binding key reached two queues: each copy must reach only the queue it was in
    ready = Source(SourceKind.READY, "shop.v1.q.mail", "mail")
    msg = pending(-60_000, target="push.any", exchange="shop.v1.due", routing_key="push.any")
    move = moved(Transfer(v1, v2).decide(msg, ready, NOW))
    assert (move.outgoing.exchange, move.outgoing.routing_key) == ("shop.v2.due", "shop.v2.q.mail")
    assert (move.tier, move.added_ms, move.remaining_ms) == (IMMEDIATE, 0, 0)
    assert move.outgoing.headers[h.H_DUE_AT] == NOW - 60_000  # kept: how late it already is
    # a ready message of a queue the target lacks stays
    target = topo(2, queues={"push": {}})
    assert "'mail'" in left(Transfer(v1, target).decide(msg, ready, NOW))


def test_a_ready_message_without_rabbit_delay_headers_moves(v1: Topology, v2: Topology) -> None:
    ready = Source(SourceKind.READY, "shop.v1.q.push", "push")
    msg = Stored(body=b"raw", message_id="x", content_type=None, headers={})
    move = moved(Transfer(v1, v2).decide(msg, ready, NOW))
    assert move.outgoing.routing_key == "shop.v2.q.push"
    assert move.outgoing.content_type == BINARY
    assert move.outgoing.headers[h.H_DUE_AT] == NOW
    assert move.outgoing.headers[h.H_ATTEMPT] == 1


def test_a_buffered_message_without_a_due_time_stays(v1: Topology, v2: Topology) -> None:
    msg = pending(10_000)
    headers = dict(msg.headers)
    del headers[h.H_DUE_AT]
    reason = left(Transfer(v1, v2).decide(Stored(msg.body, "m", JSON, headers), BUFFER, NOW))
    assert "no rd-due-at" in reason


def test_malformed_headers_stay(v1: Topology, v2: Topology) -> None:
    msg = pending(10_000, headers={h.H_DUE_AT: "soon"})
    assert "malformed" in left(Transfer(v1, v2).decide(msg, BUFFER, NOW))


def test_a_buffered_message_without_rd_target_uses_its_routing_key(
    v1: Topology, v2: Topology
) -> None:
    msg = pending(10_000)
    headers = {k: v for k, v in msg.headers.items() if k != h.H_TARGET}
    bare = Stored(msg.body, "m", JSON, headers, routing_key="shop.v1.q.push")
    assert moved(Transfer(v1, v2).decide(bare, BUFFER, NOW)).outgoing.routing_key == (
        "shop.v2.q.push"
    )
    # a cascade key spells bits, not a destination: without rd-target it stays
    level = Source(SourceKind.CASCADE, "shop.v1.cascade.03", "03", 8000)
    cascaded = Stored(msg.body, "m", JSON, headers, routing_key="0.1.0.1.push")
    assert "no rd-target" in left(Transfer(v1, v2).decide(cascaded, level, NOW))


def test_a_delay_header_that_is_not_a_number_is_replaced(v1: Topology, v2: Topology) -> None:
    msg = pending(30_000, headers={h.H_DELAY_MS: "300000"})
    move = moved(Transfer(v1, v2).decide(msg, BUFFER, NOW))
    assert move.outgoing.headers[h.H_DELAY_MS] == 30_000  # the route's, as a publish sets it


def test_a_message_without_an_id_gets_the_same_id_on_every_read(v1: Topology, v2: Topology) -> None:
    first = moved(Transfer(v1, v2).decide(pending(10_000, message_id=None), BUFFER, NOW))
    again = moved(Transfer(v1, v2).decide(pending(10_000, message_id=None), BUFFER, NOW + 3_000))
    assert first.outgoing.message_id == again.outgoing.message_id
    assert first.outgoing.message_id == stable_id(pending(10_000, message_id=None))
    other = moved(
        Transfer(v1, v2).decide(pending(10_000, message_id=None, body=b"{}"), BUFFER, NOW)
    )
    assert other.outgoing.message_id != first.outgoing.message_id


def test_the_plugin_header_of_the_source_is_dropped(v1: Topology) -> None:
    target = topo(2, tiers={"1m": "1m"}, plugin={})
    msg = pending(30_000, headers={h.H_PLUGIN_DELAY: 300_000})
    move = moved(Transfer(v1, target).decide(msg, BUFFER, NOW))
    assert move.tier == "plugin"
    assert move.outgoing.headers[h.H_PLUGIN_DELAY] == 30_000  # the target route's own
    assert not move.outgoing.mandatory


# -- refusals and notes --------------------------------------------------------------------


def test_the_same_queues_are_refused(v1: Topology, v2: Topology) -> None:
    with pytest.raises(ConfigError, match=r"same topology 'shop\.v1'.*--to FILE.*--to-url"):
        check_distinct(v1, v1, same_broker=True)
    check_distinct(v1, v1, same_broker=False)  # a move to another broker
    check_distinct(v1, v2, same_broker=True)  # v1 -> v2


def test_same_vhost() -> None:
    a = BrokerInfo(cluster_name="rabbit@a")
    b = BrokerInfo(cluster_name="rabbit@b")
    here = ("127.0.0.1", 5672, "/")
    assert same_vhost(a, b, here, here)
    assert same_vhost(a, a, here, ("localhost", 5672, "/"))  # two addresses of one node
    assert not same_vhost(a, a, here, ("localhost", 5672, "other"))  # another vhost
    assert not same_vhost(a, b, here, ("127.0.0.1", 5743, "/"))
    unnamed = BrokerInfo()
    assert not same_vhost(unnamed, unnamed, here, ("127.0.0.1", 5743, "/"))


def test_skip_reasons() -> None:
    ready = Source(SourceKind.READY, "shop.v1.q.push", "push")
    assert skip_reason(BUFFER, 10, 0) is None
    assert skip_reason(BUFFER, None, 0) == "does not exist on the source broker"
    reason = skip_reason(BUFFER, 10, 2)
    assert reason is not None
    assert "2 consumer(s)" in reason
    assert "before they are due" in reason
    assert skip_reason(ready, 10, 1) == "1 consumer(s): its workers deliver these messages"


def test_notes(v1: Topology, v2: Topology) -> None:
    notes = transfer_notes(v1, v2)
    assert len(notes) == 1
    assert "shop.v2 has no [cascade]" in notes[0]
    # where a give-back counts towards the buffers' default delivery limit: 4.0-4.2
    on_40 = transfer_notes(v1, v2, BrokerInfo(version_text="4.0.5"))
    assert len(on_40) == 2
    assert "on RabbitMQ 4.0.5 each message a dry run reads" in on_40[0]
    assert "limit is 20" in on_40[0]
    for version in ("3.10.8", "4.3.6"):  # no limit / a multiple nack does not count
        assert transfer_notes(v1, v2, BrokerInfo(version_text=version)) == notes
    classic = topo(1, queue_type="classic")
    assert len(transfer_notes(classic, v2, BrokerInfo(version_text="4.0.5"))) == 1
    plugin = topo(1, plugin={})
    cascade = topo(2, cascade={"levels": 10})
    notes = transfer_notes(plugin, cascade)
    assert len(notes) == 1
    assert "cannot be read or moved" in notes[0]


# -- the report ------------------------------------------------------------------------------


def test_tally_and_report(v1: Topology, v2: Topology) -> None:
    rules = Transfer(v1, v2)
    report = TransferReport.start(rules, dry_run=False)
    assert [q.source for q in report.queues] == list(sources(v1))
    tally = next(q for q in report.queues if q.source == BUFFER)
    tally.ready = 4
    for due in (30_000, 100_000, -1_000):
        tally.record(rules.decide(pending(due), BUFFER, NOW))
    tally.record(Leave("queue 'x' is not in the target topology shop.v2"))
    assert (tally.moved, tally.left_count, tally.later) == (3, 1, 1)
    assert (tally.added_max_ms, tally.overdue_max_ms) == (20_000, 1_000)
    assert (tally.first_due_ms, tally.last_due_ms) == (NOW - 1_000, NOW + 100_000)
    assert tally.destinations == {
        "shop.v2.q.orders.cancel (30s)": 1,
        "shop.v2.q.orders.cancel (2m)": 1,
        "shop.v2.q.orders.cancel (now)": 1,
    }
    assert report.moved == 3
    assert report.added_max_ms == 20_000
    assert report.added_mean_ms == pytest.approx(20_000 / 3)
    assert report.left_lines() == [
        "1 in shop.v1.delay.5m: queue 'x' is not in the target topology shop.v2"
    ]
    assert not report.complete
    tally.left.clear()
    assert report.complete
    tally.remaining = 2  # still in the source at the end
    assert not report.complete
    tally.remaining = 0
    report.elapsed_s = 2.0
    data = report.as_json()
    assert data["ok"] is True
    assert data["moved"] == 3
    assert data["rate_msg_s"] == 1.5
    assert data["added_lateness"] == {
        "max": "20s",
        "max_ms": 20_000,
        "mean_ms": pytest.approx(6666.7),
        "later_than_due": 1,
    }
    assert data["notes"] == transfer_notes(v1, v2)
    [row] = data["queues"]
    assert row["queue"] == "shop.v1.delay.5m"
    assert row["ttl"] == "5m"
    assert (row["first_due"], row["last_due"]) == (iso_ms(NOW - 1_000), iso_ms(NOW + 100_000))
    report.error = "stopped"
    assert not report.complete


def test_a_limit_reached_is_done(v1: Topology, v2: Topology) -> None:
    report = TransferReport.start(Transfer(v1, v2), dry_run=False, limit=1)
    tally = report.queues[0]
    tally.remaining = 5
    assert not report.complete  # still in the source, and the limit not reached
    tally.record(Transfer(v1, v2).decide(pending(30_000), BUFFER, NOW))
    assert report.limit_reached
    assert report.complete
    assert report.as_json()["limit"] == 1
    tally.record(Leave("x"))
    assert not report.complete  # something was left in place


def test_a_skipped_buffer_counts_as_left_a_consumed_business_queue_does_not() -> None:
    buffer = QueueTally(BUFFER, ready=7, consumers=1)
    buffer.skip("1 consumer(s) on it take its messages before they are due", 7)
    assert buffer.left_count == 7
    buffer.remaining = 7
    assert buffer.pending_after == 7
    ready = QueueTally(Source(SourceKind.READY, "shop.v1.q.push", "push"), ready=5, consumers=2)
    ready.skip("2 consumer(s): its workers deliver these messages", 5)
    ready.remaining = 5
    assert (ready.left_count, ready.pending_after) == (0, 0)
    missing = QueueTally(BUFFER)
    missing.skip("does not exist on the source broker", None)
    assert (missing.left_count, missing.pending_after) == (0, 0)
