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
from typing import Any

from rabbit_delay.plan import ExistingObject, Observed
from rabbit_delay.urls import ManagementEndpoint

TIMEOUT_S = 5.0


class ManagementUnavailable(Exception):
    """The API did not answer usefully; the caller falls back to AMQP."""


def _get(endpoint: ManagementEndpoint, path: str) -> Any:
    request = urllib.request.Request(endpoint.url(path))
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
            e["name"]: ExistingObject(e.get("arguments") or {}, bool(e.get("durable")), e.get("type"))
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
