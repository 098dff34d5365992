"""Durations and instants: parsed once at the edge, carried as whole milliseconds
everywhere else, and shown the same way everywhere (durations as `5m` / `1h30m`,
instants as ISO-8601 UTC: `2026-12-02T10:00:00.000Z`)."""

from __future__ import annotations

import math
import re
from datetime import UTC, datetime, timedelta
from typing import overload

from rabbit_delay._errors import DurationError

# RabbitMQ's TTL timers (queue `x-message-ttl`, the plugin's `x-delay`) take at most
# 2^32 - 1 ms (~49.7 days); longer values are refused or misbehave.
MAX_TTL_MS = 2**32 - 1

_UNITS_MS = {"ms": 1, "s": 1_000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_WHOLE = re.compile(r"(?:\d+(?:\.\d+)?(?:ms|s|m|h|d))+")
ALLOWED = (
    "a number of seconds, a timedelta, or a string such as "
    "'500ms', '90s', '5m', '2h', '1d', '1h30m'"
)

DurationLike = str | int | float | timedelta


def parse_ms(value: DurationLike) -> int:
    """Return `value` as whole milliseconds, rounded UP (a delay is never shortened).

    Raises DurationError for text that is not a duration and for negative values.
    """
    if isinstance(value, bool):
        raise DurationError(f"{value!r} is not a duration; use {ALLOWED}")
    if isinstance(value, timedelta):
        ms = value / timedelta(milliseconds=1)
    elif isinstance(value, int | float):
        if isinstance(value, float) and not math.isfinite(value):
            raise DurationError(f"{value!r} is not a finite duration; use {ALLOWED}")
        ms = value * 1000
    elif isinstance(value, str):
        text = value.strip().lower().replace(" ", "")
        if text.startswith("-") and _WHOLE.fullmatch(text[1:]):
            # the user's own text, quoted: it already reads like "-5m"
            raise DurationError(f"{value!r} is negative; a delay must be zero or more")
        if not _WHOLE.fullmatch(text):
            raise DurationError(f"{value!r} is not a duration; use {ALLOWED}")
        ms = sum(float(n) * _UNITS_MS[u] for n, u in _PART.findall(text))
    else:
        raise DurationError(f"{value!r} is not a duration; use {ALLOWED}")
    if ms < 0:
        raise DurationError(negative(math.floor(ms)))
    return math.ceil(ms - 1e-9)


def negative(ms: int) -> str:
    """The one wording of a negative delay, in the units users write: "delay -5m is
    negative; ..." (never a timedelta's repr)."""
    return f"delay {format_ms(ms)} is negative; a delay must be zero or more"


def parse_positive_ms(value: DurationLike, *, maximum: int = MAX_TTL_MS) -> int:
    """Like `parse_ms`, but the result must lie in 1..maximum ms."""
    ms = parse_ms(value)
    if ms <= 0:
        raise DurationError(f"{value!r} must be longer than zero")
    if ms > maximum:
        raise DurationError(
            f"{value!r} is {format_ms(ms)}, longer than the maximum {format_ms(maximum)} "
            "(RabbitMQ TTLs are 32-bit milliseconds)"
        )
    return ms


def format_ms(ms: int) -> str:
    """Canonical short form: 300000 -> '5m', 5400000 -> '1h30m', 1500 -> '1s500ms',
    -300000 -> '-5m'."""
    if ms == 0:
        return "0s"
    if ms < 0:
        return "-" + format_ms(-ms)
    parts = []
    rest = ms
    for unit in ("d", "h", "m", "s", "ms"):
        size = _UNITS_MS[unit]
        count, rest = divmod(rest, size)
        if count:
            parts.append(f"{count}{unit}")
    return "".join(parts)


@overload
def iso_ms(ms: int) -> str: ...
@overload
def iso_ms(ms: None) -> None: ...
def iso_ms(ms: int | None) -> str | None:
    """An instant in epoch milliseconds as ISO-8601 UTC, to the millisecond:
    1796150495995 -> '2026-12-01T18:41:35.995Z' (None stays None).

    Whole seconds and milliseconds apart: `ms / 1000` as a float can land a hair below
    the millisecond (…994.9999) and show the one before.
    """
    if ms is None:
        return None
    seconds, millis = divmod(ms, 1000)
    instant = datetime.fromtimestamp(seconds, UTC)
    return f"{instant:%Y-%m-%dT%H:%M:%S}.{millis:03d}Z"


def iso(instant: datetime) -> str:
    """An aware datetime as `iso_ms` shows instants (UTC, milliseconds, Z)."""
    return iso_ms(math.floor(instant.timestamp() * 1000))
