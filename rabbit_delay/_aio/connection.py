"""aio-pika connections: the first of several broker URLs that answers, with the settings
of `rabbit_delay._connection` (heartbeat, connect timeout, TLS).

Connections are plain, not aio-pika's robust ones: a robust connection reconnects to
its one URL only, and restores channels and consumers behind the back of code that
keeps its own state about them. The worker (and the publisher) reconnect themselves,
over every URL (see docs/connections.md).
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Sequence
from typing import Any

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractRobustConnection

from rabbit_delay._aio.errors import CLIENT_ERRORS
from rabbit_delay._broker import UNKNOWN, BrokerInfo
from rabbit_delay._connection import ConnectionSettings, query_keys, unavailable_message
from rabbit_delay._errors import BrokerUnavailable, ConnectionLost
from rabbit_delay._tls import TLSOptions, split_tls
from rabbit_delay._urls import redact

log = logging.getLogger("rabbit_delay._connection")

Urls = str | Sequence[str] | None


def tls_context(tls: TLSOptions) -> ssl.SSLContext:
    """Our verifying context; with `server_name`, the certificate is checked against
    that name instead of the URL's host (asyncio passes the host to `wrap_bio`, and
    aio-pika offers no `server_hostname`)."""
    context = tls.context()
    name = tls.server_name
    if name:
        wrap = context.wrap_bio

        def wrap_bio(*args: Any, **kwargs: Any) -> ssl.SSLObject:
            kwargs["server_hostname"] = name
            return wrap(*args, **kwargs)

        context.wrap_bio = wrap_bio  # type: ignore[method-assign]
    return context


def _prepare(url: str, settings: ConnectionSettings) -> tuple[str, ssl.SSLContext | None]:
    clean, tls = split_tls(url, settings.tls)
    return clean, tls_context(tls) if tls is not None else None


async def connect_first(
    url: Urls = None, *, name: str = "rabbit-delay", settings: ConnectionSettings | None = None
) -> tuple[AbstractConnection, str]:
    """(a connection to the first URL that answers, that URL).

    Raises BrokerUnavailable naming every URL tried (redacted) and why each failed;
    ConfigError for a URL or TLS option that is wrong (before connecting anywhere).
    """
    settings = settings or ConnectionSettings()
    candidates = settings.resolve(url)
    prepared = [(candidate, *_prepare(candidate, settings)) for candidate in candidates]
    attempts: list[tuple[str, BaseException]] = []
    for candidate, clean, context in prepared:
        extra: dict[str, Any] = {}
        if "heartbeat" not in query_keys(clean):
            extra["heartbeat"] = round(settings.heartbeat_s)
        try:
            connection = await aio_pika.connect(
                clean,
                ssl_context=context,
                timeout=settings.connect_timeout_s,
                client_properties={"connection_name": name},
                **extra,
            )
        except CLIENT_ERRORS as exc:
            log.debug("cannot connect to %s: %s", redact(candidate), redact(repr(exc)))
            attempts.append((candidate, exc))
        else:
            return connection, candidate
    raise BrokerUnavailable(unavailable_message(attempts))


async def connect(
    url: Urls = None, *, name: str = "rabbit-delay", settings: ConnectionSettings | None = None
) -> AbstractConnection:
    """Open a (plain) connection to the first of the broker URLs that answers.

    `url`: one URL, several (a sequence, or one string separated by commas), or None for
    `settings.urls`, else $RABBIT_DELAY_URL, else the local broker. Raises
    BrokerUnavailable (every URL tried, redacted, and why each failed) or ConfigError.
    """
    return (await connect_first(url, name=name, settings=settings))[0]


async def close_quietly(connection: AbstractConnection | None) -> None:
    """Close `connection` unless closed; a connection already lost needs nothing."""
    if connection is not None and not connection.is_closed:
        try:
            await connection.close()
        except CLIENT_ERRORS as exc:
            log.debug("closing a connection failed: %s", redact(repr(exc)))


async def plain_channel(connection: AbstractConnection, *, confirms: bool) -> AbstractChannel:
    """A channel that stays closed once closed, for code that replaces its own channels.

    A robust connection's channels reopen themselves after the broker closed them (a 404
    or 406); code that then opens a replacement races that reopening and leaks one
    channel per refusal. The declarer and the publisher open a new channel whenever the
    last one is closed, so they take a plain channel that is not registered for restore.
    """
    if not isinstance(connection, AbstractRobustConnection) and not connection.connected.is_set():
        # a plain connection that was lost never becomes ready again: waiting would hang
        raise ConnectionLost("the connection to the broker was lost (it is closed)")
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


__all__ = ["broker_info", "close_quietly", "connect", "connect_first", "plain_channel"]
