"""The outbox's pure part: what a row holds, what `add()` stores, what the relay
publishes for a row and what it does with each outcome. No I/O.

A row is exchange-independent: the target as the application named it (a queue of the
topology, or one of its binding keys), the delay asked for, the encoded body and the
user's headers, the message_id and the creation time by the application's clock. Which
exchange and routing key carry it is decided when it is relayed (`outgoing`), with the
relay's topology: a version raised in between is followed, and the due time stays
creation + delay (`Router.resolve_remaining`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Unpack
from urllib.parse import unquote, urlsplit

from rabbit_delay._envelope import (
    Body,
    Outgoing,
    check_message_id,
    encode_body,
    new_message_id,
)
from rabbit_delay._envelope import outgoing as envelope_outgoing
from rabbit_delay._errors import ConfigError, EncodeError, PublishError
from rabbit_delay._publishing.confirms import Ledger, State
from rabbit_delay._publishing.core import PublisherCore, RouteOptions
from rabbit_delay._topology.delays import Router
from rabbit_delay._urls import redact

DEFAULT_TABLE = "rabbit_delay_outbox"
DEFAULT_RELAY_BATCH = 1_000
DEFAULT_RETENTION = "7d"
DEFAULT_POLL = "200ms"  # the first wait of an idle relay, doubling up to DEFAULT_MAX_POLL
DEFAULT_MAX_POLL = "2s"
DEFAULT_CLEANUP_INTERVAL = "1m"
# SQLite: how long a relay's claim on rows lasts. Longer than a publish can take (the
# publisher's 30 s recovery deadline, then a blocked broker's 30 s): rows of a relay
# that died are taken again after it.
DEFAULT_RELAY_LEASE = "90s"
# A row the relay cannot publish (its target gone from the topology, returned as
# unroutable) is tried again after 1 s, 2 s, 4 s ... at most 5 minutes, and stays in
# the table, its error in `last_error`, until a relay publishes it.
REFUSED_FIRST_MS = 1_000
REFUSED_MAX_MS = 300_000


@dataclass(frozen=True, slots=True)
class NewRow:
    """What `add()` writes: validated and encoded, so nothing can fail at relay time
    that could have failed in the application's transaction."""

    message_id: str
    queue: str | None  # exactly one of queue / routing_key, as the application named it
    routing_key: str | None
    tier: str  # the tier, or "cascade" / "plugin", a direct publish would have used
    delay_ms: int  # the delay that applies (a cascade's is rounded up to its resolution)
    created_at: int  # ms, UTC, the application's clock
    body: bytes
    content_type: str
    headers: str  # JSON object of the user's headers ("{}" when none)

    @property
    def due_at(self) -> int:
        return self.created_at + self.delay_ms


@dataclass(frozen=True, slots=True)
class Row:
    """A pending row as a relay claimed it."""

    id: int
    message_id: str
    queue: str | None
    routing_key: str | None
    tier: str
    delay_ms: int
    created_at: int
    body: bytes
    content_type: str
    headers: str
    attempts: int = 0

    @property
    def due_at(self) -> int:
        return self.created_at + self.delay_ms

    @property
    def target(self) -> str:
        """The target as written by the application (for messages and logs)."""
        return self.queue if self.queue is not None else f"routing key {self.routing_key}"


