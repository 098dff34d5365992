"""`rabbit-delay worker --health-port` / `--metrics-port`: /healthz and /readyz of real
worker processes (both transports) on a scratch node that is killed and restarted.

Ready once consuming; when the node dies, /readyz turns 503 (not connected, nothing
consumed) while /healthz stays 200 (the worker is alive and reconnecting: a restart
would not help); once the node is back, /readyz is 200 again without a restart of the
worker. Never the shared brokers: the node is this module's own.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import wait_for

from rabbit_delay import topology_from_dict
from rabbit_delay._ops.delete.execute import delete_topology as sync_delete_topology
from rabbit_delay.sync import connect, declare

from ._scratch_node import ScratchNode, scratch_kind, started_node
from .workers.harness import KINDS, start_cli_worker

pytestmark = [
    pytest.mark.integration,
    pytest.mark.scratch,
    pytest.mark.xdist_group("worker-health"),
]

QUEUE = "orders.cancel"
SERVING = re.compile(r"serving (?P<routes>[/a-z, ]+) on port (?P<port>\d+)")


@pytest.fixture(scope="module")
def node(broker_url: str) -> Iterator[ScratchNode]:
    with started_node(scratch_kind(broker_url)) as scratch:
        yield scratch


@pytest.fixture
def topology_file(node: ScratchNode, tmp_path: Path) -> Iterator[Path]:
    namespace = "h" + uuid.uuid4().hex[:10]
    spec: dict[str, Any] = {
        "namespace": namespace,
        "tiers": {"1s": "1s"},
        "queues": {QUEUE: {}},
        "idempotency": {"store": "memory"},
    }
    topology = topology_from_dict(spec)
    path = tmp_path / "topology.toml"
    path.write_text(
        f'namespace = "{namespace}"\n[tiers]\n"1s" = "1s"\n[queues."{QUEUE}"]\n'
        '[idempotency]\nstore = "memory"\n',
        encoding="utf-8",
    )
    conn = connect(node.url, name="rd-test worker-health declare")
    try:
        declare(conn, topology)
    finally:
        conn.close()
    yield path
    if node.running:
        conn = connect(node.url, name="rd-test worker-health cleanup")
        try:
            sync_delete_topology(conn, topology)
        finally:
            conn.close()


def probe(base: str, path: str) -> tuple[int, dict[str, Any]]:
    """The status and the JSON body of a health route ({} for another answer)."""
    try:
        with urllib.request.urlopen(base + path, timeout=3) as response:
            code, body, kind = response.status, response.read(), response.headers["Content-Type"]
    except urllib.error.HTTPError as exc:
        code, body, kind = exc.code, exc.read(), exc.headers["Content-Type"]
    return code, json.loads(body) if kind == "application/json" else {}


class Running:
    def __init__(self, kind: str, proc: subprocess.Popen[bytes], output: Path) -> None:
        self.kind = kind
        self.proc = proc
        self.output = output
        self.base = ""

    def text(self) -> str:
        return self.output.read_text(encoding="utf-8", errors="replace")

    def find_port(self) -> bool:
        if self.proc.poll() is not None:
            pytest.fail(f"{self.kind} worker exited with {self.proc.returncode}:\n{self.text()}")
        found = SERVING.search(self.text())
        if found is not None:
            self.base = f"http://127.0.0.1:{found['port']}"
        return found is not None

    def status(self, path: str) -> int:
        return probe(self.base, path)[0]


@pytest.fixture
def workers(
    node: ScratchNode, topology_file: Path, tmp_path: Path
) -> Iterator[Callable[..., list[Running]]]:
    started: list[Running] = []

    def start(options: dict[str, list[str]]) -> list[Running]:
        """One worker of each kind, with its own options."""
        for kind in KINDS:
            output = tmp_path / f"worker-{kind}-{len(started)}.out"
            proc = start_cli_worker(
                kind,
                "crash_app",
                topology_file,
                tmp_path / "effects.log",
                node.url,
                output,
                *options[kind],
            )
            started.append(Running(kind, proc, output))
        for worker in started:
            wait_for(worker.find_port, 20, f"the {worker.kind} worker to serve its port")
        return started

    yield start
    for worker in started:
        if worker.proc.poll() is None:
            worker.proc.send_signal(signal.SIGTERM)
            try:
                worker.proc.wait(15)
            except subprocess.TimeoutExpired:
                worker.proc.kill()
                worker.proc.wait()


# Each transport with one of the two ways to serve the probes (CI time: one node restart).
PORT_OPTIONS = {"sync": ["--health-port", "0"], "async": ["--metrics-port", "0"]}
ROUTES = {"sync": "/healthz, /readyz", "async": "/metrics, /healthz, /readyz"}


@pytest.mark.timeout(240)
def test_readyz_follows_the_broker_and_healthz_stays_up(
    node: ScratchNode, workers: Callable[..., list[Running]]
) -> None:
    running = workers({k: [*v, "--reconnect-max", "1s"] for k, v in PORT_OPTIONS.items()})
    for worker in running:
        assert SERVING.search(worker.text())["routes"] == ROUTES[worker.kind]  # type: ignore[index]
        wait_for(lambda w=worker: w.status("/readyz") == 200, 20, f"{worker.kind} ready")
        code, body = probe(worker.base, "/readyz")
        assert body["consuming"] == [QUEUE]
        assert body["connected"] is True
        assert probe(worker.base, "/healthz")[0] == 200
    sync, async_ = running
    assert sync.status("/metrics") == 404  # --health-port: no metrics
    with urllib.request.urlopen(async_.base + "/metrics", timeout=3) as response:
        assert b"rabbit_delay_handled_total" in response.read()

    node.kill()
    killed_at = time.monotonic()
    for worker in running:
        wait_for(lambda w=worker: w.status("/readyz") == 503, 15, f"{worker.kind} not ready")
        code, body = probe(worker.base, "/readyz")
        assert body["ready"] is False
        assert body["not_consuming"] == [QUEUE]
    # alive all along: several probes while the node is down and the workers reconnect
    while time.monotonic() - killed_at < 3:
        for worker in running:
            code, body = probe(worker.base, "/healthz")
            assert code == 200, (worker.kind, body)
            assert body["live"] is True
        time.sleep(0.5)

    node.start()
    for worker in running:
        wait_for(lambda w=worker: w.status("/readyz") == 200, 30, f"{worker.kind} ready again")
        assert worker.proc.poll() is None  # the same process: no restart needed
        assert probe(worker.base, "/healthz")[0] == 200

    for worker in running:
        worker.proc.send_signal(signal.SIGTERM)
    for worker in running:
        assert worker.proc.wait(20) == 0, worker.text()
