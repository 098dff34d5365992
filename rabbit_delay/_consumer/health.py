"""Liveness and readiness of a worker: what `/healthz` and `/readyz` answer. Pure.

Both workers expose the same facts (`WorkerCore.health()`); the rule that turns them
into "alive" and "ready" is written here once:

- **live**: the process runs a worker whose loop is not stuck. The loop beats (the
  pika worker from its connection thread between event polls, the aio-pika worker from
  a task on its event loop) at least once a second; a beat older than `stale_after_s`
  means the loop is wedged, and only a restart helps. Before the worker runs (the
  app is loading) it counts as live: nothing is stuck yet. Once it stopped, it is not.
  Losing the broker does NOT make a worker unlive: it reconnects by itself, and a
  restart would not bring the broker back.
- **ready**: live, running (not starting, not stopping), connected, and consuming
  every queue it was asked to consume (a consumer the broker cancelled counts as
  missing until it is consumed again).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

# Longer than anything the loop legitimately blocks on between two beats: a connect
# attempt to a node that does not answer (pika's socket timeout, 10 s, per URL) or a
# confirm during a blocked broker (5 s).
LIVENESS_STALE_S = 60.0


class Phase(StrEnum):
    STARTING = "starting"  # the worker exists, run() has not begun
    RUNNING = "running"
    STOPPING = "stopping"  # asked to stop: draining in-flight handlers
    STOPPED = "stopped"  # run() has returned


@dataclass(frozen=True, slots=True)
class Health:
    """One look at a worker (WorkerCore.health())."""

    phase: Phase
    beat_age_s: float | None  # since the loop's last beat; None before it ran
    connected: bool  # connected to a broker and its consumers set up
    consuming: tuple[str, ...]  # the queues (logical names) with a live consumer now
    wanted: tuple[str, ...]  # the queues the worker was asked to consume
    broker: str  # the node connected to (or tried first), redacted
    stale_after_s: float = LIVENESS_STALE_S

    @property
    def live(self) -> bool:
        if self.phase is Phase.STOPPED:
            return False
        return self.beat_age_s is None or self.beat_age_s <= self.stale_after_s

    @property
    def missing(self) -> tuple[str, ...]:
        """Queues the worker should consume but does not, now."""
        have = set(self.consuming)
        return tuple(q for q in self.wanted if q not in have)

    @property
    def ready(self) -> bool:
        return self.live and self.phase is Phase.RUNNING and self.connected and not self.missing

    def as_json(self) -> dict[str, Any]:
        """The body of both endpoints (small, stable keys)."""
        return {
            "live": self.live,
            "ready": self.ready,
            "phase": self.phase.value,
            "connected": self.connected,
            "broker": self.broker,
            "consuming": list(self.consuming),
            "not_consuming": list(self.missing),
            "last_beat_s": None if self.beat_age_s is None else round(self.beat_age_s, 3),
        }


__all__ = ["LIVENESS_STALE_S", "Health", "Phase"]
