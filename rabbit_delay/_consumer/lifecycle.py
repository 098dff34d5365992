"""A worker's connection lifecycle: connect, check, consume, lose, back off, reconnect,
drain and close. A sans-I/O program, like the delivery program. Pure.

The three workers drive it (pika on its connection thread, aio-pika on its event loop,
the in-memory worker on its virtual clock); what it decides is written here once: the
order of the checks before consuming, that the topology is declared at the first start
only, which errors stop a start and which a reconnect round shrugs off, the failover
order and backoff between rounds, and the shutdown's cadence.

    step                 the driver                                  reply
    -------------------  ------------------------------------------  ---------------------------
    Connect(urls)        connects to the first of `urls` that        Connected(url, broker), or
                         answers and reads the broker's version      the error (the error tree)
    DECLARE              declares the topology                       None, or the error
    CheckQueue(name)     passive declare of one business queue       True, False (absent), or
                                                                     the error
    CONSUME              opens the consuming channel (prefetch, a    None, or the error
                         publisher for copies) and consumes every
                         queue: deliveries start flowing
    SERVE                runs until asked to stop or the connection  STOPPED, or Lost(reason)
                         (or the consuming channel) is lost
    CLOSE                closes the connection, quietly              None
    CANCEL               cancels the consumers: the stop begins      None, or Lost(reason)
    Wait(STOP, s)        waits `s` before a reconnect round, unless  True if asked to stop
                         asked to stop meanwhile
    Wait(SETTLED, s)     lets deliveries in flight settle, up to `s` Drained(unsettled, forced),
                         or a forced stop                            or Lost(reason)
    Wait(RECORDED, s)    after the close: up to `s` for running      handlers still running
                         handlers to record their results            (0: done, or forced)

A reply that is an exception, to a start's step, ends the program with it: the worker
cannot start (`run()` raises it). During a reconnect round, the same exception is a
failed round: reported, then the next round after a backoff, over the nodes after the
lost one first (a dead node last).
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from rabbit_delay._broker import BrokerInfo
from rabbit_delay._connection import failover_order
from rabbit_delay._consumer.events import WorkerEvents
from rabbit_delay._consumer.settings import WorkerSettings
from rabbit_delay._errors import MissingObjectError

# How often a stop that waits for running handlers says so.
STILL_RUNNING_NOTE_S = 10.0


class Act(Enum):
    """The steps that carry nothing but their name (the table above)."""

    DECLARE = "declare"
    CONSUME = "consume"
    SERVE = "serve"
    CLOSE = "close"
    CANCEL = "cancel"


DECLARE, CONSUME, SERVE = Act.DECLARE, Act.CONSUME, Act.SERVE
CLOSE, CANCEL = Act.CLOSE, Act.CANCEL


class Until(Enum):
    """What a Wait step waits for, at most its `seconds`."""

    STOP = "stop"  # the backoff before a reconnect round: ends early when asked to stop
    SETTLED = "settled"  # the drain: deliveries in flight settled (or a forced stop)
    RECORDED = "recorded"  # after the close: running handlers recorded their results


@dataclass(frozen=True, slots=True)
class Connect:
    urls: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class CheckQueue:
    name: str


@dataclass(frozen=True, slots=True)
class Wait:
    until: Until
    seconds: float


# -- replies ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Connected:
    url: str
    broker: BrokerInfo


@dataclass(frozen=True, slots=True)
class Lost:
    reason: str  # redacted


@dataclass(frozen=True, slots=True)
class Drained:
    unsettled: int  # deliveries still being handled at the end of the drain
    forced: bool  # the stop was forced (a second signal, stop(force=True))


class Stopped:
    """The reply to SERVE when the worker was asked to stop."""

    def __repr__(self) -> str:
        return "STOPPED"


STOPPED = Stopped()
LifecycleStep = Act | Connect | CheckQueue | Wait
Lifecycle = Generator[LifecycleStep, object, None]


class Target(Protocol):
    """What the program asks of the worker it runs (WorkerCore)."""

    settings: WorkerSettings

    def check_broker(self, broker: BrokerInfo) -> None: ...

    def queue_names(self) -> list[str]: ...


def lifecycle_program(worker: Target, events: WorkerEvents) -> Lifecycle:
    """The whole life of one `run()`: start (raising what prevents it), serve and
    reconnect until asked to stop, then stop."""
    url: str | None = yield from _open(worker, worker.settings.urls, first=True)
    assert url is not None
    events.consuming(url)
    while url is not None:
        served = yield SERVE
        if not isinstance(served, Lost):
            break
        events.connection_lost(served.reason)
        yield CLOSE
        url = yield from _reconnect(worker, events, url)
    if url is not None:  # connected: cancel, drain, close
        drained = yield CANCEL
        if not isinstance(drained, Lost):
            drained = yield Wait(Until.SETTLED, worker.settings.shutdown_timeout_s)
        if isinstance(drained, Lost):  # nothing more can be settled on it
            events.connection_lost_at_stop(drained.reason)
        elif isinstance(drained, Drained) and drained.unsettled:
            events.shutdown_timeout(drained.unsettled, drained.forced)
        yield CLOSE
    while running := (yield Wait(Until.RECORDED, STILL_RUNNING_NOTE_S)):
        events.still_running(_count(running))


def _open(
    worker: Target, urls: Sequence[str], *, first: bool
) -> Generator[LifecycleStep, object, str]:
    """Connect and consume: the URL consumed from. Raises what the steps answered (the
    connection closed first)."""
    connected = _result((yield Connect(tuple(urls))))
    assert isinstance(connected, Connected)
    try:
        worker.check_broker(connected.broker)  # IncompatibleBroker, before anything else
        if worker.settings.declare and first:  # at the first start only: connections.md
            _result((yield DECLARE))
        for name in worker.queue_names():
            if _result((yield CheckQueue(name))) is False:
                raise missing_queue(name)
        _result((yield CONSUME))
    except Exception:
        yield CLOSE
        raise
    return connected.url


def _reconnect(
    worker: Target, events: WorkerEvents, lost_url: str
) -> Generator[LifecycleStep, object, str | None]:
    """Rounds of `_open` with backoff until one succeeds (its URL) or a stop is asked
    (None). Each round tries the nodes after the lost one first."""
    urls = worker.settings.urls
    delays = worker.settings.backoff.delays()
    order = failover_order(urls, lost_url)
    while True:
        try:
            url = yield from _open(worker, order, first=False)
        except Exception as exc:  # the next node may lack the topology, refuse the user...
            delay = next(delays)
            events.reconnect_failed(str(exc) or repr(exc), delay, len(urls))
            if (yield Wait(Until.STOP, delay)) is True:
                return None
            continue
        events.reconnected(url)
        return url


def _result(reply: object) -> object:
    if isinstance(reply, BaseException):
        raise reply
    return reply


def _count(reply: object) -> int:
    return reply if isinstance(reply, int) else 0


def missing_queue(queue_name: str) -> MissingObjectError:
    """The error for a business queue absent from the broker at start."""
    return MissingObjectError(
        f"queue {queue_name!r} does not exist on the broker: declare the topology "
        "(`rabbit-delay declare`), or start the worker with --declare"
    )


__all__ = [
    "CANCEL",
    "CLOSE",
    "CONSUME",
    "DECLARE",
    "SERVE",
    "STILL_RUNNING_NOTE_S",
    "STOPPED",
    "Act",
    "CheckQueue",
    "Connect",
    "Connected",
    "Drained",
    "Lifecycle",
    "LifecycleStep",
    "Lost",
    "Stopped",
    "Target",
    "Until",
    "Wait",
    "lifecycle_program",
    "missing_queue",
]
