"""`rabbit-delay dashboard`'s JSON API against the real broker: depths and what needs
attention, parked pages, replay and purge with and without the token, read-only mode,
auth, one broker read per refresh interval whatever the number of clients, and 10,000
parked messages in a topology of 51 queues: browsed fast, nothing lost or reordered.

The dashboard runs in-process (`serve` on a free port), as the command runs it; the
command itself is started once, as a process (test_the_command_starts_and_says_so).
"""

from __future__ import annotations

import base64
import json
import logging
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pika
import pytest
from conftest import MakeTopology, message_count, wait_for

from rabbit_delay import Topology
from rabbit_delay import _headers as h
from rabbit_delay._envelope import JSON, Outgoing
from rabbit_delay._ops.dashboard.execute import BrokerBackend
from rabbit_delay._ops.dashboard.rules import TOKEN_HEADER, Auth
from rabbit_delay._ops.dashboard.server import Dashboard, serve
from rabbit_delay._schedule.records import ScheduleState
from rabbit_delay.sync import Publisher, Schedule, connected, declare

pytestmark = pytest.mark.integration

SECRET = "s3cret-pw"
T0 = 1_700_000_000_000


# -- a dashboard on a declared topology ---------------------------------------------------


@dataclass
class Answer:
    code: int
    headers: dict[str, str]
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode()

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class Running:
    board: Dashboard
    backend: BrokerBackend
    base: str
    topology: Topology
    url: str

    def get(self, path: str, headers: dict[str, str] | None = None) -> Answer:
        return self.request("GET", path, headers=headers)

    def post(
        self, path: str, data: dict[str, str], *, token: bool = True, **headers: str
    ) -> Answer:
        sent = dict(headers)
        if token:
            sent[TOKEN_HEADER] = self.board.token
        return self.request("POST", path, data=data, headers=sent)

    def request(
        self,
        method: str,
        path: str,
        *,
        data: dict[str, str] | None = None,
        headers: dict[str, str] | None = None,
    ) -> Answer:
        body = None
        sent = dict(headers or {})
        if data is not None:
            body = json.dumps(data).encode()
            sent["Content-Type"] = "application/json"
        req = urllib.request.Request(self.base + path, data=body, headers=sent, method=method)
        try:
            with urllib.request.urlopen(req, timeout=60) as answer:
                return Answer(answer.status, dict(answer.headers), answer.read())
        except urllib.error.HTTPError as exc:
            with exc:  # an unclosed socket would be a ResourceWarning (an error here)
                return Answer(exc.code, dict(exc.headers), exc.read())

    def count(self, queue: str) -> int:
        return message_count(self.url, queue)


Start = Callable[..., Running]


@contextmanager
def dashboards(broker_url: str) -> Iterator[Start]:
    """start(topology, **Dashboard options): declared, served on a free port, stopped
    at the end (the topology itself is deleted by make_topology)."""
    servers = []
    backends = []

    def start(topology: Topology, *, refresh_s: float = 30.0, **options: Any) -> Running:
        with connected(broker_url, name="rabbit-delay test declare") as connection:
            declare(connection, topology)
        backend = BrokerBackend(topology, [broker_url], every=refresh_s)
        backends.append(backend)
        board = Dashboard(backend, refresh_s=refresh_s, **options)
        server, _thread = serve(board, "127.0.0.1", 0)
        servers.append(server)
        base = f"http://127.0.0.1:{server.server_port}"
        return Running(board, backend, base, topology, broker_url)

    try:
        yield start
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()
        for backend in backends:  # the schedule's store, when one was opened
            backend.close()


@pytest.fixture
def dashboard(broker_url: str) -> Iterator[Start]:
    with dashboards(broker_url) as start:
        yield start


def parked(topology: Topology, queue: str, n: int, *, prefix: str = "p") -> list[Outgoing]:
    """`n` messages parked for `queue` as the worker parks them."""
    names = topology.names
    return [
        Outgoing(
            exchange=names.parking_exchange(),
            routing_key=names.queue_key(queue),
            body=json.dumps({"n": i}).encode(),
            message_id=f"{prefix}{i:05d}",
            content_type=JSON,
            headers={
                h.H_ATTEMPT: 3,
                h.H_TARGET: names.queue_key(queue),
                h.H_ERROR_TYPE: "ValueError",
                h.H_ERROR_MESSAGE: f"boom {i}",
                h.H_ERROR_TRACEBACK: f"Traceback (most recent call last):\nValueError: boom {i}",
                h.H_ORIGINAL_QUEUE: queue,
                h.H_FIRST_FAILURE: T0 + i,
                h.H_LAST_FAILURE: T0 + 60_000 + i,
                h.H_PARK_REASON: "max_attempts",
            },
            mandatory=True,
            timestamp=T0 // 1000,
        )
        for i in range(n)
    ]


