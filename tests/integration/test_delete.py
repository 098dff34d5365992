"""`rabbit-delay delete FILE` on the real broker: refused while anything holds messages
or is in use (listed), `--dry-run`, `--force`, retired shards, and never an object of
another version of the same namespace."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pika
import pytest
from conftest import MakeTopology, unique_namespace

from rabbit_delay import Topology
from rabbit_delay._plan.desired import desired
from rabbit_delay.sync import Publisher, declare

from .test_ops import Ops, cli

pytestmark = pytest.mark.integration


def toml(topology: Topology, shards: int = 1, longer: str = "3s") -> str:
    scaling = f'[scaling]\ntier_shards = {{ "1s" = {shards} }}\n' if shards > 1 else ""
    return (
        f'namespace = "{topology.namespace}"\nversion = {topology.version}\n'
        f'[tiers]\n1s = "1s"\n{longer} = "{longer}"\n'
        '[queues."orders.cancel"]\n[queues.push]\nbindings = ["push.any"]\n' + scaling
    )


def write(tmp_path: Path, topology: Topology, shards: int = 1, longer: str = "3s") -> Path:
    path = tmp_path / f"{topology.names.prefix}.toml"
    path.write_text(toml(topology, shards, longer), encoding="utf-8")
    return path


def present(url: str, topology: Topology) -> dict[str, bool]:
    """Which of the topology's queues and exchanges exist ("queue NAME": bool ...)."""
    want = desired(topology)
    found: dict[str, bool] = {}
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        for kind, names in (
            ("queue", [q.name for q in want.queues]),
            ("exchange", [e.name for e in want.exchanges]),
        ):
            for name in names:
                channel = conn.channel()
                try:
                    if kind == "queue":
                        channel.queue_declare(name, passive=True)
                    else:
                        channel.exchange_declare(name, passive=True)
                    found[f"{kind} {name}"] = True
                    channel.close()
                except pika.exceptions.ChannelClosedByBroker:
                    found[f"{kind} {name}"] = False
    finally:
        conn.close()
    return found


def run_delete(path: Path, url: str, *extra: str) -> tuple[int, dict[str, Any]]:
    result = cli("delete", str(path), "--url", url, "--json", *extra)
    return result.exit_code, json.loads(result.stdout)


def test_refused_while_not_drained_then_deleted(
    make_topology: MakeTopology, tmp_path: Path, broker_url: str
) -> None:
    topology = make_topology()
    path = write(tmp_path, topology)
    ops = Ops(topology, path, broker_url)
    n = topology.names
    try:
        ops.park("orders.cancel", 2)
        with Publisher(topology, broker_url) as publisher:
            publisher.publish_delayed({"k": 1}, "3s", queue="push")  # waiting in a buffer
        consumer = ops.conn.channel()
        consumer.basic_consume(n.business_queue("push"), lambda *_: None)  # a running worker

        code, data = run_delete(path, broker_url)
        assert code == 1
        assert data["refused"] is True
        assert data["deleted"] == []
        blocked = {b["name"]: b for b in data["blocked"]}
        assert set(blocked) == {
            n.parking_queue("orders.cancel"),
            n.tier_queue("3s"),
            n.business_queue("push"),
        }
        assert blocked[n.parking_queue("orders.cancel")]["messages"] == 2
        assert blocked[n.tier_queue("3s")]["ready"] == 1
        assert blocked[n.business_queue("push")]["consumers"] == 1
        assert all(present(broker_url, topology).values())  # nothing was deleted

        text = cli("delete", str(path), "--url", broker_url)
        assert text.exit_code == 1
        assert f"{n.parking_queue('orders.cancel')}: 2 message(s) (2 ready)" in text.stdout
        assert f"{n.business_queue('push')}: 1 consumer(s)" in text.stdout
        assert "Nothing was deleted" in text.stdout
        assert "--force" in text.stdout

        # A dry run says the same, and with --force what would go with the messages.
        assert run_delete(path, broker_url, "--dry-run")[0] == 1
        code, dry = run_delete(path, broker_url, "--dry-run", "--force")
        assert code == 0
        assert dry["deleted"] == []
        assert len(dry["would_delete"]) == len(present(broker_url, topology))
        assert all(present(broker_url, topology).values())

        # Drained: the worker stopped, the buffer expired, the parked messages handled.
        consumer.close()
        ops.drain(n.parking_queue("orders.cancel"))
        ops.drain(n.tier_queue("3s"))
        ops.drain(n.business_queue("push"))
        code, done = run_delete(path, broker_url)
        assert code == 0, done
        assert done["ok"] is True
        assert len(done["deleted"]) == len(present(broker_url, topology))
        assert not any(present(broker_url, topology).values())
        # Publishers' entries went first, the catch-all's exchange among the last.
        order = [f"{d['kind']} {d['name']}" for d in done["deleted"]]
        assert order.index(f"exchange {n.tier_exchange('1s')}") < order.index(
            f"queue {n.tier_queue('1s')}"
        )
        assert order.index(f"queue {n.unroutable_queue()}") < order.index(
            f"exchange {n.unroutable_exchange()}"
        )
        again = cli("delete", str(path), "--url", broker_url)
        assert again.exit_code == 0
        assert "nothing to delete" in again.stdout
    finally:
        ops.close()


