"""The dashboard's HTTP layer (rabbit_delay._ops.dashboard.server) on a fake backend:
routes, the security headers, who may act, auth, and that no page loads anything from elsewhere or
shows a secret. The same app against a real broker: tests/integration/test_dashboard.py."""

from __future__ import annotations

import base64
import io
import json
import logging
import re
from dataclasses import dataclass, field
from importlib import resources
from typing import Any
from wsgiref.util import setup_testing_defaults

import pytest
from typer.testing import CliRunner

from rabbit_delay import BrokerUnavailable, MissingObjectError, StoreError, Topology
from rabbit_delay._cli.app import app
from rabbit_delay._ops.dashboard.rules import (
    TIMELINE_BUCKET_MS,
    TOKEN_HEADER,
    Auth,
    Timeline,
    timelines,
)
from rabbit_delay._ops.dashboard.server import CSP, Dashboard
from rabbit_delay._ops.parked.rules import ParkedDetail, ParkedPage, find, page
from rabbit_delay._ops.replay.rules import Moved, ReplayReport
from rabbit_delay._ops.status.rules import Status
from rabbit_delay._ops.stored import Stored
from rabbit_delay._schedule.records import Payload, ScheduleRecord, ScheduleState

from .test_dashboard import Counts, a_status, a_topology

SECRET = "s3cret-pw"
TOKEN_SECRET = "t0ken-s3cret"
T0 = 1_796_150_400_000  # 2026-12-01T18:40:00.000Z
XSS = '<script>alert("k")</script>'


def stored(i: int) -> Stored:
    return Stored(
        body=json.dumps({"n": i}).encode(),
        message_id=f"m{i}",
        content_type="application/json",
        headers={
            "rd-error-type": "ValueError",
            "rd-error-message": f"boom {i}",
            "rd-error-traceback": f"Traceback\nValueError: boom {i}",
            "rd-attempt": 3,
        },
        exchange="pic.v1.parking",
        routing_key="pic.v1.q.push",
        timestamp=1_700_000_000,
    )


@dataclass
class FakeBackend:
    topology: Topology
    broker: str = f"amqp://ops:{SECRET}@rabbit:5672/"
    messages: list[Stored] = field(default_factory=lambda: [stored(i) for i in range(120)])
    status_reads: int = 0
    replays: list[tuple[str, str | None, str | None]] = field(default_factory=list)
    purges: list[str] = field(default_factory=list)
    down: bool = False
    # the schedule (a topology with [schedule])
    records: dict[str, ScheduleRecord] = field(default_factory=dict)
    schedule_reads: int = 0
    lookups: list[str] = field(default_factory=list)
    store_down: bool = False

    def read_status(self) -> Status:
        self.status_reads += 1
        if self.down:
            raise BrokerUnavailable(f"cannot reach {self.broker}")
        n = self.topology.names
        status = a_status(self.topology, **{n.parking_queue("push"): Counts(len(self.messages))})
        status.broker = self.broker  # unredacted on purpose: the pages must redact it
        return status

    def _lot(self, queue: str) -> str:
        if queue not in self.topology.queues:
            raise MissingObjectError(f"parking lot for {queue!r} does not exist")
        return self.topology.names.parking_queue(queue)

    def parked_page(self, queue: str, offset: int, limit: int) -> tuple[ParkedPage, int | None]:
        lot = self._lot(queue)
        chosen = self.messages[offset : offset + limit]
        return page(queue, lot, len(self.messages), offset, limit, chosen), 1_700_000_000_000

    def parked_detail(self, queue: str, message_id: str) -> tuple[str, int, list[ParkedDetail]]:
        return self._lot(queue), len(self.messages), find(self.messages, message_id)

    def replay(self, queue: str, *, message_id: str | None, tier: str | None) -> ReplayReport:
        self.replays.append((queue, message_id, tier))
        report = ReplayReport(self._lot(queue), f"pic.v1.q.{queue} (now)")
        for msg in self.messages:
            if message_id is None or msg.message_id == message_id:
                report.moved.append(Moved(msg.message_id or "", "pic.v1.due", queue))
                if message_id is not None:
                    break
        return report

    def purge(self, queue: str) -> tuple[str, int]:
        self.purges.append(queue)
        return self._lot(queue), len(self.messages)

    def _store(self) -> None:
        if self.store_down:
            raise StoreError(
                f"the schedule's store failed: cannot reach postgresql://rd:{SECRET}@db/rd"
            )

    def read_schedule(self) -> tuple[Timeline, ...]:
        self.schedule_reads += 1
        self._store()
        counts = {"push": [2, 0, 5] + [0] * 21, "orders": [0] * 24}
        late = [record("late", due_ms=T0 - 60_000)]
        return timelines(
            self.topology.queues, counts, late, start_ms=T0, bucket_ms=TIMELINE_BUCKET_MS
        )

    def schedule_record(self, key: str) -> ScheduleRecord | None:
        self.lookups.append(key)
        self._store()
        return self.records.get(key)


