"""What `rabbit-delay dashboard` decides, with no I/O: who may connect, who may act,
what the topology picture shows, the lateness histograms read from the workers'
Prometheus text, the bounds of a parked page, and the one cached snapshot that every
page and client shares.

The figures themselves are not computed here: queue rows and what needs attention come
from `rabbit_delay._ops.status.rules` (the rules of `status --check`), parked messages from
`rabbit_delay._ops.parked.rules`. The HTTP layer is `rabbit_delay._ops.dashboard.server`;
the broker side is `rabbit_delay._ops.dashboard.execute`.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import ipaddress
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from prometheus_client.parser import text_string_to_metric_families

from rabbit_delay._durations import format_ms, iso_ms
from rabbit_delay._errors import ConfigError
from rabbit_delay._names import Names
from rabbit_delay._observe.metrics import NAMESPACE
from rabbit_delay._ops.parked.rules import DEFAULT_LIMIT, check_page
from rabbit_delay._ops.scheduled.rules import check_key
from rabbit_delay._ops.status.rules import QueueRole, QueueRow, Status
from rabbit_delay._record import fields_json
from rabbit_delay._schedule.records import ScheduleRecord

DEFAULT_PORT = 8765
DEFAULT_HOST = "127.0.0.1"
DEFAULT_REFRESH_S = 5.0
# The broker is read at most this often, whatever --refresh says: a passive declare per
# queue and exchange, and the management API, for every read.
MIN_REFRESH_S = 1.0
# A parked page holds at most this many messages (the page itself is read from a peek of
# the whole lot, so the bound is about the size of the answer, not the broker's work).
MAX_PAGE = 500
TOKEN_HEADER = "X-Rabbit-Delay-Token"
TOKEN_FIELD = "token"
LATENESS_METRIC = f"{NAMESPACE}_delivery_lateness_seconds"


# -- who may connect ------------------------------------------------------------------------


def is_loopback(host: str) -> bool:
    """Whether `host` (what --host names) only listens on this machine."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True, slots=True)
