"""What a handler raises to steer its message (dramatiq's and arq's `Retry`).

These are signals, not failures of the library, so they stand outside the
`RabbitDelayError` tree.
"""

from __future__ import annotations

from rabbit_delay._durations import DurationLike, parse_ms


class Retry(Exception):
    """Try this message again later.

    Without arguments the queue's retry policy picks the delay; name a `tier` (e.g.
    "30m") or give a `delay` ("90s", seconds, a timedelta) to choose it. A retry counts
    as an attempt: after the queue's `max_attempts` the message is parked instead.
    A tier or delay the topology cannot serve falls back to the policy's schedule.
    Raises DurationError for a delay that is not a duration.
    """

    def __init__(
        self, reason: str = "", *, tier: str | None = None, delay: DurationLike | None = None
    ) -> None:
        super().__init__(reason or "retry requested by the handler")
        self.reason = reason
        self.tier = tier
        self.delay_ms = parse_ms(delay) if delay is not None else None


class Reject(Exception):
    """Give up on this message now: park it with `reason`, without further attempts."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason
