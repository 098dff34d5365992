"""The one exception map of the pika transport: every pika and socket exception a
public call can meet becomes a class of `rabbit_delay._errors`.

Every public call of `sync/` runs its pika calls inside `mapped(...)` (or calls
`translate` itself); what a broker's close reply means is decided once, in
`errors.broker_refusal`, for both transports. The table is in docs/connections.md.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Sequence

import pika.exceptions

import rabbit_delay._errors as errors
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


def _translate(
    exc: BaseException, *, doing: str, permission: str, message_ids: Sequence[str]
) -> errors.RabbitDelayError:
    if isinstance(exc, _e.ConnectionBlockedTimeout):
        return errors.BrokerBlocked(
            f"the broker blocked this connection (a resource alarm: memory or disk) for longer "
            f"than the blocked timeout while {doing}",
            reason="resource alarm",
        )
    if isinstance(exc, _e.ChannelClosedByBroker):
        return errors.broker_refusal(
            exc.reply_code, exc.reply_text, doing=doing, permission=permission
        )
    if isinstance(exc, _e.ConnectionClosedByBroker):
        return errors.broker_refusal(
            exc.reply_code, exc.reply_text, doing=doing, permission=permission, connection=True
        )
    if isinstance(exc, _e.ProbableAuthenticationError | _e.AuthenticationError):
        return errors.login_refused(doing)
    if isinstance(exc, _e.ProbableAccessDeniedError):
        return errors.vhost_refused(doing)
    if isinstance(exc, _e.NackError):
        return errors.NackError(
            f"the broker nacked {len(message_ids) or 'the'} message(s) while {doing}",
            message_ids=message_ids,
        )
    if isinstance(exc, _e.UnroutableError):
        return errors.UnroutableError(
            f"the broker returned the message(s) as unroutable while {doing}",
            message_ids=message_ids,
        )
    if isinstance(exc, ssl.SSLError):
        return errors.BrokerUnavailable(f"TLS failed while {doing}: {redact(str(exc))}")
    if isinstance(exc, _LOST):
        return errors.ConnectionLost(f"connection lost while {doing}: {_describe(exc)}")
    if isinstance(exc, _e.AMQPConnectionError):  # opening failed (refused, timed out, ...)
        return errors.BrokerUnavailable(f"no connection while {doing}: {_describe(exc)}")
    # a protocol error, a consumer cancelled, a duplicate consumer tag: the broker's side
    return errors.BrokerError(f"{_describe(exc)} while {doing}")


def _describe(exc: BaseException) -> str:
    text = str(exc) or repr(exc)
    if isinstance(exc, socket.timeout | TimeoutError):
        text = f"timed out ({text})"
    return redact(f"{type(exc).__name__}: {text}")


# The map itself (rabbit_delay._errors.ExceptionMap): `translate(exc, doing=...)` and
# `with mapped(doing):`, the only two things the rest of the transport calls.
_MAP = errors.ExceptionMap(_translate, CLIENT_ERRORS)
translate = _MAP.translate
mapped = _MAP.mapped
