"""Read existing objects through the management HTTP API (standard library only).

Used by `plan` and `declare` to compare arguments without touching the broker's
state, and by `status` and `replay --dry-run`. The API is used only once it is shown to
serve the same broker as the AMQP connection (`checked`): its cluster name equals the
one the broker sent in `connection.start`, and it knows the vhost. Otherwise, or when it
does not answer, callers fall back to AMQP (passive declarations) and say why.
"""

from __future__ import annotations

import base64
import json
import ssl
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from rabbit_delay.broker import BrokerInfo
from rabbit_delay.errors import ManagementUnavailable
from rabbit_delay.plan import ExistingObject, Observed
from rabbit_delay.topology import Topology
from rabbit_delay.urls import ManagementEndpoint

TIMEOUT_S = 5.0


def get_json(endpoint: ManagementEndpoint, path: str, body: Any = None) -> Any:
    """GET `path`, or POST `body` as JSON to it when given."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(endpoint.url(path), data=data)
    if data is not None:
        request.add_header("Content-Type", "application/json")
    token = base64.b64encode(f"{endpoint.username}:{endpoint.password}".encode()).decode()
    request.add_header("Authorization", f"Basic {token}")
    context = ssl.create_default_context() if endpoint.base.startswith("https") else None
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S, context=context) as response:
            return json.load(response)
    except urllib.error.HTTPError as exc:
        if exc.code in (401, 403):
            raise ManagementUnavailable(
                f"{endpoint.base}: user {endpoint.username!r} is not allowed to use the "
                f"management API (HTTP {exc.code}; it needs the `monitoring` or `management` tag)"
            ) from None
        raise ManagementUnavailable(f"{endpoint.base}: HTTP {exc.code} {exc.reason}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise ManagementUnavailable(f"{endpoint.base}: {exc}") from None


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
    vhost = get_json(endpoint, f"vhosts/{endpoint.vhost_quoted}")
    if not isinstance(vhost, dict) or vhost.get("name") != endpoint.vhost:
        raise ManagementUnavailable(f"{endpoint.base}: vhost {endpoint.vhost!r} not found")
    return broker.cluster_name


@dataclass(frozen=True, slots=True)
class Access:
    """The management API, if it may be used for this AMQP connection, and why (not)."""

    endpoint: ManagementEndpoint | None
    note: str

    @property
    def usable(self) -> bool:
        return self.endpoint is not None


def checked(endpoints: Sequence[ManagementEndpoint], broker: BrokerInfo) -> Access:
    """The first of `endpoints` that provably serves `broker` (see verify_same_broker),
    else None with the reasons; None with "not used" when none was given."""
    if not endpoints:
        return Access(None, "not used (--no-management)")
    reasons = []
    for endpoint in endpoints:
        try:
            cluster = verify_same_broker(endpoint, broker)
        except ManagementUnavailable as exc:
            reasons.append(str(exc))
            continue
        return Access(endpoint, f"{endpoint.base} (same broker: cluster {cluster!r})")
    return Access(None, "not used: " + "; ".join(reasons))


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


@dataclass(frozen=True, slots=True)
class QueueStats:
    """Counts as the management API reports them: sampled (every 5 s by default), so they
    lag behind the broker. None where the API has no figure yet (a queue just declared)."""

    ready: int | None
    unacked: int | None
    consumers: int | None


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def read_queue_stats(endpoint: ManagementEndpoint, prefix: str) -> dict[str, QueueStats]:
    """Message and consumer counts of every queue whose name starts with `prefix`.

    Raises ManagementUnavailable when the API cannot be used.
    """
    columns = "name,messages_ready,messages_unacknowledged,consumers"
    queues = get_json(endpoint, f"queues/{endpoint.vhost_quoted}?columns={columns}")
    if not isinstance(queues, list):
        raise ManagementUnavailable(f"{endpoint.base}: unexpected answer")
    return {
        q["name"]: QueueStats(
            _count(q.get("messages_ready")),
            _count(q.get("messages_unacknowledged")),
            _count(q.get("consumers")),
        )
        for q in queues
        if q["name"].startswith(prefix)
    }


def peek_messages(endpoint: ManagementEndpoint, queue: str, count: int) -> list[dict[str, Any]]:
    """Up to `count` messages from the head of `queue`, put back at once (the API's
    `ackmode=ack_requeue_true`); payloads truncated to 1 KiB.

    Each get-and-requeue is a redelivery for the broker: on RabbitMQ 4.0-4.2 it counts
    towards a quorum queue's delivery limit. Raises ManagementUnavailable.
    """
    body = {"count": count, "ackmode": "ack_requeue_true", "encoding": "auto", "truncate": 1024}
    path = f"queues/{endpoint.vhost_quoted}/{quote(queue, safe='')}/get"
    messages = get_json(endpoint, path, body)
    if not isinstance(messages, list):
        raise ManagementUnavailable(f"{endpoint.base}: unexpected answer")
    return messages


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
