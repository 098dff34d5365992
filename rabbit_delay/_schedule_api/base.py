"""What `Schedule` and `AsyncSchedule` share: the topology, the store they open (or are
given, or their publisher's), and the clock. The calls themselves differ only in
awaiting; what they decide is in `rabbit_delay._schedule.operations`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rabbit_delay._envelope import now_ms
from rabbit_delay._errors import ConfigError, StoreError
from rabbit_delay._schedule.operations import ScheduleCore
from rabbit_delay._topology.model import Topology


class ScheduleBase:
    """The store side of a schedule facade. `open_store` makes the topology's store
    (sync or async) when neither `store` nor a publisher gives one."""

    open_store: Callable[[Any], Any]

    def __init__(self, topology: Topology, *, store: Any = None, publisher: Any = None) -> None:
        self.core = ScheduleCore(topology)
        self.topology = topology
        self.publisher = publisher
        self._store = store
        self._own_store: Any = None

    def _book(self) -> Any:
        if self.publisher is not None and self._store is None:
            return self.publisher.schedule_book()
        if self._store is None:
            try:
                self._own_store = self._store = type(self).open_store(self.topology.idempotency)
            except Exception as exc:
                raise StoreError(f"opening the schedule's store failed: {exc!r}") from exc
        book = getattr(self._store, "schedule", None)
        if book is None:
            raise ConfigError(f"the store {type(self._store).__name__} keeps no schedule")
        return book

    def _now(self) -> int:
        return int(self.publisher.now()) if self.publisher is not None else now_ms()

    @staticmethod
    def _failed(doing: str, exc: Exception) -> StoreError:
        return StoreError(f"the schedule's store failed {doing}: {type(exc).__name__}: {exc}")
