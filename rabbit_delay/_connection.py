"""Connection settings shared by both transports, and the decisions around connecting:
which URLs to try in which order, how long to wait between rounds, and why an attempt
failed, in words a user can act on. Pure: the transports (`_sync/connection.py`,
`_aio/connection.py`) open the sockets.

    settings = ConnectionSettings(urls=("amqp://u:pw@node1/", "amqp://u:pw@node2/"))

Several URLs name the nodes of one cluster (or separate brokers that each hold the
topology): a connection goes to the first that answers; a worker that loses it tries the
next ones first (`failover_order`), so a dead node is skipped. See docs/connections.md.
"""

from __future__ import annotations

import errno
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from urllib.parse import parse_qsl, urlsplit

from rabbit_delay._errors import ConfigError
from rabbit_delay._tls import TLSOptions, describe_tls_error, exception_chain
from rabbit_delay._urls import DEFAULT_URL, URL_ENV, broker_urls, redact, vhost_of

DEFAULT_HEARTBEAT_S = 60.0
DEFAULT_CONNECT_TIMEOUT_S = 10.0
DEFAULT_BLOCKED_TIMEOUT_S = 30.0
# The longest wait between two reconnect rounds.
DEFAULT_RECONNECT_MAX_S = 30.0
_DEFAULT_PORTS = {"amqp": 5672, "amqps": 5671}


@dataclass(frozen=True, slots=True)
class ReconnectBackoff:
    """Waits between reconnect rounds: `initial_s`, doubling up to `max_s`, each spread
    by +-`jitter` (a fraction) so that many clients cut off at once do not come back in
    lockstep. Raises ConfigError for a negative or inverted range."""

    initial_s: float = 0.25
    max_s: float = DEFAULT_RECONNECT_MAX_S
    jitter: float = 0.2

    def __post_init__(self) -> None:
        if not 0 < self.initial_s <= self.max_s:
            raise ConfigError(
                f"reconnect backoff: need 0 < initial ({self.initial_s}s) <= max ({self.max_s}s)"
            )
        if not 0 <= self.jitter < 1:
            raise ConfigError(f"reconnect backoff: jitter must be in [0, 1), got {self.jitter}")

    def delays(self, rand: Callable[[], float] = random.random) -> Iterator[float]:
        """Seconds to wait before each further round (endless); `rand` in [0, 1)."""
        delay = self.initial_s
        while True:
            spread = 1 + self.jitter * (2 * rand() - 1)
            yield min(delay * spread, self.max_s)
            delay = min(delay * 2, self.max_s)


@dataclass(frozen=True, slots=True)
class ConnectionSettings:
    """How both transports connect.

    urls: the brokers to try, in order (a string may hold several, separated by commas);
      empty: $RABBIT_DELAY_URL, else the local broker. An explicit `url=` given to a
      connect call or a worker wins over these.
    heartbeat_s: AMQP heartbeat (0 disables it); connect_timeout_s: per URL, for TCP,
      TLS and the AMQP handshake; blocked_timeout_s: how long a publish waits while the
      broker blocks the connection (a memory or disk alarm) before it fails.
    backoff: waits between reconnect rounds; tls: CA file, client certificate and the
      name to verify for amqps:// URLs (each URL's query keys win, see tls.py).

    A URL's own query keys (`heartbeat`, `connection_timeout`, `blocked_connection_timeout`)
    win over these settings for that URL. Raises ConfigError for a bad URL or value.
    """

    urls: tuple[str, ...] = ()
    heartbeat_s: float = DEFAULT_HEARTBEAT_S
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    blocked_timeout_s: float = DEFAULT_BLOCKED_TIMEOUT_S
    backoff: ReconnectBackoff = field(default_factory=ReconnectBackoff)
    tls: TLSOptions | None = None

    def __post_init__(self) -> None:
        urls: object = self.urls
        if isinstance(urls, str) or urls:
            object.__setattr__(self, "urls", broker_urls(urls))  # type: ignore[arg-type]
        if self.heartbeat_s < 0:
            raise ConfigError(f"heartbeat_s must be 0 (off) or more, got {self.heartbeat_s}")
        for name in ("connect_timeout_s", "blocked_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be more than 0, got {getattr(self, name)}")

    def resolve(self, explicit: str | Sequence[str] | None = None) -> tuple[str, ...]:
        """The URLs to try: `explicit` when given, else these settings' URLs, else
        $RABBIT_DELAY_URL, else the local broker."""
        if explicit is not None and (not isinstance(explicit, str) or explicit.strip()):
            return broker_urls(explicit)
        return self.urls or broker_urls(None)


def failover_order(urls: Sequence[str], lost: str | None) -> tuple[str, ...]:
    """The order to try `urls` in after the connection to `lost` was lost: the ones
    after it first (a dead node is tried last, not first), then from the start."""
    if lost is None or lost not in urls:
        return tuple(urls)
    i = list(urls).index(lost) + 1
    return (*urls[i:], *urls[:i])


def query_keys(url: str) -> frozenset[str]:
    """The query keys of `url` (its own settings, which win over ConnectionSettings)."""
    return frozenset(k for k, _ in parse_qsl(urlsplit(url).query, keep_blank_values=True))


# -- why an attempt failed ------------------------------------------------------------------


