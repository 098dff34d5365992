"""Nothing on the wire changed with the redesign of issue 20 (module layout, one envelope
builder, the lifecycle programs): the code as it was before, taken from git
(`git archive BEFORE rabbit_delay`), declares a topology and publishes delayed messages
through a tier, a sharded tier and the cascade; the current code finds nothing to change
in that topology, and its worker handles every message once, never early. The other way
round too: the current publisher, the old worker. Names of exchanges and queues, their
arguments, the headers and the bodies are all on that path.

Skipped (with the reason) only outside a git checkout: a fresh clone, as CI runs it,
always has the history.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import delete_topology, unique_namespace, wait_for

from rabbit_delay import App, HandlerContext, Publisher, Worker, topology_from_dict
from rabbit_delay._io.management import read_observed
from rabbit_delay._urls import ManagementEndpoint
from rabbit_delay.sync import connected, declare, plan

# One xdist worker runs the module: the code before issue 20 is read back once.
pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("old-code")]

BEFORE = "6191a79"  # main before issue 20 (the last commit of the old layout)
REPO = Path(__file__).resolve().parents[2]
N = 8  # messages per route


@pytest.fixture(scope="module")
def old_code(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The package as it was at BEFORE, importable from the returned directory."""
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout: the code before issue 20 cannot be read back")
    known = subprocess.run(
        ["git", "-C", str(REPO), "cat-file", "-e", f"{BEFORE}^{{commit}}"], capture_output=True
    )
    if known.returncode != 0:
        reason = f"commit {BEFORE} is not in this clone's history (a shallow clone?)"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    dest = tmp_path_factory.mktemp("before-issue-20")
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", BEFORE, "rabbit_delay"],
        capture_output=True,
        check=True,
    )
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    assert (dest / "rabbit_delay" / "publishing.py").is_file()  # the old layout indeed
    return dest


def topology_data(namespace: str) -> dict[str, Any]:
    return {
        "namespace": namespace,
        "tiers": {"1s": "1s", "2s": "2s"},
        "scaling": {"tier_shards": {"2s": 3}},
        "cascade": {"levels": 4},
        "queues": {"jobs": {"retry": {"tiers": ["1s"]}}},
        "idempotency": {"store": "memory"},
    }


# Run by the old code (PYTHONPATH = the archive): declare, then publish N messages each
# through the 1s tier, the sharded 2s tier and the cascade (2.5 s); print what was sent.
OLD_PUBLISHER = """
import json, sys, time
from rabbit_delay.topology import topology_from_dict
from rabbit_delay.sync import Publisher, connected, declare
url, data, n = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
topology = topology_from_dict(data)
with connected(url) as conn:
    declare(conn, topology)
sent = []
with Publisher.connect(topology, url) as publisher:
    for i in range(n):
        for route, tier, delay in (("1s", "1s", None), ("2s", "2s", None), ("cascade", None, 2.5)):
            body = {"i": i, "route": route}
            sent.append(publisher.publish_delayed(body, tier, queue="jobs", delay=delay))
print(json.dumps({"sent": sent, "module": Publisher.__module__}))
"""

# Run by the old code: consume `n` messages with the old sync worker, print what it saw.
OLD_WORKER = """
import json, sys, threading, time
from rabbit_delay.topology import topology_from_dict
from rabbit_delay.consumer import App
from rabbit_delay.sync.worker import Worker
url, data, n = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
app = App(topology_from_dict(data))
seen = []
done = threading.Event()

@app.consumer("jobs")
def handle(body, ctx):
    seen.append({"id": ctx.message_id, "late": ctx.lateness_ms, "attempt": ctx.attempt,
                 "body": json.loads(body)})
    if len(seen) >= n:
        done.set()

worker = Worker(app, url, install_signal_handlers=False)
thread = threading.Thread(target=worker.run, daemon=True)
thread.start()
done.wait(60)
time.sleep(1.0)  # any duplicate would arrive now
worker.stop()
thread.join(30)
print(json.dumps({"seen": seen, "module": Worker.__module__}))
"""


def run_old(old_code: Path, script: str, *args: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(old_code)}
    done = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=old_code,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.fixture
def namespace(broker_url: str) -> Iterator[str]:
    name = unique_namespace()
    yield name
    delete_topology(broker_url, topology_from_dict(topology_data(name)))


def test_what_the_old_code_declared_and_published_the_new_code_plans_and_handles(
    broker_url: str, management: ManagementEndpoint, old_code: Path, namespace: str
) -> None:
    data = topology_data(namespace)
    published = run_old(old_code, OLD_PUBLISHER, broker_url, json.dumps(data), str(N))
    assert published["module"] == "rabbit_delay.sync.publisher"  # the old code ran
    sent = published["sent"]
    assert len(sent) == 3 * N

    topology = topology_from_dict(data)
    observed = read_observed(management, topology.names.prefix + ".")  # with their arguments
    with connected(broker_url) as conn:
        the_plan = plan(conn, topology, observed=observed)
    assert len(the_plan.items) > 20
    assert the_plan.in_sync, [str(item) for item in the_plan.pending]  # same names, arguments

    app = App(topology)
    seen: list[tuple[str | None, int | None, dict[str, Any]]] = []

    @app.consumer("jobs", model=dict)
    def handle(job: dict[str, Any], ctx: HandlerContext) -> None:
        seen.append((ctx.message_id, ctx.lateness_ms, job))

    worker = Worker(app, broker_url, install_signal_handlers=False)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: len(seen) >= len(sent), 30, f"{len(sent)} handled ({len(seen)})")
        time.sleep(1.0)  # a duplicate would arrive now
    finally:
        worker.stop()
        thread.join(30)
    assert sorted(m for m, _, _ in seen) == sorted(sent)  # every message, once
    lateness = [late for _, late, _ in seen]
    assert all(late is not None and late >= 0 for late in lateness), lateness  # never early
    assert max(late for late in lateness if late is not None) < 5_000
    routes = {job["route"] for _, _, job in seen}
    assert routes == {"1s", "2s", "cascade"}


def test_what_the_new_code_publishes_the_old_worker_handles(
    broker_url: str, old_code: Path, namespace: str
) -> None:
    data = topology_data(namespace)
    topology = topology_from_dict(data)
    with connected(broker_url) as conn:
        declare(conn, topology)
    sent = []
    with Publisher.connect(topology, broker_url) as publisher:
        for i in range(N):
            sent.append(publisher.publish_delayed({"i": i}, "1s", queue="jobs"))
            sent.append(publisher.publish_delayed({"i": i}, "2s", queue="jobs"))
            sent.append(publisher.publish_delayed({"i": i}, queue="jobs", delay=2.5))
    handled = run_old(old_code, OLD_WORKER, broker_url, json.dumps(data), str(len(sent)))
    assert handled["module"] == "rabbit_delay.sync.worker"  # the old worker ran
    seen = handled["seen"]
    assert sorted(s["id"] for s in seen) == sorted(sent)  # every message, once
    assert all(s["late"] is not None and s["late"] >= 0 for s in seen), seen  # never early
    assert all(s["attempt"] == 1 for s in seen)
