"""An asyncio event loop on a virtual clock: time stands still while anything can run,
and jumps to the next timer the moment nothing can.

The loop's `time()` is virtual, so `asyncio.sleep`, `call_later`, `wait_for` and
timeouts in async handlers all take virtual time. The jump happens in the selector: the
loop asks it to wait exactly until its next timer only when no callback is ready, and
this selector then moves the clock forward instead of blocking. Work handed to threads
(`run_in_executor`, `asyncio.to_thread`) is waited for in real time, with the clock
stopped, so a thread's result never arrives "late".

Everything below runs on the thread that drives the loop (`run_until`); nothing here is
thread-safe, nor needs to be.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import selectors
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any, TypeVar, TypeVarTuple

T = TypeVar("T")
Ts = TypeVarTuple("Ts")

# Broker timers are whole milliseconds; float seconds from two roundings may differ by
# ulps. A timer this close to the end of a run belongs to it.
EPSILON_S = 1e-6


class _Selector(selectors.BaseSelector):
    """The loop's real selector (its self-pipe, any real sockets), asked without waiting;
    when it has nothing and no callback is ready, the virtual clock moves instead."""

    def __init__(self, loop: VirtualLoop) -> None:
        self._real = selectors.DefaultSelector()
        self._loop = loop

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.register(fileobj, events, data)

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._real.unregister(fileobj)

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.modify(fileobj, events, data)

    def get_map(self) -> Any:
        return self._real.get_map()

    def close(self) -> None:
        self._real.close()

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = self._real.select(0)
        if ready or timeout == 0:  # timeout 0: callbacks are ready to run now
            return ready
        if self._loop.threads_busy:
            # A thread will post its result: wait for it with the clock stopped.
            return self._real.select(None)
        self._loop.idle(timeout)
        return []


class _Timer(asyncio.TimerHandle):
    """A timer that sorts by (time, creation): timers due at the same virtual instant
    fire in the order they were set. asyncio orders them by time alone, so two handlers
    waking at one instant would run in an order that varies between runs."""

    __slots__ = ("_seq",)

    def __init__(
        self,
        when: float,
        callback: Callable[..., object],
        args: tuple[Any, ...],
        loop: asyncio.AbstractEventLoop,
        context: Any,
        seq: int,
    ) -> None:
        super().__init__(when, callback, args, loop, context)
        self._seq = seq

    def _key(self) -> tuple[float, int]:
        return (self.when(), self._seq)

    def __lt__(self, other: object) -> bool:
        if isinstance(other, _Timer):
            return self._key() < other._key()
        return super().__lt__(other)  # type: ignore[operator]

    def __le__(self, other: object) -> bool:
        if isinstance(other, _Timer):
            return self._key() <= other._key()
        return super().__le__(other)  # type: ignore[operator]

    def __gt__(self, other: object) -> bool:
        if isinstance(other, _Timer):
            return self._key() > other._key()
        return super().__gt__(other)  # type: ignore[operator]

    def __ge__(self, other: object) -> bool:
        if isinstance(other, _Timer):
            return self._key() >= other._key()
        return super().__ge__(other)  # type: ignore[operator]

    def __eq__(self, other: object) -> bool:
        return self is other

    def __hash__(self) -> int:
        return id(self)


class VirtualLoop(asyncio.SelectorEventLoop):
    """See the module docstring. `time()` starts at 0.0 (seconds)."""

    def __init__(self) -> None:
        self._now = 0.0
        self.threads_busy = 0
        self._until = 0.0
        self._stop_if: Callable[[], bool] | None = None
        self._timer_seq = itertools.count()
        super().__init__(_Selector(self))

    def time(self) -> float:
        return self._now

    def call_at(  # type: ignore[override]
        self, when: float, callback: Callable[..., object], *args: Any, context: Any = None
    ) -> asyncio.TimerHandle:
        """BaseEventLoop.call_at with timers that keep their creation order at equal
        times (`_Timer`); pushed on the loop's own heap, as asyncio does."""
        self._check_closed()  # type: ignore[attr-defined]
        timer = _Timer(when, callback, args, self, context, next(self._timer_seq))
        heapq.heappush(self._scheduled, timer)  # type: ignore[attr-defined]
        timer._scheduled = True  # type: ignore[attr-defined]
        return timer

    def run_in_executor(
        self, executor: Executor | None, func: Callable[[*Ts], T], *args: *Ts
    ) -> asyncio.Future[T]:
        future = super().run_in_executor(executor, func, *args)
        self.threads_busy += 1
        future.add_done_callback(self._thread_done)
        return future

    def _thread_done(self, _future: asyncio.Future[Any]) -> None:
        self.threads_busy -= 1

    def idle(self, timeout: float | None) -> None:
        """Nothing can run at this instant; the next timer is `timeout` s away (None:
        there is none). Stop here when `stop_if()` says so, else jump to that timer if it
        falls within the run, else end the run at its end."""
        if self._stop_if is not None and self._stop_if():
            self.stop()
            return
        if timeout is not None and self._now + timeout <= self._until + EPSILON_S:
            self._now += timeout
            return
        self._now = max(self._now, self._until)
        self.stop()

    def run_until(self, until: float, stop_if: Callable[[], bool] | None = None) -> None:
        """Run every callback and timer up to virtual time `until` (inclusive), or only
        up to the first instant, once it settled, at which `stop_if()` is true."""
        self._until = until
        self._stop_if = stop_if
        try:
            self.run_forever()
        finally:
            self._stop_if = None
