"""Housekeeping beside the deliveries: renewing running handlers' leases, purging expired
idempotency records. A sans-I/O program, like the delivery program. Pure.

    step              the driver                                   reply
    ----------------  -------------------------------------------  --------------------------
    Sleep(seconds)    waits (a thread, a task, virtual time)       True to end the program
                                                                   (the worker stops)
    Renew(key, owner) renews one claim in the store                whether it is still held,
                                                                   or the store's exception
    Purge()           deletes expired records                      None, or the exception

Every half renewal period the leases due for renewal (`LeaseBook.due`) are renewed, a
lost one reported; every `PURGE_EVERY_S` (when the store needs purging at all) expired
records are purged. No lock is held across a store round trip: handlers start and finish
meanwhile. With `until_idle`, the program ends once no lease is held (the in-memory
worker renews only while handlers run, in virtual time).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass

from rabbit_delay._consumer.events import WorkerEvents
from rabbit_delay._consumer.leases import LeaseBook
from rabbit_delay._idempotency.guard import Guard

# How often expired idempotency records are deleted (stores that keep them: SQLite, memory).
PURGE_EVERY_S = 600.0


@dataclass(frozen=True, slots=True)
class Sleep:
    seconds: float


@dataclass(frozen=True, slots=True)
class Renew:
    key: str
    owner: str


@dataclass(frozen=True, slots=True)
class Purge:
    pass


PURGE = Purge()
HousekeepingStep = Sleep | Renew | Purge


def housekeeping_program(
    leases: LeaseBook,
    events: WorkerEvents,
    *,
    clock: Callable[[], int],
    monotonic: Callable[[], float],
    purges: bool,
    until_idle: bool = False,
) -> Generator[HousekeepingStep, object, None]:
    """Renew and purge until the driver answers a Sleep with True. `clock` gives UTC epoch
    ms (the leases' clock), `monotonic` seconds (the purge cadence); `purges`: the store
    keeps expired records (`store.needs_purge`)."""
    next_purge = monotonic() + PURGE_EVERY_S
    sleep = Sleep(leases.every_ms / 2000)
    while not (until_idle and not len(leases)):
        if (yield sleep) is True:
            return
        for key, owner in leases.due(clock()):
            renewed = yield Renew(key, owner)
            if isinstance(renewed, BaseException):
                events.renewal_failed(key, renewed)
                continue
            if leases.renewed(owner, bool(renewed), clock()):
                events.lease_lost(key, owner)
        if purges and monotonic() >= next_purge:
            next_purge = monotonic() + PURGE_EVERY_S
            purged = yield PURGE
            if isinstance(purged, BaseException):
                events.purge_failed(purged)


def on_guard(guard: Guard, step: Renew | Purge) -> object:
    """A Renew or Purge step on a synchronous guard: its reply (the store's exception
    included)."""
    try:
        if isinstance(step, Renew):
            return guard.renew(step.key, step.owner)
        guard.purge()
    except Exception as exc:
        return exc
    return None


__all__ = [
    "PURGE",
    "PURGE_EVERY_S",
    "HousekeepingStep",
    "Purge",
    "Renew",
    "Sleep",
    "housekeeping_program",
    "on_guard",
]
