"""The dashboard's HTTP layer: a WSGI app on the standard library's server.

Routes (GET unless said):

    /                               the overview (picture, tiers, queues, lateness)
    /parked/<queue>?offset=&limit=  a page of a parking lot, actions when allowed
    /static/dashboard.js|.css       the package's own script and stylesheet
    /api/snapshot                   the overview as JSON (what the script refreshes from)
    /api/parked/<queue>?offset=&limit=
    /api/parked/<queue>/<message_id>   one message in full (traceback, body)
    /schedule?key=                  a schedule key's record, and the search box
                                    (a topology with [schedule]; 404 without)
    /api/schedule                   per queue, what comes due in the next hours
    /api/schedule/record?key=       a key's record (as `scheduled show --json`)
    POST /api/replay                queue, [message_id], [tier]      (--allow-actions)
    POST /api/purge                 queue, confirm=<the queue name>  (--allow-actions)

Every request passes `Dashboard.refuse` first: the Host header (no DNS rebinding onto a
loopback dashboard), then --auth. Every action then needs POST (405), actions switched
on (403), and the per-run token (403), in a header or a form field.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import parse_qs, unquote
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from rabbit_delay._errors import (
    BrokerError,
    ConfigError,
    MissingObjectError,
    RabbitDelayError,
    StoreError,
)
from rabbit_delay._ops.dashboard import html as _html
from rabbit_delay._ops.dashboard.rules import (
    DEFAULT_HOST,
    TOKEN_FIELD,
    TOKEN_HEADER,
    Auth,
    Cached,
    Histogram,
    Poller,
    Timeline,
    action_token_ok,
    age_s,
    check_binding,
    is_loopback,
    lateness_histograms,
    page_bounds,
    schedule_json,
    schedule_key,
    snapshot_json,
)
from rabbit_delay._ops.parked.rules import ParkedDetail, ParkedPage
from rabbit_delay._ops.replay.rules import ReplayReport
from rabbit_delay._ops.scheduled.rules import unknown_key
from rabbit_delay._ops.status.rules import Status
from rabbit_delay._schedule.records import ScheduleRecord
from rabbit_delay._topology.model import Topology
from rabbit_delay._urls import redact

if TYPE_CHECKING:
    from wsgiref.types import StartResponse, WSGIEnvironment

log = logging.getLogger("rabbit_delay.dashboard")

CSP = "default-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'"
_COMMON = [
    ("Content-Security-Policy", CSP),
    ("X-Content-Type-Options", "nosniff"),
    ("Referrer-Policy", "no-referrer"),
    ("X-Frame-Options", "DENY"),
    ("Cache-Control", "no-store"),
]
_STATIC = {
    "dashboard.js": "application/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}
SCRAPE_TIMEOUT_S = 2.0
# A POST body larger than this is refused: an action is a few form fields.
MAX_BODY = 64 * 1024


class Backend(Protocol):
    """What the dashboard reads and does (`rabbit_delay._ops.dashboard.execute.BrokerBackend`)."""

    topology: Topology

    def read_status(self) -> Status: ...

    def parked_page(self, queue: str, offset: int, limit: int) -> tuple[ParkedPage, int | None]: ...

    def parked_detail(self, queue: str, message_id: str) -> tuple[str, int, list[ParkedDetail]]: ...

    def replay(self, queue: str, *, message_id: str | None, tier: str | None) -> ReplayReport: ...

    def purge(self, queue: str) -> tuple[str, int]: ...

    def read_schedule(self) -> tuple[Timeline, ...]: ...

    def schedule_record(self, key: str) -> ScheduleRecord | None: ...


@dataclass(frozen=True, slots=True)
class Snapshot:
    status: Status
    lateness: tuple[Histogram, ...]
    metric_errors: tuple[str, ...]


def scrape(url: str, timeout: float = SCRAPE_TIMEOUT_S) -> str:
    """The Prometheus text at `url`. Raises OSError (urllib's errors) when unreachable."""
    with urllib.request.urlopen(url, timeout=timeout) as answer:
        return str(answer.read().decode("utf-8"))


@dataclass
class Response:
    status: str
    body: bytes
    content_type: str = "text/html; charset=utf-8"
    headers: list[tuple[str, str]] = field(default_factory=list)


def _json(status: str, data: Any) -> Response:
    body = redact(json.dumps(data, default=str)).encode()
    return Response(status, body, "application/json")


def _error(status: str, message: str, kind: str) -> Response:
    return _json(status, {"error": redact(message), "kind": kind})


def _status_of(exc: RabbitDelayError) -> str:
    if isinstance(exc, MissingObjectError):
        return "404 Not Found"
    if isinstance(exc, ValueError):  # ConfigError, UnknownTargetError, DelayError
        return "400 Bad Request"
    if isinstance(exc, BrokerError | StoreError):
        return "503 Service Unavailable"
    return "500 Internal Server Error"


class Dashboard:
    """The dashboard's state for one run: the backend, the one snapshot poller, the
    per-run action token, and the settings the command was given."""

    def __init__(
        self,
        backend: Backend,
        *,
        refresh_s: float,
        metrics_urls: Sequence[str] = (),
        allow_actions: bool = False,
        auth: Auth | None = None,
        host: str = DEFAULT_HOST,
        port: int = 0,
        scraper: Callable[[str], str] = scrape,
    ) -> None:
        self.backend = backend
        self.topology = backend.topology
        self.refresh_s = refresh_s
        self.metrics_urls = tuple(metrics_urls)
        self.allow_actions = allow_actions
        self.auth = auth
        self.host = host
        self.port = port
        self.scraper = scraper
        self.token = secrets.token_urlsafe(32)
        self.poller: Poller[Snapshot] = Poller(
            self._read, refresh_s, errors=(RabbitDelayError,), describe=lambda x: redact(str(x))
        )
        # The schedule's timelines (a topology with [schedule]): read from its store at
        # most once per refresh too, apart from the broker's snapshot (one can fail
        # while the other answers).
        self.schedule_poller: Poller[tuple[Timeline, ...]] | None = None
        if self.topology.schedule is not None:
            self.schedule_poller = Poller(
                backend.read_schedule,
                refresh_s,
                errors=(RabbitDelayError,),
                describe=lambda x: redact(str(x)),
            )

    # -- the snapshot ---------------------------------------------------------------------

    def _read(self) -> Snapshot:
        status = self.backend.read_status()
        texts, errors = [], []
        for url in self.metrics_urls:
            try:
                texts.append(self.scraper(url))
            except (OSError, ValueError) as exc:
                errors.append(f"metrics {redact(url)}: {redact(str(exc))}")
        try:
            found = lateness_histograms(texts, self.topology.queues)
        except ValueError as exc:  # not Prometheus text
            found, errors = [], [*errors, f"metrics: not Prometheus text ({exc})"]
        return Snapshot(status, tuple(found), tuple(errors))

    def snapshot(self) -> dict[str, Any]:
        state = self.poller.get()
        snap = state.value
        return snapshot_json(
            snap.status if snap is not None else None,
            snap.lateness if snap is not None else (),
            snap.metric_errors if snap is not None else (),
            read_at_ms=state.read_at_ms,
            age=age_s(state, self.poller.clock()),
            took_s=state.took_s,
            error=state.error,
            refresh_s=self.refresh_s,
            actions=self.allow_actions,
            names=self.topology.names,
        )

    def schedule(self) -> dict[str, Any] | None:
        """What `/api/schedule` answers; None for a topology without [schedule]."""
        if self.schedule_poller is None:
            return None
        state = self.schedule_poller.get()
        return schedule_json(
            state.value,
            read_at_ms=state.read_at_ms,
            age=age_s(state, self.schedule_poller.clock()),
            error=state.error,
            refresh_s=self.refresh_s,
        )

    # -- who may ask ----------------------------------------------------------------------

    def refuse(self, environ: WSGIEnvironment) -> Response | None:
        """Why this request may not be answered at all, or None."""
        if self.auth is None:
            # Loopback without auth: a web page elsewhere must not reach it through a
            # DNS name rebound to 127.0.0.1; only loopback Host headers are answered.
            host = str(environ.get("HTTP_HOST") or "").lower()
            if not _loopback_host(host):
                return _error("421 Misdirected Request", f"unexpected Host {host!r}", "host")
            return None
        if not self.auth.allows(environ.get("HTTP_AUTHORIZATION")):
            response = _error("401 Unauthorized", "authentication required", "auth")
            response.headers.append(
                ("WWW-Authenticate", 'Basic realm="rabbit-delay dashboard", charset="UTF-8"')
            )
            return response
        return None

    # -- the app --------------------------------------------------------------------------

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        try:
            response = self.refuse(environ) or self.route(environ)
        except Exception:  # never a traceback to the client, nor a secret in the log
            log.exception("dashboard request %s failed", environ.get("PATH_INFO"))
            response = _error(
                "500 Internal Server Error", "internal error (see the log)", "internal"
            )
        headers = [
            ("Content-Type", response.content_type),
            ("Content-Length", str(len(response.body))),
            *_COMMON,
            *response.headers,
        ]
        start_response(response.status, headers)
        return [response.body]

    def route(self, environ: WSGIEnvironment) -> Response:
        method = str(environ.get("REQUEST_METHOD") or "GET").upper()
        path = str(environ.get("PATH_INFO") or "/")
        query = parse_qs(str(environ.get("QUERY_STRING") or ""))
        if path in ("/api/replay", "/api/purge"):
            if method != "POST":
                response = _error("405 Method Not Allowed", f"{path} takes POST only", "method")
                response.headers.append(("Allow", "POST"))
                return response
            return self.action(path, environ)
        if method not in ("GET", "HEAD"):
            response = _error("405 Method Not Allowed", f"{path} takes GET only", "method")
            response.headers.append(("Allow", "GET, HEAD"))
            return response
        try:
            return self.get(path, query)
        except RabbitDelayError as exc:
            if path.startswith("/api/"):
                return _error(_status_of(exc), str(exc), type(exc).__name__)
            return self.page("error", _html.error_page(str(exc)), _status_of(exc))

    def page(self, title: str, body: str, status: str = "200 OK", name: str = "other") -> Response:
        token = self.token if self.allow_actions else None
        html = _html.layout(title, body, token=token, refresh_s=self.refresh_s, page=name)
        return Response(status, redact(html).encode())

    def get(self, path: str, query: dict[str, list[str]]) -> Response:
        def one(name: str) -> str | None:
            values = query.get(name)
            return values[0] if values else None

        if path == "/":
            state = self.poller.get()
            snap = state.value
            status_state = _status_state(state)
            body = _html.overview(
                status_state,
                age_s(state, self.poller.clock()),
                self.topology.names,
                snap.lateness if snap is not None else (),
                snap.metric_errors if snap is not None else (),
                metrics_given=bool(self.metrics_urls),
                refresh_s=self.refresh_s,
                actions=self.allow_actions,
            )
            if self.schedule_poller is not None:
                timeline = self.schedule_poller.get()
                body += "\n" + _html.schedule_section(timeline, refresh_s=self.refresh_s)
            return self.page(f"dashboard of {self.topology.names.prefix}", body, name="overview")
        if path.startswith("/static/"):
            return _static(path[len("/static/") :])
        if path == "/api/snapshot":
            return _json("200 OK", self.snapshot())
        if path in ("/schedule", "/api/schedule", "/api/schedule/record"):
            return self.scheduled(path, one("key"))
        m = re.fullmatch(r"/(api/)?parked/([^/]+)(?:/(.+))?", path)
        if m is None:
            return _error("404 Not Found", f"no such page: {path}", "not_found")
        api, queue = m[1] is not None, unquote(m[2])
        if m[3] is not None:
            if not api:
                return _error("404 Not Found", f"no such page: {path}", "not_found")
            return self.detail(queue, unquote(m[3]))
        offset, limit = page_bounds(one("offset"), one("limit"))
        found, read_at = self.backend.parked_page(queue, offset, limit)
        if api:
            return _json("200 OK", found.as_json() | {"read_at_ms": read_at})
        body = _html.parked(
            found,
            read_at,
            tiers=list(self.topology.tiers),
            actions=self.allow_actions,
            token=self.token if self.allow_actions else None,
        )
        return self.page(f"parked for {found.queue}", body, name="parked")

    def scheduled(self, path: str, key: str | None) -> Response:
        """The schedule's pages: the timelines as JSON, a key's record as JSON, or the
        key page (the search box, and the record when a key is given)."""
        if self.schedule_poller is None:
            message = (
                f"the topology {self.topology.names.prefix!r} has no schedule: add a "
                "[schedule] table (docs/schedule.md)"
            )
            if path.startswith("/api/"):
                return _error("404 Not Found", message, "no_schedule")
            return self.page("no schedule", _html.error_page(message), "404 Not Found")
        if path == "/api/schedule":
            return _json("200 OK", self.schedule())
        if path == "/schedule" and not key:
            body = _html.schedule_key_page(None, None, now_ms=self.poller.wall_ms())
            return self.page("schedule key", body, name="schedule")
        key = schedule_key(key)
        record = self.backend.schedule_record(key)
        if path == "/api/schedule/record":
            if record is None:
                return _error("404 Not Found", unknown_key(key), "UnknownKey")
            return _json("200 OK", record.as_dict())
        body = _html.schedule_key_page(key, record, now_ms=self.poller.wall_ms())
        status = "200 OK" if record is not None else "404 Not Found"
        return self.page(f"schedule key {key}", body, status, name="schedule")

    def detail(self, queue: str, message_id: str) -> Response:
        lot, total, copies = self.backend.parked_detail(queue, message_id)
        if not copies:
            return _error(
                "404 Not Found",
                f"no message with id {message_id!r} in {lot} ({total} message(s) there)",
                "MessageNotFound",
            )
        return _json(
            "200 OK",
            {
                "parking_queue": lot,
                "message_id": message_id,
                "total": total,
                "copies": [d.as_json() for d in copies],
            },
        )

    # -- actions --------------------------------------------------------------------------

    def action(self, path: str, environ: WSGIEnvironment) -> Response:
        if not self.allow_actions:
            return _error(
                "403 Forbidden",
                "actions are off: start the dashboard with --allow-actions",
                "read_only",
            )
        try:
            form = _form(environ)
        except ConfigError as exc:
            return _error("400 Bad Request", str(exc), "ConfigError")
        given = environ.get("HTTP_" + TOKEN_HEADER.upper().replace("-", "_")) or form.get(
            TOKEN_FIELD
        )
        if not action_token_ok(given, self.token):
            log.warning("refused %s: missing or wrong action token", path)
            return _error(
                "403 Forbidden",
                f"missing or wrong action token (header {TOKEN_HEADER} or field {TOKEN_FIELD})",
                "token",
            )
        queue = form.get("queue")
        if not queue:
            return _error("400 Bad Request", "name the queue (field queue)", "usage")
        try:
            if path == "/api/replay":
                return self.replay(queue, form)
            return self.purge(queue, form)
        except RabbitDelayError as exc:
            log.warning("%s of %s refused: %s", path, queue, redact(str(exc)))
            return _error(_status_of(exc), str(exc), type(exc).__name__)

    def replay(self, queue: str, form: dict[str, str]) -> Response:
        message_id = form.get("message_id") or None
        tier = form.get("tier") or None
        report = self.backend.replay(queue, message_id=message_id, tier=tier)
        self.poller.invalidate()
        if message_id is not None and not report.moved and report.error is None:
            return _error(
                "404 Not Found",
                f"no message with id {message_id!r} in {report.source}: nothing replayed",
                "MessageNotFound",
            )
        status = "200 OK" if report.error is None else "502 Bad Gateway"
        return _json(status, report.as_json())

    def purge(self, queue: str, form: dict[str, str]) -> Response:
        names = self.topology.names
        confirm = form.get("confirm") or ""
        # The page asks for the queue's name; either of its names confirms.
        accepted = {queue}
        if queue in self.topology.queues:
            accepted.add(names.parking_queue(queue))
        if confirm not in accepted:
            return _error(
                "400 Bad Request",
                f"purging deletes every message parked for {queue}: confirm with confirm={queue}",
                "confirm",
            )
        lot, purged = self.backend.purge(queue)
        self.poller.invalidate()
        return _json("200 OK", {"parking_queue": lot, "purged": purged})


def _loopback_host(host: str) -> bool:
    name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
    return is_loopback(name.strip("[]"))


def _status_state(state: Cached[Snapshot]) -> Cached[Status]:
    """The snapshot's state with its Status as the value (what the overview renders)."""
    snap = state.value
    return Cached(
        snap.status if snap is not None else None,
        state.read_at,
        state.read_at_ms,
        state.took_s,
        state.error,
        state.reads,
    )


def _form(environ: WSGIEnvironment) -> dict[str, str]:
    """The fields of a POST: form-encoded or a JSON object. Raises ConfigError."""
    try:
        size = int(environ.get("CONTENT_LENGTH") or 0)
    except ValueError:
        raise ConfigError("bad Content-Length") from None
    if size > MAX_BODY:
        raise ConfigError(f"request body over {MAX_BODY} bytes")
    raw = environ["wsgi.input"].read(size) if size else b""
    kind = str(environ.get("CONTENT_TYPE") or "").split(";")[0].strip().lower()
    if kind == "application/json":
        try:
            data = json.loads(raw or b"{}")
        except ValueError:
            raise ConfigError("the body is not JSON") from None
        if not isinstance(data, dict):
            raise ConfigError("the body must be a JSON object")
        return {str(k): str(v) for k, v in data.items() if v is not None}
    fields = parse_qs(raw.decode("utf-8", errors="replace"), keep_blank_values=True)
    return {k: v[0] for k, v in fields.items()}


def _static(name: str) -> Response:
    if name not in _STATIC:
        return _error("404 Not Found", f"no such file: {name}", "not_found")
    data = resources.files("rabbit_delay._ops.dashboard").joinpath("static", name).read_bytes()
    return Response("200 OK", data, _STATIC[name])


# -- the server ------------------------------------------------------------------------------


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    allow_reuse_address = True
    # socketserver's default backlog is 5: a sixth page connecting at the same moment
    # had its SYN dropped and retried a second later (measured: p99 1.07 s for 20
    # clients, for a 136 ms read).
    request_queue_size = 128


class _Server6(_Server):
    address_family = socket.AF_INET6


class _Handler(WSGIRequestHandler):
    """Requests at debug level on `rabbit_delay.dashboard` (the page polls every few
    seconds); never the query string, which could hold a token in a bad client."""

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), self.requestline.split("?", 1)[0])

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        log.debug("%s %s -> %s", self.address_string(), self.requestline.split("?", 1)[0], code)


def serve(dashboard: Dashboard, host: str, port: int) -> tuple[WSGIServer, threading.Thread]:
    """Serve `dashboard` on host:port from a daemon thread (port 0: a free port, see
    `server.server_port`). Raises ConfigError for anything but loopback without auth,
    OSError when the address is taken."""
    check_binding(host, dashboard.auth)
    server_class = _Server6 if ":" in host else _Server
    server = make_server(host, port, dashboard, server_class=server_class, handler_class=_Handler)
    dashboard.port = server.server_port
    thread = threading.Thread(
        target=server.serve_forever, name="rabbit-delay-dashboard", daemon=True
    )
    thread.start()
    return server, thread


__all__ = ["CSP", "Backend", "Dashboard", "Response", "Snapshot", "scrape", "serve"]
