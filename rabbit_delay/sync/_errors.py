"""The one exception map of the pika transport: every pika and socket exception a
public call can meet becomes a class of `rabbit_delay._errors`.

Every public call of `sync/` runs its pika calls inside `mapped(...)` (or calls
`translate` itself); what a broker's close reply means is decided once, in
`errors.broker_refusal`, for both transports. The table is in docs/connections.md.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import pika.exceptions

from rabbit_delay._errors import (
    BrokerBlocked,
    BrokerError,
    BrokerUnavailable,
    ConnectionLost,
    NackError,
    RabbitDelayError,
    UnroutableError,
    broker_refusal,
    for_publishes,
)
from rabbit_delay._urls import redact

# What a pika call can raise besides our own errors.
CLIENT_ERRORS: tuple[type[BaseException], ...] = (
    pika.exceptions.AMQPError,
    OSError,  # socket errors, ssl.SSLError, ConnectionError, TimeoutError
    EOFError,
)

_e = pika.exceptions
# An open connection or channel that went away (or was used after it went away).
_LOST: tuple[type[BaseException], ...] = (
    _e.StreamLostError,
    _e.ConnectionClosed,  # by the client, or by the broker without a reply we read
    _e.AMQPHeartbeatTimeout,
    _e.ConnectionWrongStateError,  # a call on a connection that is closed
    _e.ChannelWrongStateError,  # a call on a channel that is closed
    _e.ChannelClosed,  # by the client (ChannelClosedByBroker is read first)
    OSError,
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
    error = _translate(exc, doing=doing, permission=permission, message_ids=message_ids)
    return for_publishes(error, message_ids)


def _translate(
    exc: BaseException, *, doing: str, permission: str, message_ids: Sequence[str]
) -> RabbitDelayError:
    if isinstance(exc, _e.ConnectionBlockedTimeout):
        return BrokerBlocked(
            f"the broker blocked this connection (a resource alarm: memory or disk) for longer "
            f"than the blocked timeout while {doing}",
            reason="resource alarm",
        )
    if isinstance(exc, _e.ChannelClosedByBroker):
        return broker_refusal(exc.reply_code, exc.reply_text, doing=doing, permission=permission)
    if isinstance(exc, _e.ConnectionClosedByBroker):
        return broker_refusal(
            exc.reply_code, exc.reply_text, doing=doing, permission=permission, connection=True
        )
    if isinstance(exc, _e.ProbableAuthenticationError | _e.AuthenticationError):
        return BrokerUnavailable(
            f"the broker refused the login while {doing}: check the user name and password "
            "of the URL"
        )
    if isinstance(exc, _e.ProbableAccessDeniedError):
        return BrokerUnavailable(
            f"the broker refused the virtual host while {doing}: it does not exist, or the "
            "user has no permissions on it"
        )
    if isinstance(exc, _e.NackError):
        return NackError(
            f"the broker nacked {len(message_ids) or 'the'} message(s) while {doing}",
            message_ids=message_ids,
        )
    if isinstance(exc, _e.UnroutableError):
        return UnroutableError(
            f"the broker returned the message(s) as unroutable while {doing}",
            message_ids=message_ids,
        )
    if isinstance(exc, ssl.SSLError):
        return BrokerUnavailable(f"TLS failed while {doing}: {redact(str(exc))}")
    if isinstance(exc, _LOST):
        return ConnectionLost(f"connection lost while {doing}: {_describe(exc)}")
    if isinstance(exc, _e.AMQPConnectionError):  # opening failed (refused, timed out, ...)
        return BrokerUnavailable(f"no connection while {doing}: {_describe(exc)}")
    # a protocol error, a consumer cancelled, a duplicate consumer tag: the broker's side
    return BrokerError(f"{_describe(exc)} while {doing}")


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
