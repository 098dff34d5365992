"""Why a connection to the broker failed, in words a user can act on.

The transports' `connect` already words each URL's failure (`rabbit_delay._connection`
decides the words, for both clients). This module keeps the same words for a
`BrokerUnavailable` built elsewhere as "cannot connect to URL: detail" with the
client's error as its context. Pure: nothing here imports pika or aio-pika (TID251).
"""

from __future__ import annotations

from rabbit_delay._connection import Cause, cause_of, describe_failure
from rabbit_delay._errors import BrokerUnavailable

_PREFIX = "cannot connect to "


def describe_unavailable(exc: BrokerUnavailable) -> str:
    """One line: where the connection went (redacted URL), what failed, what to fix.

    The exception's own text when it already says so (the connect helpers' errors), or
    when the cause is not recognised.
    """
    text = str(exc)
    if cause_of(exc) is None or not text.startswith(_PREFIX):
        return text
    # the message is "cannot connect to URL: detail", the URL already redacted
    target = text.removeprefix(_PREFIX).partition(": ")[0]
    return f"{_PREFIX}{target}: {describe_failure(target, exc)}"


__all__ = ["Cause", "cause_of", "describe_unavailable"]