class Cause(StrEnum):
    LOGIN = "login refused"
    VHOST = "virtual host refused"
    REFUSED = "connection refused"
    DNS = "unknown host"
    TLS = "TLS handshake failed"
    TIMEOUT = "timed out"
    PROTOCOL = "no AMQP"


def cause_of(exc: BaseException) -> Cause | None:
    """The cause of a failed connection attempt, None when it is none of the known ones.
    Recognised by builtin types, errno and the clients' class names (no client import)."""
    if describe_tls_error(exc) is not None:
        return Cause.TLS
    for e in exception_chain(exc):
        name = type(e).__name__
        if name == "gaierror":  # socket.gaierror: the name did not resolve
            return Cause.DNS
        if isinstance(e, ConnectionRefusedError) or getattr(e, "errno", None) == errno.ECONNREFUSED:
            return Cause.REFUSED  # aiormq's AMQPConnectionError carries the socket's errno
        if "AuthenticationError" in name:  # pika and aiormq use the same names
            return Cause.LOGIN
        if "AccessDenied" in name or name == "ConnectionNotAllowed":
            return Cause.VHOST
        # aiormq: the broker answered connection.open with connection.close (530)
        if name == "InvalidFrameError" and "Connection.Close" in str(e):
            return Cause.VHOST
        if isinstance(e, TimeoutError) or "Timeout" in name:
            return Cause.TIMEOUT
        # the server accepted the connection and closed it without a word of AMQP
        if isinstance(e, EOFError) or name == "IncompatibleProtocolError":
            return Cause.PROTOCOL
    return None


def _innermost(exc: BaseException) -> BaseException:
    last = exc
    for e in exception_chain(exc):
        if e.args and not isinstance(e.args[0], BaseException):
            last = e
    return last


def parts_scheme(url: str) -> str:
    try:
        return urlsplit(url).scheme.lower()
    except ValueError:
        return ""


def describe_failure(url: str, exc: BaseException) -> str:
    """Why connecting to `url` failed and what to fix: one line, password redacted,
    without the client library's class names where the cause is known."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or "localhost"
        port = parts.port or _DEFAULT_PORTS.get(parts.scheme.lower(), 5672)
        user = parts.username or "guest"
    except ValueError:
        host, port, user = "?", 0, "?"
    cause = cause_of(exc)
    if cause is Cause.LOGIN:
        return (
            f"the broker refused the login of user {user!r}: check the user name and "
            f"password in --url or ${URL_ENV}"
        )
    if cause is Cause.VHOST:
        return (
            f"user {user!r} may not open virtual host {vhost_of(url)!r}: it does not exist, "
            "or the user has no permissions on it (`rabbitmqctl list_vhosts`, "
            "`rabbitmqctl list_user_permissions USER`)"
        )
    if cause is Cause.REFUSED:
        return (
            f"nothing is listening on {host}:{port} (connection refused): is RabbitMQ running "
            "there, and is the port right? (5672 for amqp://, 5671 for amqps://)"
        )
    if cause is Cause.DNS:
        return f"cannot resolve the host name {host!r}: check the host in --url or ${URL_ENV}"
    if cause is Cause.TLS:
        said = describe_tls_error(exc) or f"the TLS handshake failed ({redact(str(exc))})"
        return f"TLS with {host}:{port}: {said}"
    if cause is Cause.PROTOCOL and parts_scheme(url) == "amqps" and "certfile=" in url:
        # TLS 1.3: the broker checks our certificate after our side of the handshake is
        # done, and its alert can be lost in the close (pika then sees a bare EOF)
        return (
            f"{host}:{port} closed the TLS connection right after the handshake: the broker "
            "most likely refused our client certificate (it must be signed by a CA the "
            "broker trusts: ssl_options.cacertfile on the broker)"
        )
    if cause is Cause.PROTOCOL:
        return (
            f"{host}:{port} closed the connection without speaking AMQP: is it RabbitMQ's "
            "AMQP port (5672, 5671 for amqps://), and not e.g. the management API's?"
        )
    if cause is Cause.TIMEOUT:
        return (
            f"no answer from {host}:{port} in time: is the host right, and does a firewall "
            "let the port through?"
        )
    inner = _innermost(exc)
    return redact(f"{type(inner).__name__}: {inner}" if str(inner) else repr(inner))


def unavailable_message(attempts: Sequence[tuple[str, BaseException]]) -> str:
    """The BrokerUnavailable text after every URL failed: each URL (redacted) and why."""
    if len(attempts) == 1:
        url, exc = attempts[0]
        return f"cannot connect to {redact(url)}: {describe_failure(url, exc)}"
    reasons = "; ".join(f"{redact(url)}: {describe_failure(url, exc)}" for url, exc in attempts)
    return f"cannot connect to any of {len(attempts)} brokers: {reasons}"


__all__ = [
    "DEFAULT_BLOCKED_TIMEOUT_S",
    "DEFAULT_CONNECT_TIMEOUT_S",
    "DEFAULT_HEARTBEAT_S",
    "DEFAULT_URL",
    "Cause",
    "ConnectionSettings",
    "ReconnectBackoff",
    "broker_urls",
    "cause_of",
    "describe_failure",
    "failover_order",
    "query_keys",
    "unavailable_message",
]
