"""Leases, their renewal, deferral backoff and crash accounting. Pure: clock in, decisions out.

A claim is a lease (`[idempotency] lease`, 30 s by default). While a handler runs, its
worker renews the lease every third of it, so a live handler never loses its key and a
dead worker (SIGKILL, OOM, power) blocks its keys for at most one lease.

A copy that finds its key held by a running handler (IN_PROGRESS) is put off: re-published
through a delay that starts at the queue's shortest tier and doubles per deferral, capped
at half a lease, so a key held by a dead worker is taken over within about 1.5 leases
and a long-running handler costs a bounded number of re-publishes per lease.

A delivery that comes back from the broker while its handler may have run (a crash, a
cut connection) is counted across copies in the `rd-crashes` header: re-publishing a copy
resets the broker's x-delivery-count, so without this a message that kills every worker
would loop for ever under the guard. At the queue's `delivery_limit`, it is parked with
reason `crashed`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from rabbit_delay._envelope import Envelope
from rabbit_delay._idempotency.guard import ClaimResult, Guard
from rabbit_delay._schedule.records import Ref, Update

if TYPE_CHECKING:
    from rabbit_delay._consumer.events import WorkerEvents

# A renewal every third of the lease: two may fail before the lease runs out.
RENEWALS_PER_LEASE = 3


def renew_every_ms(lease_ms: int) -> int:
    """How often running handlers' leases are renewed."""
    return max(lease_ms // RENEWALS_PER_LEASE, 10)


def defer_delay_ms(deferrals: int, shortest_ms: int, lease_ms: int) -> int:
    """The delay of deferral number `deferrals` (1 = first) of a copy whose key is held:
    the shortest tier, doubling per deferral, capped at half a lease (never below the
    shortest tier)."""
    cap = max(lease_ms // 2, shortest_ms)
    exponent = min(max(deferrals - 1, 0), 30)
    return min(shortest_ms << exponent, cap)


def lost_deliveries(env: Envelope, redelivered: bool, *, native: bool, held: bool) -> int:
    """Deliveries of this message lost while its handler may have run: those counted in
    earlier copies (rd-crashes) plus those of this copy.

    Of this copy: the quorum queue's x-delivery-count (every lost delivery counts there;
    a nack-requeue counts too before RabbitMQ 4.3, as it does for the broker's own
    delivery limit), or 1 for a classic queue's redelivered flag. With retry backend
    "broker" the count also holds the failed attempts, so this copy counts only when it
    comes back while another holder has the key (`held`): the broker's delivery limit
    counts the rest.
    """
    if native:
        here = 1 if redelivered and held else 0
    elif env.delivery_count:
        here = env.delivery_count
    else:
        here = 1 if redelivered else 0
    return env.crashes + here


def may_have_run(env: Envelope, redelivered: bool) -> bool:
    """True when the handler may already have run for this message: a broker redelivery,
    a copy carrying lost deliveries, or a copy put off behind another that since gave the
    key up (finished with a failure, or died: a takeover)."""
    return redelivered or env.crashes > 0 or env.deferrals > 0 or env.delivery_count > 0


class LeaseBook:
    """The claims a worker holds while their handlers run, and when to renew them.

    Thread-safe without a lock of its own (single dict operations are atomic in
    CPython): a handler starting or finishing never waits, neither on another key's
    renewal nor on the book. Only the renewer (one thread or task) calls `due` and
    `renewed`.
    """

    def __init__(self, lease_ms: int) -> None:
        self.lease_ms = lease_ms
        self.every_ms = renew_every_ms(lease_ms)
        self._held: dict[str, tuple[str, int]] = {}  # owner -> (key, held since); handlers
        self._renewed: dict[str, int] = {}  # owner -> last renewal; the renewer only
        self._lost: dict[str, None] = {}  # owners whose lease was lost (ordered set)
        self.lost = 0  # renewals that found the claim gone (a second copy may run)

    # -- the bookkeeping around a store's claims and finishes: here only, for every driver

    def claimed(self, key: str, owner: str, result: object, now_ms: int) -> None:
        """After a Claim step: a key claimed is held (and renewed) until its Finish."""
        if result is ClaimResult.CLAIMED:
            self._held[owner] = (key, now_ms)

    def claimed_many(
        self, claims: Sequence[tuple[str, str]], results: Sequence[object], now_ms: int
    ) -> None:
        """`claimed` for a batch of (key, owner) and their results."""
        held = self._held
        for (key, owner), result in zip(claims, results, strict=True):
            if result is ClaimResult.CLAIMED:
                held[owner] = (key, now_ms)

    def finishing(self, key: str, owner: str, events: WorkerEvents) -> None:
        """Before a Finish step: the claim is no longer renewed; a lease lost meanwhile
        (another copy may have run beside this one) is reported."""
        if self.drop(owner):
            events.finished_after_lost_lease(key)

    def finishing_many(self, finishes: Sequence[tuple[str, str]], events: WorkerEvents) -> None:
        """`finishing` for a batch of (key, owner)."""
        for key, owner in finishes:
            self.finishing(key, owner, events)

    def drop(self, owner: str) -> bool:
        """Forget `owner`'s claim (its handler finished). True if its lease was lost."""
        self._held.pop(owner, None)
        if self._lost:
            return self._lost.pop(owner, 0) is None
        return False

    def due(self, now_ms: int) -> list[tuple[str, str]]:
        """(key, owner) of the claims to renew now: renewed longer than `every_ms` ago."""
        threshold = now_ms - self.every_ms
        held = dict(self._held)  # a snapshot: handlers go on holding and dropping
        renewed, lost = self._renewed, self._lost
        for owner in [o for o in renewed if o not in held]:  # finished since
            del renewed[owner]
        for owner in [o for o in lost if o not in held]:
            lost.pop(owner, None)
        return [
            (key, owner)
            for owner, (key, since) in held.items()
            if renewed.get(owner, since) <= threshold and owner not in lost
        ]

    def renewed(self, owner: str, ok: bool, now_ms: int) -> bool:
        """Record a renewal's result. True when it reveals a lost lease (the claim is
        gone or another owner took it: the handler still running is no longer the only
        one); False otherwise, including a claim dropped meanwhile."""
        if owner not in self._held:
            return False  # finished while the renewal ran
        if ok:
            self._renewed[owner] = now_ms
            return False
        self._lost[owner] = None
        if owner not in self._held:  # dropped meanwhile: not a loss after all
            self._lost.pop(owner, None)
            return False
        self.lost += 1
        return True

    def __len__(self) -> int:
        return len(self._held)


def claim_with(
    guard: Guard, leases: LeaseBook, key: str, owner: str, now_ms: int, ref: Ref | None = None
) -> object:
    """A Claim step on a synchronous guard: its result (a key claimed is held in `leases`),
    or the store's exception (the step's reply). With the delivery's schedule `ref`, the
    schedule is asked in the same store call."""
    if ref is not None:
        result: object = guard.scheduled_batch([], [(key, owner, ref)])[1][0]
    else:
        try:
            result = guard.claim(key, owner)
        except Exception as exc:
            return exc
    leases.claimed(key, owner, result, now_ms)
    return result


def finish_with(
    guard: Guard,
    leases: LeaseBook,
    key: str,
    owner: str,
    succeeded: bool,
    events: WorkerEvents,
    update: Update | None = None,
) -> object:
    """A Finish step on a synchronous guard: done or released, the lease dropped (a lease
    lost meanwhile reported), the schedule `update` written with it; None, or the store's
    exception (the step's reply)."""
    leases.finishing(key, owner, events)
    if update is not None:
        return guard.scheduled_batch([(key, owner, succeeded, update)], [])[0][0]
    try:
        if succeeded:
            guard.done(key, owner)
        else:
            guard.failed(key, owner)
    except Exception as exc:
        return exc
    return None
