"""Read existing objects through the management HTTP API (standard library only).

Used by `plan` and `declare` to compare arguments without touching the broker's
state, and by `status` and `delete`. The API is used only once it is shown to
serve the same broker as the AMQP connection (`checked`): its cluster name equals the
one the broker sent in `connection.start`, and it knows the vhost. Otherwise, or when it
does not answer, callers fall back to AMQP (passive declarations) and say why.

Over https the server's certificate is verified like the AMQP connection's, with the
same CA (and client certificate) as the AMQP URL's TLS options, or the management URL's
own query (`https://host:15671?cafile=...`): never without verification.

When the API refuses the user (docs/security.md):
  - the user has no `management` / `monitoring` tag (HTTP 401 "Not management user",
    or a 403): the usual state of a least-privilege user. Callers fall back to AMQP and
    say why, once (the CLI's note, a log line);
  - the login itself fails (HTTP 401, any other reason): an error (`AccessRefused`)
    for a management URL the user named; for an address derived from the AMQP URL, whose
    credentials the broker just accepted over AMQP, it is not that broker's API: a wrong
    guess, skipped like one that does not answer, and said so;
  - a request needs a vhost permission the user lacks (401 "ACCESS_REFUSED ..."):
    `AccessRefused` naming it (e.g. peeking a parking lot needs `read`).
"""

from __future__ import annotations

import base64
import json
import logging
import ssl
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any
from urllib.parse import quote

from rabbit_delay._broker import BrokerInfo, QueueCounts
from rabbit_delay._errors import AccessRefused, ManagementUnavailable, broker_refusal
from rabbit_delay._plan.diff import ExistingObject, Observed
from rabbit_delay._tls import TLSOptions, describe_tls_error
from rabbit_delay._topology.model import Topology
from rabbit_delay._urls import ManagementEndpoint, management_endpoints, redact

log = logging.getLogger(__name__)

TIMEOUT_S = 5.0
# The 401 reason RabbitMQ gives a user without the management/monitoring tag (3.x and 4.x).
NOT_MANAGEMENT_USER = "Not management user"
# ... and to a management user asking for an administrator's resource (none is read here).
NOT_ADMINISTRATOR = "Not administrator user"
NO_TAG_FIX = (
    "least-privilege users normally have none; give the user the `monitoring` tag "
    "(`rabbitmqctl set_user_tags USER monitoring`), or pass --management-url with a user "
    "that has one, or --no-management"
)


class RefusalKind(StrEnum):
    """How the management API refused a user (`ManagementRefused.refusal`)."""

    LOGIN = "login"  # the user name or password is wrong for this API
    NO_TAG = "no tag"  # the user may not use the API at all (no management tag)


class ManagementRefused(ManagementUnavailable):
    """The management API refused the user (HTTP 401 / 403); `refusal` says how."""

    def __init__(self, message: str, *, refusal: RefusalKind, status: int) -> None:
        super().__init__(message)
        self.refusal = refusal
        self.status = status


def _context(endpoint: ManagementEndpoint) -> ssl.SSLContext | None:
    """A verifying context for https (the endpoint's CA, else the system's); None for
    http. Raises ConfigError for a CA or certificate file that cannot be used."""
    if not endpoint.base.lower().startswith("https"):
        return None
    return (endpoint.tls or TLSOptions()).context()


def _reason(exc: urllib.error.HTTPError) -> str:
    """The `reason` of RabbitMQ's JSON error body, else the HTTP reason phrase."""
    try:
        body = json.loads(exc.read() or b"{}")
    except (ValueError, OSError):
        body = {}
    reason = body.get("reason") if isinstance(body, dict) else None
    return str(reason or exc.reason or "")


def _refused(
    endpoint: ManagementEndpoint, status: int, reason: str, *, doing: str, permission: str
) -> Exception:
    where = f"the management API at {redact(endpoint.base)}"
    if reason.startswith("ACCESS_REFUSED"):
        return broker_refusal(403, reason, doing=f"{doing} via {where}", permission=permission)
    if status == 403 or reason in (NOT_MANAGEMENT_USER, NOT_ADMINISTRATOR):
        tag = "`administrator`" if reason == NOT_ADMINISTRATOR else "`management` or `monitoring`"
        return ManagementRefused(
            f"{where}: user {endpoint.username!r} may not use it (HTTP {status}: {reason}); it "
            f"needs the {tag} tag: {NO_TAG_FIX}",
            refusal=RefusalKind.NO_TAG,
            status=status,
        )
    return ManagementRefused(
        f"{where} refused the login of user {endpoint.username!r} (HTTP {status}: {reason})",
        refusal=RefusalKind.LOGIN,
        status=status,
    )