def record(key: str, **changes: Any) -> ScheduleRecord:
    fields: dict[str, Any] = {
        "scope": "pic.v1",
        "key": key,
        "generation": 1,
        "state": ScheduleState.SCHEDULED,
        "queue": "push",
        "due_ms": T0 + 5 * 60_000,
        "message_id": f"id-{key}",
        "created_ms": T0,
        "updated_ms": T0,
        "sweep_ms": T0 + 6 * 60_000,
        "payload": Payload(b'{"order": 42}', "application/json"),
    }
    fields.update(changes)
    return ScheduleRecord(**fields)


@dataclass
class Answer:
    status: str
    headers: dict[str, str]
    body: bytes

    @property
    def code(self) -> int:
        return int(self.status.split()[0])

    @property
    def text(self) -> str:
        return self.body.decode()

    def json(self) -> Any:
        return json.loads(self.body)


def call(
    board: Dashboard,
    path: str,
    *,
    method: str = "GET",
    data: dict[str, str] | None = None,
    headers: dict[str, str] | None = None,
    as_json: bool = False,
) -> Answer:
    environ: dict[str, Any] = {}
    setup_testing_defaults(environ)
    path, _, query = path.partition("?")
    body = b""
    if data is not None:
        if as_json:
            body = json.dumps(data).encode()
            environ["CONTENT_TYPE"] = "application/json"
        else:
            body = "&".join(f"{k}={v}" for k, v in data.items()).encode()
            environ["CONTENT_TYPE"] = "application/x-www-form-urlencoded"
    environ.update(
        {
            "REQUEST_METHOD": method,
            "PATH_INFO": path,
            "QUERY_STRING": query,
            "HTTP_HOST": f"127.0.0.1:{board.port}",
            "CONTENT_LENGTH": str(len(body)),
            "wsgi.input": io.BytesIO(body),
        }
    )
    for name, value in (headers or {}).items():
        environ["HTTP_" + name.upper().replace("-", "_")] = value
    seen: dict[str, Any] = {}

    def start_response(status: str, response_headers: list[tuple[str, str]]) -> None:
        seen["status"], seen["headers"] = status, dict(response_headers)

    chunks = board(environ, start_response)
    return Answer(seen["status"], seen["headers"], b"".join(chunks))


def make(*, schedule: bool = False, **options: Any) -> tuple[Dashboard, FakeBackend]:
    backend = FakeBackend(a_topology(schedule={}) if schedule else a_topology())
    options.setdefault("refresh_s", 5.0)
    board = Dashboard(backend, port=8765, **options)
    return board, backend


# -- pages and the API -----------------------------------------------------------------


def test_pages_answer_with_the_security_headers() -> None:
    board, _ = make()
    for path in ("/", "/parked/push", "/api/snapshot", "/api/parked/push", "/static/dashboard.js"):
        answer = call(board, path)
        assert answer.code == 200, (path, answer.text)
        assert answer.headers["Content-Security-Policy"] == CSP
        assert CSP.startswith("default-src 'self'")
        assert answer.headers["X-Content-Type-Options"] == "nosniff"
        assert answer.headers["Cache-Control"] == "no-store"
    assert call(board, "/static/dashboard.css").headers["Content-Type"].startswith("text/css")
    assert call(board, "/static/../pyproject.toml").code == 404
    assert call(board, "/nowhere").code == 404


