"""The one exception map of the aio-pika transport: every aiormq, aio-pika, asyncio and
socket exception a public call can meet becomes a class of `rabbit_delay._errors`.

What a broker's close reply means is decided once, in `errors.broker_refusal`, for both
transports; this module only reads the reply out of aiormq's exceptions. The table is
in docs/connections.md.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Sequence

import aio_pika.exceptions
import aiormq.exceptions

import rabbit_delay._errors as errors
from rabbit_delay._urls import redact

_e = aiormq.exceptions

CLIENT_ERRORS: tuple[type[BaseException], ...] = (
    _e.AMQPError,
    _e.ChannelInvalidStateError,  # a RuntimeError: a call on a closed channel
    aio_pika.exceptions.AMQPException,
    asyncio.TimeoutError,
    OSError,
    EOFError,
)

# aiormq raises a subclass per known reply code with only the reply text as argument,
# and the base class with (reply code, reply text) for the others.
CHANNEL_CODES: dict[type[BaseException], int] = {
    _e.ChannelAccessRefused: 403,
    _e.ChannelNotFoundEntity: 404,
    _e.ChannelLockedResource: 405,
    _e.ChannelPreconditionFailed: 406,
}
CONNECTION_CODES: dict[type[BaseException], int] = {
    _e.ConnectionFrameError: 501,
    _e.ConnectionSyntaxError: 502,
    _e.ConnectionCommandInvalid: 503,
    _e.ConnectionChannelError: 504,
    _e.ConnectionUnexpectedFrame: 505,
    _e.ConnectionResourceError: 506,
    _e.ConnectionNotAllowed: 530,
    _e.ConnectionNotImplemented: 540,
    _e.ConnectionInternalError: 541,
}
# What aiormq raises (RuntimeError) for a call on a connection torn down under it.
_CLOSED_WORDS = ("closed", "writer is none", "no active transport")


def reply_of(exc: BaseException, codes: dict[type[BaseException], int]) -> tuple[int | None, str]:
    """(reply code, reply text) of an aiormq close exception; (None, "") for a channel or
    connection the client closed itself."""
    args = exc.args
    if len(args) >= 2 and (args[0] is None or isinstance(args[0], int)):
        return args[0], "" if args[1] is None else str(args[1])
    text = " ".join(str(a) for a in args if a is not None)
    for cls, code in codes.items():
        if isinstance(exc, cls):
            return code, text
    return None, text


def is_closed_error(exc: BaseException) -> bool:
    """A RuntimeError aiormq / aio-pika raise for a call on a closed connection."""
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(w in text for w in _CLOSED_WORDS)


def _translate(
    exc: BaseException, *, doing: str, permission: str, message_ids: Sequence[str]
) -> errors.RabbitDelayError:
    if isinstance(exc, _e.PublishError):  # basic.return under mandatory
        return errors.UnroutableError(
            f"the broker returned the message(s) as unroutable while {doing}: {exc}",
            message_ids=message_ids,
        )
    if isinstance(exc, _e.DeliveryError):  # basic.nack
        return errors.NackError(
            f"the broker nacked the message(s) while {doing}", message_ids=message_ids
        )
    if isinstance(exc, _e.ChannelClosed):
        code, text = reply_of(exc, CHANNEL_CODES)
        if code is None and not text:
            return errors.ConnectionLost(f"channel closed while {doing}")
        return errors.broker_refusal(code, text, doing=doing, permission=permission)
    if isinstance(exc, _e.ProbableAuthenticationError | _e.AuthenticationError):
        return errors.login_refused(doing)
    if isinstance(exc, _e.ConnectionClosed):
        code, text = reply_of(exc, CONNECTION_CODES)
        if not code:  # (0, "normal closed"): closed on this side
            return errors.ConnectionLost(f"connection closed while {doing}")
        return errors.broker_refusal(
            code, text, doing=doing, permission=permission, connection=True
        )
    if isinstance(exc, _e.InvalidFrameError) and "Connection.Close" in str(exc):
        # aiormq: connection.open answered by connection.close (530, the vhost)
        return errors.vhost_refused(doing)
    if isinstance(exc, ssl.SSLError):
        return errors.BrokerUnavailable(f"TLS failed while {doing}: {redact(str(exc))}")
    if isinstance(exc, asyncio.TimeoutError):
        return errors.ConnectionLost(f"timed out while {doing} (no answer from the broker)")
    if isinstance(
        exc, _e.AMQPConnectionError | _e.ChannelInvalidStateError | OSError | EOFError
    ) or is_closed_error(exc):
        return errors.ConnectionLost(f"connection lost while {doing}: {_describe(exc)}")
    # a protocol error, a duplicate consumer tag: the broker's side
    return errors.BrokerError(f"{_describe(exc)} while {doing}")


def _describe(exc: BaseException) -> str:
    text = str(exc) or repr(exc)
    return redact(f"{type(exc).__name__}: {text}")


# The map itself (rabbit_delay._errors.ExceptionMap): `translate(exc, doing=...)` and
# `with mapped(doing):`, the only two things the rest of the transport calls.
_MAP = errors.ExceptionMap(_translate, CLIENT_ERRORS, also=is_closed_error)
translate = _MAP.translate
mapped = _MAP.mapped
