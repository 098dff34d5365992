"""What a handler learns about the delivery it is handling."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from rabbit_delay._envelope import Envelope, traceparent_of


def clock_ms() -> int:
    """UTC epoch milliseconds, as message.now_ms, without building a datetime (hot path)."""
    return time.time_ns() // 1_000_000


@dataclass(frozen=True, slots=True)
class HandlerContext:
    """One delivery, as the handler sees it (the second argument of a handler).

    `attempt` is 1 for the first delivery and grows by one per retry (with retry backend
    "broker", also per delivery lost with a crashed worker: the queue counts those too);
    `max_attempts` is the queue's limit, so `ctx.attempt == ctx.max_attempts` is the
    last try.
    `redelivered` is the broker's flag: the message may have been handed out before
    (a worker died or lost its connection), so the handler may have run already.
    """

    queue: str  # logical queue name, as in the topology
    envelope: Envelope
    redelivered: bool
    received_ms: int  # UTC epoch ms when the worker took the delivery
    max_attempts: int
    # Makes the delivery's handle span current while the handler runs (rabbit_delay.
    # tracing, where the application uses OpenTelemetry); None otherwise. For the worker.
    span_scope: Callable[[], AbstractContextManager[Any]] | None = field(
        default=None, repr=False, compare=False
    )

    @property
    def message_id(self) -> str | None:
        return self.envelope.message_id

    @property
    def attempt(self) -> int:
        return self.envelope.attempt

    @property
    def tier(self) -> str | None:
        """The tier (or "cascade" / "plugin") the message waited in last."""
        return self.envelope.tier

    @property
    def headers(self) -> Mapping[str, object]:
        return self.envelope.headers

    @property
    def traceparent(self) -> str | None:
        """The W3C trace context the publisher sent (`traceparent` header), carried
        unchanged through the delay and every retry; None if it sent none."""
        return traceparent_of(self.envelope.headers)

    @property
    def scheduled_at(self) -> datetime | None:
        """When the message was due (rd-due-at), or None if it carries no due time."""
        return self.envelope.due_at

    @property
    def lateness_ms(self) -> int | None:
        """How long after its due time the worker received it (negative: early)."""
        return self.envelope.lateness_ms(self.received_ms)

    @property
    def lateness(self) -> timedelta | None:
        ms = self.lateness_ms
        return None if ms is None else timedelta(milliseconds=ms)

    @property
    def is_last_attempt(self) -> bool:
        return self.envelope.attempt >= self.max_attempts