def test_the_overview_shows_the_picture_tiers_and_what_needs_attention() -> None:
    board, backend = make()
    html = call(board, "/").text
    n = backend.topology.names
    assert '<svg class="topology"' in html
    assert f'data-q="{n.tier_queue("1s")}"' in html
    assert f'data-q="{n.parking_queue("push")}"' in html
    assert "ready 120" in html  # the lot's depth in the picture
    assert '<a href="/parked/push">' in html
    assert "120 message(s) need a human" in html
    assert "rabbit-delay parked list push" in html  # the hint of `status --check`
    assert "RabbitMQ 3.10.8" in html
    assert "no worker metrics given" in html


def test_the_snapshot_is_read_once_per_interval_for_every_page() -> None:
    board, backend = make(refresh_s=60.0)
    for _ in range(20):
        call(board, "/")
        call(board, "/api/snapshot")
    assert backend.status_reads == 1
    data = call(board, "/api/snapshot").json()
    assert data["refresh_s"] == 60.0
    assert data["age_s"] is not None
    assert data["age_s"] >= 0
    assert data["read_at_ms"] > 0


def test_a_broker_that_fails_is_shown_not_a_crash() -> None:
    board, backend = make(refresh_s=1.0)
    backend.down = True
    data = call(board, "/api/snapshot").json()
    assert data["status"] is None
    assert "cannot reach amqp://ops:***@rabbit:5672/" in data["error"]
    html = call(board, "/").text
    assert "no status read yet" in html
    assert SECRET not in html


def test_parked_pages_and_detail() -> None:
    board, _ = make()
    data = call(board, "/api/parked/push?offset=50&limit=20").json()
    assert [m["message_id"] for m in data["messages"]] == [f"m{i}" for i in range(50, 70)]
    assert (data["total"], data["next_offset"]) == (120, 70)
    assert len(call(board, "/api/parked/push").json()["messages"]) == 50  # the default
    assert call(board, "/api/parked/push?limit=0").code == 400
    assert call(board, "/api/parked/push?offset=-3").code == 400
    detail = call(board, "/api/parked/push/m7").json()
    (copy,) = detail["copies"]
    assert copy["traceback"].endswith("ValueError: boom 7")
    assert copy["body"]["encoding"] == "json"
    missing = call(board, "/api/parked/push/nope")
    assert missing.code == 404
    assert missing.json()["kind"] == "MessageNotFound"
    assert call(board, "/api/parked/nosuch").code == 404  # MissingObjectError
    html = call(board, "/parked/push?offset=50").text
    assert "messages 50-99 of 120" in html
    assert 'href="?offset=100&amp;limit=50"' in html
    assert 'href="?offset=0&amp;limit=50"' in html
    assert "boom 51" in html
    assert "read-only" in html  # no action forms
    assert "/api/replay" not in html


# -- actions ----------------------------------------------------------------------------


def test_actions_are_refused_without_allow_actions() -> None:
    board, backend = make()
    for path in ("/api/replay", "/api/purge"):
        answer = call(
            board,
            path,
            method="POST",
            data={"queue": "push", "confirm": "push"},
            headers={TOKEN_HEADER: board.token},
        )
        assert answer.code == 403
        assert answer.json()["kind"] == "read_only"
    assert backend.replays == backend.purges == []
    assert 'name="rd-token"' not in call(board, "/").text  # no token in a read-only page


def test_actions_take_post_only() -> None:
    board, _ = make(allow_actions=True)
    for path in ("/api/replay", "/api/purge"):
        answer = call(board, path)
        assert answer.code == 405
        assert answer.headers["Allow"] == "POST"
    assert call(board, "/", method="POST").code == 405
    assert call(board, "/api/snapshot", method="DELETE").code == 405


