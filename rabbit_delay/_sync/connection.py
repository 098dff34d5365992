"""pika connections: the first of several broker URLs that answers, with the settings of
`rabbit_delay._connection` (heartbeat, timeouts, blocked-connection timeout, TLS)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import pika
import pika.exceptions
from pika.adapters.blocking_connection import BlockingChannel

from rabbit_delay._broker import BrokerInfo
from rabbit_delay._connection import ConnectionSettings, query_keys, unavailable_message
from rabbit_delay._errors import BrokerUnavailable, ConfigError
from rabbit_delay._sync.errors import CLIENT_ERRORS
from rabbit_delay._tls import split_tls
from rabbit_delay._urls import redact

log = logging.getLogger("rabbit_delay._connection")

Urls = str | Sequence[str] | None


def parameters(url: str, settings: ConnectionSettings, name: str) -> pika.URLParameters:
    """pika's parameters for one URL: our settings where the URL's query does not set
    its own, one attempt (the URL list is the retry), and for amqps:// our verifying TLS
    context, never pika's default one. Raises ConfigError for a bad URL or TLS file."""
    clean, tls = split_tls(url, settings.tls)
    try:
        params = pika.URLParameters(clean)
    except ValueError as exc:  # an unknown query key, a value that is not a number
        raise ConfigError(f"broker URL {redact(url)!r}: {redact(str(exc))}") from None
    own = query_keys(clean)
    params.client_properties = {"connection_name": name}
    params.connection_attempts = 1
    if "heartbeat" not in own:
        params.heartbeat = round(settings.heartbeat_s)
    if "socket_timeout" not in own:
        params.socket_timeout = settings.connect_timeout_s
    if "stack_timeout" not in own:
        # the whole handshake: TCP, TLS and AMQP
        params.stack_timeout = settings.connect_timeout_s
    if "blocked_connection_timeout" not in own:
        params.blocked_connection_timeout = settings.blocked_timeout_s
    if tls is not None:
        params.ssl_options = pika.SSLOptions(tls.context(), tls.server_name)
    return params


def connect_first(
    url: Urls = None, *, name: str = "rabbit-delay", settings: ConnectionSettings | None = None
) -> tuple[pika.BlockingConnection, str]:
    """(a blocking connection to the first URL that answers, that URL).

    Raises BrokerUnavailable naming every URL tried (redacted) and why each failed;
    ConfigError for a URL or TLS option that is wrong (before connecting anywhere).
    """
    settings = settings or ConnectionSettings()
    candidates = settings.resolve(url)
    prepared = [(candidate, parameters(candidate, settings, name)) for candidate in candidates]
    attempts: list[tuple[str, BaseException]] = []
    for candidate, params in prepared:
        try:
            return pika.BlockingConnection(params), candidate
        except CLIENT_ERRORS as exc:
            log.debug("cannot connect to %s: %s", redact(candidate), redact(repr(exc)))
            attempts.append((candidate, exc))
    # raised outside the except: the message says all, the client's traceback nothing
    raise BrokerUnavailable(unavailable_message(attempts))


def connect(
    url: Urls = None, *, name: str = "rabbit-delay", settings: ConnectionSettings | None = None
) -> pika.BlockingConnection:
    """Open a blocking connection to the first of the broker URLs that answers.

    `url`: one URL, several (a sequence, or one string separated by commas), or None for
    `settings.urls`, else $RABBIT_DELAY_URL, else the local broker. Raises
    BrokerUnavailable (every URL tried, redacted, and why each failed) or ConfigError.
    """
    return connect_first(url, name=name, settings=settings)[0]


@contextmanager
def connected(
    url: Urls = None, *, name: str = "rabbit-delay", settings: ConnectionSettings | None = None
) -> Iterator[pika.BlockingConnection]:
    """`connect`, closed on exit unless the broker already closed it (e.g. a 503)."""
    connection = connect(url, name=name, settings=settings)
    try:
        yield connection
    finally:
        close_quietly(connection)


def close_quietly(connection: pika.BlockingConnection | None) -> None:
    """Close `connection` if it is open; a connection already lost needs nothing."""
    if connection is not None and connection.is_open:
        try:
            connection.close()
        except CLIENT_ERRORS as exc:
            log.debug("closing a connection failed: %s", redact(repr(exc)))


class ChannelSlot:
    """One channel for a run of operations, opened when first needed and replaced once
    closed: a refusal (404, 406, 403) closes the channel it came on, not the others."""

    def __init__(self, connection: pika.BlockingConnection) -> None:
        self.connection = connection
        self._ch: BlockingChannel | None = None

    @property
    def channel(self) -> BlockingChannel:
        if self._ch is None or not self._ch.is_open:
            self._ch = self.connection.channel()
        return self._ch

    def close(self) -> None:
        """Close the channel if it is still open; a lost one needs nothing (and an error
        on the way out never hides the one that ended the run)."""
        if self._ch is not None and self._ch.is_open:
            with contextlib.suppress(*CLIENT_ERRORS):
                self._ch.close()


def broker_info(connection: pika.BlockingConnection) -> BrokerInfo:
    """What the broker said about itself when the connection opened (version, cluster)."""
    return BrokerInfo.from_server_properties(connection._impl.server_properties)


__all__ = [
    "ChannelSlot",
    "broker_info",
    "close_quietly",
    "connect",
    "connect_first",
    "connected",
    "parameters",
]
