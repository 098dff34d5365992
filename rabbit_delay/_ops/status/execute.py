"""Read what `status` shows from the broker (pika and the management API); what it
means is decided in `rabbit_delay._ops.status.rules`.

Live figures come from AMQP: a passive declare per queue (ready messages, consumers)
and per exchange (present or not), and a peek at the head of each non-empty buffer for
the age of its oldest message, where peeking cannot cost that message (see
`BrokerInfo.peeks_quorum_buffers_freely`). The management API, once proven to serve
the same broker, adds unacked messages, placement, messages being dead-lettered and the
plugin's store; without AMQP it stands in for the counts. When a buffer shows dead
letters its destination has not confirmed, the API is read again a sample later
(`DEAD_LETTER_RECHECK_S`): still pending, not fewer, they are stalled. With [schedule],
the schedule's records still scheduled past their due time plus the grace are counted
per business queue (overdue), from the idempotency store.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime
from pathlib import Path

import pika
import pika.exceptions

from rabbit_delay._broker import BrokerInfo, QueueCounts
from rabbit_delay._envelope import now_ms
from rabbit_delay._errors import (
    AccessRefused,
    BrokerUnavailable,
    ManagementUnavailable,
    RabbitDelayError,
)
from rabbit_delay._io.management import (
    access_for,
    read_broker_version,
    read_delayed_messages,
    read_exchange_names,
    read_queue_counts,
)
from rabbit_delay._names import CASCADE_KIND, TIER_KIND
from rabbit_delay._ops.queues import passive_counts, peek_head
from rabbit_delay._ops.status.rules import (
    AGE_FROM_API,
    BUFFER_ROLES,
    DEAD_LETTER_RECHECK_S,
    OVERDUE_LIMIT,
    PluginStore,
    QueueRole,
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


def overdue_records(topology: Topology, now_ms: int) -> tuple[dict[str, int] | None, str]:
    """With [schedule] (and a store other processes share): per business queue, how many
    records are still scheduled past their due time plus the grace (at most
    `OVERDUE_LIMIT` each). None and why when not read (no schedule, the memory store, a
    store error: its kind only, a store's message may carry its URL)."""
    if topology.schedule is None:
        return None, ""
    if topology.idempotency.store == "memory":
        return None, "overdue records not read: the memory store is one process's"
    from rabbit_delay._schedule_api.sync import Schedule

    store = topology.idempotency
    if store.store == "sqlite" and not Path(store.path).exists():
        return None, f"overdue records not read: no SQLite file at {store.path} yet"

    cutoff = datetime.fromtimestamp((now_ms - topology.schedule.grace) / 1000, UTC)
    try:
        with Schedule(topology) as schedule:
            return {
                queue: len(
                    schedule.list(
                        queue=queue, state="scheduled", due_before=cutoff, limit=OVERDUE_LIMIT
                    )
                )
                for queue in topology.queues
            }, ""
    except (RabbitDelayError, OSError) as exc:
        return None, f"overdue records not read: the schedule's store failed ({type(exc).__name__})"


def read_status(
    topology: Topology,
    urls: Sequence[str],
    *,
    management_url: str | None = None,
    no_management: bool = False,
    name: str = "rabbit-delay status",
    recheck_s: float = DEAD_LETTER_RECHECK_S,
    sleep: Callable[[float], None] = time.sleep,
) -> Status:
    """Everything `status` shows for `topology`, read from the first of `urls` that
    answers (and its management API): see `rabbit_delay._ops.status.rules`.

    Without an AMQP connection, the management API (unverified: there is nothing to
    compare it with) stands in for the counts. When a buffer has dead letters pending,
    the API is read again after `recheck_s` (0: not). Raises BrokerUnavailable when neither
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
    api_again: dict[str, QueueCounts] | None = None
    if (
        endpoint is not None
        and api is not None
        and recheck_s > 0
        and _dead_letters_pending(topology, api)
    ):
        sleep(recheck_s)
        try:
            api_again = read_queue_counts(endpoint, topology.names.prefix + ".")
        except ManagementUnavailable:
            api_again = None
    overdue, overdue_note = overdue_records(topology, checked_at)

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
    if overdue_note:
        notes.append(overdue_note)
    plugin = None
    if topology.plugin is not None:
        plugin = PluginStore(topology.names.plugin_exchange(), delayed)
    rows = status_rows(
        topology,
        live,
        api,
        heads=heads,
        now_ms=checked_at,
        api_again=api_again,
        overdue=overdue,
        overdue_grace_ms=topology.schedule.grace if topology.schedule is not None else None,
    )
    blind = [r.name for r in rows if r.no_figures and r.role in (*BUFFER_ROLES, QueueRole.BUSINESS)]
    if blind:
        notes.append(
            f"the management API has no message figures for {len(blind)} quorum queue(s) "
            "(RabbitMQ 3.10 after a partition: docs/reliability.md#network-partitions): "
            "dead letters stalled in them do not show here"
            + ("" if overdue is not None else "; with [schedule] they show as overdue")
        )
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


def _dead_letters_pending(topology: Topology, api: dict[str, QueueCounts]) -> bool:
    """Whether a tier buffer or cascade level shows dead letters not yet confirmed."""
    return any(
        counts.dead_lettering
        for name, counts in api.items()
        if topology.names.parse(name)[0] in (TIER_KIND, CASCADE_KIND)
    )


__all__ = ["head_times", "overdue_records", "passive_exchanges", "read_status"]
