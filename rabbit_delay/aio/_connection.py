"""aio-pika connections: open with a redacted error."""

from __future__ import annotations

import aio_pika
import aiormq
from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractRobustConnection

from rabbit_delay.broker import UNKNOWN, BrokerInfo
from rabbit_delay.errors import BrokerUnavailable
from rabbit_delay.urls import broker_url, redact


async def connect(
    url: str | None = None, *, name: str = "rabbit-delay"
) -> AbstractRobustConnection:
    """Open a robust connection (reconnects by itself). Raises BrokerUnavailable."""
    url = broker_url(url)
    try:
        return await aio_pika.connect_robust(url, client_properties={"connection_name": name})
    except (aiormq.exceptions.AMQPError, OSError, ValueError) as exc:
        raise BrokerUnavailable(f"cannot connect to {redact(url)}: {redact(repr(exc))}") from None


async def plain_channel(connection: AbstractConnection, *, confirms: bool) -> AbstractChannel:
    """A channel that stays closed once closed, for code that replaces its own channels.

    A robust connection's channels reopen themselves after the broker closed them (a 404
    or 406); code that then opens a replacement races that reopening and leaks one
    channel per refusal. The declarer and the publisher open a new channel whenever the
    last one is closed, so they take a plain channel that is not registered for restore.
    """
    await connection.ready()
    channel = aio_pika.Channel(connection, publisher_confirms=confirms, on_return_raises=confirms)
    await channel.initialize()
    return channel


def broker_info(connection: AbstractConnection) -> BrokerInfo:
    """What the broker said about itself when the connection opened (version, cluster).

    UNKNOWN while the connection is not open (a robust connection between reconnects).
    """
    transport = connection.transport
    if transport is None:
        return UNKNOWN
    return BrokerInfo.from_server_properties(transport.connection.server_properties)
