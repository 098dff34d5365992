"""A client that is not Python, by the wire contract alone: Node.js with amqplib
(tests/interop/node/interop.js, installed by `npm ci` from its package-lock.json; .ci/test
and .ci/run install Node.js and run it).

- A Node publisher sends delayed JSON jobs as the contract says (persistent, message_id,
  content type application/json, the rd-* headers of `rabbit_delay._envelope.outgoing`,
  on a confirm channel, `mandatory`), to a tier exchange `<ns>.v1.delay.<tier>` with the
  business queue's key, and for a sharded tier to the shard its CRC-32 rule picks (the
  same rule as `rabbit_delay._topology.delays.shard_index`, reimplemented in JS): a
  rabbit-delay sync worker handles every job once, never early, lateness within a bound.
- rabbit-delay's `Publisher.publish_delayed` sends through a (sharded) tier and a Node
  consumer reads every message once, never early, with a readable `rd-due-at`.

Node declares nothing: the topology is declared by rabbit-delay and deleted after the
test (`make_topology`). The lateness figures are printed (`-s` shows them).
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from conftest import wait_for

from rabbit_delay import App, HandlerContext, Publisher, Topology
from rabbit_delay import _headers as h
from rabbit_delay._envelope import JSON, now_ms
from rabbit_delay._publishing.core import PublisherCore
from rabbit_delay._topology.delays import Router, shard_index
from rabbit_delay.stores import MemoryStore
from rabbit_delay.sync import connected, declare

from .workers.harness import RunningWorker

pytestmark = pytest.mark.integration

NODE_DIR = Path(__file__).resolve().parents[1] / "interop" / "node"
SCRIPT = NODE_DIR / "interop.js"
SHARDS = 3
TO_WORKER = 50  # jobs Node publishes (half through the sharded 1s tier, half through 2s)
TO_NODE = 20  # messages rabbit-delay publishes for the Node consumer
# Lateness bound (p99, and every message): a busy 2-core CI box running other suites.
# Measured: a few ms to a few tens of ms (the figures are printed).
P99_LATE_MS = 2_000
MAX_LATE_MS = 3_000


def node_binary() -> str:
    """Node.js and the package's amqplib, or the test fails saying how to install them
    (never skipped: .ci/test installs both)."""
    node = shutil.which("node") or shutil.which("nodejs")
    if node is None:
        pytest.fail(
            "Node.js is not installed: the interop test needs it (bash .ci/test installs "
            "Debian's nodejs and npm; or apt-get install nodejs npm)"
        )
    if not (NODE_DIR / "node_modules" / "amqplib" / "package.json").is_file():
        pytest.fail(
            f"amqplib is not installed in {NODE_DIR}: run `npm ci --prefix {NODE_DIR}` "
            "(bash .ci/test does)"
        )
    return node


def run_node(*args: str, stdin: str | None = None, timeout: float = 30) -> Any:
    done = subprocess.run(
        [node_binary(), str(SCRIPT), *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        cwd=NODE_DIR,
    )
    assert done.returncode == 0, f"interop.js {args[0]} failed:\n{done.stderr}"
    return json.loads(done.stdout.strip().splitlines()[-1])


@contextmanager
def node_consumer(
    url: str, queue: str, count: int, timeout_s: float
) -> Iterator[Callable[[], Any]]:
    """A Node consumer of `queue`, consuming once this enters; the function given waits
    for it to end (`count` messages, or `timeout_s`) and returns what it received."""
    proc = subprocess.Popen(
        [node_binary(), str(SCRIPT), "consume", url, queue, str(count), str(int(timeout_s * 1000))],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=NODE_DIR,
    )
    assert proc.stdout is not None
    assert proc.stderr is not None
    try:
        ready = proc.stdout.readline()
        assert ready.strip() == "ready", f"the Node consumer did not start: {proc.stderr.read()}"

        def result() -> Any:
            out, err = proc.communicate(timeout=timeout_s + 10)
            assert proc.returncode == 0, f"the Node consumer failed:\n{err}"
            return json.loads(out.strip().splitlines()[-1])

        yield result
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def figures(late_ms: list[int]) -> dict[str, int]:
    ordered = sorted(late_ms)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return {
        "n": len(ordered),
        "min": ordered[0],
        "p50": int(statistics.median(ordered)),
        "p99": p99,
        "max": ordered[-1],
    }


def check_lateness(what: str, late_ms: dict[str, int], broker: str) -> None:
    early = {i: ms for i, ms in late_ms.items() if ms < 0}
    assert not early, f"{what}: early by {early} ms"
    shown = figures(list(late_ms.values()))
    print(f"\n{what} on {broker}: lateness ms {shown}")
    assert shown["p99"] <= P99_LATE_MS, f"{what}: {shown}"
    assert shown["max"] <= MAX_LATE_MS, f"{what}: {shown}"


def interop_topology(make_topology: Callable[..., Topology]) -> Topology:
    return make_topology(
        tiers={"1s": "1s", "2s": "2s"},
        scaling={"tier_shards": {"1s": SHARDS}},
        queues={"jobs": {}, "node.inbox": {}},
    )


def test_node_and_python_pick_the_same_shard() -> None:
    ids = [uuid.uuid4().hex for _ in range(300)]
    ids += [f"order-{n}" for n in range(100)]
    ids += ["ünïcödé-✓", "x", "a" * 255, "order 1", "ÆØÅ/ß", "🐇-delay"]
    for shards in (2, SHARDS, 8, 32):
        assert run_node("shards", str(shards), *ids) == [shard_index(i, shards) for i in ids]
    assert run_node("shards", "1", "anything") == [0]


def test_a_node_publisher_by_the_contract_reaches_a_rabbit_delay_worker(
    make_topology: Callable[..., Topology], broker_url: str, broker_info: Any
) -> None:
    topology = interop_topology(make_topology)
    names = topology.names
    declare_on(broker_url, topology)
    app = App(topology, store=MemoryStore())
    seen: list[tuple[str, Any, int, HandlerContext]] = []
    lock = threading.Lock()

    @app.consumer("jobs")  # no model=: the annotation decides (issue 22)
    def handle(msg: dict[str, Any], ctx: HandlerContext) -> None:
        assert ctx.message_id is not None
        assert ctx.lateness_ms is not None
        with lock:
            seen.append((ctx.message_id, msg, ctx.lateness_ms, ctx))

    worker = RunningWorker("sync", app, broker_url).start()
    try:
        jobs = [
            {
                "message_id": f"node-{n}-{uuid.uuid4().hex[:8]}",
                "tier": tier,
                "tier_ms": topology.tiers[tier],
                "shards": topology.shards(tier),
                "queue": "jobs",
                "body": {"job": n, "by": "node", "text": "ünï ✓"},
            }
            for n in range(TO_WORKER)
            for tier in ["1s" if n % 2 == 0 else "2s"]
        ]
        spec = {"namespace": topology.namespace, "version": topology.version, "jobs": jobs}
        published = run_node("publish", broker_url, stdin=json.dumps(spec))
        assert published["returned"] == []  # every one routed to a buffer (mandatory)
        wait_for(lambda: len(seen) >= TO_WORKER, 15, f"{TO_WORKER} jobs handled")
        wait_for(lambda: worker.stats.acked == TO_WORKER, 5, "every job acked")
        time.sleep(0.3)  # a duplicate would be handled by now
    finally:
        worker.stop()

    by_id = {message_id: (msg, late, ctx) for message_id, msg, late, ctx in seen}
    assert len(seen) == len(by_id) == TO_WORKER, "a job handled twice, or one lost"
    jobs_by_id = {job["message_id"]: job for job in jobs}
    assert set(by_id) == set(jobs_by_id)
    router = Router(topology)
    python_headers = set(outgoing_headers(topology))  # what a Python publish sets
    for sent in published["sent"]:
        message_id = sent["message_id"]
        job = jobs_by_id[message_id]
        msg, _late, ctx = by_id[message_id]
        assert msg == job["body"]  # a dict, decoded by the handler's annotation
        assert (ctx.tier, ctx.attempt, ctx.queue) == (job["tier"], 1, "jobs")
        assert ctx.scheduled_at is not None
        assert int(ctx.headers[h.H_DUE_AT]) == sent["due_at"]
        assert python_headers <= set(ctx.headers), "Node sent every header a Python publish does"
        # The exchange Node chose is the one rabbit-delay's router picks, and the buffer
        # the broker dead-lettered it from is that shard's.
        route = router.resolve(names.queue_key("jobs"), tier=job["tier"])
        assert sent["exchange"] == route.exchange_for(message_id)
        buffers = topology.tier_queues(job["tier"])
        assert death_queue(ctx.headers) == buffers[shard_index(message_id, len(buffers))]
    used = {death_queue(ctx.headers) for _msg, _late, ctx in by_id.values()}
    assert set(topology.tier_queues("1s")) <= used, f"a shard of 1s got nothing: {used}"
    check_lateness(
        "Node -> rabbit-delay worker",
        {message_id: late for message_id, (_m, late, _c) in by_id.items()},
        broker_info.describe(),
    )
    assert (worker.stats.parked, worker.stats.retried, worker.stats.duplicate) == (0, 0, 0)


def test_a_node_consumer_reads_what_rabbit_delay_published(
    make_topology: Callable[..., Topology], broker_url: str, broker_info: Any
) -> None:
    topology = interop_topology(make_topology)
    declare_on(broker_url, topology)
    queue = topology.names.business_queue("node.inbox")
    with node_consumer(broker_url, queue, TO_NODE, timeout_s=12) as received:
        bodies = [{"n": n, "by": "python", "text": "ünï ✓"} for n in range(TO_NODE)]
        before = now_ms()
        with Publisher(topology, broker_url) as publisher:
            ids = [publisher.publish_delayed(b, "1s", queue="node.inbox") for b in bodies]
        after = now_ms()
        result = received()

    got = result["received"]
    assert result["why"] == "count", result["why"]
    assert len(got) == TO_NODE, "a message read twice (or beyond the count)"
    by_id = {m["message_id"]: m for m in got}
    assert set(by_id) == set(ids)
    tier_ms = topology.tiers["1s"]
    late: dict[str, int] = {}
    for message_id, body in zip(ids, bodies, strict=True):
        message = by_id[message_id]
        headers = message["headers"]
        due = headers[h.H_DUE_AT]
        assert isinstance(due, int), f"rd-due-at read by Node as {due!r}"
        assert before + tier_ms <= due <= after + tier_ms
        assert headers[h.H_TIER] == "1s"
        assert headers[h.H_ATTEMPT] == 1
        assert headers[h.H_TARGET] == topology.names.queue_key("node.inbox")
        assert message["delivery_mode"] == 2  # persistent
        assert message["content_type"] == JSON
        assert message["redelivered"] is False
        assert json.loads(message["body"]) == body
        late[message_id] = message["received_at"] - due
    check_lateness("rabbit-delay publisher -> Node consumer", late, broker_info.describe())


# -- helpers -------------------------------------------------------------------------------


def declare_on(url: str, topology: Topology) -> None:
    with connected(url, name="rd-test interop declare") as connection:
        declare(connection, topology)


def outgoing_headers(topology: Topology) -> dict[str, object]:
    """The headers a Python publish of a delayed message sets (`_envelope.outgoing`)."""
    return PublisherCore(topology).prepare({}, "1s", queue="jobs").headers


def death_queue(headers: Any) -> str:
    """The queue the broker dead-lettered a message from (its latest x-death entry)."""
    queue = headers["x-death"][0]["queue"]
    return queue.decode() if isinstance(queue, bytes) else str(queue)
