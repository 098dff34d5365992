"""Why a connection to the broker failed, in words a user can act on.

`BrokerUnavailable` carries the client library's own error (pika or aiormq) as its
`__context__`: the library raises it `from None` so that tracebacks stay short, which
keeps the context but hides it. Both clients end in the same few causes; each gets one
sentence naming what to fix. Pure: nothing here imports pika or aio-pika (TID251), the
causes are recognised by builtin types, errno and the clients' class names.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Iterator
from enum import StrEnum
from urllib.parse import urlsplit

from rabbit_delay.errors import BrokerUnavailable
from rabbit_delay.urls import URL_ENV, vhost_of

_PREFIX = "cannot connect to "
_DEFAULT_PORTS = {"amqp": 5672, "amqps": 5671}


class Cause(StrEnum):
    LOGIN = "login refused"
    VHOST = "virtual host refused"
    REFUSED = "connection refused"
    DNS = "unknown host"
    TIMEOUT = "timed out"


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc`, its causes and contexts, and the exceptions it wraps, each once.

    pika wraps the socket error in a connector error (`.exception`) in a workflow error
    (`.exceptions`) in args; an ExceptionGroup keeps its members in `.exceptions` too.
    """
    seen: set[int] = set()
    todo = [exc]
    while todo:
        current = todo.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        wrapped = [*current.args, getattr(current, "exception", None)]
        members = getattr(current, "exceptions", ())
        if isinstance(members, tuple | list):
            wrapped.extend(members)
        todo.extend(w for w in wrapped if isinstance(w, BaseException))
        todo.extend(c for c in (current.__cause__, current.__context__) if c is not None)


def cause_of(exc: BaseException) -> Cause | None:
    """The cause of a failed connection attempt, None when it is none of the known ones."""
    for e in _chain(exc):
        name = type(e).__name__
        if isinstance(e, socket.gaierror):
            return Cause.DNS
        # aiormq's AMQPConnectionError is an OSError carrying the socket's errno
        if isinstance(e, ConnectionRefusedError) or getattr(e, "errno", None) == errno.ECONNREFUSED:
            return Cause.REFUSED
        # pika: ProbableAuthenticationError, AuthenticationError; aiormq: the same names
        if "AuthenticationError" in name:
            return Cause.LOGIN
        # pika: ProbableAccessDeniedError (no such vhost, or no permission on it)
        if "AccessDenied" in name or name == "ConnectionNotAllowed":
            return Cause.VHOST
        if isinstance(e, TimeoutError):
            return Cause.TIMEOUT
    return None


def describe_unavailable(exc: BrokerUnavailable) -> str:
    """One line: where the connection went (redacted URL), what failed, what to fix.

    Falls back to the exception's own text when the cause is not recognised.
    """
    text = str(exc)
    cause = cause_of(exc)
    if cause is None or not text.startswith(_PREFIX):
        return text
    # the message is "cannot connect to URL: detail", the URL already redacted
    target = text.removeprefix(_PREFIX).partition(": ")[0]
    try:
        parts = urlsplit(target)
        host = parts.hostname or "localhost"
        port = parts.port or _DEFAULT_PORTS.get(parts.scheme, 5672)
        user = parts.username or "guest"
    except ValueError:
        return text
    where = f"{_PREFIX}{target}: "
    if cause is Cause.LOGIN:
        return (
            f"{where}the broker refused the login of user {user!r}: check the user name and "
            f"password in --url or ${URL_ENV}"
        )
    if cause is Cause.VHOST:
        return (
            f"{where}user {user!r} may not open virtual host {vhost_of(target)!r}: it does not "
            "exist, or the user has no permissions on it (`rabbitmqctl list_vhosts`, "
            "`rabbitmqctl list_user_permissions USER`)"
        )
    if cause is Cause.REFUSED:
        return (
            f"{where}nothing is listening on {host}:{port} (connection refused): is RabbitMQ "
            "running there, and is the port right? (5672 for amqp://, 5671 for amqps://)"
        )
    if cause is Cause.DNS:
        return (
            f"{where}cannot resolve the host name {host!r}: check the host in --url or ${URL_ENV}"
        )
    return (
        f"{where}no answer from {host}:{port} in time: is the host right, and does a "
        "firewall let the port through?"
    )


__all__ = ["Cause", "cause_of", "describe_unavailable"]
