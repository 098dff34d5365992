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

import threading
from dataclasses import dataclass

from rabbit_delay.message import Envelope

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


@dataclass(slots=True)
class _Held:
    key: str
    renewed_ms: int
    lost: bool = False


class LeaseBook:
    """The claims a worker holds while their handlers run, and when to renew them.

    Thread-safe; its lock guards only the book, never a store round trip, so a handler
    starting or finishing never waits on another key's renewal.
    """

    def __init__(self, lease_ms: int) -> None:
        self.lease_ms = lease_ms
        self.every_ms = renew_every_ms(lease_ms)
        self._held: dict[str, _Held] = {}  # owner -> its claim
        self._lock = threading.Lock()
        self.lost = 0  # renewals that found the claim gone (a second copy may run)

    def hold(self, key: str, owner: str, now_ms: int) -> None:
        with self._lock:
            self._held[owner] = _Held(key, now_ms)

    def hold_many(self, held: list[tuple[str, str]], now_ms: int) -> None:
        """`hold` for a batch of (key, owner), under one lock."""
        with self._lock:
            for key, owner in held:
                self._held[owner] = _Held(key, now_ms)

    def drop_many(self, owners: list[str]) -> list[str]:
        """`drop` for a batch; returns the owners whose lease was lost."""
        lost = []
        with self._lock:
            for owner in owners:
                held = self._held.pop(owner, None)
                if held is not None and held.lost:
                    lost.append(owner)
        return lost

    def drop(self, owner: str) -> bool:
        """Forget `owner`'s claim (its handler finished). True if its lease was lost."""
        with self._lock:
            held = self._held.pop(owner, None)
        return held is not None and held.lost

    def due(self, now_ms: int) -> list[tuple[str, str]]:
        """(key, owner) of the claims to renew now: renewed longer than `every_ms` ago."""
        threshold = now_ms - self.every_ms
        with self._lock:
            return [
                (held.key, owner)
                for owner, held in self._held.items()
                if held.renewed_ms <= threshold and not held.lost
            ]

    def renewed(self, owner: str, ok: bool, now_ms: int) -> bool:
        """Record a renewal's result. True when it reveals a lost lease (the claim is
        gone or another owner took it: the handler still running is no longer the only
        one); False otherwise, including a claim dropped meanwhile."""
        with self._lock:
            held = self._held.get(owner)
            if held is None:
                return False  # finished while the renewal ran
            if ok:
                held.renewed_ms = now_ms
                return False
            held.lost = True
            self.lost += 1
            return True

    def __len__(self) -> int:
        return len(self._held)
