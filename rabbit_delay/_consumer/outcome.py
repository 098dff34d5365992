"""What became of one delivery: its outcome, computed once by the delivery program. Pure.

One vocabulary for every reader: the worker's counters (`WorkerStats`), the metric
`rabbit_delay_handled_total{outcome}`, the log lines, the `rabbit_delay.outcome`
attribute of a handle span and the test kit's records (`Handled.outcome`,
`TestBroker.outcomes()`) all name what became of a delivery with these values and
nothing else.

    outcome      what happened to the delivery                     the message
    -----------  ------------------------------------------------  ---------------------------
    acked        the handler returned; acked                       done
    retried      the handler failed; a copy waits for attempt + 1  comes back later
                 (a delay tier, or the 4.3 queue's own delay)
    deferred     not run now: a copy is being handled elsewhere,   comes back later, same
                 or the store failed on a broker that counts       attempt
                 requeues; a copy waits in the shortest tier
    parked       in the parking lot, with the reason (its copy     waits for a person
                 sent there, or dead-lettered there when the
                 retry copy could not be sent)
    duplicate    already handled: acked, the handler not run       done
    cancelled    cancelled (a tombstone, or its schedule key was   dropped
                 cancelled): acked, not run
    superseded   a newer generation of its schedule key replaced   dropped (the newer one
                 it: acked, not run                                runs)
    requeued     handed back to the queue at once (nack)           comes back at once
    handed_back  not started when the worker stopped: nacked       comes back at once
    stale        its channel or consumer was gone: nothing sent,   the broker delivers it
                 the broker redelivers it                          again
"""

from __future__ import annotations

from enum import StrEnum


class Outcome(StrEnum):
    """What became of one delivery (the table in this module's docstring)."""

    ACKED = "acked"
    RETRIED = "retried"
    DEFERRED = "deferred"
    PARKED = "parked"
    DUPLICATE = "duplicate"
    CANCELLED = "cancelled"
    SUPERSEDED = "superseded"
    REQUEUED = "requeued"
    HANDED_BACK = "handed_back"
    STALE = "stale"


# The outcomes that end a delivery's handling on this attempt (counted by
# rabbit_delay_handled_total): not a message handed straight back to its queue.
OUTCOMES = (
    Outcome.ACKED,
    Outcome.RETRIED,
    Outcome.DEFERRED,
    Outcome.PARKED,
    Outcome.DUPLICATE,
    Outcome.CANCELLED,
    Outcome.SUPERSEDED,
)

__all__ = ["OUTCOMES", "Outcome"]
