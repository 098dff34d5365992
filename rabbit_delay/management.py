"""Read existing objects through the management HTTP API (standard library only).

Used by `plan` and `declare` to compare arguments without touching the broker's
state. When the API is not reachable, callers fall back to passive declarations.
"""

from __future__ import annotations

import base64
import json
import ssl
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from rabbit_delay.plan import ExistingObject, Observed
from rabbit_delay.topology import Topology
from rabbit_delay.urls import ManagementEndpoint

TIMEOUT_S = 5.0


class ManagementUnavailable(Exception):
    """The API did not answer usefully; the caller falls back to AMQP."""


def _get(endpoint: ManagementEndpoint, path: str, body: Any = None) -> Any:
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
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise ManagementUnavailable(f"{endpoint.base}: {exc}") from None


def read_observed(endpoint: ManagementEndpoint, prefix: str) -> Observed:
    """Exchanges, queues and bindings whose names start with `prefix`.

    Raises ManagementUnavailable when the API cannot be used.
    """
    vhost = endpoint.vhost_quoted
    queues = _get(endpoint, f"queues/{vhost}?columns=name,arguments,durable")
    exchanges = _get(endpoint, f"exchanges/{vhost}?columns=name,arguments,durable,type")
    bindings = _get(endpoint, f"bindings/{vhost}")
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
    queues = _get(endpoint, f"queues/{endpoint.vhost_quoted}?columns={columns}")
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
    messages = _get(endpoint, path, body)
    if not isinstance(messages, list):
        raise ManagementUnavailable(f"{endpoint.base}: unexpected answer")
    return messages


def observe(endpoint: ManagementEndpoint | None, topology: Topology) -> Observed | None:
    """What the management API says exists, or None to fall back to passive declares."""
    if endpoint is None:
        return None
    try:
        return read_observed(endpoint, topology.names.prefix + ".")
    except ManagementUnavailable:
        return None
