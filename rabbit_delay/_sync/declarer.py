"""Execute the core's declaration program on a pika connection."""

from __future__ import annotations

import time
from collections.abc import Generator
from typing import TypeVar

import pika
import pika.exceptions

from rabbit_delay._plan import program
from rabbit_delay._plan.desired import ExchangeSpec, Kind, desired
from rabbit_delay._plan.diff import Observed, Plan
from rabbit_delay._sync.connection import ChannelSlot, broker_info
from rabbit_delay._sync.errors import CLIENT_ERRORS, translate
from rabbit_delay._topology.model import Topology

T = TypeVar("T")


class _Executor(ChannelSlot):
    """Runs one operation at a time; a channel closed by a 404/406 is replaced."""

    def __call__(self, op: program.Operation) -> object:
        try:
            return self._run(op)
        except pika.exceptions.ChannelClosedByBroker as exc:
            self._ch = None
            return program.refused(op, exc, translate, exc.reply_code, exc.reply_text)
        except pika.exceptions.ConnectionClosedByBroker as exc:
            raise program.failure(op, exc, translate, exc.reply_text) from None
        except CLIENT_ERRORS as exc:
            raise program.failure(op, exc, translate) from None

    def _routes_every_key(self, op: program.RoutesEveryKey) -> bool:
        """See program.RoutesEveryKey: a temporary exclusive queue, deleted with its channel."""
        bound, sent = op.probe_keys()
        ch = self.connection.channel()
        try:
            queue = ch.queue_declare("", exclusive=True, auto_delete=True).method.queue
            ch.queue_bind(queue, op.exchange, routing_key=bound)
            if op.due is not None:  # the probe's way back through the due exchange
                ch.queue_bind(queue, op.due, routing_key=sent)
            ch.confirm_delivery()
            ch.basic_publish(op.exchange, sent, b"", pika.BasicProperties())
            deadline = time.monotonic() + program.ROUTING_PROBE_TIMEOUT_S
            while time.monotonic() < deadline:
                method, _props, _body = ch.basic_get(queue, auto_ack=True)
                if method is not None:
                    return True
                self.connection.sleep(program.ROUTING_PROBE_POLL_S)
            return False
        finally:
            if ch.is_open:
                ch.close()  # the exclusive queue goes with it

    def _run(self, op: program.Operation) -> object:
        if isinstance(op, program.RoutesEveryKey):
            return self._routes_every_key(op)
        ch = self.channel
        if isinstance(op, program.SupportsType):
            ch.exchange_declare(program.TYPE_PROBE_EXCHANGE, op.exchange_type, durable=False)
        elif isinstance(op, program.Exists | program.Declare):
            spec, passive = op.spec, isinstance(op, program.Exists)
            arguments = dict(spec.arguments)
            if isinstance(spec, ExchangeSpec):
                ch.exchange_declare(
                    spec.name, spec.type, passive=passive, durable=spec.durable, arguments=arguments
                )
            else:
                ch.queue_declare(
                    spec.name, passive=passive, durable=spec.durable, arguments=arguments
                )
        else:
            b = op.spec
            if b.destination_type is Kind.QUEUE:
                ch.queue_bind(b.destination, b.source, routing_key=b.routing_key)
            else:
                ch.exchange_bind(b.destination, b.source, routing_key=b.routing_key)
        return program.accepted(op)


def run_program(
    connection: pika.BlockingConnection, steps: Generator[program.Operation, object, T]
) -> T:
    """Drive a sans-I/O program (program.declare_program, program.plan_program) to its end."""
    execute = _Executor(connection)
    try:
        op = next(steps)
        while True:
            op = steps.send(execute(op))
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
) -> program.DeclareReport:
    """Declare the topology. Raises DeclarationConflict or IncompatibleBroker (nothing
    changed), MissingPluginError, MissingObjectError, AccessRefused (the permission
    named), ConnectionLost (the connection went away mid-way: run it again, it is
    idempotent) or BrokerError."""
    steps = program.declare_program(desired(topology), observed, broker_info(connection))
    return run_program(connection, steps)


def plan(
    connection: pika.BlockingConnection, topology: Topology, *, observed: Observed | None = None
) -> Plan:
    """What `declare` would do, changing nothing (see program.plan_program).

    Raises MissingPluginError when the topology needs a plugin the broker lacks,
    IncompatibleBroker when the broker's version cannot hold the topology, ConnectionLost
    or AccessRefused.
    """
    steps = program.plan_program(desired(topology), observed, broker_info(connection))
    return run_program(connection, steps)