def new_row(
    core: PublisherCore[Any, Any],
    msg: Body,
    tier: str | timedelta | None = None,
    *,
    now: int,
    message_id: str | None = None,
    headers: Mapping[str, object] | None = None,
    key: str | None = None,
    on_conflict: str | None = None,
    **where: Unpack[RouteOptions],
) -> NewRow:
    """The row for one `add()`, refused exactly as `publish_delayed` would refuse the
    message: DelayError, UnknownTargetError, EncodeError (also for headers that are not
    a JSON object). ConfigError for `key=` / `on_conflict=`: the relay records a row in
    the schedule under its message_id (docs/schedule.md#the-outbox)."""
    if key is not None or on_conflict is not None:
        raise ConfigError(
            "Outbox.add takes no key= or on_conflict=: the relay records the row in the "
            "schedule under its message_id, so give message_id=<your key> (a second add "
            "of one message_id is refused: reschedule with Publisher.schedule)"
        )
    if isinstance(tier, timedelta):
        if where.get("delay") is not None:
            raise ConfigError("give the delay once: as the tier argument or as delay=, not both")
        where["delay"] = tier
        tier = None
    route = core.route(tier, now=now, **where)
    body, content_type = encode_body(msg)
    return NewRow(
        message_id=check_message_id(message_id) if message_id is not None else new_message_id(),
        queue=where.get("queue"),
        routing_key=where.get("routing_key"),
        tier=route.tier,
        delay_ms=route.delay_ms,
        created_at=now,
        body=body,
        content_type=content_type,
        headers=encode_headers(headers),
    )