def test_every_action_needs_the_token(caplog: pytest.LogCaptureFixture) -> None:
    board, backend = make(allow_actions=True)
    for headers in ({}, {TOKEN_HEADER: "wrong"}, {TOKEN_HEADER: ""}):
        answer = call(board, "/api/replay", method="POST", data={"queue": "push"}, headers=headers)
        assert answer.code == 403, headers
        assert answer.json()["kind"] == "token"
    assert backend.replays == []
    html = call(board, "/parked/push").text
    assert f'<meta name="rd-token" content="{board.token}">' in html
    assert f'name="token" value="{board.token}"' in html  # forms work without the script
    assert len(board.token) >= 40
    # In the header, as a form field, or in a JSON body.
    with caplog.at_level(logging.DEBUG, logger="rabbit_delay"):
        ok = call(
            board,
            "/api/replay",
            method="POST",
            data={"queue": "push", "message_id": "m3"},
            headers={TOKEN_HEADER: board.token},
        )
    assert ok.code == 200, ok.text
    assert ok.json()["message_ids"] == ["m3"]
    form = call(
        board,
        "/api/replay",
        method="POST",
        data={"queue": "push", "tier": "30m", "token": board.token},
    )
    assert form.code == 200
    as_json = call(
        board,
        "/api/replay",
        method="POST",
        data={"queue": "push", "token": board.token},
        as_json=True,
    )
    assert as_json.code == 200
    assert backend.replays == [("push", "m3", None), ("push", None, "30m"), ("push", None, None)]
    assert board.token not in caplog.text


def test_replaying_a_message_that_is_not_there_is_404() -> None:
    board, _ = make(allow_actions=True)
    answer = call(
        board,
        "/api/replay",
        method="POST",
        data={"queue": "push", "message_id": "gone"},
        headers={TOKEN_HEADER: board.token},
    )
    assert answer.code == 404
    assert "nothing replayed" in answer.json()["error"]


def test_purge_needs_the_queue_name_as_confirmation() -> None:
    board, backend = make(allow_actions=True)
    token = {TOKEN_HEADER: board.token}
    for confirm in (None, "", "yes", "orders"):
        data = {"queue": "push"} | ({"confirm": confirm} if confirm is not None else {})
        answer = call(board, "/api/purge", method="POST", data=data, headers=token)
        assert answer.code == 400, confirm
        assert answer.json()["kind"] == "confirm"
    assert backend.purges == []
    done = call(
        board, "/api/purge", method="POST", data={"queue": "push", "confirm": "push"}, headers=token
    )
    assert done.json() == {"parking_queue": "pic.v1.parking.push", "purged": 120}
    lot = call(
        board,
        "/api/purge",
        method="POST",
        data={"queue": "push", "confirm": "pic.v1.parking.push"},
        headers=token,
    )
    assert lot.code == 200
    assert backend.purges == ["push", "push"]
    missing = call(board, "/api/purge", method="POST", data={"confirm": "push"}, headers=token)
    assert missing.code == 400


# -- who may ask ------------------------------------------------------------------------


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def test_with_auth_every_request_needs_credentials() -> None:
    board, _ = make(auth=Auth("ops", SECRET), host="0.0.0.0")
    for path in ("/", "/api/snapshot", "/static/dashboard.js", "/api/replay"):
        answer = call(board, path)
        assert answer.code == 401, path
        assert answer.headers["WWW-Authenticate"].startswith("Basic realm=")
    assert call(board, "/", headers={"Authorization": basic("ops", "nope")}).code == 401
    ok = call(board, "/", headers={"Authorization": basic("ops", SECRET)})
    assert ok.code == 200
    assert SECRET not in ok.text
    tokened, _ = make(auth=Auth(None, TOKEN_SECRET), host="0.0.0.0")
    assert call(tokened, "/api/snapshot").code == 401
    assert (
        call(tokened, "/api/snapshot", headers={"Authorization": f"Bearer {TOKEN_SECRET}"}).code
        == 200
    )


def test_a_loopback_dashboard_answers_loopback_host_names_only() -> None:
    """A page elsewhere must not read it through a DNS name rebound to 127.0.0.1."""
    board, _ = make()
    assert call(board, "/", headers={"Host": "localhost:8765"}).code == 200
    assert call(board, "/", headers={"Host": "[::1]:8765"}).code == 200
    assert call(board, "/", headers={"Host": "evil.example:8765"}).code == 421


