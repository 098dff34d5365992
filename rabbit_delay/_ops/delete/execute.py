"""Delete a topology on pika: survey what exists, let `rabbit_delay._ops.delete.rules` decide,
then delete in its order, looking at each queue once more just before it goes."""

from __future__ import annotations

from dataclasses import replace

import pika
import pika.exceptions

from rabbit_delay._broker import QueueCounts
from rabbit_delay._errors import ManagementUnavailable, RabbitDelayError
from rabbit_delay._io.management import read_observed, read_queue_counts
from rabbit_delay._ops.delete.rules import DeleteReport, Found, Target, decide, still_idle
from rabbit_delay._plan.desired import Kind, desired
from rabbit_delay._plan.diff import PlanItem, retired_shards
from rabbit_delay._plan.program import probe_retired_shards
from rabbit_delay._sync.connection import ChannelSlot
from rabbit_delay._sync.declarer import run_program
from rabbit_delay._sync.errors import CLIENT_ERRORS, mapped, translate
from rabbit_delay._topology.model import QueueType, Topology
from rabbit_delay._urls import ManagementEndpoint

# What stops a delete run (reported in DeleteReport.error, never raised).
_FAILURES: tuple[type[BaseException], ...] = (*CLIENT_ERRORS, RabbitDelayError)


class _Objects(ChannelSlot):
    """Passive declares and deletes on one channel, replaced when a 404 (or a refused
    delete) closes it."""

    def queue(self, name: str) -> QueueCounts | None:
        with mapped(f"checking queue {name!r} (passive declare)"):
            try:
                ok = self.channel.queue_declare(name, passive=True)
            except pika.exceptions.ChannelClosedByBroker as exc:
                if exc.reply_code == 404:
                    return None
                raise
        return QueueCounts(
            ready=ok.method.message_count or 0, consumers=ok.method.consumer_count or 0
        )

    def exchange(self, name: str) -> bool:
        with mapped(f"checking exchange {name!r} (passive declare)"):
            try:
                self.channel.exchange_declare(name, passive=True)
            except pika.exceptions.ChannelClosedByBroker as exc:
                if exc.reply_code == 404:
                    return False
                raise
        return True

    def delete(self, target: Target, *, if_idle: bool) -> None:
        """Delete `target`. With `if_idle`, a classic queue is deleted only if empty and
        unused, by the broker itself (quorum queues refuse those flags: the caller
        looks before)."""
        with mapped(f"deleting {target.kind.value} {target.name!r}", permission="configure"):
            if target.kind is Kind.EXCHANGE:
                self.channel.exchange_delete(target.name)
            else:
                self.channel.queue_delete(target.name, if_unused=if_idle, if_empty=if_idle)


def _with_api(state: QueueCounts | None, api: QueueCounts | None) -> QueueCounts | None:
    """Live counts, with the management API's unacked and dead-lettering figures."""
    if state is None or api is None:
        return state
    return replace(state, unacked=api.unacked, dead_lettering=api.dead_lettering)


def survey(
    connection: pika.BlockingConnection,
    topology: Topology,
    *,
    endpoint: ManagementEndpoint | None = None,
) -> Found:
    """What the broker has of `topology`: each queue's live counts (plus, with the
    management API, unacked and dead-lettering messages), each exchange, and the
    buffers of retired shards (listed by the API, else probed with passive declares).

    Raises ConnectionLost, AccessRefused or BrokerError.
    """
    want = desired(topology)
    stats: dict[str, QueueCounts] = {}
    retired: tuple[PlanItem, ...] | None = None
    if endpoint is not None:
        prefix = topology.names.prefix + "."
        try:
            stats = read_queue_counts(endpoint, prefix)
            observed = read_observed(endpoint, prefix)
            retired = retired_shards(want, observed.exchanges, observed.queues)
        except ManagementUnavailable:
            stats, retired = {}, None  # counted over AMQP alone
    if retired is None:
        retired = run_program(connection, probe_retired_shards(want))
    objects = _Objects(connection)
    try:
        queues = {q.name: _with_api(objects.queue(q.name), stats.get(q.name)) for q in want.queues}
        for item in retired:
            if item.kind is Kind.QUEUE:
                queues[item.name] = _with_api(objects.queue(item.name), stats.get(item.name))
        exchanges = {e.name: objects.exchange(e.name) for e in want.exchanges}
        exchanges |= {i.name: True for i in retired if i.kind is Kind.EXCHANGE}
    finally:
        objects.close()
    return Found(queues, exchanges, retired)


def delete(
    connection: pika.BlockingConnection,
    topology: Topology,
    *,
    force: bool = False,
    dry_run: bool = False,
    endpoint: ManagementEndpoint | None = None,
) -> DeleteReport:
    """Delete the objects of `topology` (and its retired shards), if no queue holds
    messages or has consumers; with `force`, with whatever they hold.

    Refused (nothing deleted) when a queue blocks it: `report.plan.blocked` lists them.
    With `dry_run` nothing is deleted. A queue that is no longer empty or unused when
    its turn comes stops the run (`report.error`; what was deleted before stays
    deleted, what is left can be deleted by running it again).

    Raises ConnectionLost, AccessRefused or BrokerError before deleting anything (the
    survey); a failure while deleting is reported in `report.error`.
    """
    plan = decide(desired(topology), survey(connection, topology, endpoint=endpoint), force=force)
    report = DeleteReport(plan, dry_run)
    if dry_run or plan.refused:
        return report
    classic = topology.queue_type is QueueType.CLASSIC
    objects = _Objects(connection)
    try:
        for target in plan.delete:
            if target.kind is Kind.QUEUE and not force:
                state = objects.queue(target.name)
                if not still_idle(state):
                    assert state is not None
                    report.error = (
                        f"queue {target.name!r} is no longer empty and unused ({state.ready} "
                        f"ready, {state.consumers} consumer(s)): stopped, it is kept with "
                        f"everything after it; {len(report.deleted)} object(s) were deleted"
                    )
                    break
                if state is None:
                    continue  # gone meanwhile
            objects.delete(target, if_idle=classic and not force)
            report.deleted.append(target)
    except _FAILURES as exc:
        report.failure = translate(exc, doing="deleting the topology", permission="configure")
        report.error = f"stopped after {len(report.deleted)} object(s): {report.failure}"
    finally:
        objects.close()
    return report


def delete_topology(connection: pika.BlockingConnection, topology: Topology) -> list[str]:
    """Delete every queue and exchange of the topology (and its retired shards), WITH
    the messages in them: `delete(force=True)`.

    For tests, demos and benchmarks. Objects already gone are skipped. Returns what was
    deleted, as "queue NAME" / "exchange NAME". Raises AccessRefused, ConnectionLost or
    BrokerError.
    """
    report = delete(connection, topology, force=True)
    if report.failure is not None:
        raise report.failure
    return [f"{t.kind.value} {t.name}" for t in report.deleted]


__all__ = ["delete", "delete_topology", "survey"]
