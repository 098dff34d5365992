"""What the worker's programs report as they go, as one protocol. Pure.

The lifecycle and housekeeping programs decide and the drivers execute; what happened
on the way (a lost connection, a failed reconnect round, a lease lost...) is told to a
`WorkerEvents`, which counts it, logs it and exports it as metrics
(`rabbit_delay._observe.report.WorkerReport`, handed in by the worker). The core itself
neither logs nor counts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from rabbit_delay._broker import BrokerInfo
    from rabbit_delay._consumer.delivery import Settled


class WorkerEvents(Protocol):
    """What a worker's programs tell; every method returns at once."""

    def settled(self, settled: Settled) -> None:
        """What became of one delivery (counted, logged, exported)."""

    def consuming(self, url: str) -> None:
        """The worker consumes its queues on `url` (at start)."""

    def connection_lost(self, reason: str) -> None:
        """The connection or the consuming channel is gone; the worker reconnects."""

    def connection_lost_at_stop(self, reason: str) -> None:
        """The connection was lost while the worker stopped: nothing more to settle."""

    def reconnect_failed(self, why: str, delay_s: float, urls: int) -> None:
        """A reconnect round failed; the next one in `delay_s`."""

    def reconnected(self, url: str) -> None:
        """Consuming again, on `url`."""

    def consumer_cancelled(
        self, queue: str, queue_name: str, tag: str, broker: BrokerInfo, again: bool
    ) -> None:
        """The broker cancelled one of the worker's consumers; consumed `again` or not."""

    def stop_begins(self, signal_name: str | None, forced: bool) -> None:
        """A stop was asked (by a signal, or None: by `stop()`); `forced`: a second one."""

    def shutdown_timeout(self, unsettled: int, forced: bool) -> None:
        """The stop's drain ended with `unsettled` deliveries still being handled."""

    def still_running(self, running: int) -> None:
        """After the drain, `running` handlers are still recording their results."""

    def lease_lost(self, key: str, owner: str) -> None:
        """A running handler's claim could not be renewed: a second copy may run."""

    def finished_after_lost_lease(self, key: str) -> None:
        """A handler finished whose lease had been lost meanwhile."""

    def renewal_failed(self, key: str, error: BaseException) -> None:
        """A lease renewal failed (tried again next round)."""

    def purge_failed(self, error: BaseException) -> None:
        """Purging expired idempotency records failed (tried again later)."""


__all__ = ["WorkerEvents"]
