"""The worker's health rule (_consumer/health.py), its HTTP endpoints
(rabbit_delay/_io/endpoints.py) and the JSON log lines (rabbit_delay/_observe/logs.py), without a
broker. A worker process answering /readyz on a real (and killed) broker is in
tests/integration/test_worker_health.py.
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from rabbit_delay import App, Worker, topology_from_dict
from rabbit_delay._consumer.decide import Ack
from rabbit_delay._consumer.health import LIVENESS_STALE_S, Health, Phase
from rabbit_delay._io.endpoints import serve
from rabbit_delay._observe.logs import JsonFormatter, TextFormatter, delivery_fields
from rabbit_delay._observe.report import log_action
from rabbit_delay.metrics import Metrics

SECRET = "s3cret-pw"


def health(**changes: Any) -> Health:
    base: dict[str, Any] = {
        "phase": Phase.RUNNING,
        "beat_age_s": 0.2,
        "connected": True,
        "consuming": ("a", "b"),
        "wanted": ("a", "b"),
        "broker": "amqp://guest:***@127.0.0.1:5672/%2F",
    }
    return Health(**(base | changes))


# -- the rule -----------------------------------------------------------------------------


def test_a_running_connected_worker_consuming_every_queue_is_live_and_ready() -> None:
    now = health()
    assert (now.live, now.ready, now.missing) == (True, True, ())


@pytest.mark.parametrize(
    ("changes", "live"),
    [
        ({"connected": False, "consuming": ()}, True),  # the broker is gone: reconnecting
        ({"consuming": ("a",)}, True),  # a consumer the broker cancelled
        ({"phase": Phase.STARTING, "beat_age_s": None}, True),  # loading, not stuck
        ({"phase": Phase.STOPPING}, True),  # draining in-flight handlers
        ({"phase": Phase.STOPPED}, False),
        ({"beat_age_s": LIVENESS_STALE_S + 1}, False),  # the loop is stuck
    ],
    ids=["disconnected", "one-queue-missing", "starting", "stopping", "stopped", "stuck"],
)
def test_not_ready(changes: dict[str, Any], live: bool) -> None:
    now = health(**changes)
    assert now.ready is False
    assert now.live is live


def test_the_body_says_why() -> None:
    body = health(consuming=("a",), connected=True).as_json()
    assert body == {
        "live": True,
        "ready": False,
        "phase": "running",
        "connected": True,
        "broker": "amqp://guest:***@127.0.0.1:5672/%2F",
        "consuming": ["a"],
        "not_consuming": ["b"],
        "last_beat_s": 0.2,
    }


# -- a worker's own facts -------------------------------------------------------------------


def test_a_worker_reports_its_health_before_it_runs() -> None:
    topology = topology_from_dict(
        {
            "namespace": "h",
            "tiers": {"1s": "1s"},
            "queues": {"a": {}, "b": {}},
            "idempotency": {"store": "memory"},
        }
    )
    app = App(topology)
    app.add_consumer("a", lambda m: None)
    app.add_consumer("b", lambda m: None)
    worker = Worker(app, f"amqp://guest:{SECRET}@127.0.0.1:1/", install_signal_handlers=False)
    now = worker.health()
    assert now.phase is Phase.STARTING
    assert (now.live, now.ready, now.connected) == (True, False, False)
    assert now.wanted == ("a", "b")
    assert SECRET not in now.broker
    worker.run_begins()
    assert worker.health().phase is Phase.RUNNING
    assert worker.health().missing == ("a", "b")
    worker.stop()
    assert worker.health().phase is Phase.STOPPING
    worker.run_ends()
    assert worker.health().live is False


# -- the endpoints ------------------------------------------------------------------------


@pytest.fixture
def server() -> Iterator[tuple[str, dict[str, Health]]]:
    """The endpoints on a free port, answering whatever `state["now"]` holds."""
    state = {"now": health()}
    metrics = Metrics()
    metrics.published("orders", "5m")
    http, thread = serve(
        0, addr="127.0.0.1", health=lambda: state["now"], registry=metrics.registry
    )
    try:
        yield f"http://127.0.0.1:{http.server_port}", state
    finally:
        http.shutdown()
        http.server_close()
        thread.join(timeout=5)


def get(url: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.headers["Content-Type"], response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read().decode()


def test_one_port_serves_metrics_and_both_probes(server: tuple[str, dict[str, Health]]) -> None:
    base, state = server
    code, kind, text = get(f"{base}/metrics")
    assert code == 200
    assert 'rabbit_delay_published_total{queue="orders",tier="5m"} 1.0' in text
    for path in ("/healthz", "/readyz"):
        code, kind, text = get(base + path)
        assert (code, kind) == (200, "application/json"), path
        assert json.loads(text)["ready"] is True

    state["now"] = health(connected=False, consuming=())  # the broker went away
    assert get(f"{base}/healthz")[0] == 200
    code, _, text = get(f"{base}/readyz")
    assert code == 503
    assert json.loads(text)["not_consuming"] == ["a", "b"]

    state["now"] = health(beat_age_s=LIVENESS_STALE_S * 2)  # stuck
    assert get(f"{base}/healthz")[0] == 503
    assert get(f"{base}/readyz")[0] == 503
    assert get(f"{base}/nope")[0] == 404


def test_health_only_serves_no_metrics() -> None:
    http, thread = serve(0, addr="127.0.0.1", health=health, metrics=False)
    try:
        base = f"http://127.0.0.1:{http.server_port}"
        assert get(f"{base}/readyz")[0] == 200
        code, _, text = get(f"{base}/metrics")
        assert code == 404
        assert "/healthz, /readyz" in text
    finally:
        http.shutdown()
        http.server_close()
        thread.join(timeout=5)


# -- log lines -----------------------------------------------------------------------------


def record(msg: str, *args: object, **extra: Any) -> logging.LogRecord:
    rec = logging.LogRecord("rabbit_delay.worker", logging.WARNING, __file__, 1, msg, args, None)
    rec.created = 1_796_150_495.995
    for key, value in extra.items():
        setattr(rec, key, value)
    return rec


def test_a_json_line_carries_the_delivery_fields() -> None:
    fields = delivery_fields("orders", "m-1", 2, "1s", next_tier="5m")
    line = JsonFormatter().format(record("%s: %s failed", "orders", "m-1", **fields))
    assert "\n" not in line
    assert json.loads(line) == {
        "ts": "2026-12-01T18:41:35.995Z",
        "level": "WARNING",
        "logger": "rabbit_delay.worker",
        "message": "orders: m-1 failed",
        "message_id": "m-1",
        "queue": "orders",
        "attempt": 2,
        "tier": "1s",
        "next_tier": "5m",
    }


def test_a_json_line_has_the_traceback_as_one_field_and_no_password() -> None:
    try:
        raise ValueError(f"cannot reach amqp://app:{SECRET}@rabbit:5672/")
    except ValueError:
        import sys

        rec = record("lost amqp://app:%s@rabbit/", SECRET)
        rec.exc_info = sys.exc_info()
    line = JsonFormatter().format(rec)
    data = json.loads(line)
    assert data["message"] == "lost amqp://app:***@rabbit/"
    assert data["exc_info"].startswith("Traceback (most recent call last):")
    assert "ValueError: cannot reach amqp://app:***@rabbit:5672/" in data["exc_info"]
    assert SECRET not in line
    assert "\n" not in line


def test_text_lines_are_stamped_in_utc_and_redacted() -> None:
    line = TextFormatter().format(record("lost amqp://app:%s@rabbit/", SECRET))
    assert (
        line == "2026-12-01T18:41:35.995Z WARNING rabbit_delay.worker: lost amqp://app:***@rabbit/"
    )


def test_what_a_worker_logs_about_a_delivery_carries_its_fields(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="rabbit_delay.worker")
    log_action("orders", "m-1", 3, Ack(), "1s")
    [rec] = caplog.records
    assert (rec.queue, rec.message_id, rec.attempt, rec.tier) == ("orders", "m-1", 3, "1s")  # type: ignore[attr-defined]
