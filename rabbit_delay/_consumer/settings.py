"""A worker's options, validated once: what both transports' workers (and the in-memory
one) are told. Pure."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict

from rabbit_delay._connection import ConnectionSettings, ReconnectBackoff

if TYPE_CHECKING:
    from rabbit_delay._observe.metrics import Metrics

# How long running handlers get to finish once a worker is asked to stop.
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0


class WorkerOptions(TypedDict, total=False):
    """The keyword options of the workers (`Worker`, `AsyncWorker`): see WorkerSettings."""

    queues: Sequence[str] | None
    prefetch: int | None
    concurrency: int | None
    declare: bool
    shutdown_timeout: float
    reconnect_max_s: float | None
    connection_settings: ConnectionSettings | None
    name: str | None
    install_signal_handlers: bool
    metrics: Metrics | None


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    """A worker's options, resolved and checked (`resolve`).

    `urls`: the broker nodes, in the order tried at start; `prefetch` bounds unacked
    deliveries per consumer (default 2 x concurrency); `concurrency` the handlers running
    at once; `declare` declares the topology at start (only at start: see
    docs/connections.md); `shutdown_timeout_s` what running handlers get at a stop;
    `backoff` the waits between reconnect rounds.
    """

    urls: tuple[str, ...]
    concurrency: int
    prefetch: int
    declare: bool
    shutdown_timeout_s: float
    backoff: ReconnectBackoff
    connection: ConnectionSettings
    install_signal_handlers: bool

    @classmethod
    def resolve(
        cls,
        url: str | Sequence[str] | None,
        *,
        default_concurrency: int,
        prefetch: int | None = None,
        concurrency: int | None = None,
        declare: bool = False,
        shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
        reconnect_max_s: float | None = None,
        connection_settings: ConnectionSettings | None = None,
        install_signal_handlers: bool = True,
    ) -> WorkerSettings:
        """`url`: one broker URL, several (a sequence, or one string separated by commas),
        or None for `connection_settings.urls`, else $RABBIT_DELAY_URL, else the local
        broker. `reconnect_max_s` replaces the backoff's maximum.

        Raises ConfigError for a malformed URL list, ValueError for a concurrency or
        prefetch below 1."""
        concurrency = default_concurrency if concurrency is None else concurrency
        if concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {concurrency}")
        prefetch = prefetch if prefetch is not None else 2 * concurrency
        if prefetch < 1:
            raise ValueError(f"prefetch must be at least 1, got {prefetch}")
        connection = connection_settings or ConnectionSettings()
        backoff = connection.backoff
        if reconnect_max_s is not None:
            backoff = ReconnectBackoff(
                min(backoff.initial_s, reconnect_max_s), reconnect_max_s, backoff.jitter
            )
        return cls(
            urls=connection.resolve(url),
            concurrency=concurrency,
            prefetch=prefetch,
            declare=declare,
            shutdown_timeout_s=shutdown_timeout,
            backoff=backoff,
            connection=connection,
            install_signal_handlers=install_signal_handlers,
        )


__all__ = ["DEFAULT_SHUTDOWN_TIMEOUT_S", "WorkerOptions", "WorkerSettings"]
