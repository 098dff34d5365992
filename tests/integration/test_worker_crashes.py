"""Worker processes that die: the crash loop, the dead worker's leases, the redelivered
flag, and `app.cancel()` from another working directory.

Real `rabbit-delay worker` subprocesses on the broker under test, each test over the
sync and the async worker, with the default idempotency guard (SQLite). The apps are
`workers/poison_app.py` (a handler that kills its process for some messages and
records its effect with the inbox pattern) and `workers/crash_app.py` (a slow handler
logging `start` and `effect` lines).

Deadlines are derived from the topology's lease and from the restart time measured in
the test itself, plus a stated slack; a broken promise shows up as a failed assertion
naming what was seen, not as a hang.
"""

from __future__ import annotations

import ast
import os
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pika
import pytest
from conftest import delete_topology, message_count, unique_namespace, wait_for

from rabbit_delay import Topology, load_topology
from rabbit_delay.sync import Publisher, connect, declare

from .workers.harness import KINDS, start_cli_worker

pytestmark = [pytest.mark.integration, pytest.mark.slow]

QUEUE = "orders.cancel"
START_S = 20.0  # a worker process: import, connect, declare-check, consume
EXIT_S = 20.0
PARK_REASON = "rd-park-reason"


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


# -- topologies ---------------------------------------------------------------------------


def topology_toml(
    namespace: str,
    *,
    lease: str,
    store_path: Path | None,
    delivery_limit: int | None = None,
    tiers: tuple[str, ...] = ("1s",),
    publish_tiers: tuple[str, ...] | None = None,
) -> str:
    """A one-queue topology file; `store_path` None keeps the default (relative) path."""
    text = f'namespace = "{namespace}"\n[tiers]\n'
    text += "".join(f'"{tier}" = "{tier}"\n' for tier in tiers)
    text += f'[queues."{QUEUE}"]\n'
    if delivery_limit is not None:
        text += f"delivery_limit = {delivery_limit}\n"
    if publish_tiers is not None:
        text += "tiers = [" + ", ".join(f'"{t}"' for t in publish_tiers) + "]\n"
    text += f'[queues."{QUEUE}".retry]\ntiers = ["1s"]\nmax_attempts = 3\n'
    text += f'[idempotency]\nstore = "sqlite"\nlease = "{lease}"\n'
    if store_path is not None:
        text += f'path = "{store_path}"\n'
    return text


@pytest.fixture
def declared(broker_url: str) -> Iterator[Callable[[Path, str], Topology]]:
    """Write a topology file, declare it; every topology is deleted afterwards."""
    made: list[Topology] = []

    def make(path: Path, text: str) -> Topology:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        topology = load_topology(path)
        made.append(topology)
        conn = connect(broker_url, name="rd-test worker-crashes declare")
        try:
            declare(conn, topology)
        finally:
            conn.close()
        return topology

    yield make
    for topology in made:
        delete_topology(broker_url, topology)


# -- worker processes ---------------------------------------------------------------------

_STOPPED = re.compile(r"worker \S+ stopped: (\{.*\})")


