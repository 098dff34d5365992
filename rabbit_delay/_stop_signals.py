"""SIGINT / SIGTERM for the long-running commands that stop by themselves (the sync
worker, the outbox relay): one way to install and restore the handlers."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def install_stop_signals(on_signal: Callable[[str], None]) -> Callable[[], None]:
    """Call `on_signal(name)` ("SIGINT" / "SIGTERM") on each of them; the function that
    puts the previous handlers back. Outside the main thread (where Python cannot set
    handlers) nothing is installed. `on_signal` runs between two bytecodes of the main
    thread: it should only set flags (pika is not reentrant)."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}

    def handler(signum: int, _frame: FrameType | None) -> None:
        on_signal(signal.Signals(signum).name)

    for sig in previous:
        signal.signal(sig, handler)

    def restore() -> None:
        for sig, old in previous.items():
            signal.signal(sig, old)

    return restore
