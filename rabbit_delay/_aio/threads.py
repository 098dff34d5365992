"""The async worker's pool for plain `def` handlers: daemon threads."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from functools import partial
from queue import SimpleQueue
from typing import Any


class DaemonThreads(Executor):
    """The pool for plain `def` handlers: daemon threads, so a forced stop (a second
    SIGINT/SIGTERM) can end the process under a handler that is still running, which
    `ThreadPoolExecutor` would wait for at interpreter exit."""

    def __init__(self, size: int, prefix: str) -> None:
        self._jobs: SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]] | None] = (
            SimpleQueue()
        )
        self._threads = [
            threading.Thread(target=self._work, name=f"{prefix}-{i}", daemon=True)
            for i in range(size)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        call = partial(fn, **kwargs) if kwargs else fn
        self._jobs.put((future, call, args))
        return future

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            future, fn, args = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args)
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(result)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        if cancel_futures:
            while not self._jobs.empty():
                job = self._jobs.get_nowait()
                if job is not None:
                    job[0].cancel()
        for _ in self._threads:
            self._jobs.put(None)
        if wait:
            for thread in self._threads:
                thread.join()


__all__ = ["DaemonThreads"]