def park(url: str, topology: Topology, queue: str, n: int, **kw: Any) -> list[str]:
    with Publisher(topology, url=url) as publisher:
        return publisher.publish_outgoing(parked(topology, queue, n, **kw))


def drain_ids(url: str, queue: str, expected: int) -> list[str | None]:
    """Consume every message of `queue` (acked), in queue order."""
    got: list[str | None] = []
    with connected(url, name="rabbit-delay test drain") as connection:
        channel = connection.channel()
        channel.basic_qos(prefetch_count=1000)
        deadline = time.monotonic() + 60
        for method, props, _body in channel.consume(queue, inactivity_timeout=2):
            if method is None:
                break
            got.append(props.message_id)
            channel.basic_ack(method.delivery_tag)
            if len(got) >= expected or time.monotonic() > deadline:
                break
        channel.cancel()
    return got


# -- what it shows ---------------------------------------------------------------------


def test_the_snapshot_shows_depths_tiers_and_what_needs_attention(
    make_topology: MakeTopology, dashboard: Start, broker_url: str
) -> None:
    topology = make_topology(tiers={"1m": "1m", "5m": "5m"})
    run = dashboard(topology)
    n = topology.names
    with Publisher(topology, url=broker_url) as publisher:
        publisher.publish_many([{"i": i} for i in range(3)], "5m", queue="push")
    park(broker_url, topology, "orders.cancel", 2)
    snap = run.get("/api/snapshot").json()
    rows = {row["name"]: row for row in snap["status"]["queues"]}
    assert rows[n.tier_queue("5m")]["ready"] == 3
    assert rows[n.tier_queue("1m")]["ready"] == 0
    assert rows[n.parking_queue("orders.cancel")]["ready"] == 2
    assert rows[n.parking_queue("orders.cancel")]["attention"]
    subjects = [item["subject"] for item in snap["status"]["attention_items"]]
    assert subjects == [n.parking_queue("orders.cancel")]  # the rules of status --check
    tiers = {tier["name"]: tier for tier in snap["tiers"]}
    assert tiers[n.tier_queue("5m")]["waiting"] == 3
    assert snap["status"]["broker_version"]
    picture = {node["key"]: node for node in snap["picture"]}
    assert picture[n.tier_queue("5m")]["ready"] == 3
    assert picture[n.parking_queue("orders.cancel")]["attention"]
    # The page: the same figures, the broker named, its password not.
    html = run.get("/").text
    assert "ready 3" in html
    assert f'data-q="{n.tier_queue("5m")}"' in html
    assert snap["status"]["broker_version"] in html
    password = broker_url.split("@")[0].rsplit(":", 1)[1]
    assert f":{password}@" not in html + json.dumps(snap)
    assert ":***@" in html


def test_parked_pages_and_detail_lose_and_reorder_nothing(
    make_topology: MakeTopology, dashboard: Start, broker_url: str
) -> None:
    topology = make_topology()
    run = dashboard(topology, refresh_s=1.0)
    ids = park(broker_url, topology, "push", 120)
    page = run.get("/api/parked/push?offset=50&limit=50").json()
    assert [m["message_id"] for m in page["messages"]] == ids[50:100]
    assert (page["total"], page["next_offset"]) == (120, 100)
    first = page["messages"][0]
    assert (first["reason"], first["error_type"], first["error_message"]) == (
        "max_attempts",
        "ValueError",
        "boom 50",
    )
    assert (first["attempts"], first["first_failure"]) == (3, "2023-11-14T22:13:20.050Z")
    assert len(run.get("/api/parked/push").json()["messages"]) == 50
    detail = run.get(f"/api/parked/push/{ids[7]}").json()
    (copy,) = detail["copies"]
    assert copy["traceback"].endswith("ValueError: boom 7")
    assert copy["body"]["text"] == '{\n  "n": 7\n}'
    assert run.get("/api/parked/push/nope").code == 404
    assert run.get("/api/parked/nosuchqueue").code == 400  # not in the topology
    html = run.get("/parked/push?offset=100").text
    assert "messages 100-119 of 120" in html
    time.sleep(1.1)  # past the refresh interval: the lot is peeked again
    assert run.get("/api/parked/push?limit=500").json()["total"] == 120
    assert drain_ids(broker_url, topology.names.parking_queue("push"), 120) == ids


