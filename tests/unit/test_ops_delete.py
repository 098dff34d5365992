"""The pure decision of `rabbit-delay delete` (rabbit_delay._ops.delete.rules): which objects,
in which order, what blocks it, and that nothing of another namespace or version is in."""

from __future__ import annotations

from rabbit_delay import Topology, topology_from_dict
from rabbit_delay._broker import QueueCounts
from rabbit_delay._ops.delete.rules import (
    Blocker,
    DeleteReport,
    Found,
    Target,
    blocks,
    decide,
    still_idle,
    targets,
)
from rabbit_delay._plan.desired import Desired, Kind, desired
from rabbit_delay._plan.diff import retired_shards


def topology(version: int = 1, **extra: object) -> Topology:
    data: dict[str, object] = {
        "namespace": "shop",
        "version": version,
        "tiers": {"1s": "1s", "3s": "3s"},
        "queues": {"orders": {}, "push": {"bindings": ["push.any"]}},
    }
    data.update(extra)
    return topology_from_dict(data)


def everything(want: Desired, **states: QueueCounts | None) -> Found:
    queues: dict[str, QueueCounts | None] = {
        q.name: QueueCounts(ready=0, consumers=0) for q in want.queues
    }
    queues.update(states)
    return Found(queues, {e.name: True for e in want.exchanges})


def test_every_object_of_the_topology_and_only_those() -> None:
    want = desired(topology())
    got = targets(want)
    assert {(t.kind, t.name) for t in got} == {
        *((Kind.QUEUE, q.name) for q in want.queues),
        *((Kind.EXCHANGE, e.name) for e in want.exchanges),
    }
    assert len(got) == len(want.queues) + len(want.exchanges)
    assert all(t.name.startswith("shop.v1.") for t in got)


def test_order_entries_first_then_queues_buffers_first_catch_all_last() -> None:
    t = topology(cascade={"levels": 3}, scaling={"tier_shards": {"1s": 2}})
    n = t.names
    order = [(x.kind, x.name) for x in targets(desired(t))]
    queues = [name for kind, name in order if kind is Kind.QUEUE]
    first_queue = order.index((Kind.QUEUE, queues[0]))
    entries = {name for kind, name in order[:first_queue]}
    assert entries == {
        n.tier_exchange("1s"),
        n.tier_exchange("1s", 1),
        n.tier_exchange("3s"),
        *(n.cascade_entry_exchange(level) for level in range(3)),
    }
    assert queues[:3] == [n.tier_queue("1s"), n.tier_queue("1s", 1), n.tier_queue("3s")]
    assert queues[-1] == n.unroutable_queue()
    last_queue = order.index((Kind.QUEUE, queues[-1]))
    rest = {name for _kind, name in order[last_queue + 1 :]}
    assert {n.due_exchange(), n.parking_exchange(), n.unroutable_exchange()} <= rest
    assert n.cascade_deliver_exchange() in rest


def test_the_plugin_exchange_is_an_entry() -> None:
    t = topology(plugin={})
    order = targets(desired(t))
    assert order[0] == Target(Kind.EXCHANGE, t.names.plugin_exchange())


def test_retired_shards_are_deleted_too_but_never_another_version() -> None:
    """A lowered shard count leaves shard 1 of tier 1s behind: it is deleted with the
    version; names of v2 and v10 of the same namespace are never picked up."""
    t = topology()
    want = desired(t)
    found_on_broker = ["shop.v1.delay.1s.1", "shop.v2.delay.1s.1", "shop.v10.delay.1s.1"]
    retired = retired_shards(want, found_on_broker, found_on_broker)
    assert [(i.kind, i.name) for i in retired] == [
        (Kind.EXCHANGE, "shop.v1.delay.1s.1"),
        (Kind.QUEUE, "shop.v1.delay.1s.1"),
    ]
    got = targets(want, retired)
    assert Target(Kind.QUEUE, "shop.v1.delay.1s.1", extra=True) in got
    assert Target(Kind.EXCHANGE, "shop.v1.delay.1s.1", extra=True) in got
    assert not any(x.name.startswith(("shop.v2.", "shop.v10.")) for x in got)


def test_a_drained_topology_is_deleted() -> None:
    want = desired(topology())
    plan = decide(want, everything(want))
    assert not plan.refused
    assert not plan.blocked
    assert not plan.missing
    assert len(plan.delete) == len(want.queues) + len(want.exchanges)


def test_a_queue_holding_messages_or_used_blocks_everything() -> None:
    t = topology()
    want = desired(t)
    n = t.names
    lot, business, buffer = n.parking_queue("orders"), n.business_queue("push"), n.tier_queue("3s")
    found = everything(
        want,
        **{
            lot: QueueCounts(ready=3, consumers=0),
            business: QueueCounts(ready=0, consumers=2),
            buffer: QueueCounts(ready=0, consumers=0, unacked=4, dead_lettering=1),
        },
    )
    plan = decide(want, found)
    assert plan.refused
    assert {b.name: b.reason for b in plan.blocked} == {
        buffer: "5 message(s) (4 unacked, 1 being dead-lettered)",
        business: "2 consumer(s)",
        lot: "3 message(s) (3 ready)",
    }
    assert [b.as_json()["messages"] for b in plan.blocked if b.name == lot] == [3]
    forced = decide(want, found, force=True)
    assert not forced.refused
    assert forced.blocked == plan.blocked  # still listed: what --force deletes with them
    report = DeleteReport(plan, dry_run=False)
    assert not report.ok
    data = report.as_json()
    assert (data["refused"], data["deleted"]) == (True, [])
    assert len(data["would_delete"]) == len(plan.delete)


def test_missing_objects_are_nothing_to_do() -> None:
    want = desired(topology())
    nothing = Found(dict.fromkeys((q.name for q in want.queues), None), {})
    plan = decide(want, nothing)
    assert not plan.delete
    assert not plan.refused
    assert len(plan.missing) == len(want.queues) + len(want.exchanges)
    assert DeleteReport(plan, dry_run=False).ok


def test_the_last_look_before_a_queue_goes() -> None:
    assert still_idle(None)
    assert still_idle(QueueCounts(ready=0, consumers=0))
    assert not still_idle(QueueCounts(ready=1, consumers=0))
    assert not still_idle(QueueCounts(ready=0, consumers=1))
    assert not blocks(QueueCounts(ready=0, consumers=0, unacked=0, dead_lettering=0))
    assert (
        Blocker("q", QueueCounts(ready=1, consumers=1)).reason
        == "1 message(s) (1 ready) and 1 consumer(s)"
    )
