"""The one exception map of the AMQP 1.0 transport: every proton exception and every
error condition the broker sends (on the connection, the session or the link) becomes a
class of `rabbit_delay._errors`."""

from __future__ import annotations

from collections.abc import Sequence

import proton

import rabbit_delay._errors as errors
from rabbit_delay._urls import redact

CLIENT_ERRORS: tuple[type[BaseException], ...] = (proton.ProtonException, OSError)

# Conditions after which reconnecting cannot help: the holder stops with the error.
UNAUTHORIZED = "amqp:unauthorized-access"
NOT_FOUND = "amqp:not-found"
# The broker answered the AMQP 1.0 header with another protocol's: 3.x without the
# amqp1_0 plugin answers with AMQP 0-9-1's ("Expected SASL protocol header got: Unknown
# protocol ['AMQP\x00\x00\x09\x01']").
_OTHER_PROTOCOL = ("header mismatch", "unknown protocol")


def condition_error(
    name: str | None, description: str | None, *, doing: str, address: str = ""
) -> errors.RabbitDelayError:
    """The project's error for an AMQP 1.0 error condition met while `doing`."""
    text = redact(description or "").replace("\x00", "\\x00").replace("\t", "\\x09")
    if name == UNAUTHORIZED:
        return errors.AccessRefused(
            f"the broker refused access while {doing}: {text}", permission="read"
        )
    if name == NOT_FOUND:
        return errors.MissingObjectError(
            f"{address or 'the holding queue'} does not exist: declare the topology first "
            f"(`rabbit-delay declare`) ({text})"
        )
    if any(marker in text.lower() for marker in _OTHER_PROTOCOL):
        return errors.IncompatibleBroker(
            f"the broker does not speak AMQP 1.0 on this port ({text}): the [held] backend "
            "needs RabbitMQ 4.3+, which serves AMQP 1.0 on its AMQP port"
        )
    return errors.ConnectionLost(f"the AMQP 1.0 connection was lost while {doing}: {name} {text}")


def fatal(error: errors.RabbitDelayError) -> bool:
    """Whether a holder stops on `error` rather than reconnecting."""
    return isinstance(
        error, errors.AccessRefused | errors.MissingObjectError | errors.IncompatibleBroker
    )


def _translate(
    exc: BaseException, *, doing: str, permission: str, message_ids: Sequence[str]
) -> errors.RabbitDelayError:
    return errors.ConnectionLost(
        f"the AMQP 1.0 connection failed while {doing}: {redact(str(exc))}"
    )


EXCEPTIONS = errors.ExceptionMap(_translate, CLIENT_ERRORS)
translate = EXCEPTIONS.translate
mapped = EXCEPTIONS.mapped
