"""Worker processes, run as users run them (`rabbit-delay worker MODULE:APP`):
killed with SIGKILL mid-handler, stopped with SIGTERM (and forced with a second one),
refusing to start.

The app is `workers/crash_app.py`; its handler logs `start` and `effect` lines to a
file, so a test can count effects across processes. Idempotency lives in a SQLite
file shared by the processes, with a 2 s lease.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import message_count, wait_for

from rabbit_delay import Topology
from rabbit_delay.sync import Publisher, connect, declare

from .workers.harness import HANDLER_KINDS, KINDS, WORKERS_DIR, start_cli_worker

pytestmark = [pytest.mark.integration, pytest.mark.slow]

QUEUE = "orders.cancel"
EXIT_S = 20.0
FORCED_EXIT_S = 5.0  # from a second SIGTERM to the process gone: no handler waited for


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(params=HANDLER_KINDS)
def handler_kind(request: pytest.FixtureRequest) -> str:
    """A worker and its handler: sync (def), async (async def), async-def (def in the
    async worker's thread pool)."""
    return str(request.param)


@pytest.fixture
def setup(
    make_topology: Callable[..., Topology], broker_url: str, tmp_path: Path
) -> tuple[Topology, Path]:
    """A declared topology (1 s tier) and its TOML file, with a SQLite guard in tmp_path."""
    namespace = "t" + uuid.uuid4().hex[:10]
    store = tmp_path / "idempotency.sqlite3"
    topology = make_topology(
        namespace=namespace,
        tiers={"1s": "1s"},
        queues={QUEUE: {"retry": {"tiers": ["1s"], "max_attempts": 3}}},
        idempotency={"store": "sqlite", "path": str(store), "lease": "2s"},
    )
    path = tmp_path / "topology.toml"
    path.write_text(
        f'namespace = "{namespace}"\n'
        '[tiers]\n"1s" = "1s"\n'
        f'[queues."{QUEUE}".retry]\ntiers = ["1s"]\nmax_attempts = 3\n'
        f'[idempotency]\nstore = "sqlite"\npath = "{store}"\nlease = "2s"\n',
        encoding="utf-8",
    )
    conn = connect(broker_url, name="rd-test worker-process declare")
    try:
        declare(conn, topology)
    finally:
        conn.close()
    return topology, path


class WorkerProcess:
    def __init__(self, proc: subprocess.Popen[bytes], output: Path) -> None:
        self.proc = proc
        self.output = output

    @property
    def pid(self) -> int:
        return self.proc.pid

    def text(self) -> str:
        return self.output.read_text(encoding="utf-8", errors="replace")

    def wait(self, timeout: float = EXIT_S) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"worker {self.pid} did not exit within {timeout}s:\n{self.text()}")


@pytest.fixture
def spawn(broker_url: str, tmp_path: Path) -> Iterator[Callable[..., WorkerProcess]]:
    started: list[WorkerProcess] = []

    def start(kind: str, topology_file: Path, log: Path, *args: str, **env: str) -> WorkerProcess:
        """`kind` is one of HANDLER_KINDS: "async-def" runs the `def` handler on the
        async worker."""
        output = tmp_path / f"worker-{len(started)}.out"
        proc = start_cli_worker(
            kind,
            "crash_app",
            topology_file,
            log,
            broker_url,
            output,
            *args,
            log_level="debug",
            **env,
        )
        worker = WorkerProcess(proc, output)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        if worker.proc.poll() is None:
            worker.proc.kill()
            worker.proc.wait()


def lines(log: Path, step: str) -> list[list[str]]:
    if not log.exists():
        return []
    rows = [line.split() for line in log.read_text(encoding="utf-8").splitlines()]
    return [row for row in rows if row and row[0] == step]


def consuming(worker: WorkerProcess) -> bool:
    if worker.proc.poll() is not None:
        pytest.fail(f"worker exited with {worker.proc.returncode}:\n{worker.text()}")
    return " consuming " in worker.text()


def publish(url: str, topology: Topology, *bodies: Any) -> list[str]:
    with Publisher(topology, url) as publisher:
        return [publisher.publish_delayed(body, "1s", queue=QUEUE) for body in bodies]


@pytest.mark.timeout(90)
def test_a_worker_killed_mid_handler_is_finished_by_another_with_one_effect(
    kind: str,
    setup: tuple[Topology, Path],
    spawn: Callable[..., WorkerProcess],
    broker_url: str,
    tmp_path: Path,
) -> None:
    topology, topology_file = setup
    log = tmp_path / "effects.log"
    first = spawn(kind, topology_file, log, RD_TEST_SLOW_S="30")
    wait_for(lambda: consuming(first), 20, "the first worker to consume")
    [message_id] = publish(broker_url, topology, {"order_id": 1})

    wait_for(lambda: lines(log, "start"), 15, "the handler to start in the first worker")
    os.kill(first.pid, signal.SIGKILL)  # mid-handler: no ack, no done-record, a live lease
    first.wait()

    second = spawn(kind, topology_file, log, RD_TEST_SLOW_S="0")
    wait_for(lambda: lines(log, "effect"), 30, "the second worker to finish the message")
    time.sleep(1.5)  # room for a wrong second effect to show up
    os.kill(second.pid, signal.SIGTERM)
    assert second.wait() == 0, second.text()

    effects = lines(log, "effect")
    assert effects == [["effect", message_id, str(second.pid)]], effects
    starts = lines(log, "start")
    assert starts[0] == ["start", message_id, str(first.pid)]
    assert all(row[2] == str(second.pid) for row in starts[1:])
    assert message_count(broker_url, topology.names.business_queue(QUEUE)) == 0
    assert message_count(broker_url, topology.names.parking_queue(QUEUE)) == 0