class WorkerProcess:
    def __init__(self, proc: subprocess.Popen[bytes], output: Path) -> None:
        self.proc = proc
        self.output = output
        self.spawned_at = time.monotonic()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def text(self) -> str:
        return self.output.read_text(encoding="utf-8", errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def consuming(self) -> bool:
        if not self.alive():
            pytest.fail(f"worker exited with {self.proc.returncode}:\n{self.text()[-4000:]}")
        return " consuming " in self.text()

    def stop(self, timeout: float = EXIT_S) -> int:
        """SIGTERM, and the exit code (the worker logs its stats on the way out)."""
        if self.alive():
            os.kill(self.pid, signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"worker {self.pid} did not stop within {timeout}s:\n{self.text()[-4000:]}")

    def stats(self) -> dict[str, int] | None:
        """The counters of the final `worker ... stopped: {...}` line, if it got that far."""
        found = _STOPPED.findall(self.text())
        return ast.literal_eval(found[-1]) if found else None


class Workers:
    """Starts `rabbit-delay worker MODULE:app` processes; kills what is left at the end."""

    def __init__(self, url: str, tmp_path: Path) -> None:
        self.url = url
        self.tmp_path = tmp_path
        self.started: list[WorkerProcess] = []
        self.supervisors: list[Supervisor] = []
        self._lock = threading.Lock()

    def start(
        self,
        kind: str,
        module: str,
        topology_file: Path,
        log: Path,
        *args: str,
        cwd: Path | None = None,
        **env: str,
    ) -> WorkerProcess:
        with self._lock:
            output = self.tmp_path / f"worker-{len(self.started)}.out"
            proc = start_cli_worker(
                kind, module, topology_file, log, self.url, output, *args, cwd=cwd, **env
            )
            worker = WorkerProcess(proc, output)
            self.started.append(worker)
            return worker

    def supervise(self, start: Callable[[], WorkerProcess], size: int) -> Supervisor:
        supervisor = Supervisor(start, size)
        self.supervisors.append(supervisor)
        return supervisor

    def kill_all(self) -> None:
        for supervisor in self.supervisors:
            supervisor.halt()
        for worker in self.started:
            if worker.alive():
                worker.proc.kill()
                worker.proc.wait()


@pytest.fixture
def workers(
    broker_url: str, tmp_path: Path, declared: Callable[[Path, str], Topology]
) -> Iterator[Workers]:
    # Depends on `declared`: the processes die before their topology is deleted.
    started = Workers(broker_url, tmp_path)
    yield started
    started.kill_all()


class Supervisor:
    """Keeps `size` workers running, as systemd or Kubernetes would: a background thread
    replaces each dead process by a new one (`start()`), polling every 50 ms."""

    def __init__(self, start: Callable[[], WorkerProcess], size: int) -> None:
        self._start = start
        self.current = [start() for _ in range(size)]
        self.restarts = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="supervisor", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(0.05):
            for i, worker in enumerate(self.current):
                if not worker.alive():
                    self.current[i] = self._start()
                    self.restarts += 1

    def halt(self) -> None:
        """No more restarts."""
        self._stop.set()
        self._thread.join(5)

    def stop(self) -> None:
        """No more restarts; SIGTERM the running workers."""
        self.halt()
        for worker in self.current:
            worker.stop()


# -- observations -------------------------------------------------------------------------


def log_rows(log: Path, step: str) -> list[list[str]]:
    if not log.exists():
        return []
    rows = [line.split() for line in log.read_text(encoding="utf-8").splitlines()]
    return [row for row in rows if row and row[0] == step]


def effects(database: Path) -> dict[str, int]:
    """message_id -> effects, from poison_app's `effects` table."""
    if not database.exists():
        return {}
    conn = sqlite3.connect(database, timeout=30)
    try:
        rows = conn.execute("SELECT message_id, count(*) FROM effects GROUP BY message_id")
        return {str(mid): int(n) for mid, n in rows}
    except sqlite3.OperationalError:  # no table yet: no handler got that far
        return {}
    finally:
        conn.close()


def drain(url: str, queue: str) -> list[pika.BasicProperties]:
    """Take (and ack) every message now in `queue`; their properties."""
    got: list[pika.BasicProperties] = []
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        channel = conn.channel()
        while True:
            method, props, _body = channel.basic_get(queue, auto_ack=True)
            if method is None:
                return got
            got.append(props)
    finally:
        conn.close()


def park_reason(props: pika.BasicProperties) -> str:
    headers: dict[str, Any] = dict(props.headers or {})
    reason = headers.get(PARK_REASON)
    if reason is not None:
        return reason.decode() if isinstance(reason, bytes) else str(reason)
    deaths = headers.get("x-death") or []
    return "x-death:" + ",".join(str(d.get("reason")) for d in deaths)


# -- 1. the crash loop ends in the parking lot ---------------------------------------------

DELIVERY_LIMIT = 3
CRASH_LEASE_S = 3.0
NORMAL = 1_000
NORMAL_SETTLE_S = 30.0


@pytest.mark.timeout(120)
def test_a_message_that_kills_every_worker_is_parked_as_crashed_and_the_rest_run_once(
    kind: str,
    declared: Callable[[Path, str], Topology],
    workers: Workers,
    broker_url: str,
    tmp_path: Path,
) -> None:
    database = tmp_path / "idempotency.sqlite3"
    topology_file = tmp_path / "topology.toml"
    topology = declared(
        topology_file,
        topology_toml(
            unique_namespace(),
            lease=f"{CRASH_LEASE_S:g}s",
            store_path=database,
            delivery_limit=DELIVERY_LIMIT,
        ),
    )
    log = tmp_path / "handler.log"
    supervisor = workers.supervise(lambda: workers.start(kind, "poison_app", topology_file, log), 2)
    for worker in supervisor.current:
        wait_for(worker.consuming, START_S, "a worker to consume")
    # What a restart costs here: spawn to consuming, as just measured, plus the 50 ms poll.
    restart_s = max(time.monotonic() - w.spawned_at for w in supervisor.current) + 0.05
    park_deadline_s = DELIVERY_LIMIT * (CRASH_LEASE_S + restart_s) + 15.0

    with Publisher(topology, broker_url) as publisher:
        poison = publisher.publish_delayed({"order_id": 0, "crash": "always"}, "1s", queue=QUEUE)
        published = time.monotonic()
        normal = publisher.publish_many(
            [{"order_id": i} for i in range(1, NORMAL + 1)], "1s", queue=QUEUE
        )

    parking = topology.names.parking_queue(QUEUE)
    parked_after: float | None = None
    deadline = published + park_deadline_s
    while time.monotonic() < deadline:
        if parked_after is None and message_count(broker_url, parking) > 0:
            parked_after = time.monotonic() - published
        if parked_after is not None and len(effects(database)) >= NORMAL:
            break
        time.sleep(0.25)
    # The other messages only have to finish, exactly once: each crash hands a dead
    # worker's in-flight ones to the other worker, which waits out their lease. On a
    # loaded machine that can outlast the parking deadline; give them their own.
    settle_deadline = time.monotonic() + NORMAL_SETTLE_S
    while len(effects(database)) < NORMAL and time.monotonic() < settle_deadline:
        time.sleep(0.25)
    supervisor.stop()

    poison_runs = sum(row[1] == poison for row in log_rows(log, "start"))
    done = effects(database)
    parked = drain(broker_url, parking)
    reasons = {props.message_id: park_reason(props) for props in parked}
    seen = (
        f"poison ran {poison_runs} times, parked after {parked_after}s "
        f"(deadline {park_deadline_s:.1f}s, restart {restart_s:.1f}s), "
        f"{supervisor.restarts} restarts, {len(done)}/{NORMAL} normal effects, "
        f"{sum(n > 1 for n in done.values())} duplicated, parking lot: {reasons}"
    )
    print(seen)  # the figures for the report (pytest -rP)
    assert reasons.get(poison) == "crashed", seen
    assert parked_after is not None
    assert parked_after <= park_deadline_s, seen
    assert poison_runs <= DELIVERY_LIMIT + 1, seen
    assert poison not in done, seen
    assert {mid: done.get(mid, 0) for mid in normal} == dict.fromkeys(normal, 1), seen
    assert set(reasons) == {poison}, seen


# -- 2. a dead worker blocks its keys for about one lease ----------------------------------

IN_FLIGHT = 50
BLOCK_LEASE_S = 6.0
SLACK_S = 6.0  # the second worker's start, the tier the deferred copies wait in, the handler
# Tiers of 1, 2 and 3 s: the deferral backoff (1, 2, 3, 3 s: doubling, capped at half the
# lease) re-checks a dead worker's keys about 4 times before its lease ends; a fixed
# shortest-tier deferral (the old rule) took 6.
BLOCK_TIERS = ("1s", "2s", "3s")
MAX_DEFERRALS_PER_MESSAGE = 4.5


@pytest.mark.timeout(120)
def test_a_killed_worker_blocks_its_keys_for_about_one_lease(
    kind: str,
    declared: Callable[[Path, str], Topology],
    workers: Workers,
    broker_url: str,
    tmp_path: Path,
) -> None:
    topology_file = tmp_path / "topology.toml"
    topology = declared(
        topology_file,
        topology_toml(
            unique_namespace(),
            lease=f"{BLOCK_LEASE_S:g}s",
            tiers=BLOCK_TIERS,
            store_path=tmp_path / "idempotency.sqlite3",
        ),
    )
    log = tmp_path / "handler.log"
    options = ("--concurrency", str(IN_FLIGHT), "--prefetch", str(IN_FLIGHT))
    first = workers.start(kind, "crash_app", topology_file, log, *options, RD_TEST_SLOW_S="30")
    wait_for(first.consuming, START_S, "the first worker to consume")
    with Publisher(topology, broker_url) as publisher:
        ids = publisher.publish_many([{"order_id": i} for i in range(IN_FLIGHT)], "1s", queue=QUEUE)
    wait_for(lambda: len(log_rows(log, "start")) >= IN_FLIGHT, 20, f"{IN_FLIGHT} handlers to start")
    os.kill(first.pid, signal.SIGKILL)  # 50 live leases, no done-record, no ack
    killed = time.monotonic()
    first.proc.wait(EXIT_S)

    second = workers.start(kind, "crash_app", topology_file, log, *options, RD_TEST_SLOW_S="0")
    allowed_s = 1.5 * BLOCK_LEASE_S + SLACK_S
    handled_after: float | None = None
    while time.monotonic() < killed + allowed_s + 10:  # watch a little past the promise
        if {row[1] for row in log_rows(log, "effect")} >= set(ids):
            handled_after = time.monotonic() - killed
            break
        if not second.alive():
            pytest.fail(f"the second worker died:\n{second.text()[-4000:]}")
        time.sleep(0.1)
    time.sleep(1.5)  # room for a wrong second effect to show up
    assert second.stop() == 0, second.text()[-4000:]

    stats = second.stats() or {}
    deferred = stats.get("deferred", -1)
    by_id: dict[str, list[str]] = {}
    for row in log_rows(log, "effect"):
        by_id.setdefault(row[1], []).append(row[2])
    seen = (
        f"handled {len(by_id)}/{IN_FLIGHT} after {handled_after}s (allowed {allowed_s:g}s), "
        f"deferred {deferred} times ({deferred / IN_FLIGHT:.1f} per message), "
        f"second worker stats {stats}"
    )
    print(seen)  # the figures for the report (pytest -rP)
    assert handled_after is not None, seen
    assert handled_after <= allowed_s, seen
    assert by_id == {mid: [str(second.pid)] for mid in ids}, seen
    assert 0 <= deferred <= MAX_DEFERRALS_PER_MESSAGE * IN_FLIGHT, seen


# -- 3. app.cancel() from another working directory ----------------------------------------

# long enough for the canceller (a new Python process) to start on a loaded machine
CANCEL_DELAY = "6s"
CANCEL_DELAY_S = 6.0
MARGIN_S = 3.0

CANCEL = "import sys; from rabbit_delay import App; App(sys.argv[1]).cancel(sys.argv[2])"


@pytest.mark.timeout(90)
def test_cancel_from_another_working_directory_drops_the_message(
    kind: str,
    declared: Callable[[Path, str], Topology],
    workers: Workers,
    broker_url: str,
    tmp_path: Path,
) -> None:
    # The topology keeps the default, relative store path: it must mean the same file to
    # a worker and a canceller started in different directories.
    topology_file = tmp_path / "config" / "topology.toml"
    topology = declared(
        topology_file,
        topology_toml(
            unique_namespace(),
            lease="30s",
            store_path=None,
            tiers=("1s", CANCEL_DELAY),
            publish_tiers=(CANCEL_DELAY,),
        ),
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    log = tmp_path / "handler.log"
    worker = workers.start(kind, "crash_app", topology_file, log, cwd=tmp_path)
    wait_for(worker.consuming, START_S, "the worker to consume")

    with Publisher(topology, broker_url) as publisher:
        doomed = publisher.publish_delayed({"order_id": 1}, CANCEL_DELAY, queue=QUEUE)
        published = time.monotonic()
        control = publisher.publish_delayed({"order_id": 2}, CANCEL_DELAY, queue=QUEUE)
    cancel = subprocess.run(
        [sys.executable, "-c", CANCEL, str(topology_file), doomed],
        cwd=elsewhere,
        capture_output=True,
        text=True,
        timeout=30,
    )
    cancelled_after = time.monotonic() - published
    assert cancel.returncode == 0, cancel.stderr
    if cancelled_after >= CANCEL_DELAY_S:
        pytest.fail(f"inconclusive: the cancel took {cancelled_after:.1f}s, past the due time")

    wait_for(
        lambda: any(row[1] == control for row in log_rows(log, "effect")),
        CANCEL_DELAY_S + 15,
        "the control message to run",
    )
    time.sleep(max(0.0, published + CANCEL_DELAY_S + MARGIN_S - time.monotonic()))
    assert worker.stop() == 0, worker.text()[-4000:]

    ran = sorted({row[1] for row in log_rows(log, "start")})
    stores = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*.sqlite3"))
    seen = f"handled {ran}, stats {worker.stats()}, SQLite files {stores}"
    assert doomed not in ran, seen
    assert control in ran, seen


# -- 4. ctx.redelivered after a crash ------------------------------------------------------

REDELIVERY_LEASE_S = 3.0


@pytest.mark.timeout(90)
def test_the_run_after_a_crash_sees_ctx_redelivered(
    kind: str,
    declared: Callable[[Path, str], Topology],
    workers: Workers,
    broker_url: str,
    tmp_path: Path,
) -> None:
    database = tmp_path / "idempotency.sqlite3"
    topology_file = tmp_path / "topology.toml"
    topology = declared(
        topology_file,
        topology_toml(unique_namespace(), lease=f"{REDELIVERY_LEASE_S:g}s", store_path=database),
    )
    log = tmp_path / "handler.log"
    supervisor = workers.supervise(lambda: workers.start(kind, "poison_app", topology_file, log), 1)
    wait_for(supervisor.current[0].consuming, START_S, "the worker to consume")
    with Publisher(topology, broker_url) as publisher:
        message_id = publisher.publish_delayed({"order_id": 1, "crash": "once"}, "1s", queue=QUEUE)

    # The first run kills its worker; the supervisor starts another; the message comes
    # back once the dead worker's lease has ended at the latest.
    wait_for(
        lambda: message_id in effects(database),
        REDELIVERY_LEASE_S + START_S + 10,
        "the run after the crash",
    )
    supervisor.stop()

    runs = [row for row in log_rows(log, "start") if row[1] == message_id]
    seen = f"runs (start, id, pid, redelivered): {runs}; restarts {supervisor.restarts}"
    assert len(runs) == 2, seen
    assert runs[0][3] == "0", seen  # the first delivery is not a redelivery
    assert runs[1][3] == "1", seen  # ctx.redelivered on the run after the crash
    assert effects(database) == {message_id: 1}, seen
