"""Sharded tiers and placement arguments on the broker under test.

One tier of 4 buffers (1 s): messages published by both publishers are spread over the
shards by message_id, every one arrives in its business queue, never before its
`rd-due-at`, through the buffer its id hashes to (the broker's `x-death` record names
the buffer a message was dead-lettered from). A worker's retries (both workers) and
`replay --tier` of parked messages take the same shards, and `status` lists every
shard. Then: `plan` is clean, a lowered shard
count leaves the buffers past it as `extra`, and placement arguments are declared on
new queues but never a conflict on existing ones.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import message_count, wait_for

from rabbit_delay import App, HandlerContext, Topology
from rabbit_delay import _headers as h
from rabbit_delay._io.management import read_observed
from rabbit_delay._ops.replay.execute import replay_parked
from rabbit_delay._ops.status.execute import read_status
from rabbit_delay._ops.status.rules import QueueRole
from rabbit_delay._plan.desired import Kind
from rabbit_delay._plan.diff import Change
from rabbit_delay._topology.delays import shard_index
from rabbit_delay._urls import ManagementEndpoint
from rabbit_delay.stores import MemoryStore
from rabbit_delay.sync import connect

from ._publishers import Collector, Transport, broker_state, open_transport, queue_info
from .workers.harness import KINDS, RunningWorker

pytestmark = pytest.mark.integration

SHARDS = 4
PER_PUBLISHER = 150  # publish_many per transport, plus a few publish_delayed
RETRIED = 40  # messages a worker fails twice (a retry through the tier, then parked)


@pytest.fixture
def transports(broker_url: str) -> Iterator[dict[str, Transport]]:
    with open_transport("sync", broker_url) as sync, open_transport("aio", broker_url) as aio:
        yield {"sync": sync, "aio": aio}


def sharded_topology(make_topology: Any, namespace: str | None = None, **scaling: Any) -> Topology:
    """The conftest topology with `SHARDS` buffers for its 1 s tier (`scaling` overrides);
    in `namespace` to stand for another version of the same topology. Each is deleted
    after the test (make_topology), shards included."""
    more = {"namespace": namespace} if namespace is not None else {}
    topology: Topology = make_topology(
        scaling={"tier_shards": {"1s": SHARDS}, **scaling},
        **more,
    )
    return topology


def death_queue(headers: dict[str, Any]) -> str:
    """The queue the broker dead-lettered a message from (its latest x-death entry)."""
    deaths = headers["x-death"]
    queue = deaths[0]["queue"]
    return queue.decode() if isinstance(queue, bytes) else str(queue)


def test_a_sharded_tier_spreads_by_id_and_delivers_every_message_on_time(
    transports: dict[str, Transport],
    make_topology: Any,
    broker_url: str,
    management: ManagementEndpoint,
) -> None:
    topology = sharded_topology(make_topology)
    shards = topology.tier_queues("1s")
    assert len(shards) == SHARDS
    transports["sync"].declare(topology)
    business = topology.names.business_queue("orders.cancel")

    with Collector(broker_url, [business]) as collector:
        ids: list[str] = []
        for kind, transport in transports.items():
            publisher = transport.publisher(topology)
            ids += publisher.publish_many(
                [{"n": i, "by": kind} for i in range(PER_PUBLISHER)], "1s", queue="orders.cancel"
            )
            ids += [
                publisher.publish_delayed(
                    {"one": i}, "1s", queue="orders.cancel", message_id=f"{kind}-{i}"
                )
                for i in range(5)
            ]
        collector.wait_for(ids, timeout=20)

    assert len(set(ids)) == len(ids) == 2 * (PER_PUBLISHER + 5)
    arrivals = {a.message_id: a for a in collector.arrivals}
    assert set(arrivals) == set(ids), "lost or foreign messages"
    through: Counter[str] = Counter()
    for message_id, arrival in arrivals.items():
        headers = arrival.headers
        due = int(headers[h.H_DUE_AT])
        assert arrival.arrived_ms >= due, (
            f"{message_id} arrived {due - arrival.arrived_ms} ms early"
        )
        assert headers[h.H_TIER] == "1s"  # the tier, never the shard
        buffer = death_queue(headers)
        assert buffer == shards[shard_index(message_id, SHARDS)], message_id
        through[buffer] += 1
    assert set(through) == set(shards), f"a shard got nothing: {through}"

    # Everything in place, via the management API and via passive declares: no extra.
    observed = read_observed(management, topology.names.prefix + ".")
    for plan in (
        transports["sync"].plan(topology, observed=observed),
        transports["aio"].plan(topology),
    ):
        assert plan.in_sync, plan.pending
        assert not [i for i in plan.items if i.action is Change.EXTRA]
        buffers = {i.name for i in plan.items if i.kind is Kind.QUEUE and ".delay.1s" in i.name}
        assert buffers == set(shards)
    # Each shard is its own quorum buffer with the tier's TTL and due exchange, placed.
    for name in shards:
        arguments = queue_info(management, name)["arguments"]
        assert arguments["x-message-ttl"] == 1000
        assert arguments["x-dead-letter-exchange"] == topology.names.due_exchange()
        assert arguments["x-queue-leader-locator"] == "balanced"


@pytest.mark.parametrize("use_management", [True, False], ids=["management", "passive"])
def test_a_lowered_shard_count_leaves_the_retired_buffers_as_extra(
    transports: dict[str, Transport],
    make_topology: Any,
    management: ManagementEndpoint,
    use_management: bool,
) -> None:
    topology = sharded_topology(make_topology)
    transport = transports["sync"]
    transport.declare(topology)
    lowered = sharded_topology(make_topology, topology.namespace, tier_shards={"1s": 2})
    observed = read_observed(management, topology.names.prefix + ".") if use_management else None
    plan = transport.plan(lowered, observed=observed)
    extra = {(i.kind, i.name) for i in plan.items if i.action is Change.EXTRA}
    retired = topology.tier_queues("1s")[2:]
    assert extra == {(kind, name) for name in retired for kind in (Kind.EXCHANGE, Kind.QUEUE)}
    assert plan.in_sync  # declare has nothing to do: it never deletes a buffer
    # declare leaves them alone
    transport.declare(lowered, observed=observed)
    state = broker_state(management, topology.names.prefix + ".")
    assert set(retired) <= set(state.queues)


@pytest.mark.parametrize("kind", ["sync", "aio"])
def test_placement_added_to_an_existing_topology_is_never_a_conflict(
    transports: dict[str, Transport],
    make_topology: Any,
    management: ManagementEndpoint,
    kind: str,
) -> None:
    """Queues created without placement, then the topology asks for it: with the
    management API and with re-declares (whatever the broker checks), declare finds
    everything in place; new queues (an added shard) get the placement arguments."""
    before = sharded_topology(make_topology, leader_locator="broker")
    transport = transports[kind]
    transport.declare(before)
    assert (
        "x-queue-leader-locator"
        not in queue_info(management, before.tier_queues("1s")[0])["arguments"]
    )
    after = sharded_topology(
        make_topology, before.namespace, tier_shards={"1s": SHARDS + 1}, replicas=1
    )
    for observed in (read_observed(management, before.names.prefix + "."), None):
        report = transport.declare(after, observed=observed)
        queues = [i for i in report.items if i.kind is Kind.QUEUE]
        added = after.tier_queues("1s")[-1]
        assert {i.action for i in queues if i.name != added} == {Change.IN_PLACE}
    existing = queue_info(management, before.tier_queues("1s")[0])["arguments"]
    assert "x-queue-leader-locator" not in existing  # never changed in place
    new = queue_info(management, added)["arguments"]
    assert new["x-queue-leader-locator"] == "balanced"
    assert new["x-quorum-initial-group-size"] == 1
    plan = transport.plan(after, observed=read_observed(management, before.names.prefix + "."))
    assert plan.in_sync
    notes = [n for i in plan.items for n in i.notes]
    assert any("x-queue-leader-locator unset on the broker" in n for n in notes)


@pytest.mark.parametrize("kind", KINDS)
def test_retries_replays_and_status_go_through_the_shard_of_each_id(
    kind: str,
    transports: dict[str, Transport],
    make_topology: Any,
    broker_url: str,
) -> None:
    """A worker's retries through a sharded tier, then `replay --tier` of the parked
    messages: each copy is dead-lettered by the buffer its id hashes to (x-death), every
    shard is used, nothing is lost; `status` lists every shard as a tier buffer."""
    topology = make_topology(
        tiers={"1s": "1s"},
        queues={"orders.cancel": {"retry": {"tiers": ["1s"], "max_attempts": 2}}},
        scaling={"tier_shards": {"1s": SHARDS}},
    )
    shards = topology.tier_queues("1s")
    transports["sync"].declare(topology)
    queue = "orders.cancel"

    retried: dict[str, str] = {}  # message_id -> the buffer its retry came from

    def always_fails(message: Any, ctx: HandlerContext) -> None:
        if ctx.attempt == 2:
            retried[ctx.message_id] = death_queue(dict(ctx.headers))
        raise ValueError("payment service down")

    app = App(topology, store=MemoryStore())
    app.add_consumer(queue, always_fails)
    worker = RunningWorker(kind, app, broker_url).start()
    try:
        ids = (
            transports["sync"]
            .publisher(topology)
            .publish_many([{"n": i} for i in range(RETRIED)], "1s", queue=queue)
        )
        parking = topology.names.parking_queue(queue)
        wait_for(lambda: message_count(broker_url, parking) == RETRIED, 30, "every id parked")
    finally:
        worker.stop()
    assert set(retried) == set(ids), "a retry was lost or not seen"
    for message_id, buffer in retried.items():
        assert buffer == shards[shard_index(message_id, SHARDS)], message_id
    assert set(retried.values()) == set(shards), "a shard got no retry"

    # `status`: every shard is a tier buffer of the topology, each one read.
    status = read_status(topology, [broker_url], no_management=True)
    buffers = [r.name for r in status.rows if r.role is QueueRole.BUFFER]
    assert buffers == list(shards)
    assert all(r.exists for r in status.rows if r.role is QueueRole.BUFFER)

    # `replay --tier 1s`: every parked message back through the shard of its id.
    business = topology.names.business_queue(queue)
    with Collector(broker_url, [business]) as collector:
        connection = connect(broker_url)
        try:
            report = replay_parked(connection, topology, queue, tier="1s")
        finally:
            connection.close()
        assert report.error is None, report.error
        collector.wait_for(ids, timeout=20)
    replayed = {a.message_id: death_queue(a.headers) for a in collector.arrivals}
    assert set(replayed) == set(ids)
    for message_id, buffer in replayed.items():
        assert buffer == shards[shard_index(message_id, SHARDS)], message_id
