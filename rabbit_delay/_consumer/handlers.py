"""Calling a handler: decode its input (if the delivery left it undecoded), run it with
its span current (if traced), time it. The Run step of the delivery program, for every
driver: a plain `def` on whatever thread the driver chose, an `async def` awaited."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

from rabbit_delay._consumer.app import Consumer, Prepared
from rabbit_delay._consumer.decide import Result, Undecodable

_NO_SPAN = contextlib.nullcontext()  # reusable: entering it does nothing
# Told each handler's run time (queue, seconds): the worker's handler-time histogram.
Timer = Callable[[str, float], None]


def call_handler(consumer: Consumer, prepared: Prepared, timer: Timer | None) -> Result:
    """Decode the body (if not yet) and run a plain `def` handler: None, the exception it
    raised, or Undecodable (the Run step's reply)."""
    try:
        message = consumer.decoded(prepared)
    except Exception as exc:  # ValidationError, or whatever a TypeAdapter raises
        return Undecodable.from_exception(exc)
    start = time.perf_counter() if timer is not None else 0.0
    scope = prepared.ctx.span_scope
    try:
        with scope() if scope is not None else _NO_SPAN:  # its span current, if traced
            if consumer.takes_context:
                consumer.handler(message, prepared.ctx)
            else:
                consumer.handler(message)
    except Exception as exc:
        return exc
    finally:
        if timer is not None:
            timer(consumer.queue, time.perf_counter() - start)
    return None


async def call_async_handler(consumer: Consumer, prepared: Prepared, timer: Timer | None) -> Result:
    """`call_handler` for an `async def` handler."""
    try:
        message = consumer.decoded(prepared)
    except Exception as exc:
        return Undecodable.from_exception(exc)
    start = time.perf_counter() if timer is not None else 0.0
    handler: Any = consumer.handler
    scope = prepared.ctx.span_scope
    try:
        with scope() if scope is not None else _NO_SPAN:
            if consumer.takes_context:
                await handler(message, prepared.ctx)
            else:
                await handler(message)
    except Exception as exc:
        return exc
    finally:
        if timer is not None:
            timer(consumer.queue, time.perf_counter() - start)
    return None


__all__ = ["Timer", "call_async_handler", "call_handler"]
