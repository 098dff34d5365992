"""Execute the core's declaration program on a pika connection."""

from __future__ import annotations

from collections.abc import Generator
from typing import TypeVar

import pika
import pika.exceptions
from pika.adapters.blocking_connection import BlockingChannel

from rabbit_delay.errors import BrokerError, MissingObjectError, MissingPluginError
from rabbit_delay.plan import (
    PLUGIN_HINT,
    TYPE_PROBE_EXCHANGE,
    UNKNOWN_EXCHANGE_TYPE,
    Declare,
    DeclareReport,
    ExchangeSpec,
    Exists,
    Kind,
    ObjectSpec,
    Observed,
    Operation,
    Plan,
    SupportsType,
    declare_program,
    describe,
    desired,
    plan_program,
)
from rabbit_delay.topology import Topology

T = TypeVar("T")


class _Executor:
    """Runs one operation at a time; a channel closed by a 404/406 is replaced."""

    def __init__(self, connection: pika.BlockingConnection) -> None:
        self.connection = connection
        self._ch: BlockingChannel | None = None

    @property
    def channel(self) -> BlockingChannel:
        if self._ch is None or not self._ch.is_open:
            self._ch = self.connection.channel()
        return self._ch

    def close(self) -> None:
        if self._ch is not None and self._ch.is_open:
            self._ch.close()

    def __call__(self, op: Operation) -> object:
        try:
            return self._run(op)
        except pika.exceptions.ChannelClosedByBroker as exc:
            self._ch = None
            if isinstance(op, Exists) and exc.reply_code == 404:
                return False
            if isinstance(op, Declare) and exc.reply_code == 406:
                return exc.reply_text
            if isinstance(op, SupportsType) and exc.reply_code == 403:
                return True  # the type passed the check; the reserved name was refused
            if exc.reply_code == 404:
                raise MissingObjectError(f"{exc.reply_text} (while {describe(op)})") from None
            raise BrokerError(f"{exc.reply_code} {exc.reply_text} (while {describe(op)})") from None
        except pika.exceptions.ConnectionClosedByBroker as exc:
            if UNKNOWN_EXCHANGE_TYPE in exc.reply_text:
                raise MissingPluginError(f"{exc.reply_text}: {PLUGIN_HINT}") from None
            raise BrokerError(
                f"connection closed by the broker: {exc.reply_code} {exc.reply_text}"
            ) from None

    def _run(self, op: Operation) -> object:
        ch = self.channel
        if isinstance(op, SupportsType):
            ch.exchange_declare(TYPE_PROBE_EXCHANGE, op.exchange_type, durable=False)
            return True
        if isinstance(op, Exists | Declare):
            passive = isinstance(op, Exists)
            spec = op.spec
            if isinstance(spec, ExchangeSpec):
                ch.exchange_declare(
                    spec.name,
                    spec.type,
                    passive=passive,
                    durable=spec.durable,
                    arguments=dict(spec.arguments),
                )
            else:
                ch.queue_declare(
                    spec.name, passive=passive, durable=spec.durable, arguments=dict(spec.arguments)
                )
            return True if passive else None
        b = op.spec
        if b.destination_type is Kind.QUEUE:
            ch.queue_bind(b.destination, b.source, routing_key=b.routing_key)
        else:
            ch.exchange_bind(b.destination, b.source, routing_key=b.routing_key)
        return None


def run_program(connection: pika.BlockingConnection, program: Generator[Operation, object, T]) -> T:
    """Drive a sans-I/O program (plan.declare_program, plan.plan_program) to its end."""
    execute = _Executor(connection)
    try:
        op = next(program)
        while True:
            op = program.send(execute(op))
    except StopIteration as stop:
        result: T = stop.value
        return result
    finally:
        execute.close()


def declare(
    connection: pika.BlockingConnection,
    topology: Topology,
    *,
    observed: Observed | None = None,
) -> DeclareReport:
    """Declare the topology. Raises DeclarationConflict (nothing changed),
    MissingPluginError, MissingObjectError or BrokerError."""
    return run_program(connection, declare_program(desired(topology), observed))


def plan(
    connection: pika.BlockingConnection, topology: Topology, *, observed: Observed | None = None
) -> Plan:
    """What `declare` would do, changing nothing (see plan.plan_program).

    Raises MissingPluginError when the topology needs a plugin the broker lacks.
    """
    return run_program(connection, plan_program(desired(topology), observed))


def delete_topology(connection: pika.BlockingConnection, topology: Topology) -> list[str]:
    """Delete every queue and exchange the topology declares, WITH the messages in them.

    For tests, demos and benchmarks, never part of normal operation (nothing else in
    rabbit-delay deletes or purges). Objects already gone are skipped. Returns what was
    deleted, as "queue NAME" / "exchange NAME".
    """
    want = desired(topology)
    deleted: list[str] = []
    specs: list[ObjectSpec] = [*want.queues, *want.exchanges]
    for spec in specs:
        channel = connection.channel()
        try:
            if isinstance(spec, ExchangeSpec):
                channel.exchange_declare(spec.name, passive=True)
                channel.exchange_delete(spec.name)
            else:
                channel.queue_declare(spec.name, passive=True)
                channel.queue_delete(spec.name)
            deleted.append(f"{spec.kind.value} {spec.name}")
        except pika.exceptions.ChannelClosedByBroker as exc:
            if exc.reply_code != 404:
                raise BrokerError(f"{exc.reply_code} {exc.reply_text}") from None
        except pika.exceptions.ConnectionClosedByBroker as exc:
            raise BrokerError(
                f"connection closed while deleting {spec.name!r}: {exc.reply_code} {exc.reply_text}"
            ) from None
        finally:
            if channel.is_open:
                channel.close()
    return deleted
