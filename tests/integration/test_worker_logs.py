"""`rabbit-delay worker --log-format json`: a message fails, is retried, fails again and
is parked; every line the worker wrote on stderr is one JSON object, and the records
about that message carry its message_id, queue, attempt and tier (both transports).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from conftest import message_count, wait_for

from rabbit_delay import Topology
from rabbit_delay.sync import Publisher, connect, declare

from .workers.harness import KINDS

pytestmark = pytest.mark.integration

QUEUE = "orders.cancel"
APP = """\
from rabbit_delay import App

app = App({topology!r})


@app.consumer({queue!r})
def fails(message, ctx):
    raise ValueError("no such order")
"""


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.timeout(90)
def test_json_log_lines_about_a_parked_message(
    kind: str, make_topology: Callable[..., Topology], broker_url: str, tmp_path: Path
) -> None:
    namespace = "l" + uuid.uuid4().hex[:10]
    topology = make_topology(
        namespace=namespace,
        tiers={"1s": "1s"},
        queues={QUEUE: {"retry": {"tiers": ["1s"], "max_attempts": 2}}},
        idempotency={"store": "memory"},
    )
    path = tmp_path / "topology.toml"
    path.write_text(
        f'namespace = "{namespace}"\n[tiers]\n"1s" = "1s"\n'
        f'[queues."{QUEUE}".retry]\ntiers = ["1s"]\nmax_attempts = 2\n'
        '[idempotency]\nstore = "memory"\n',
        encoding="utf-8",
    )
    conn = connect(broker_url, name="rd-test worker-logs declare")
    try:
        declare(conn, topology)
    finally:
        conn.close()
    (tmp_path / "failing_app.py").write_text(
        APP.format(topology=str(path), queue=QUEUE), encoding="utf-8"
    )
    stderr = tmp_path / "stderr.log"
    command = [
        sys.executable,
        "-m",
        "rabbit_delay",
        "worker",
        "failing_app:app",
        "--app-dir",
        str(tmp_path),
        "--transport",
        kind,
        "--url",
        broker_url,
        "--log-format",
        "json",
        "--log-level",
        "debug",  # the client libraries' lines too: JSON as well
    ]
    with stderr.open("wb") as sink:
        proc = subprocess.Popen(
            command,
            stdout=subprocess.DEVNULL,
            stderr=sink,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    try:
        wait_for(lambda: "consuming" in stderr.read_text(), 30, "the worker to consume")
        with Publisher(topology, broker_url) as publisher:
            message_id = publisher.publish_delayed({"order_id": 7}, "1s", queue=QUEUE)
        parking = topology.names.parking_queue(QUEUE)
        wait_for(lambda: message_count(broker_url, parking) == 1, 20, "the message parked")
        wait_for(lambda: "parked via" in stderr.read_text(), 5, "the park logged")
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(20)
    assert code == 0, stderr.read_text()

    lines = [line for line in stderr.read_text(encoding="utf-8").splitlines() if line.strip()]
    records: list[dict[str, Any]] = []
    for line in lines:
        record = json.loads(line)  # every line: one JSON object, nothing else
        assert isinstance(record, dict), line
        assert {"ts", "level", "logger", "message"} <= set(record), line
        assert datetime.fromisoformat(record["ts"]).utcoffset() is not None
        assert record["ts"].endswith("Z")
        records.append(record)
    assert "guest:guest@" not in stderr.read_text()  # the URL of the broker, redacted

    about = [r for r in records if r.get("message_id") == message_id]
    failed = [r for r in about if "failed on attempt" in r["message"]]
    assert [(r["attempt"], r["queue"], r["tier"], r["level"]) for r in failed] == [
        (1, QUEUE, "1s", "WARNING"),
        (2, QUEUE, "1s", "WARNING"),
    ]
    [retried] = [r for r in about if "will be retried" in r["message"]]
    assert (retried["attempt"], retried["next_tier"]) == (1, "1s")
    [parked] = [r for r in about if "parked via" in r["message"]]
    assert (parked["attempt"], parked["queue"], parked["tier"]) == (2, QUEUE, "1s")
    assert "no such order" in parked["message"]
    assert any(r["logger"] == "rabbit_delay.worker" and "stopped" in r["message"] for r in records)
