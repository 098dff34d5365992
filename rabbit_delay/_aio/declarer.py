"""Execute the core's declaration program on an aio-pika connection."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Generator
from typing import TypeVar

import aiormq
from aio_pika.abc import AbstractChannel as AbstractAioChannel
from aio_pika.abc import AbstractConnection
from aiormq.abc import AbstractChannel

from rabbit_delay._aio.connection import broker_info, plain_channel
from rabbit_delay._aio.errors import (
    CHANNEL_CODES,
    CLIENT_ERRORS,
    CONNECTION_CODES,
    is_closed_error,
    reply_of,
    translate,
)
from rabbit_delay._plan import program
from rabbit_delay._plan.desired import ExchangeSpec, Kind, desired
from rabbit_delay._plan.diff import Observed, Plan
from rabbit_delay._topology.model import Topology

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

    async def __call__(self, op: program.Operation) -> object:
        try:
            return await self._run(op)
        except aiormq.exceptions.ConnectionClosed as exc:
            _code, text = reply_of(exc, CONNECTION_CODES)
            raise program.failure(op, exc, translate, text) from None
        except aiormq.exceptions.ChannelClosed as exc:
            self._ch = None
            return program.refused(op, exc, translate, *reply_of(exc, CHANNEL_CODES))
        except CLIENT_ERRORS as exc:
            raise program.failure(op, exc, translate) from None
        except RuntimeError as exc:
            if not is_closed_error(exc):
                raise
            raise program.failure(op, exc, translate) from None

    async def _routes_every_key(self, op: program.RoutesEveryKey) -> bool:
        """See program.RoutesEveryKey: a temporary exclusive queue, deleted with its channel."""
        bound, sent = op.probe_keys()
        owner = await plain_channel(self.connection, confirms=True)
        try:
            ch = await owner.get_underlay_channel()
            declared = await ch.queue_declare("", exclusive=True, auto_delete=True)
            queue = declared.queue
            assert queue is not None
            await ch.queue_bind(queue, op.exchange, routing_key=bound)
            if op.due is not None:  # the probe's way back through the due exchange
                await ch.queue_bind(queue, op.due, routing_key=sent)
            await ch.basic_publish(b"", exchange=op.exchange, routing_key=sent)
            deadline = time.monotonic() + program.ROUTING_PROBE_TIMEOUT_S
            while time.monotonic() < deadline:
                got = await ch.basic_get(queue, no_ack=True)
                if got.delivery_tag is not None:
                    return True
                await asyncio.sleep(program.ROUTING_PROBE_POLL_S)
            return False
        finally:
            if not owner.is_closed:
                await owner.close()  # the exclusive queue goes with it

    async def _run(self, op: program.Operation) -> object:
        if isinstance(op, program.RoutesEveryKey):
            return await self._routes_every_key(op)
        ch = await self.channel()
        if isinstance(op, program.SupportsType):
            await ch.exchange_declare(
                program.TYPE_PROBE_EXCHANGE, exchange_type=op.exchange_type, durable=False
            )
        elif isinstance(op, program.Exists | program.Declare):
            spec, passive = op.spec, isinstance(op, program.Exists)
            arguments = dict(spec.arguments)
            if isinstance(spec, ExchangeSpec):
                await ch.exchange_declare(
                    spec.name,
                    exchange_type=spec.type,
                    passive=passive,
                    durable=spec.durable,
                    arguments=arguments,  # type: ignore[arg-type]
                )
            else:
                await ch.queue_declare(
                    spec.name,
                    passive=passive,
                    durable=spec.durable,
                    arguments=arguments,  # type: ignore[arg-type]
                )
        else:
            b = op.spec
            if b.destination_type is Kind.QUEUE:
                await ch.queue_bind(b.destination, b.source, routing_key=b.routing_key)
            else:
                await ch.exchange_bind(b.destination, b.source, routing_key=b.routing_key)
        return program.accepted(op)


async def run_program(
    connection: AbstractConnection, steps: Generator[program.Operation, object, T]
) -> T:
    """Drive a sans-I/O program (program.declare_program, program.plan_program) to its end."""
    execute = _Executor(connection)
    try:
        op = next(steps)
        while True:
            op = steps.send(await execute(op))
    except StopIteration as stop:
        result: T = stop.value
        return result
    finally:
        await execute.close()


async def declare(
    connection: AbstractConnection, topology: Topology, *, observed: Observed | None = None
) -> program.DeclareReport:
    """Declare the topology. Raises DeclarationConflict or IncompatibleBroker (nothing
    changed), MissingPluginError, MissingObjectError, AccessRefused (the permission
    named), ConnectionLost (the connection went away mid-way: run it again, it is
    idempotent) or BrokerError."""
    steps = program.declare_program(desired(topology), observed, broker_info(connection))
    return await run_program(connection, steps)


async def plan(
    connection: AbstractConnection, topology: Topology, *, observed: Observed | None = None
) -> Plan:
    """What `declare` would do, changing nothing. Raises MissingPluginError,
    IncompatibleBroker, ConnectionLost or AccessRefused."""
    steps = program.plan_program(desired(topology), observed, broker_info(connection))
    return await run_program(connection, steps)
