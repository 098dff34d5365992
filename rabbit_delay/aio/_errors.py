"""The one exception map of the aio-pika transport: every aiormq, aio-pika, asyncio and
socket exception a public call can meet becomes a class of `rabbit_delay.errors`.

What a broker's close reply means is decided once, in `errors.broker_refusal`, for both
transports; this module only reads the reply out of aiormq's exceptions.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import aio_pika.exceptions
import aiormq.exceptions

from rabbit_delay.errors import (
    BrokerBlocked,
    BrokerUnavailable,
    ConnectionLost,
    RabbitDelayError,
    UnconfirmedError,
    broker_refusal,
)
from rabbit_delay.urls import redact

CLIENT_ERRORS: tuple[type[BaseException], ...] = (
    aiormq.exceptions.AMQPError,
    aiormq.exceptions.ChannelInvalidStateError,
    aio_pika.exceptions.AMQPException,
    asyncio.TimeoutError,
    OSError,
    EOFError,
)

# aiormq raises a subclass per reply code with only the reply text as its argument.
_CHANNEL_CODES: dict[type[BaseException], int] = {
    aiormq.exceptions.ChannelAccessRefused: 403,
    aiormq.exceptions.ChannelNotFoundEntity: 404,
    aiormq.exceptions.ChannelLockedResource: 405,
    aiormq.exceptions.ChannelPreconditionFailed: 406,
}
_CONNECTION_CODES: dict[type[BaseException], int] = {
    aiormq.exceptions.ConnectionNotAllowed: 530,
    aiormq.exceptions.ConnectionResourceError: 506,
    aiormq.exceptions.ConnectionInternalError: 541,
}


def reply_of(exc: BaseException, codes: dict[type[BaseException], int]) -> tuple[int | None, str]:
    """(reply code, reply text) of an aiormq close exception."""
    for cls, code in codes.items():
        if isinstance(exc, cls):
            return code, " ".join(str(a) for a in exc.args)
    args = exc.args
    if len(args) >= 2 and (args[0] is None or isinstance(args[0], int)):
        return args[0], str(args[1] or "")
    return None, " ".join(str(a) for a in args)


def translate(
    exc: BaseException,
    *,
    doing: str,
    permission: str = "",
    message_ids: Sequence[str] = (),
) -> RabbitDelayError:
    """The project's error for `exc`, raised by aio-pika/aiormq (or the socket) while
    `doing`. With `message_ids`, a lost connection becomes an `UnconfirmedError` naming
    them."""
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
    e = aiormq.exceptions
    if isinstance(exc, e.ChannelClosed):
        code, text = reply_of(exc, _CHANNEL_CODES)
        if code is None and not text.strip("None "):  # closed by the client side
            return ConnectionLost(f"channel closed while {doing}")
        return broker_refusal(code, text, doing=doing, permission=permission)
    if isinstance(exc, e.ProbableAuthenticationError | e.AuthenticationError):
        return BrokerUnavailable(
            f"the broker refused the login while {doing}: check the user name, password and "
            f"vhost of the URL ({type(exc).__name__})"
        )
    if isinstance(exc, e.ConnectionClosed):
        code, text = reply_of(exc, _CONNECTION_CODES)
        return broker_refusal(code, text, doing=doing, permission=permission, connection=True)
    if isinstance(exc, ssl.SSLError):
        return BrokerUnavailable(f"TLS failed while {doing}: {redact(str(exc))}")
    if isinstance(exc, asyncio.TimeoutError):
        return ConnectionLost(f"timed out while {doing}")
    return ConnectionLost(f"connection lost while {doing}: {_describe(exc)}")


def _describe(exc: BaseException) -> str:
    text = str(exc) or repr(exc)
    return redact(f"{type(exc).__name__}: {text}")


@contextmanager
def mapped(doing: str, *, permission: str = "", message_ids: Sequence[str] = ()) -> Iterator[None]:
    """Run a block of awaits on aio-pika; a client exception leaves it as the project's
    error. (A plain context manager works around `await`s inside an `async def`.)"""
    try:
        yield
    except RabbitDelayError:
        raise
    except CLIENT_ERRORS as exc:
        raise translate(exc, doing=doing, permission=permission, message_ids=message_ids) from None