# -- actions ----------------------------------------------------------------------------


def test_read_only_refuses_every_action(
    make_topology: MakeTopology, dashboard: Start, broker_url: str
) -> None:
    topology = make_topology()
    run = dashboard(topology)
    park(broker_url, topology, "push", 3)
    lot = topology.names.parking_queue("push")
    for path, data in (
        ("/api/replay", {"queue": "push"}),
        ("/api/purge", {"queue": "push", "confirm": "push"}),
    ):
        refused = run.post(path, data)
        assert refused.code == 403
        assert "--allow-actions" in refused.json()["error"]
        assert run.get(path).code == 405
    assert run.count(lot) == 3


def test_replay_and_purge_need_the_token(
    make_topology: MakeTopology,
    dashboard: Start,
    broker_url: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    topology = make_topology(tiers={"1s": "1s", "1m": "1m"})
    run = dashboard(topology, allow_actions=True, refresh_s=1.0)
    n = topology.names
    lot, business = n.parking_queue("push"), n.business_queue("push")
    ids = park(broker_url, topology, "push", 40)
    assert run.post("/api/replay", {"queue": "push"}, token=False).code == 403
    assert (
        run.post("/api/replay", {"queue": "push"}, token=False, **{TOKEN_HEADER: "x"}).code == 403
    )
    assert run.get("/api/replay").code == 405
    assert run.count(lot) == 40
    with caplog.at_level(logging.INFO, logger="rabbit_delay.dashboard"):
        # One message, by id: the others stay, in their order.
        one = run.post("/api/replay", {"queue": "push", "message_id": ids[5]})
        assert one.code == 200, one.text
        assert one.json()["message_ids"] == [ids[5]]
        assert wait_for(lambda: run.count(business) == 1, 10, "the replayed message")
        assert run.count(lot) == 39
        left = run.get("/api/parked/push?limit=100").json()
        assert [m["message_id"] for m in left["messages"]] == ids[:5] + ids[6:]
        # Not there: nothing moved.
        assert run.post("/api/replay", {"queue": "push", "message_id": "nope"}).code == 404
        # The whole lot, through a tier.
        lot_replay = run.post("/api/replay", {"queue": "push", "tier": "1m"})
        assert lot_replay.json()["moved"] == 39
        assert run.count(n.tier_queue("1m")) == 39
        assert run.count(lot) == 0
        # Purge: confirmed by the queue's name only.
        park(broker_url, topology, "push", 4, prefix="again")
        assert run.post("/api/purge", {"queue": "push"}).code == 400
        assert run.post("/api/purge", {"queue": "push", "confirm": "push"}, token=False).code == 403
        assert run.count(lot) == 4
        purged = run.post("/api/purge", {"queue": "push", "confirm": "push"})
        assert purged.json() == {"parking_queue": lot, "purged": 4}
        assert run.count(lot) == 0
    logged = caplog.text
    assert f"replay from {lot} of message {ids[5]} now: 1 moved" in logged
    assert "through tier 1m: 39 moved" in logged
    assert f"purged 4 message(s) from {lot}" in logged
    assert "missing or wrong action token" in logged
    assert run.board.token not in logged


# -- the schedule ---------------------------------------------------------------------------


def scheduled_topology(make_topology: MakeTopology, tmp_path: Path, **extra: Any) -> Topology:
    """A topology with [schedule], its records in a SQLite file of the test's own."""
    return make_topology(
        tiers={"1m": "1m", "10m": "10m", "1h": "1h"},
        schedule={},
        idempotency={"path": str(tmp_path / "idem.sqlite3")},
        **extra,
    )


def test_the_schedule_timeline_and_a_key_record(
    make_topology: MakeTopology, dashboard: Start, broker_url: str, tmp_path: Path
) -> None:
    topology = scheduled_topology(make_topology, tmp_path)
    run = dashboard(topology, refresh_s=1.0)
    with Publisher(topology, url=broker_url) as publisher:
        publisher.publish_many(
            [{"i": i} for i in range(3)], "10m", queue="push", keys=["a", "b", "c"]
        )
        publisher.publish_delayed({"i": 8}, "1m", queue="push", key="soon")
        publisher.publish_delayed({"order": 9}, "1h", queue="orders.cancel", key="order-9")
    data = run.get("/api/schedule").json()
    assert (data["error"], data["span_ms"], data["bucket_ms"]) == (None, 21_600_000, 900_000)
    queues = {q["queue"]: q for q in data["queues"]}
    assert set(queues) == {"push", "orders.cancel"}
    push, cancel = queues["push"], queues["orders.cancel"]
    assert len(push["buckets"]) == 24
    assert [b["count"] for b in push["buckets"]] == [4] + [0] * 23  # 1m and 10m: the first 15m
    # due 1h after the publish, which came before this read: the bucket 45m-60m
    assert [b["count"] for b in cancel["buckets"]] == [0, 0, 0, 1] + [0] * 20
    assert (push["total"], push["past_due"], cancel["total"]) == (4, 0, 1)
    assert push["caption"] == "4 due in the next 6h"

    found = run.get("/api/schedule/record?key=order-9")
    assert found.code == 200, found.text
    record = found.json()
    assert (record["key"], record["state"], record["queue"]) == (
        "order-9",
        "scheduled",
        "orders.cancel",
    )
    assert (record["generation"], record["body_bytes"]) == (1, len(b'{"order":9}'))  # compact JSON
    unknown = run.get("/api/schedule/record?key=nope")
    assert (unknown.code, unknown.json()["kind"]) == (404, "UnknownKey")
    assert run.get("/api/schedule/record?key=" + "k" * 256).code == 400
    page = run.get("/schedule?key=order-9")
    assert page.code == 200
    assert '<dd data-f="queue">orders.cancel</dd>' in page.text
    assert run.get("/schedule?key=nope").code == 404
    html = run.get("/").text
    assert '<section id="schedule">' in html
    assert "4 due in the next 6h" in html

    # A cancel shows at the next read (at most once per refresh interval).
    with Schedule(topology) as schedule:
        assert schedule.cancel("a") is ScheduleState.SCHEDULED
    cancelled = run.get("/api/schedule/record?key=a").json()
    assert cancelled["state"] == "cancelled"  # a lookup is never cached
    time.sleep(1.1)
    again = {q["queue"]: q for q in run.get("/api/schedule").json()["queues"]}
    assert again["push"]["total"] == 3


def test_a_topology_without_a_schedule_has_no_schedule_pages(
    make_topology: MakeTopology, dashboard: Start
) -> None:
    run = dashboard(make_topology())
    assert run.get("/api/schedule").json()["kind"] == "no_schedule"
    assert run.get("/api/schedule/record?key=k").code == 404
    assert 'id="schedule"' not in run.get("/").text


# -- who may ask ------------------------------------------------------------------------


def test_with_auth_every_request_needs_credentials(
    make_topology: MakeTopology, dashboard: Start
) -> None:
    run = dashboard(make_topology(), auth=Auth("ops", SECRET))
    assert run.get("/api/snapshot").code == 401
    assert run.get("/").headers["WWW-Authenticate"].startswith("Basic")
    good = "Basic " + base64.b64encode(f"ops:{SECRET}".encode()).decode()
    bad = "Basic " + base64.b64encode(b"ops:guess").decode()
    assert run.get("/api/snapshot", {"Authorization": bad}).code == 401
    answer = run.get("/api/snapshot", {"Authorization": good})
    assert answer.code == 200
    assert SECRET not in answer.text
    token = dashboard(make_topology(), auth=Auth(None, SECRET))
    assert token.get("/api/snapshot", {"Authorization": f"Bearer {SECRET}"}).code == 200
    assert token.get("/api/snapshot", {"Authorization": "Bearer nope"}).code == 401


def test_the_command_starts_and_says_so(tmp_path: Path, broker_url: str) -> None:
    """The real command: refuses a public address without --auth, and says where it
    listens, whether actions and auth are on, and the broker without its password."""
    path = tmp_path / "t.toml"
    path.write_text('namespace = "dash"\n[tiers]\n1s = "1s"\n[queues.push]\n', encoding="utf-8")
    base = [sys.executable, "-m", "rabbit_delay", "dashboard", str(path), "--url", broker_url]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RABBIT_DELAY_")}
    refused = subprocess.run(
        [*base, "--host", "0.0.0.0"], capture_output=True, text=True, timeout=60, env=env
    )
    assert refused.returncode == 1
    assert "is not a loopback address" in refused.stderr
    process = subprocess.Popen(
        [*base, "--port", "0", "--allow-actions", "--auth", f"ops:{SECRET}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert "rabbit-delay dashboard on http://127.0.0.1:" in line
        assert "actions: ON (--allow-actions); auth: on (HTTP Basic)" in line
        password = broker_url.split("@")[0].rsplit(":", 1)[1]
        assert f":{password}@" not in line
        port = int(line.split("http://127.0.0.1:")[1].split("/")[0])
        req = urllib.request.Request(f"http://127.0.0.1:{port}/static/dashboard.css")
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(req, timeout=10)
        assert caught.value.code == 401
        caught.value.close()
    finally:
        process.terminate()
        _out, err = process.communicate(timeout=20)
    assert process.returncode == 0, err
    assert SECRET not in line + err


# -- performance -------------------------------------------------------------------------


def test_many_clients_one_broker_read(make_topology: MakeTopology, dashboard: Start) -> None:
    run = dashboard(make_topology(), refresh_s=30.0)
    reads = []
    real = run.backend.read_status

    def counted() -> Any:
        reads.append(time.monotonic())
        return real()

    run.backend.read_status = counted  # type: ignore[method-assign]
    answers: list[int] = []

    def client() -> None:
        for path in ("/api/snapshot", "/", "/api/snapshot"):
            answers.append(run.get(path).code)

    threads = [threading.Thread(target=client) for _ in range(40)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert answers == [200] * 120
    assert len(reads) == 1  # 120 answers from 40 clients, one read of the broker
    assert run.get("/api/snapshot").json()["age_s"] < 30


# 2 tier buffers + 24 business queues + 24 parking lots + the catch-all
MANY_QUEUES = {f"q{i:02d}": {} for i in range(24)}
PARKED = 10_000


def test_10000_parked_in_51_queues_fast_and_unchanged(
    make_topology: MakeTopology, dashboard: Start, broker_url: str
) -> None:
    topology = make_topology(tiers={"1m": "1m", "5m": "5m"}, queues=MANY_QUEUES)
    run = dashboard(topology, refresh_s=30.0)
    lot = topology.names.parking_queue("q07")
    ids = park(broker_url, topology, "q07", PARKED)
    figures: dict[str, float] = {}

    def timed(name: str, path: str) -> Any:
        started = time.perf_counter()
        answer = run.get(path)
        figures[name] = time.perf_counter() - started
        assert answer.code == 200, answer.text
        return answer

    snap = timed("snapshot, broker read", "/api/snapshot").json()
    assert len(snap["status"]["queues"]) == 51
    assert {r["name"]: r["ready"] for r in snap["status"]["queues"]}[lot] == PARKED
    timed("snapshot, cached", "/api/snapshot")
    timed("overview page, cached", "/")
    first = timed("parked page, peek of the lot", "/api/parked/q07").json()
    assert [m["message_id"] for m in first["messages"]] == ids[:50]
    middle = timed("parked page 101, cached", "/api/parked/q07?offset=5000").json()
    assert [m["message_id"] for m in middle["messages"]] == ids[5000:5050]
    timed("parked html page, cached", "/parked/q07?offset=9950")
    timed("parked detail, cached", f"/api/parked/q07/{ids[9999]}")
    print(
        "\ndashboard, 51 queues, 10,000 parked:",
        {k: f"{v * 1000:.0f} ms" for k, v in figures.items()},
    )
    # Browsing lost and reordered nothing.
    assert run.count(lot) == PARKED
    started = time.perf_counter()
    assert drain_ids(broker_url, lot, PARKED) == ids
    raw_s = time.perf_counter() - started  # pika alone, reading the same 10,000 now
    # Generous bounds (a loaded CI machine); the figures are in docs/dashboard.md. What
    # reads the broker may take 20 s, or 4 times what pika alone took to read the lot
    # here (a loaded machine slows both: seen 22 s beside three test runs).
    slow_s = max(20.0, 4 * raw_s)
    for name, took in figures.items():
        bound = slow_s if "peek" in name or "broker" in name else 2.0
        assert took < bound, (name, took, f"pika read the lot in {raw_s:.1f}s")


def test_a_raw_pika_check_that_nothing_is_consuming_the_lot(
    make_topology: MakeTopology, dashboard: Start, broker_url: str
) -> None:
    """The dashboard never leaves a consumer behind on a lot (a peek cancels its own)."""
    topology = make_topology()
    run = dashboard(topology)
    park(broker_url, topology, "push", 40)  # past 32: the peek uses a consumer
    assert run.get("/api/parked/push").code == 200
    connection = pika.BlockingConnection(pika.URLParameters(broker_url))
    try:
        ok = connection.channel().queue_declare(topology.names.parking_queue("push"), passive=True)
        assert ok.method.consumer_count == 0
        assert ok.method.message_count == 40
    finally:
        connection.close()