@pytest.mark.timeout(60)
def test_sigterm_lets_the_running_handler_finish_and_hands_back_the_rest(
    kind: str,
    setup: tuple[Topology, Path],
    spawn: Callable[..., WorkerProcess],
    broker_url: str,
    tmp_path: Path,
) -> None:
    topology, topology_file = setup
    log = tmp_path / "effects.log"
    worker = spawn(
        kind, topology_file, log, "--concurrency", "1", "--prefetch", "2", RD_TEST_SLOW_S="2"
    )
    wait_for(lambda: consuming(worker), 20, "the worker to consume")
    first, second = publish(broker_url, topology, {"order_id": 1}, {"order_id": 2})

    [started] = wait_for(lambda: lines(log, "start"), 15, "the first handler to start")
    os.kill(worker.pid, signal.SIGTERM)
    assert worker.wait() == 0, worker.text()

    assert lines(log, "effect") == [["effect", started[1], str(worker.pid)]]
    assert len(lines(log, "start")) == 1
    assert {started[1]} < {first, second}
    queue = topology.names.business_queue(QUEUE)
    wait_for(lambda: message_count(broker_url, queue) == 1, 10, "the second message, back")
    assert "stopping" in worker.text()


@pytest.mark.timeout(120)
def test_a_second_sigterm_stops_at_once_and_the_message_runs_again_after_the_lease(
    handler_kind: str,
    setup: tuple[Topology, Path],
    spawn: Callable[..., WorkerProcess],
    broker_url: str,
    tmp_path: Path,
) -> None:
    topology, topology_file = setup  # lease 2 s
    log = tmp_path / "effects.log"
    worker = spawn(handler_kind, topology_file, log, RD_TEST_SLOW_S="30")
    wait_for(lambda: consuming(worker), 20, "the worker to consume")
    [message_id] = publish(broker_url, topology, {"order_id": 1})

    wait_for(lambda: lines(log, "start"), 15, "the handler to start")
    os.kill(worker.pid, signal.SIGTERM)  # drain: the handler gets --shutdown-timeout (30 s)
    wait_for(lambda: "signal SIGTERM: stopping" in worker.text(), 5, "the first SIGTERM")
    time.sleep(1.0)
    assert worker.proc.poll() is None, worker.text()  # still waiting for the handler
    os.kill(worker.pid, signal.SIGTERM)  # again: stop now, abandon the handler
    forced_at = time.monotonic()
    code = worker.wait(timeout=45)  # past the handler's 30 s: measure, do not hang
    took = time.monotonic() - forced_at
    assert took < FORCED_EXIT_S, f"exited {took:.1f}s after the second SIGTERM:\n{worker.text()}"
    assert code == 0, worker.text()
    assert "SIGTERM again: stopping now" in worker.text()
    assert lines(log, "effect") == []  # abandoned like a crash: no effect, no done-record

    # Not lost: unacked, so back in the queue; its claim runs out after the lease, and
    # the next worker runs it.
    second = spawn(handler_kind, topology_file, log, RD_TEST_SLOW_S="0")
    wait_for(lambda: lines(log, "effect"), 30, "the next worker to run the message")
    time.sleep(1.5)  # room for a wrong second effect to show up
    os.kill(second.pid, signal.SIGTERM)
    assert second.wait() == 0, second.text()
    assert lines(log, "effect") == [["effect", message_id, str(second.pid)]]
    assert message_count(broker_url, topology.names.business_queue(QUEUE)) == 0
    assert message_count(broker_url, topology.names.parking_queue(QUEUE)) == 0


def test_the_cli_refuses_what_the_worker_cannot_run(
    setup: tuple[Topology, Path], tmp_path: Path
) -> None:
    _, topology_file = setup
    env = {
        **os.environ,
        "RD_TEST_TOPOLOGY": str(topology_file),
        "RD_TEST_LOG": str(tmp_path / "log"),
        "RD_TEST_ASYNC": "1",  # an async def handler...
    }
    cli = [sys.executable, "-c", "from rabbit_delay._cli.app import main; main()", "worker"]
    refused = subprocess.run(
        [*cli, "crash_app:app", "--app-dir", str(WORKERS_DIR), "--transport", "sync"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 1  # ...that the sync worker cannot run
    assert "cannot run async handlers" in refused.stderr
    assert not (tmp_path / "log").exists()

    missing = subprocess.run(
        [*cli, "no_such_module:app", "--app-dir", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 1
    assert "cannot import module 'no_such_module'" in missing.stderr