def test_no_page_loads_anything_from_elsewhere() -> None:
    board, _ = make(allow_actions=True)
    pages = [call(board, p).text for p in ("/", "/parked/push")]
    for html in pages:
        for attr in re.findall(r'\s(?:src|href|action)="([^"]*)"', html):
            # same origin, nothing else (no //host/, no scheme)
            assert attr.startswith(("/", "?", "#")), attr
            assert not attr.startswith("//"), attr
        assert "@import" not in html
    script = call(board, "/static/dashboard.js").text
    style = call(board, "/static/dashboard.css").text
    assert not re.search(r"https?://", script + style)
    assert "url(" not in style
    assert "style=" not in "".join(pages)  # CSP: no inline style attributes
    assert "<script>" not in "".join(pages)  # nor inline scripts


def test_the_script_and_stylesheet_are_package_data() -> None:
    static = resources.files("rabbit_delay._ops.dashboard").joinpath("static")
    assert static.joinpath("dashboard.js").is_file()
    assert static.joinpath("dashboard.css").is_file()


def test_secrets_never_reach_pages_answers_or_logs(caplog: pytest.LogCaptureFixture) -> None:
    board, backend = make(allow_actions=True, auth=Auth("ops", SECRET))
    creds = {"Authorization": basic("ops", SECRET)}
    with caplog.at_level(logging.DEBUG, logger="rabbit_delay"):
        texts = [call(board, p, headers=creds).text for p in ("/", "/api/snapshot", "/parked/push")]
        call(board, "/api/replay", method="POST", data={"queue": "push"}, headers=creds)
    assert "amqp://ops:***@rabbit:5672/" in texts[0]
    for text in [*texts, caplog.text]:
        assert SECRET not in text
    assert backend.status_reads == 1


# -- the schedule ---------------------------------------------------------------------------


def test_a_topology_without_a_schedule_shows_nothing_new() -> None:
    board, backend = make()
    html = call(board, "/").text
    assert 'id="schedule"' not in html
    assert "/schedule" not in html
    for path in ("/api/schedule", "/api/schedule/record?key=k"):
        answer = call(board, path)
        assert answer.code == 404, path
        assert answer.json()["kind"] == "no_schedule"
        assert "has no schedule" in answer.json()["error"]
    assert call(board, "/schedule?key=k").code == 404
    assert "schedule" not in call(board, "/api/snapshot").json()
    assert backend.schedule_reads == 0
    assert backend.lookups == []


def test_the_overview_shows_what_comes_due_and_a_search_box() -> None:
    board, backend = make(schedule=True)
    html = call(board, "/").text
    assert '<section id="schedule">' in html
    assert '<form class="search" id="schedule-search" method="get" action="/schedule">' in html
    assert 'data-queues="orders,push"' in html
    assert '<figure class="series" data-tq="push">' in html
    assert "7 due in the next 6h; 1 past due, not handled yet" in html
    assert "nothing due in the next 6h" in html  # orders
    assert html.count('<rect class="bar"') == 48  # two queues, 24 buckets each
    assert ">now</text>" in html
    assert ">+1h</text>" in html
    assert "2026-12-01T18:40:00.000Z to 2026-12-01T18:55:00.000Z: 2" in html
    for _ in range(10):  # read at most once per refresh interval, like the snapshot
        call(board, "/")
        call(board, "/api/schedule")
    assert backend.schedule_reads == 1


def test_the_schedule_api() -> None:
    board, backend = make(schedule=True)
    backend.records["order-42"] = record("order-42")
    data = call(board, "/api/schedule").json()
    assert (data["span_ms"], data["bucket_ms"], data["error"]) == (21_600_000, 900_000, None)
    assert data["read_at_ms"] > 0
    push = {q["queue"]: q for q in data["queues"]}["push"]
    assert [b["count"] for b in push["buckets"][:3]] == [2, 0, 5]
    assert (push["total"], push["past_due"]) == (7, 1)
    found = call(board, "/api/schedule/record?key=order-42")
    assert found.code == 200
    assert found.json() == backend.records["order-42"].as_dict()
    assert found.json()["body_bytes"] == 13
    unknown = call(board, "/api/schedule/record?key=nope")
    assert unknown.code == 404
    assert unknown.json() == {
        "error": "unknown key 'nope': never scheduled, or purged after its retention",
        "kind": "UnknownKey",
    }
    for query in ("", "?key=", "?key=" + "k" * 256):
        bad = call(board, "/api/schedule/record" + query)
        assert bad.code == 400, query
        assert bad.json()["kind"] == "ConfigError"
    assert backend.lookups == ["order-42", "nope"]  # a bad key never reaches the store
    spaced = call(board, "/api/schedule/record?key=order%2042%2F%C3%A9")
    assert spaced.code == 404
    assert "'order 42/é'" in spaced.json()["error"]  # decoded once, as UTF-8


