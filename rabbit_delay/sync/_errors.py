"""The one exception map of the pika transport: every pika and socket exception a
public call can meet becomes a class of `rabbit_delay.errors`.

Every public call of `sync/` runs its pika calls inside `mapped(...)` (or calls
`translate` itself); what a broker's close reply means is decided once, in
`errors.broker_refusal`, for both transports.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import pika.exceptions

from rabbit_delay.errors import (
    BrokerBlocked,
    BrokerUnavailable,
    ConnectionLost,
    RabbitDelayError,
    UnconfirmedError,
    broker_refusal,
)
from rabbit_delay.urls import redact

# What a pika call can raise besides our own errors.
CLIENT_ERRORS: tuple[type[BaseException], ...] = (
    pika.exceptions.AMQPError,
    OSError,  # socket errors, ssl.SSLError, ConnectionError, TimeoutError
    EOFError,
)


def translate(
    exc: BaseException,
    *,
    doing: str,
    permission: str = "",
    message_ids: Sequence[str] = (),
) -> RabbitDelayError:
    """The project's error for `exc`, raised by pika (or the socket) while `doing`.

    With `message_ids` (a publish whose confirms were outstanding), a lost connection
    or a blocked-connection timeout becomes an `UnconfirmedError` naming them.
    """
    if isinstance(exc, RabbitDelayError):
        return exc
    error = _translate(exc, doing=doing, permission=permission)
    if message_ids and isinstance(error, BrokerBlocked):
        return BrokerBlocked(str(error), message_ids=message_ids, reason=error.reason)
    if message_ids and isinstance(error, ConnectionLost):
        return UnconfirmedError(
            f"{len(message_ids)} message(s) not confirmed: {error}; publish them again "
            "with the same message ids",
            message_ids=message_ids,
        )
    return error


def _translate(exc: BaseException, *, doing: str, permission: str) -> RabbitDelayError:
    e = pika.exceptions
    if isinstance(exc, e.ConnectionBlockedTimeout):
        return BrokerBlocked(
            f"the broker blocked this connection (a resource alarm) for too long while {doing}"
        )
    if isinstance(exc, e.ChannelClosedByBroker):
        return broker_refusal(exc.reply_code, exc.reply_text, doing=doing, permission=permission)
    if isinstance(exc, e.ConnectionClosedByBroker):
        return broker_refusal(
            exc.reply_code, exc.reply_text, doing=doing, permission=permission, connection=True
        )
    if isinstance(exc, e.ProbableAccessDeniedError | e.ProbableAuthenticationError):
        return BrokerUnavailable(
            f"the broker refused the login while {doing}: check the user name, password and "
            f"vhost of the URL ({type(exc).__name__})"
        )
    if isinstance(exc, ssl.SSLError):
        return BrokerUnavailable(f"TLS failed while {doing}: {redact(str(exc))}")
    if isinstance(exc, e.AMQPConnectionError | e.ConnectionWrongStateError) and not isinstance(
        exc, e.StreamLostError | e.ConnectionClosed
    ):
        return BrokerUnavailable(f"no connection while {doing}: {_describe(exc)}")
    if isinstance(
        exc,
        e.StreamLostError
        | e.ConnectionClosed
        | e.ChannelWrongStateError
        | e.ChannelClosed
        | OSError
        | EOFError,
    ):
        return ConnectionLost(f"connection lost while {doing}: {_describe(exc)}")
    return ConnectionLost(f"{type(exc).__name__} while {doing}: {_describe(exc)}")


def _describe(exc: BaseException) -> str:
    text = str(exc) or repr(exc)
    if isinstance(exc, socket.timeout | TimeoutError):
        text = f"timed out ({text})"
    return redact(f"{type(exc).__name__}: {text}")


@contextmanager
def mapped(doing: str, *, permission: str = "", message_ids: Sequence[str] = ()) -> Iterator[None]:
    """Run a block of pika calls; a client exception leaves it as the project's error
    (chained nowhere: the client's traceback adds nothing for the user)."""
    try:
        yield
    except RabbitDelayError:
        raise
    except CLIENT_ERRORS as exc:
        raise translate(exc, doing=doing, permission=permission, message_ids=message_ids) from None