class Auth:
    """`--auth user:password` (HTTP Basic) or `--auth TOKEN` (a bearer token; a browser
    may also send it as the password of HTTP Basic, with any user name)."""

    user: str | None
    secret: str

    def __repr__(self) -> str:  # never show the secret, even in a traceback
        kind = "basic" if self.user is not None else "token"
        return f"Auth({kind}, user={self.user!r})"

    @property
    def kind(self) -> str:
        return "HTTP Basic" if self.user is not None else "bearer token"

    def allows(self, authorization: str | None) -> bool:
        """Whether an `Authorization` header value carries these credentials."""
        if not authorization:
            return False
        scheme, _, value = authorization.strip().partition(" ")
        value = value.strip()
        if scheme.lower() == "bearer":
            return self.user is None and _same(value, self.secret)
        if scheme.lower() != "basic":
            return False
        try:
            decoded = base64.b64decode(value, validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            return False
        user, sep, password = decoded.partition(":")
        if not sep:
            return False
        if self.user is None:
            return _same(password, self.secret)
        # Both compared, always: the time taken tells nothing about which one was wrong.
        user_ok = _same(user, self.user)
        return _same(password, self.secret) and user_ok


def _same(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode("utf-8"), expected.encode("utf-8"))


def parse_auth(value: str | None) -> Auth | None:
    """`user:password` or a token (no colon). Raises ConfigError for an empty part."""
    if value is None:
        return None
    user, sep, secret = value.partition(":")
    if sep:
        if not user or not secret:
            raise ConfigError("--auth: give user:password (both non-empty) or a token")
        return Auth(user, secret)
    if not value.strip():
        raise ConfigError("--auth: give user:password (both non-empty) or a token")
    return Auth(None, value)


def check_binding(host: str, auth: Auth | None) -> None:
    """Refuse to serve anything but loopback without --auth (ConfigError)."""
    if auth is None and not is_loopback(host):
        raise ConfigError(
            f"--host {host} is not a loopback address: anyone who reaches it could read the "
            "parking lots (and act, with --allow-actions). Give --auth user:password (or "
            "--auth TOKEN), or keep the default --host 127.0.0.1"
        )


def action_token_ok(given: str | None, expected: str) -> bool:
    """Whether an action carries the per-run token (header or form field)."""
    return given is not None and _same(given, expected)


def start_message(
    host: str, port: int, *, actions: bool, auth: Auth | None, broker: str, refresh_s: float
) -> str:
    """What the command prints when it listens (`broker` already redacted)."""
    shown = f"[{host}]" if ":" in host else host
    return (
        f"rabbit-delay dashboard on http://{shown}:{port}/ (broker {broker}, refresh "
        f"{refresh_s:g}s); actions: {'ON (--allow-actions)' if actions else 'off (read-only)'}; "
        f"auth: {f'on ({auth.kind})' if auth is not None else 'off (loopback only)'}"
    )


# -- parked pages --------------------------------------------------------------------------


def page_bounds(offset: str | None, limit: str | None) -> tuple[int, int]:
    """(offset, limit) of a parked page from query parameters: defaults 0 and 50, limit
    capped at MAX_PAGE. Raises ConfigError for anything but non-negative integers."""

    def number(text: str | None, name: str, default: int) -> int:
        if text is None or text == "":
            return default
        try:
            return int(text)
        except ValueError:
            raise ConfigError(f"{name} {text!r} is not a whole number") from None

    start = number(offset, "offset", 0)
    size = number(limit, "limit", DEFAULT_LIMIT)
    check_page(start, size)  # the rule `parked list` applies
    return start, min(size, MAX_PAGE)


# -- lateness histograms -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Histogram:
    """One queue and tier's lateness, summed over every worker scraped: `counts[i]`
    observations at most `bounds[i]` seconds late and more than `bounds[i-1]`; the last
    bound is +Inf."""

    queue: str
    tier: str
    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    total: int
    sum_s: float

    def quantile(self, q: float) -> float | None:
        """The upper bound of the bucket holding quantile `q` (None: no observation).
        +Inf when it lies past the last finite bound."""
        if self.total <= 0:
            return None
        rank = q * self.total
        seen = 0
        for bound, count in zip(self.bounds, self.counts, strict=True):
            seen += count
            if seen >= rank:
                return bound
        return self.bounds[-1]

    def as_json(self) -> dict[str, Any]:
        def bound(b: float) -> float | str:
            return "+Inf" if math.isinf(b) else b

        p50, p99 = self.quantile(0.5), self.quantile(0.99)
        return {
            "queue": self.queue,
            "tier": self.tier,
            "buckets": [
                {"le": bound(b), "count": c} for b, c in zip(self.bounds, self.counts, strict=True)
            ],
            "count": self.total,
            "sum_s": self.sum_s,
            "mean_s": self.sum_s / self.total if self.total else None,
            "p50_le_s": bound(p50) if p50 is not None else None,
            "p99_le_s": bound(p99) if p99 is not None else None,
        }


def lateness_histograms(
    texts: Iterable[str], queues: Iterable[str] | None = None
) -> list[Histogram]:
    """The lateness histograms (`rabbit_delay_delivery_lateness_seconds{queue,tier}`) in
    the Prometheus text of each worker, summed per queue and tier, sorted by both.
    `queues` keeps only those queues (the topology's). Raises ValueError for text that
    is not Prometheus exposition format."""
    wanted = set(queues) if queues is not None else None
    cumulative: dict[tuple[str, str], dict[float, float]] = {}
    counts: dict[tuple[str, str], float] = {}
    sums: dict[tuple[str, str], float] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            if family.name != LATENESS_METRIC:
                continue
            for sample in family.samples:
                queue = sample.labels.get("queue")
                tier = sample.labels.get("tier", "none")
                if queue is None or (wanted is not None and queue not in wanted):
                    continue
                key = (queue, tier)
                if sample.name.endswith("_bucket"):
                    le = float(sample.labels["le"])
                    series = cumulative.setdefault(key, {})
                    series[le] = series.get(le, 0.0) + sample.value
                elif sample.name.endswith("_count"):
                    counts[key] = counts.get(key, 0.0) + sample.value
                elif sample.name.endswith("_sum"):
                    sums[key] = sums.get(key, 0.0) + sample.value
    found = []
    for key in sorted(cumulative):
        series = cumulative[key]
        bounds = tuple(sorted(series))
        per_bucket, previous = [], 0.0
        for b in bounds:
            per_bucket.append(max(round(series[b] - previous), 0))
            previous = series[b]
        total = round(counts.get(key, previous))
        found.append(
            Histogram(key[0], key[1], bounds, tuple(per_bucket), total, sums.get(key, 0.0))
        )
    return found


# -- the topology picture ------------------------------------------------------------------

# Columns, left to right, in the order a message travels.
PUBLISH, BUFFERS, DUE, BUSINESS, PARKING = range(5)
NODE_W, NODE_H, GAP_Y, COL_W, MARGIN = 190, 44, 10, 230, 12


@dataclass(frozen=True, slots=True)
class Node:
    key: str  # the queue name, or "publish", "due", "plugin"
    label: str
    column: int
    row: int
    role: str
    ready: int | None = None
    unacked: int | None = None
    consumers: int | None = None
    attention: bool = False
    notes: tuple[str, ...] = ()
    queue: str | None = None  # the logical business queue of a business queue or lot

    @property
    def x(self) -> int:
        return MARGIN + self.column * COL_W

    @property
    def y(self) -> int:
        return MARGIN + self.row * (NODE_H + GAP_Y)

    def as_json(self) -> dict[str, Any]:
        return fields_json(
            self,
            "key",
            "label",
            "column",
            "row",
            "role",
            "ready",
            "unacked",
            "consumers",
            "attention",
            "queue",
        )


@dataclass(frozen=True, slots=True)
class Picture:
    """publish -> tier buffers (cascade levels, plugin) -> due exchange -> business
    queues -> parking lots, and the catch-all under the due exchange."""

    nodes: tuple[Node, ...]
    edges: tuple[tuple[str, str], ...]  # (from key, to key)

    @property
    def width(self) -> int:
        return 2 * MARGIN + (PARKING + 1) * COL_W - (COL_W - NODE_W)

    @property
    def height(self) -> int:
        rows = max((n.row for n in self.nodes), default=0) + 1
        return 2 * MARGIN + rows * (NODE_H + GAP_Y)

    def node(self, key: str) -> Node:
        return next(n for n in self.nodes if n.key == key)


def _label(names: Names, name: str) -> str:
    """A queue's name in the picture: without the `{namespace}.v{version}.` prefix."""
    head = names.prefix + "."
    return name[len(head) :] if name.startswith(head) else name


def picture(status: Status, names: Names) -> Picture:
    """What the topology picture shows, from the same rows `status` prints."""
    nodes: list[Node] = []
    edges: list[tuple[str, str]] = []

    def add(column: int, row: int, q: QueueRow) -> None:
        kind, detail = names.parse(q.name)
        logical = detail if kind in ("q", "parking") else None
        nodes.append(
            Node(
                q.name,
                _label(names, q.name),
                column,
                row,
                q.role.value,
                q.ready,
                q.unacked,
                q.consumers,
                q.attention,
                tuple(q.notes),
                logical,
            )
        )

    by_role: dict[QueueRole, list[QueueRow]] = {role: [] for role in QueueRole}
    for q in status.rows:
        by_role[q.role].append(q)
    nodes.append(Node("publish", "publish", PUBLISH, 0, "publisher"))
    nodes.append(Node("due", "due exchange", DUE, 0, "exchange"))
    row = 0
    for q in by_role[QueueRole.BUFFER] + by_role[QueueRole.CASCADE] + by_role[QueueRole.HOLDING]:
        add(BUFFERS, row, q)
        edges += [("publish", q.name), (q.name, "due")]
        row += 1
    if status.plugin is not None:
        held = status.plugin.delayed
        label = f"plugin store ({'?' if held is None else held})"
        nodes.append(Node("plugin", label, BUFFERS, row, "plugin", held))
        edges += [("publish", "plugin"), ("plugin", "due")]
    lots = {q.name: q for q in by_role[QueueRole.PARKING]}
    for i, q in enumerate(by_role[QueueRole.BUSINESS]):
        add(BUSINESS, i, q)
        edges.append(("due", q.name))
        lot = lots.pop(names.parking_queue(names.parse(q.name)[1]), None)
        if lot is not None:
            add(PARKING, i, lot)
            edges.append((q.name, lot.name))
    for i, lot in enumerate(lots.values()):  # a lot without its business queue: unexpected
        add(PARKING, len(by_role[QueueRole.BUSINESS]) + i, lot)
    for i, q in enumerate(by_role[QueueRole.CATCH_ALL]):
        add(DUE, 1 + i, q)
        edges.append(("due", q.name))
    return Picture(tuple(nodes), tuple(edges))


# -- the one snapshot ----------------------------------------------------------------------

T = TypeVar("T")


@dataclass
class Cached(Generic[T]):
    value: T | None = None
    read_at: float | None = None  # monotonic seconds
    read_at_ms: int | None = None  # wall clock, for people
    took_s: float = 0.0
    error: str | None = None
    reads: int = 0
    stale: bool = False


@dataclass
class Poller(Generic[T]):
    """One reader for every client: `get()` returns the cached value while it is younger
    than `every` seconds; otherwise the first caller reads (holding the lock) and the
    others wait for that read instead of starting their own. A read that fails keeps the
    last good value and records the error. `clock` and `wall_ms` are injected for tests."""

    read: Callable[[], T]
    every: float
    clock: Callable[[], float] = time.monotonic
    wall_ms: Callable[[], int] = field(default=lambda: int(time.time() * 1000))
    errors: tuple[type[BaseException], ...] = (Exception,)
    describe: Callable[[BaseException], str] = str
    _state: Cached[T] = field(default_factory=Cached)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def fresh(self, state: Cached[T]) -> bool:
        return (
            state.read_at is not None
            and not state.stale
            and self.clock() - state.read_at < self.every
        )

    def get(self) -> Cached[T]:
        if self.fresh(self._state):
            return self._state
        with self._lock:
            if self.fresh(self._state):  # another caller read while this one waited
                return self._state
            started = self.clock()
            value, error = self._state.value, None
            try:
                value = self.read()
            except self.errors as exc:
                error = self.describe(exc)
            done = self.clock()
            self._state = Cached(
                value, done, self.wall_ms(), done - started, error, self._state.reads + 1
            )
            return self._state

    def invalidate(self) -> None:
        """The next `get()` reads again (after an action changed what is shown)."""
        self._state.stale = True

    @property
    def reads(self) -> int:
        return self._state.reads


def age_s(state: Cached[Any], now: float) -> float | None:
    return None if state.read_at is None else max(0.0, now - state.read_at)


def snapshot_json(
    status: Status | None,
    histograms: Sequence[Histogram],
    metric_errors: Sequence[str],
    *,
    read_at_ms: int | None,
    age: float | None,
    took_s: float,
    error: str | None,
    refresh_s: float,
    actions: bool,
    names: Names,
) -> dict[str, Any]:
    """What `/api/snapshot` answers: the status as `status --json` has it, the picture's
    nodes, the lateness histograms, and how old all of it is."""
    tiers = []
    if status is not None:
        tiers = [
            {
                "name": r.name,
                "role": r.role.value,
                "ttl_ms": r.ttl_ms,
                "waiting": r.ready,
                "oldest_age_ms": r.oldest_age_ms,
                "attention": r.attention,
            }
            for r in status.rows
            if r.role in (QueueRole.BUFFER, QueueRole.CASCADE)
        ]
    return {
        "read_at_ms": read_at_ms,
        "age_s": age,
        "read_took_s": took_s,
        "refresh_s": refresh_s,
        "error": error,
        "actions": actions,
        "status": status.as_json() if status is not None else None,
        "tiers": tiers,
        "picture": [n.as_json() for n in picture(status, names).nodes] if status else [],
        "lateness": [h.as_json() for h in histograms],
        "metrics_errors": list(metric_errors),
    }


# -- the schedule (a topology with [schedule]) -------------------------------------------

# What comes due over the next TIMELINE_SPAN, per queue, in buckets of TIMELINE_BUCKET.
TIMELINE_SPAN_MS = 6 * 3_600_000
TIMELINE_BUCKET_MS = 15 * 60_000
# A bucket label every hour (every fourth 15-minute bucket).
TIMELINE_LABEL_EVERY_MS = 3_600_000
# The records still scheduled past their due time are counted up to this many (one page
# of the list: the count never loads the whole table).
PAST_DUE_CAP = 1_000


@dataclass(frozen=True, slots=True)
class Timeline:
    """One queue's scheduled records coming due: `counts[i]` in the bucket that starts
    at `start_ms + i * bucket_ms`; `past_due` are still scheduled past their due time
    (being handled or retried, or late: the sweeper's business), at most PAST_DUE_CAP
    (`past_due_more`: there may be more)."""

    queue: str
    start_ms: int
    bucket_ms: int
    counts: tuple[int, ...]
    past_due: int = 0
    past_due_more: bool = False

    @property
    def total(self) -> int:
        return sum(self.counts)

    def caption(self) -> str:
        span = format_ms(self.bucket_ms * len(self.counts))
        head = (
            f"{self.total} due in the next {span}"
            if self.total
            else f"nothing due in the next {span}"
        )
        if self.past_due:
            more = "+" if self.past_due_more else ""
            head += f"; {self.past_due}{more} past due, not handled yet"
        return head

    def as_json(self) -> dict[str, Any]:
        return {
            "queue": self.queue,
            "start_ms": self.start_ms,
            "bucket_ms": self.bucket_ms,
            "buckets": [
                {"start": iso_ms(at), "start_ms": at, "count": n}
                for at, n in zip(self.edges(), self.counts, strict=False)
            ],
            "total": self.total,
            "past_due": self.past_due,
            "past_due_more": self.past_due_more,
            "caption": self.caption(),
        }

    def edges(self) -> list[int]:
        return [self.start_ms + i * self.bucket_ms for i in range(len(self.counts) + 1)]


def timelines(
    queues: Iterable[str],
    counts: Mapping[str, Sequence[int]],
    past_due: Sequence[ScheduleRecord],
    *,
    start_ms: int,
    bucket_ms: int,
) -> tuple[Timeline, ...]:
    """A timeline per queue of the topology, in its order, from the counts of
    `Schedule.timeline` and a page of the records still scheduled before `start_ms`."""
    late: dict[str, int] = {}
    for record in past_due:
        late[record.queue] = late.get(record.queue, 0) + 1
    more = len(past_due) >= PAST_DUE_CAP
    return tuple(
        Timeline(q, start_ms, bucket_ms, tuple(counts.get(q, ())), late.get(q, 0), more)
        for q in queues
    )


def timeline_labels(
    buckets: int, bucket_ms: int, every_ms: int = TIMELINE_LABEL_EVERY_MS
) -> list[str]:
    """A label under each bucket: "now" under the first, "+1h" under each bucket starting
    a whole `every_ms` later, "" under the others."""
    labels = []
    for i in range(buckets):
        offset = i * bucket_ms
        if i == 0:
            labels.append("now")
        elif offset % every_ms == 0:
            labels.append("+" + format_ms(offset))
        else:
            labels.append("")
    return labels


def schedule_json(
    found: Sequence[Timeline] | None,
    *,
    read_at_ms: int | None,
    age: float | None,
    error: str | None,
    refresh_s: float,
) -> dict[str, Any]:
    """What `/api/schedule` answers: a timeline per queue, and how old it is."""
    return {
        "span_ms": TIMELINE_SPAN_MS,
        "bucket_ms": TIMELINE_BUCKET_MS,
        "read_at_ms": read_at_ms,
        "age_s": age,
        "refresh_s": refresh_s,
        "error": error,
        "queues": [t.as_json() for t in found or ()],
    }


def schedule_key(value: str | None) -> str:
    """The key asked for (`?key=`): a schedule key. Raises ConfigError."""
    if value is None:
        raise ConfigError("name the schedule key: ?key=KEY")
    return check_key(value, "key")


__all__ = [
    "DEFAULT_HOST",
    "DEFAULT_PORT",
    "DEFAULT_REFRESH_S",
    "LATENESS_METRIC",
    "MAX_PAGE",
    "MIN_REFRESH_S",
    "PAST_DUE_CAP",
    "TIMELINE_BUCKET_MS",
    "TIMELINE_LABEL_EVERY_MS",
    "TIMELINE_SPAN_MS",
    "TOKEN_FIELD",
    "TOKEN_HEADER",
    "Auth",
    "Cached",
    "Histogram",
    "Node",
    "Picture",
    "Poller",
    "Timeline",
    "action_token_ok",
    "age_s",
    "check_binding",
    "is_loopback",
    "lateness_histograms",
    "page_bounds",
    "parse_auth",
    "picture",
    "schedule_json",
    "schedule_key",
    "snapshot_json",
    "start_message",
    "timeline_labels",
    "timelines",
]
