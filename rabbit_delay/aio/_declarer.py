"""Execute the core's declaration program on an aio-pika connection."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Generator
from typing import TypeVar

import aiormq
from aio_pika.abc import AbstractChannel as AbstractAioChannel
from aio_pika.abc import AbstractConnection
from aiormq.abc import AbstractChannel

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
from rabbit_delay.aio._connection import broker_info, plain_channel
from rabbit_delay.aio._errors import (
    CHANNEL_CODES,
    CLIENT_ERRORS,
    CONNECTION_CODES,
    is_closed_error,
    reply_of,
    translate,
)

T = TypeVar("T")


class _Executor:
    """One operation at a time on the underlying aiormq channel; replaced when the broker
    closes it (404 on a passive declare, 406 on a conflicting one)."""

    def __init__(self, connection: AbstractConnection) -> None:
        self.connection = connection
        self._ch: AbstractChannel | None = None
        self._owner: AbstractAioChannel | None = None  # the aio-pika channel owning `_ch`

    async def channel(self) -> AbstractChannel:
        if self._ch is None or self._ch.is_closed:
            await self.close()
            self._owner = await plain_channel(self.connection, confirms=False)
            self._ch = await self._owner.get_underlay_channel()
        return self._ch

    async def close(self) -> None:
        """Close the channel if it is still open; a lost one needs nothing (and an error
        on the way out never hides the one that ended the program)."""
        owner, self._owner, self._ch = self._owner, None, None
        if owner is not None and not owner.is_closed:
            with contextlib.suppress(*CLIENT_ERRORS, RuntimeError):
                await owner.close()

    async def __call__(self, op: Operation) -> object:
        try:
            return await self._run(op)
        except aiormq.exceptions.ConnectionClosed as exc:
            _code, text = reply_of(exc, CONNECTION_CODES)
            if UNKNOWN_EXCHANGE_TYPE.search(text):  # 3.x: 503, whole connection
                raise MissingPluginError(f"{text}: {PLUGIN_HINT}") from None
            raise translate(exc, doing=describe(op), permission=permission(op)) from None
        except aiormq.exceptions.ChannelClosed as exc:
            self._ch = None
            code, text = reply_of(exc, CHANNEL_CODES)
            if UNKNOWN_EXCHANGE_TYPE.search(text):  # 4.x: 406, channel only
                raise MissingPluginError(f"{text}: {PLUGIN_HINT}") from None
            answer = refusal_answer(op, code, text)
            if answer is not NOT_ANSWERED:
                return answer
            raise translate(exc, doing=describe(op), permission=permission(op)) from None
        except CLIENT_ERRORS as exc:
            raise translate(exc, doing=describe(op), permission=permission(op)) from None
        except RuntimeError as exc:
            if not is_closed_error(exc):
                raise
            raise translate(exc, doing=describe(op), permission=permission(op)) from None

    async def _routes_every_key(self, op: RoutesEveryKey) -> bool:
        """See plan.RoutesEveryKey: a temporary exclusive queue, deleted with its channel."""
        owner = await plain_channel(self.connection, confirms=True)
        try:
            ch = await owner.get_underlay_channel()
            declared = await ch.queue_declare("", exclusive=True, auto_delete=True)
            queue = declared.queue
            assert queue is not None
            probe = f"rabbit-delay.routing-probe.{uuid.uuid4().hex}"
            await ch.queue_bind(queue, op.exchange, routing_key=f"{probe}.bound")
            if op.due is not None:  # the probe's way back through the due exchange
                await ch.queue_bind(queue, op.due, routing_key=f"{probe}.sent")
            await ch.basic_publish(b"", exchange=op.exchange, routing_key=f"{probe}.sent")
            deadline = time.monotonic() + ROUTING_PROBE_TIMEOUT_S
            while time.monotonic() < deadline:
                got = await ch.basic_get(queue, no_ack=True)
                if got.delivery_tag is not None:
                    return True
                await asyncio.sleep(0.02)
            return False
        finally:
            if not owner.is_closed:
                await owner.close()  # the exclusive queue goes with it

    async def _run(self, op: Operation) -> object:
        if isinstance(op, RoutesEveryKey):
            return await self._routes_every_key(op)
        ch = await self.channel()
        if isinstance(op, SupportsType):
            await ch.exchange_declare(
                TYPE_PROBE_EXCHANGE, exchange_type=op.exchange_type, durable=False
            )
            return True
        if isinstance(op, Exists | Declare):
            passive = isinstance(op, Exists)
            spec = op.spec
            if isinstance(spec, ExchangeSpec):
                await ch.exchange_declare(
                    spec.name,
                    exchange_type=spec.type,
                    passive=passive,
                    durable=spec.durable,
                    arguments=dict(spec.arguments),  # type: ignore[arg-type]
                )
            else:
                await ch.queue_declare(
                    spec.name,
                    passive=passive,
                    durable=spec.durable,
                    arguments=dict(spec.arguments),  # type: ignore[arg-type]
                )
            return True if passive else None
        b = op.spec
        if b.destination_type is Kind.QUEUE:
            await ch.queue_bind(b.destination, b.source, routing_key=b.routing_key)
        else:
            await ch.exchange_bind(b.destination, b.source, routing_key=b.routing_key)
        return None


async def run_program(
    connection: AbstractConnection, program: Generator[Operation, object, T]
) -> T:
    """Drive a sans-I/O program (plan.declare_program, plan.plan_program) to its end."""
    execute = _Executor(connection)
    try:
        op = next(program)
        while True:
            op = program.send(await execute(op))
    except StopIteration as stop:
        result: T = stop.value
        return result
    finally:
        await execute.close()


async def declare(
    connection: AbstractConnection, topology: Topology, *, observed: Observed | None = None
) -> DeclareReport:
    """Declare the topology. Raises DeclarationConflict or IncompatibleBroker (nothing
    changed), MissingPluginError, MissingObjectError, AccessRefused (the permission
    named), ConnectionLost (the connection went away mid-way: run it again, it is
    idempotent) or BrokerError."""
    program = declare_program(desired(topology), observed, broker_info(connection))
    return await run_program(connection, program)


async def plan(
    connection: AbstractConnection, topology: Topology, *, observed: Observed | None = None
) -> Plan:
    """What `declare` would do, changing nothing. Raises MissingPluginError,
    IncompatibleBroker, ConnectionLost or AccessRefused."""
    program = plan_program(desired(topology), observed, broker_info(connection))
    return await run_program(connection, program)