def get_json(
    endpoint: ManagementEndpoint,
    path: str,
    body: Any = None,
    *,
    doing: str = "reading",
    permission: str = "",
) -> Any:
    """GET `path`, or POST `body` as JSON to it when given.

    Raises ManagementUnavailable (no answer, TLS failure, HTTP error), ManagementRefused
    (the user was refused, see the module docstring), AccessRefused (a vhost permission
    the request needs, `permission`, is missing) or ConfigError (an unusable CA file).
    """
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(endpoint.url(path), data=data)
    if data is not None:
        request.add_header("Content-Type", "application/json")
    token = base64.b64encode(f"{endpoint.username}:{endpoint.password}".encode()).decode()
    request.add_header("Authorization", f"Basic {token}")
    context = _context(endpoint)
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S, context=context) as response:
            return json.load(response)
    except urllib.error.HTTPError as exc:
        if exc.code in (401, 403):
            raise _refused(
                endpoint, exc.code, _reason(exc), doing=doing, permission=permission
            ) from None
        raise ManagementUnavailable(f"{endpoint.base}: HTTP {exc.code} {exc.reason}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        why = describe_tls_error(exc) or str(exc)
        raise ManagementUnavailable(redact(f"{endpoint.base}: {why}")) from None


def verify_same_broker(endpoint: ManagementEndpoint, broker: BrokerInfo) -> str:
    """Prove that `endpoint` serves the broker of an AMQP connection; its cluster name.

    The cluster name the API reports (/api/overview) must equal the `cluster_name` the
    broker sent in `connection.start`, and the API must know the connection's vhost.
    Raises ManagementUnavailable saying why not (another broker, no answer, no rights).
    """
    if not broker.cluster_name:
        raise ManagementUnavailable(
            f"{endpoint.base}: the AMQP broker sent no cluster name, so nothing proves that "
            "this management API serves it"
        )
    overview = get_json(endpoint, "overview")
    cluster = overview.get("cluster_name") if isinstance(overview, dict) else None
    if cluster != broker.cluster_name:
        raise ManagementUnavailable(
            f"{endpoint.base} serves another broker (cluster {cluster!r}, the AMQP connection's "
            f"is {broker.cluster_name!r}): pass the right --management-url"
        )
    # The list, not /api/vhosts/NAME: that one is for administrators only (3.10 to 4.3);
    # the list shows a management or monitoring user the vhosts it may use.
    vhosts = get_json(endpoint, "vhosts?columns=name")
    names = (
        {v.get("name") for v in vhosts if isinstance(v, dict)} if isinstance(vhosts, list) else ()
    )
    if endpoint.vhost not in names:
        raise ManagementUnavailable(
            f"{endpoint.base}: vhost {endpoint.vhost!r} not found (or user "
            f"{endpoint.username!r} has no permissions on it)"
        )
    return broker.cluster_name


@dataclass(frozen=True, slots=True)
class Access:
    """The management API, if it may be used for this AMQP connection, and why (not)."""

    endpoint: ManagementEndpoint | None
    note: str


def checked(endpoints: Sequence[ManagementEndpoint], broker: BrokerInfo) -> Access:
    """The first of `endpoints` that provably serves `broker` (see verify_same_broker),
    else None with the reasons; None with "not used" when none was given.

    Raises AccessRefused when a management URL the user named (`endpoint.explicit`)
    refuses the login: wrong credentials are an error, not a reason to fall back.
    """
    if not endpoints:
        return Access(None, "not used (--no-management)")
    reasons = []
    for endpoint in endpoints:
        try:
            cluster = verify_same_broker(endpoint, broker)
        except ManagementRefused as exc:
            if exc.refusal is RefusalKind.LOGIN and endpoint.explicit:
                raise AccessRefused(
                    f"{exc}: the user name or password is wrong for this API. Give "
                    "credentials it accepts in --management-url (or "
                    "$RABBIT_DELAY_MANAGEMENT_URL), e.g. https://USER:PASSWORD@HOST:15671, "
                    "or pass --no-management to use AMQP only",
                    permission="management login",
                ) from None
            if exc.refusal is RefusalKind.LOGIN:
                # The broker accepted these credentials over AMQP: not its API.
                reasons.append(
                    f"{exc} with the AMQP URL's credentials, so it is not that broker's API "
                    "(or it authenticates differently): pass --management-url"
                )
            else:
                reasons.append(str(exc))
            continue
        except ManagementUnavailable as exc:
            reasons.append(str(exc))
            continue
        return Access(endpoint, f"{endpoint.base} (same broker: cluster {cluster!r})")
    note = "not used: " + "; ".join(reasons)
    log.info("management API %s", redact(note))
    return Access(None, note)


def access_for(
    broker: BrokerInfo, url: str, management_url: str | None, no_management: bool
) -> Access:
    """The management API for the broker at `url` (an explicit `management_url`, else
    the addresses derived from `url`), if it provably serves `broker`; none when
    `no_management`. Raises AccessRefused as `checked` does."""
    endpoints = [] if no_management else management_endpoints(url, management_url)
    return checked(endpoints, broker)


def read_observed(endpoint: ManagementEndpoint, prefix: str) -> Observed:
    """Exchanges, queues and bindings whose names start with `prefix`.

    Raises ManagementUnavailable when the API cannot be used.
    """
    vhost = endpoint.vhost_quoted
    queues = get_json(endpoint, f"queues/{vhost}?columns=name,arguments,durable")
    exchanges = get_json(endpoint, f"exchanges/{vhost}?columns=name,arguments,durable,type")
    bindings = get_json(endpoint, f"bindings/{vhost}")
    if not all(isinstance(x, list) for x in (queues, exchanges, bindings)):
        raise ManagementUnavailable(f"{endpoint.base}: unexpected answer")
    return Observed(
        exchanges={
            e["name"]: ExistingObject(
                e.get("arguments") or {}, bool(e.get("durable")), e.get("type")
            )
            for e in exchanges
            if e["name"].startswith(prefix)
        },
        queues={
            q["name"]: ExistingObject(q.get("arguments") or {}, bool(q.get("durable")))
            for q in queues
            if q["name"].startswith(prefix)
        },
        bindings=frozenset(
            (b["source"], b["destination"], b["destination_type"], b["routing_key"])
            for b in bindings
            if b.get("source", "").startswith(prefix)
        ),
    )


# -- operations (rabbit-delay status / replay) ---------------------------------------------


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _node(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


def _nodes(value: object) -> tuple[str, ...] | None:
    if not isinstance(value, list):
        return None
    return tuple(sorted(str(node) for node in value if isinstance(node, str)))


def counts_from_api(row: dict[str, Any]) -> QueueCounts:
    """One row of /api/queues as QueueCounts (pure): counts as the API samples them (every
    5 s by default, so they lag behind the broker). Placement (leader, members, online)
    and dead-lettering only for a quorum queue: a classic queue's `node` is not a Raft
    leader."""
    quorum = row.get("type") == "quorum"
    return QueueCounts(
        _count(row.get("messages_ready")),
        _count(row.get("messages_unacknowledged")),
        _count(row.get("consumers")),
        _node(row.get("leader")) if quorum else None,
        _nodes(row.get("members")) if quorum else None,
        _nodes(row.get("online")) if quorum else None,
        _count(row.get("messages_dlx")) if quorum else None,
        _count(row.get("head_message_timestamp")),
        _count(row.get("messages_delayed")) if quorum else None,
        _count(row.get("next_delayed_at")) if quorum else None,
    )


def read_queue_counts(endpoint: ManagementEndpoint, prefix: str) -> dict[str, QueueCounts]:
    """Message and consumer counts of every queue whose name starts with `prefix`, and
    where each quorum queue's replicas are (`counts_from_api`).

    Raises ManagementUnavailable when the API cannot be used.
    """
    columns = (
        "name,type,messages_ready,messages_unacknowledged,consumers,leader,members,online,"
        "messages_dlx,head_message_timestamp,messages_delayed,next_delayed_at"
    )
    queues = get_json(endpoint, f"queues/{endpoint.vhost_quoted}?columns={columns}")
    if not isinstance(queues, list):
        raise ManagementUnavailable(f"{endpoint.base}: unexpected answer")
    return {
        q["name"]: counts_from_api(q)
        for q in queues
        if isinstance(q, dict) and str(q.get("name", "")).startswith(prefix)
    }


def read_exchange_names(endpoint: ManagementEndpoint, prefix: str) -> set[str]:
    """The names of the vhost's exchanges that start with `prefix`.

    Raises ManagementUnavailable when the API cannot be used.
    """
    exchanges = get_json(endpoint, f"exchanges/{endpoint.vhost_quoted}?columns=name")
    if not isinstance(exchanges, list):
        raise ManagementUnavailable(f"{endpoint.base}: unexpected answer")
    return {
        str(e["name"])
        for e in exchanges
        if isinstance(e, dict) and str(e.get("name", "")).startswith(prefix)
    }


def delayed_messages(row: object) -> int | None:
    """How many messages an x-delayed-message exchange holds, from its /api/exchanges
    entry (the plugin reports `messages_delayed`); None when the answer has no count."""
    return _count(row.get("messages_delayed")) if isinstance(row, dict) else None


def read_delayed_messages(endpoint: ManagementEndpoint, exchange: str) -> int | None:
    """Messages waiting in the delayed-message plugin's store for `exchange` (None when
    the API does not report them).

    Raises ManagementUnavailable when the API cannot be used or has no such exchange.
    """
    path = f"exchanges/{endpoint.vhost_quoted}/{quote(exchange, safe='')}"
    return delayed_messages(get_json(endpoint, path, doing=f"reading exchange {exchange!r}"))


def read_broker_version(endpoint: ManagementEndpoint) -> str | None:
    """The RabbitMQ version the API reports (/api/overview), None when it does not say.

    Raises ManagementUnavailable when the API cannot be used.
    """
    overview = get_json(endpoint, "overview")
    version = overview.get("rabbitmq_version") if isinstance(overview, dict) else None
    return version if isinstance(version, str) and version else None


def observe(access: Access, topology: Topology) -> tuple[Observed | None, str]:
    """What the management API says exists, or None to fall back to passive declares;
    and where the answer came from (or why the API was not used), for the output."""
    if access.endpoint is None:
        return None, f"passive declares, arguments not compared (management API {access.note})"
    try:
        observed = read_observed(access.endpoint, topology.names.prefix + ".")
    except ManagementUnavailable as exc:
        return None, f"passive declares, arguments not compared (management API not used: {exc})"
    return observed, f"management API at {access.note}"
