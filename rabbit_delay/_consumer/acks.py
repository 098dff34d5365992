"""Coalescing the acks of one channel into multiple-acks, where that is exact. Pure.

A socket write per ack is the largest single cost of consuming. `basic.ack(multiple=
True)` with tag T settles every outstanding delivery up to T, so it may only be sent
when every delivery up to T has finished and wants its ack. The tracker knows the
lowest delivery still being handled (`low`): acks below it are coalesced into one
multiple-ack, acks above it are sent one by one at the same flush, so one slow
handler never holds back the acks (and the prefetch window) of the others.

Negative acknowledgements never go through here: they are sent one by one, at once
(RabbitMQ 4.3 counts a multiple-nack towards no delivery limit), and reported with
`settled(tag)` only once written, so a later multiple-ack cannot overtake them.

A multiple-ack is only exact if the tracker saw every delivery of its channel; tags
are consecutive per channel, so a gap switches coalescing off for that channel. One
tracker per channel: a new channel (after a reconnect) gets a new one.
"""

from __future__ import annotations


class AckTracker:
    """Delivery tags of one channel: which are being handled, which wait for an ack."""

    __slots__ = ("_exact", "_low", "_max_seen", "_pending", "_waiting")

    def __init__(self) -> None:
        self._pending: set[int] = set()  # delivered, not finished
        self._waiting: list[int] = []  # finished, ack not yet written
        self._max_seen = 0  # tags start at 1 on every channel
        self._low = 1  # lowest pending tag, or max_seen + 1 when none is pending
        self._exact = True

    def __len__(self) -> int:
        """Deliveries not yet settled on the wire (being handled, or waiting for an ack)."""
        return len(self._pending) + len(self._waiting)

    @property
    def coalescing(self) -> bool:
        return self._exact

    def delivered(self, tag: int) -> None:
        if tag != self._max_seen + 1:
            self._exact = False  # a delivery this tracker did not see: no multiple-ack
        if tag > self._max_seen:
            self._max_seen = tag
        was_idle = not self._pending
        self._pending.add(tag)
        if was_idle or tag < self._low:
            self._low = tag

    def acked(self, tag: int) -> None:
        """The delivery may be acked (its handler succeeded, or its copy is confirmed)."""
        self._done(tag)
        self._waiting.append(tag)

    def settled(self, tag: int) -> None:
        """A reject/nack for the delivery was written: nothing more to send for it."""
        self._done(tag)

    def _done(self, tag: int) -> None:
        pending = self._pending
        pending.discard(tag)
        if tag == self._low:
            low, top = tag + 1, self._max_seen
            while low <= top and low not in pending:
                low += 1
            self._low = low

    def flush(self) -> list[tuple[int, bool]]:
        """The acks to write now, as (delivery_tag, multiple), in order."""
        waiting = self._waiting
        if not waiting:
            return []
        self._waiting = []
        if len(waiting) == 1 or not self._exact:
            return [(tag, False) for tag in waiting]
        low = self._low
        below = [t for t in waiting if t < low]
        frames: list[tuple[int, bool]] = []
        if len(below) > 1:
            frames.append((max(below), True))
        elif below:
            frames.append((below[0], False))
        if len(below) < len(waiting):
            frames.extend((t, False) for t in waiting if t > low)
        return frames
