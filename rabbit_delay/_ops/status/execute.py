"""Read what `status` shows from the broker (pika and the management API); what it
means is decided in `rabbit_delay._ops.status.rules`.

Live figures come from AMQP: a passive declare per queue (ready messages, consumers)
and per exchange (present or not), and a peek at the head of each non-empty buffer for
the age of its oldest message, where peeking cannot cost that message (see
`BrokerInfo.peeks_quorum_buffers_freely`). The management API, once proven to serve
the same broker, adds unacked messages, placement, messages being dead-lettered and the
plugin's store; without AMQP it stands in for the counts.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import pika
import pika.exceptions

from rabbit_delay._broker import BrokerInfo, QueueCounts
from rabbit_delay._envelope import now_ms
from rabbit_delay._errors import AccessRefused, BrokerUnavailable, ManagementUnavailable
from rabbit_delay._io.management import (
    access_for,
    read_broker_version,
    read_delayed_messages,
    read_exchange_names,
    read_queue_counts,
)
from rabbit_delay._ops.queues import passive_counts, peek_head
from rabbit_delay._ops.status.rules import (
    AGE_FROM_API,
    PluginStore,
    Status,
    may_peek_buffers,
    nonempty_buffers,
    status_rows,
)
from rabbit_delay._plan.desired import desired
from rabbit_delay._sync.connection import broker_info, close_quietly, connect_first
from rabbit_delay._sync.errors import mapped
from rabbit_delay._topology.model import Topology
from rabbit_delay._urls import ManagementEndpoint, management_endpoint, redact


def _exchange_exists(connection: pika.BlockingConnection, exchange: str) -> bool:
    with mapped(f"checking exchange {exchange!r} (passive declare)"):
        try:
            channel = connection.channel()
            channel.exchange_declare(exchange, passive=True)
        except pika.exceptions.ChannelClosedByBroker as exc:
            if exc.reply_code == 404:  # and the channel is closed
                return False
            raise
        channel.close()
    return True


def passive_exchanges(
    connection: pika.BlockingConnection, exchanges: Iterable[str]
) -> dict[str, bool]:
    """Which of `exchanges` exist, by passive declares (live, exact).

    Raises ConnectionLost, AccessRefused or BrokerError.
    """
    return {name: _exchange_exists(connection, name) for name in exchanges}


def head_times(
    connection: pika.BlockingConnection, queues: Iterable[str]
) -> tuple[dict[str, int | None], AccessRefused | None]:
    """When the message at the head of each buffer entered it (`Stored.queued_at_ms`;
    None when the message does not say), read by peeking it (`peek_head`). A queue
    found empty (its head just expired) or gone is left out. A user without the `read`
    permission on the buffers (a monitoring user) gets no ages: the refusal is returned
    with what was read before it.

    Raises ConnectionLost.
    """
    heads: dict[str, int | None] = {}
    for queue in queues:
        try:
            head = peek_head(connection, queue)
        except AccessRefused as exc:
            return heads, exc
        if head is not None:
            heads[queue] = head.queued_at_ms
    return heads, None


def read_status(
    topology: Topology,
    urls: Sequence[str],
    *,
    management_url: str | None = None,
    no_management: bool = False,
    name: str = "rabbit-delay status",
) -> Status:
    """Everything `status` shows for `topology`, read from the first of `urls` that
    answers (and its management API): see `rabbit_delay._ops.status.rules`.

    Without an AMQP connection, the management API (unverified: there is nothing to
    compare it with) stands in for the counts. Raises BrokerUnavailable when neither
    answers, ConfigError for a bad URL, AccessRefused when a named management URL
    refuses the login or a passive declare is refused.
    """
    want = desired(topology)
    queue_names = [spec.name for spec in want.queues]
    exchange_names = [spec.name for spec in want.exchanges]
    broker = urls[0]  # the node shown until one answers
    live: dict[str, QueueCounts | None] | None = None
    exchanges: dict[str, bool] | None = None
    heads: dict[str, int | None] | None = None
    amqp_error: BrokerUnavailable | None = None
    info: BrokerInfo | None = None
    endpoint: ManagementEndpoint | None = None
    unpeeked = False  # non-empty buffers whose head this broker's version cannot peek
    refused: AccessRefused | None = None  # a peek the user may not do
    try:
        connection, broker = connect_first(urls, name=name)
    except BrokerUnavailable as exc:
        amqp_error = exc
        # Nothing to compare the API with: use it, and say it is unverified.
        if not no_management:
            endpoint = management_endpoint(broker, management_url)
        api_note = f"{endpoint.base} (not verified: no AMQP connection)" if endpoint else ""
    else:
        try:
            info = broker_info(connection)
            live = passive_counts(connection, queue_names)
            exchanges = passive_exchanges(connection, exchange_names)
            buffers = nonempty_buffers(topology, live)
            if may_peek_buffers(topology, info):
                heads, refused = head_times(connection, buffers)
            elif buffers:
                unpeeked = True
        finally:
            close_quietly(connection)
        access = access_for(info, broker, management_url, no_management)
        endpoint, api_note = access.endpoint, access.note
    checked_at = now_ms()

    api: dict[str, QueueCounts] | None = None
    api_error = api_note or "not used (--no-management)"
    version = info.version_text if info is not None and info.version_text else None
    delayed: int | None = None
    if endpoint is not None:
        prefix = topology.names.prefix + "."
        try:
            api = read_queue_counts(endpoint, prefix)
            if exchanges is None:
                present = read_exchange_names(endpoint, prefix)
                exchanges = {name: name in present for name in exchange_names}
            if version is None:
                version = read_broker_version(endpoint)
            if topology.plugin is not None:
                delayed = read_delayed_messages(endpoint, topology.names.plugin_exchange())
        except ManagementUnavailable as exc:
            api_error = f"not reachable ({exc})"
    if live is None and api is None:
        assert amqp_error is not None
        raise BrokerUnavailable(f"{amqp_error}; management API {api_error}")

    notes = []
    if api is None:
        notes.append(f"management API {api_error}: unacked messages unknown ('?')")
    if live is None:
        notes.append(f"no AMQP connection ({amqp_error}): counts from the management API")
    if unpeeked:
        assert info is not None
        notes.append(
            f"buffer ages unknown on RabbitMQ {info.version_text or '(version unknown)'}: "
            f"its quorum queues cannot be peeked safely ({info.quorum_buffer_peek_risk})"
        )
    if refused is not None:
        notes.append(f"buffer ages not read: {refused}")
    plugin = None
    if topology.plugin is not None:
        plugin = PluginStore(topology.names.plugin_exchange(), delayed)
    rows = status_rows(topology, live, api, heads=heads, now_ms=checked_at)
    age_from_api = any(row.age_source == AGE_FROM_API for row in rows)
    return Status(
        namespace=topology.names.prefix,
        broker=redact(broker),
        broker_version=version,
        broker_description=info.describe() if info is not None else None,
        checked_at_ms=checked_at,
        rows=rows,
        missing_exchanges=(
            None if exchanges is None else tuple(n for n, ok in exchanges.items() if not ok)
        ),
        plugin=plugin,
        sources={
            "ready_and_consumers": "amqp passive declare" if live is not None else "management API",
            "exchanges": (
                "amqp passive declare"
                if live is not None
                else ("management API" if exchanges is not None else None)
            ),
            "unacked": "management API" if api is not None else None,
            "placement": "management API" if api is not None else None,
            "oldest_age": (
                "peek (basic.get, requeue)" if heads else AGE_FROM_API if age_from_api else None
            ),
        },
        management_api="ok" if api is not None else api_error,
        notes=notes,
    )


__all__ = ["head_times", "passive_exchanges", "read_status"]
