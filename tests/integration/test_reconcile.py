"""Reconciliation on the real broker: a due message deliberately lost (its buffer purged)
is found by the app's reconciler and handled once; a message that was not lost is
handled once too (the guard absorbs the late original); two workers run a reconciler
once per period between them; `rabbit-delay reconcile` runs them once, now.

The reconcilers know what should have fired from their own "database" (`Orders`, the
application's table of orders and their deadlines), as a real one would.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pika
import pytest
from conftest import wait_for
from pydantic import BaseModel
from typer.testing import CliRunner
from worker_behaviour import Calls, handler

from rabbit_delay import (
    App,
    AsyncReconcileContext,
    HandlerContext,
    ReconcileContext,
    Resubmit,
    Topology,
)
from rabbit_delay._cli.app import app as cli_app
from rabbit_delay._envelope import now_ms
from rabbit_delay.sync import Publisher, connect, declare

from ._publishers import toml_for
from .workers.harness import HANDLER_KINDS, KINDS, RunningWorker, get_all

pytestmark = pytest.mark.integration

QUEUE = "orders.cancel"


class CancelOrder(BaseModel):
    order_id: int


class Orders:
    """The application's own table: each order's deadline, and whether it was cancelled
    (the handler's effect). Thread-safe: the handler and the reconciler share it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.deadline: dict[int, int] = {}
        self.cancelled: list[int] = []
        self.looks = 0  # reconciler runs

    def add(self, order_id: int, due_ms: int) -> None:
        with self._lock:
            self.deadline[order_id] = due_ms

    def cancel(self, order_id: int) -> None:
        with self._lock:
            self.cancelled.append(order_id)

    def overdue(self) -> list[int]:
        """Orders past their deadline and not cancelled: what should have fired."""
        with self._lock:
            self.looks += 1
            now = now_ms()
            return [o for o, due in self.deadline.items() if due <= now and o not in self.cancelled]


def resubmission(order_id: int) -> Resubmit:
    # the original's message_id: whichever copy comes first runs, the other is skipped
    return Resubmit({"order_id": order_id}, f"order-{order_id}-timeout", queue=QUEUE)


def add_reconciler(kind: str, app: App, orders: Orders, every: str = "1s") -> None:
    """The same reconciler three ways: a `def` returning Resubmits (sync worker), an
    `async def` returning them (async worker), and a `def` that publishes itself on the
    blocking publisher it gets in the async worker (through the 1s tier)."""
    if kind == "sync":

        def overdue(ctx: ReconcileContext) -> Iterator[Resubmit]:
            for order_id in orders.overdue():
                yield resubmission(order_id)

        app.add_reconciler(overdue, every=every)
    elif kind == "async":

        async def overdue_async(ctx: AsyncReconcileContext) -> list[Resubmit]:
            return [resubmission(order_id) for order_id in orders.overdue()]

        app.add_reconciler(overdue_async, every=every, name="overdue")
    else:

        def overdue_publishing(ctx: ReconcileContext) -> None:
            for order_id in orders.overdue():
                item = resubmission(order_id)
                ctx.publisher.publish_delayed(
                    item.body, "1s", queue=QUEUE, message_id=item.message_id
                )

        app.add_reconciler(overdue_publishing, every=every, name="overdue")


@pytest.fixture
def declared(make_topology: Callable[..., Topology], broker_url: str, tmp_path: Path) -> Topology:
    """A unique topology with its SQLite guard in the test's directory, declared."""
    db = tmp_path / "idempotency.sqlite3"
    topology = make_topology(idempotency={"store": "sqlite", "path": str(db), "lease": "3s"})
    conn = connect(broker_url, name="rd-test reconcile declare")
    try:
        declare(conn, topology)
    finally:
        conn.close()
    return topology


@pytest.fixture
def run_worker(broker_url: str) -> Iterator[Callable[..., RunningWorker]]:
    running: list[RunningWorker] = []

    def start(kind: str, app: App, **options: Any) -> RunningWorker:
        worker = RunningWorker(kind, app, broker_url, close_app=True, **options)
        running.append(worker)
        return worker.start()

    yield start
    for worker in running:
        if worker.thread.is_alive():
            worker.stop()


def app_for(kind: str, topology: Topology, orders: Orders, calls: Calls) -> App:
    app = App(topology)

    def cancel(msg: CancelOrder, ctx: HandlerContext) -> None:
        orders.cancel(msg.order_id)

    app.add_consumer(QUEUE, handler(kind, calls, then=cancel), model=CancelOrder)
    return app


def purge(url: str, queue: str) -> int:
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        return int(conn.channel().queue_purge(queue).method.message_count)
    finally:
        conn.close()


@pytest.mark.parametrize("kind", HANDLER_KINDS)
def test_a_lost_due_message_is_found_and_handled_once(
    kind: str, declared: Topology, run_worker: Callable[..., RunningWorker], broker_url: str
) -> None:
    topology, orders, calls = declared, Orders(), Calls(wait_for)
    app = app_for(kind, topology, orders, calls)
    add_reconciler(kind, app, orders)
    with Publisher(topology, broker_url) as publisher:
        publisher.publish_delayed({"order_id": 1}, "1s", queue=QUEUE, message_id="order-1-timeout")
    orders.add(1, now_ms() + 1_000)
    # lost: gone from its buffer before it fell due
    assert purge(broker_url, topology.names.tier_queue("1s")) == 1
    worker = run_worker(kind, app)

    done = calls.wait_finished(1, timeout=15)
    looks = orders.looks
    wait_for(lambda: orders.looks >= looks + 2, 10, "two more reconciler runs")
    worker.stop()

    assert [c.ctx.message_id for c in calls.finished] == ["order-1-timeout"]
    assert orders.cancelled == [1]
    assert done[0].ctx.tier == ("1s" if kind == "async-def" else "now")
    assert worker.stats.acked == 1


@pytest.mark.parametrize("kind", KINDS)
def test_a_message_that_was_not_lost_is_still_handled_once(
    kind: str, declared: Topology, run_worker: Callable[..., RunningWorker], broker_url: str
) -> None:
    """The reconciler re-submits an order whose original is still waiting (its table
    says the deadline passed): the copy runs the handler, the original is skipped."""
    topology, orders, calls = declared, Orders(), Calls(wait_for)
    app = app_for(kind, topology, orders, calls)
    add_reconciler(kind, app, orders)
    with Publisher(topology, broker_url) as publisher:
        publisher.publish_delayed({"order_id": 2}, "3s", queue=QUEUE, message_id="order-2-timeout")
    orders.add(2, now_ms())
    worker = run_worker(kind, app)

    calls.wait_finished(1, timeout=10)
    wait_for(lambda: worker.stats.duplicate == 1, 10, "the original, skipped as a duplicate")
    worker.stop()

    assert len(calls.finished) == 1
    assert orders.cancelled == [2]
    assert worker.stats.acked == 1


def test_two_workers_run_a_reconciler_once_per_period(
    declared: Topology, run_worker: Callable[..., RunningWorker]
) -> None:
    """A sync and an async worker (each its own App over one SQLite file, as two
    processes would be): runs never overlap and start at least `every` apart."""
    runs: list[tuple[float, float]] = []
    lock = threading.Lock()

    def tracked(ctx: ReconcileContext) -> None:
        start = time.time()
        time.sleep(0.2)  # long enough that a second worker would overlap it
        with lock:
            runs.append((start, time.time()))

    workers = []
    for kind in KINDS:
        app = App(declared)
        app.add_consumer(QUEUE, lambda msg: None)
        app.add_reconciler(tracked, every="1s")
        workers.append(run_worker(kind, app))
    began = time.time()
    time.sleep(3.2)
    for worker in workers:
        worker.stop()
    elapsed = time.time() - began

    starts = sorted(runs)
    assert 3 <= len(starts) <= int(elapsed) + 1, starts
    for (start, end), (next_start, _) in itertools.pairwise(starts):
        assert next_start >= end, "two runs overlapped"
        assert next_start - start >= 0.95, f"runs {next_start - start:.3f}s apart"


def test_an_error_in_a_reconciler_never_stops_the_worker(
    declared: Topology,
    run_worker: Callable[..., RunningWorker],
    broker_url: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    failures: list[float] = []

    def broken(ctx: ReconcileContext) -> None:
        failures.append(time.time())
        raise RuntimeError("the orders database is down")

    calls = Calls(wait_for)
    app = App(declared)
    app.add_consumer(QUEUE, handler("sync", calls), model=CancelOrder)
    app.add_reconciler(broken, every="1s")
    worker = run_worker("sync", app)
    wait_for(lambda: len(failures) >= 2, 10, "the reconciler to fail twice")
    with Publisher(declared, broker_url) as publisher:
        publisher.publish_delayed({"order_id": 3}, "1s", queue=QUEUE)
    calls.wait_finished(1, timeout=10)
    worker.stop()
    assert "reconciler broken failed" in caplog.text
    assert "RuntimeError: the orders database is down" in caplog.text


# -- rabbit-delay reconcile ----------------------------------------------------------------

APP_MODULE = """
import json, os
from rabbit_delay import App, Resubmit

app = App(os.environ["RD_TEST_TOPOLOGY"])


@app.reconcile(every="10m")
def overdue(ctx):
    with open(os.environ["RD_TEST_ORDERS"]) as f:
        for order_id in json.load(f):
            yield Resubmit({"order_id": order_id}, f"order-{order_id}-timeout",
                           queue="orders.cancel")


@app.reconcile(every="10m")
def broken(ctx):
    raise RuntimeError("the orders database is down")
"""


def test_the_reconcile_command_runs_them_once_now(
    declared: Topology, broker_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = declared.idempotency.path
    topology_file = tmp_path / "topology.toml"
    topology_file.write_text(
        toml_for(declared) + f'[idempotency]\nstore = "sqlite"\npath = "{db}"\n', "utf-8"
    )
    orders = tmp_path / "orders.json"
    orders.write_text(json.dumps([7, 8]), "utf-8")
    monkeypatch.setenv("RD_TEST_TOPOLOGY", str(topology_file))
    monkeypatch.setenv("RD_TEST_ORDERS", str(orders))

    def reconcile(*args: str) -> Any:
        # a module of its own each time: a process of its own, as from cron
        module = f"reconcile_app_{uuid.uuid4().hex[:8]}"
        (tmp_path / f"{module}.py").write_text(APP_MODULE, "utf-8")
        base = ["reconcile", f"{module}:app", "--app-dir", str(tmp_path), "--url", broker_url]
        return CliRunner().invoke(cli_app, [*base, *args])

    ok = reconcile("--name", "overdue", "--json")
    assert ok.exit_code == 0, ok.output
    (report,) = json.loads(ok.stdout)["reconcilers"]
    assert report["name"] == "overdue"
    assert report["ok"] is True
    assert report["resubmitted"] == ["order-7-timeout", "order-8-timeout"]
    got = get_all(broker_url, declared.names.business_queue(QUEUE), 2)
    assert sorted(g.properties.message_id for g in got) == ["order-7-timeout", "order-8-timeout"]

    orders.write_text("[]", "utf-8")
    both = reconcile()
    assert both.exit_code == 1, both.output
    assert "overdue: ran in" in both.stdout  # now, whatever its period
    assert "0 message(s) re-submitted" in both.stdout
    assert "broken: ran in" in both.stdout
    assert "failed: RuntimeError: the orders database is down" in both.stdout

    unknown = reconcile("--name", "nope")
    assert unknown.exit_code == 1
    assert "no reconciler named 'nope'; registered: broken, overdue" in unknown.output