def test_another_version_of_the_namespace_is_never_touched(
    make_topology: MakeTopology, tmp_path: Path, broker_url: str
) -> None:
    """v1, v2 and v10 of one namespace: deleting v1 leaves v2 and v10 whole (v10's names
    start with "ns.v1" too)."""
    namespace = unique_namespace()
    v1, v2, v10 = (make_topology(namespace=namespace, version=v) for v in (1, 2, 10))
    with pika.BlockingConnection(pika.URLParameters(broker_url)) as conn:
        for topology in (v1, v2, v10):
            declare(conn, topology)
    code, data = run_delete(write(tmp_path, v1), broker_url, "--no-management")
    assert code == 0, data
    assert data["deleted"]
    assert all(d["name"].startswith(f"{namespace}.v1.") for d in data["deleted"])
    assert not any(present(broker_url, v1).values())
    for other in (v2, v10):
        assert all(present(broker_url, other).values()), other.names.prefix
        shown = cli("status", str(write(tmp_path, other)), "--url", broker_url, "--check")
        assert shown.exit_code == 0, shown.stdout
    # With the management API listing the vhost, the same.
    code, data = run_delete(write(tmp_path, v2), broker_url)
    assert code == 0, data
    assert all(d["name"].startswith(f"{namespace}.v2.") for d in data["deleted"])
    assert all(present(broker_url, v10).values())


def test_force_deletes_with_the_messages_and_the_retired_shards(
    make_topology: MakeTopology, tmp_path: Path, broker_url: str
) -> None:
    """Tier 1s had 2 shards, the topology now has 1: shard 1 is retired (`extra` in a
    plan), and deleted with the version; --force deletes a buffer that holds a message."""
    # The message waits in the 1h tier: in its buffer however long the two dry runs take (a
    # 3s tier's had moved on to its queue under load).
    topology = make_topology(tiers={"1s": "1s", "1h": "1h"}, scaling={"tier_shards": {"1s": 2}})
    with pika.BlockingConnection(pika.URLParameters(broker_url)) as conn:
        declare(conn, topology)
    lowered = write(tmp_path, topology, shards=1, longer="1h")
    retired = topology.names.tier_queue("1s", 1)
    with Publisher(topology, broker_url) as publisher:
        publisher.publish_delayed({"k": 1}, "1h", queue="push")
    for management in ([], ["--no-management"]):  # retired shards listed, or probed
        code, dry = run_delete(lowered, broker_url, "--dry-run", *management)
        assert code == 1
        extra = [t for t in dry["would_delete"] if t["extra"]]
        assert extra == [
            {"kind": "exchange", "name": retired, "extra": True},
            {"kind": "queue", "name": retired, "extra": True},
        ]
        assert [b["name"] for b in dry["blocked"]] == [topology.names.tier_queue("1h")]
    code, data = run_delete(lowered, broker_url, "--force")
    assert code == 0, data
    deleted = {f"{d['kind']} {d['name']}" for d in data["deleted"]}
    assert {f"queue {retired}", f"exchange {retired}"} <= deleted
    assert not any(present(broker_url, topology).values())  # shard 1 included