def test_the_key_page_shows_a_record_or_says_it_is_unknown() -> None:
    board, backend = make(schedule=True)
    backend.records[XSS] = record(XSS, last_error=f"boom at amqp://u:{SECRET}@h/")
    empty = call(board, "/schedule")
    assert empty.code == 200
    assert 'id="schedule-search"' in empty.text
    assert "schedule-record" not in empty.text
    quoted = "%3Cscript%3Ealert(%22k%22)%3C%2Fscript%3E"
    found = call(board, f"/schedule?key={quoted}")
    assert found.code == 200
    assert "<script>alert" not in found.text  # escaped everywhere: the title, the box, the page
    assert "&lt;script&gt;alert(&quot;k&quot;)&lt;/script&gt;" in found.text
    assert '<dl id="schedule-record">' in found.text
    assert '<dd data-f="state">scheduled</dd>' in found.text
    assert '<dd data-f="body">13 bytes (application/json)</dd>' in found.text
    assert "amqp://u:***@h/" in found.text
    assert SECRET not in found.text
    missing = call(board, "/schedule?key=nope")
    assert missing.code == 404
    assert '<p class="error" id="schedule-missing">unknown key &#x27;nope&#x27;' in missing.text
    assert call(board, "/schedule?key=" + "k" * 256).code == 400


def test_a_store_that_fails_is_shown_not_a_crash() -> None:
    board, backend = make(schedule=True, refresh_s=1.0)
    backend.store_down = True
    data = call(board, "/api/schedule").json()
    assert data["queues"] == []
    assert "cannot reach postgresql://rd:***@db/rd" in data["error"]
    html = call(board, "/")
    assert html.code == 200
    assert "cannot reach postgresql://rd:***@db/rd" in html.text
    assert "ready 120" in html.text  # the broker's part is still there
    lookup = call(board, "/api/schedule/record?key=k")
    assert lookup.code == 503
    assert lookup.json()["kind"] == "StoreError"
    page_answer = call(board, "/schedule?key=k")
    assert page_answer.code == 503
    for text in (json.dumps(data), html.text, lookup.text, page_answer.text):
        assert SECRET not in text


def test_the_schedule_pages_load_nothing_from_elsewhere() -> None:
    board, backend = make(schedule=True)
    backend.records["k"] = record("k")
    for path in ("/", "/schedule", "/schedule?key=k", "/schedule?key=nope"):
        html = call(board, path).text
        for attr in re.findall(r'\s(?:src|href|action)="([^"]*)"', html):
            assert attr.startswith(("/", "?", "#")), (path, attr)
        assert "style=" not in html
        assert "<script>" not in html


# -- the command ------------------------------------------------------------------------


def test_the_command_refuses_a_public_host_without_auth(tmp_path: Any) -> None:
    path = tmp_path / "t.toml"
    path.write_text('namespace = "shop"\n[tiers]\n1s = "1s"\n[queues.push]\n', encoding="utf-8")
    result = CliRunner().invoke(app, ["dashboard", str(path), "--host", "0.0.0.0", "--json"])
    assert result.exit_code == 1
    data = json.loads(result.stdout)
    assert data["kind"] == "ConfigError"
    assert "--host 0.0.0.0 is not a loopback address" in data["error"]
    slow = CliRunner().invoke(app, ["dashboard", str(path), "--refresh", "100ms"])
    assert slow.exit_code == 1
    assert "--refresh 100ms: at least 1s" in slow.stderr
    bad_auth = CliRunner().invoke(app, ["dashboard", str(path), "--auth", "ops:"])
    assert bad_auth.exit_code == 1
    assert "--auth: give user:password" in bad_auth.stderr