def encode_headers(headers: Mapping[str, object] | None) -> str:
    """The user's headers as the JSON object stored in the row. Raises EncodeError for
    headers that JSON cannot hold (bytes, datetimes, non-string keys)."""
    if not headers:
        return "{}"
    if not isinstance(headers, Mapping) or not all(isinstance(k, str) for k in headers):
        raise EncodeError("headers must be a mapping with string keys")
    try:
        return json.dumps(dict(headers), separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise EncodeError(
            f"outbox headers must be JSON values (str, int, float, bool, None, lists and "
            f"objects of them): {exc}"
        ) from None


def outgoing(router: Router, row: Row, now: int) -> Outgoing:
    """The message to publish for `row`, relayed at `now` (the relay's clock).

    The due time counts from the row's creation: what remains of the delay goes through
    `Router.resolve_remaining` (due already: the due exchange now; a cascade or the
    plugin: exactly what remains; tiers: the shortest accepted tier not shorter than
    what remains, so never early), and `rd-due-at` stays creation + delay, which makes
    any lateness visible in the workers' metrics. What remains is capped at the delay
    asked for: an application clock ahead of the relay's must not make a message wait
    longer than it asked for.

    Raises UnknownTargetError / DelayError when the relay's topology cannot serve the
    row (a queue removed, a tier gone), EncodeError for stored headers that are not a
    JSON object.
    """
    key = router.target_key(row.queue, row.routing_key)
    remaining = min(row.due_at - now, row.delay_ms)
    route = router.resolve_remaining(key, remaining)
    return envelope_outgoing(
        route,
        row.body,
        row.content_type,
        now,
        row.message_id,
        decode_headers(row),
        due_at=row.due_at,
        requested_ms=row.delay_ms,
    )


def decode_headers(row: Row) -> dict[str, object]:
    """The user's headers of `row`. Raises EncodeError when they are not a JSON object."""
    if row.headers in ("{}", ""):
        return {}  # most rows: no parse
    try:
        headers = json.loads(row.headers)
    except ValueError:
        headers = None
    if not isinstance(headers, dict):
        raise EncodeError(f"row {row.id}: its headers are not a JSON object: {row.headers!r}")
    return headers


def refused_until(attempts: int, now: int) -> int:
    """When a row refused for the `attempts`-th time may be tried again."""
    wait: int = REFUSED_FIRST_MS << min(max(attempts - 1, 0), 20)
    return now + min(wait, REFUSED_MAX_MS)


# Refusal.reason: the values of metrics.PublishErrorReason they are counted under.
INVALID = "invalid"  # the relay's topology cannot route the row
UNROUTABLE = "unroutable"  # the broker returned it (mandatory): nothing bound


@dataclass(frozen=True, slots=True)
class Refusal:
    row: Row
    error: str
    retry_at: int  # ms: the row is not claimed before
    reason: str = INVALID


@dataclass(slots=True)
class Settlement:
    """What becomes of each claimed row after a batch was published.

    sent: confirmed by the broker, marked sent. refused: cannot be published as it is
    (the topology cannot route it, or the broker returned it): kept with its error and
    tried again later. retry: no confirm (a nack, the call ended early): released, taken
    again at once; any of them may have reached the broker, so it may be delivered twice,
    under the same message_id.
    """

    sent: list[Row] = field(default_factory=list)
    refused: list[Refusal] = field(default_factory=list)
    retry: list[Row] = field(default_factory=list)


def plan_batch(
    router: Router,
    rows: Sequence[Row],
    now: int,
    mark: Callable[[Outgoing], Outgoing] | None = None,
) -> tuple[list[Row], list[Outgoing], list[Refusal]]:
    """The messages to publish for claimed rows (in claim order), and the rows refused
    before anything is sent. `mark` marks each for the schedule (a topology with
    [schedule]: `PublisherCore.scheduled`, under its message_id)."""
    planned: list[Row] = []
    outs: list[Outgoing] = []
    refused: list[Refusal] = []
    for row in rows:
        try:
            out = outgoing(router, row, now)
            outs.append(mark(out) if mark is not None else out)
        except PublishError as exc:  # DelayError, UnknownTargetError, EncodeError
            error = f"{type(exc).__name__}: {exc}"
            refused.append(Refusal(row, error, refused_until(row.attempts + 1, now)))
            continue
        planned.append(row)
    return planned, outs, refused


def settle(rows: Sequence[Row], ledger: Ledger, now: int) -> Settlement:
    """Each published row's fate from the publish call's ledger (`rows[i]` was sent as
    `ledger.outs[i]`)."""
    result = Settlement()
    for index, (row, state) in enumerate(zip(rows, ledger.states, strict=True)):
        if state is State.CONFIRMED:
            result.sent.append(row)
        elif state is State.RETURNED:
            reply = ledger.replies.get(index, "")
            error = f"UnroutableError: returned by the broker ({reply}): is the topology declared?"
            retry_at = refused_until(row.attempts + 1, now)
            result.refused.append(Refusal(row, error, retry_at, UNROUTABLE))
        else:
            result.retry.append(row)
    return result


# -- the --db URL -----------------------------------------------------------------------

SQLITE = "sqlite"
POSTGRESQL = "postgresql"


@dataclass(frozen=True, slots=True)
class Database:
    """Where the outbox table lives: an SQLite file or a PostgreSQL conninfo URL."""

    dialect: str  # SQLITE or POSTGRESQL
    target: str  # the file path, or the URL psycopg connects to (with its password)

    def __repr__(self) -> str:  # never show the password, even in a traceback
        return f"Database({self.dialect!r}, {redact(self.target)!r})"

    @property
    def shown(self) -> str:
        return redact(self.target) if self.dialect == POSTGRESQL else f"sqlite:///{self.target}"


def parse_database(url: str) -> Database:
    """`sqlite:///relative/path.db`, `sqlite:////absolute/path.db` (SQLAlchemy's
    spelling) or `postgresql://user:password@host:5432/dbname` (also `postgres://`
    and `postgresql+psycopg://`). Raises ConfigError for anything else; the password
    is never shown."""
    if not isinstance(url, str) or "://" not in url:
        raise ConfigError(
            f"database URL {redact(str(url))!r}: write sqlite:///path/to/file.db or "
            "postgresql://user:password@host:5432/dbname"
        )
    scheme, _, rest = url.partition("://")
    scheme = scheme.lower()
    if scheme == SQLITE:
        path = unquote(urlsplit(url).path)
        path = path[1:] if path.startswith("/") else path  # sqlite:///x -> "x"; ////x -> "/x"
        if not path or path == ":memory:":
            raise ConfigError(
                f"database URL {url!r}: name an SQLite file (sqlite:///app.db, or "
                "sqlite:////abs/path/app.db); an in-memory database is not shared with the "
                "application"
            )
        return Database(SQLITE, path)
    if scheme in ("postgresql", "postgres", "postgresql+psycopg"):
        return Database(POSTGRESQL, f"postgresql://{rest}")
    raise ConfigError(
        f"database URL {redact(url)!r}: unsupported scheme {scheme!r}; write "
        "sqlite:///path/to/file.db or postgresql://user:password@host:5432/dbname"
    )
