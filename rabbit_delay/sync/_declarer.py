"""Execute the core's declaration program on a pika connection."""

from __future__ import annotations

import time
import uuid
from collections.abc import Generator
from typing import TypeVar

import pika
import pika.exceptions

from rabbit_delay._errors import MissingPluginError
from rabbit_delay._plan.plan import (
    NOT_ANSWERED,
    PLUGIN_HINT,
    ROUTING_PROBE_TIMEOUT_S,
    TYPE_PROBE_EXCHANGE,
    UNKNOWN_EXCHANGE_TYPE,
    Declare,
    DeclareReport,
    ExchangeSpec,
    Exists,
    Kind,
    Observed,
    Operation,
    Plan,
    RoutesEveryKey,
    SupportsType,
    declare_program,
    describe,
    desired,
    permission,
    plan_program,
    refusal_answer,
)
from rabbit_delay._topology.model import Topology
from rabbit_delay.sync._connection import ChannelSlot, broker_info
from rabbit_delay.sync._errors import CLIENT_ERRORS, translate

T = TypeVar("T")


class _Executor(ChannelSlot):
    """Runs one operation at a time; a channel closed by a 404/406 is replaced."""

    def __call__(self, op: Operation) -> object:
        try:
            return self._run(op)
        except pika.exceptions.ChannelClosedByBroker as exc:
            self._ch = None
            if UNKNOWN_EXCHANGE_TYPE.search(exc.reply_text):  # 4.x: 406, channel only
                raise MissingPluginError(f"{exc.reply_text}: {PLUGIN_HINT}") from None
            answer = refusal_answer(op, exc.reply_code, exc.reply_text)
            if answer is not NOT_ANSWERED:
                return answer
            raise translate(exc, doing=describe(op), permission=permission(op)) from None
        except pika.exceptions.ConnectionClosedByBroker as exc:
            if UNKNOWN_EXCHANGE_TYPE.search(exc.reply_text):  # 3.x: 503, whole connection
                raise MissingPluginError(f"{exc.reply_text}: {PLUGIN_HINT}") from None
            raise translate(exc, doing=describe(op), permission=permission(op)) from None
        except CLIENT_ERRORS as exc:
            raise translate(exc, doing=describe(op), permission=permission(op)) from None

    def _routes_every_key(self, op: RoutesEveryKey) -> bool:
        """See plan.RoutesEveryKey: a temporary exclusive queue, deleted with its channel."""
        ch = self.connection.channel()
        try:
            queue = ch.queue_declare("", exclusive=True, auto_delete=True).method.queue
            probe = f"rabbit-delay.routing-probe.{uuid.uuid4().hex}"
            ch.queue_bind(queue, op.exchange, routing_key=f"{probe}.bound")
            if op.due is not None:  # the probe's way back through the due exchange
                ch.queue_bind(queue, op.due, routing_key=f"{probe}.sent")
            ch.confirm_delivery()
            ch.basic_publish(op.exchange, f"{probe}.sent", b"", pika.BasicProperties())
            deadline = time.monotonic() + ROUTING_PROBE_TIMEOUT_S
            while time.monotonic() < deadline:
                method, _props, _body = ch.basic_get(queue, auto_ack=True)
                if method is not None:
                    return True
                self.connection.sleep(0.02)
            return False
        finally:
            if ch.is_open:
                ch.close()  # the exclusive queue goes with it

    def _run(self, op: Operation) -> object:
        if isinstance(op, RoutesEveryKey):
            return self._routes_every_key(op)
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
    """Declare the topology. Raises DeclarationConflict or IncompatibleBroker (nothing
    changed), MissingPluginError, MissingObjectError, AccessRefused (the permission
    named), ConnectionLost (the connection went away mid-way: run it again, it is
    idempotent) or BrokerError."""
    program = declare_program(desired(topology), observed, broker_info(connection))
    return run_program(connection, program)


def plan(
    connection: pika.BlockingConnection, topology: Topology, *, observed: Observed | None = None
) -> Plan:
    """What `declare` would do, changing nothing (see plan.plan_program).

    Raises MissingPluginError when the topology needs a plugin the broker lacks,
    IncompatibleBroker when the broker's version cannot hold the topology, ConnectionLost
    or AccessRefused.
    """
    program = plan_program(desired(topology), observed, broker_info(connection))
    return run_program(connection, program)
