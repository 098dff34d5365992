"""What both publishers know about one publish call, and the rules they follow when the
connection is lost or the broker blocks publishing. Pure: no I/O; clocks are passed in.

* `Ledger`: every message of a call in send order, with its state (unsent, sent and
  unconfirmed, confirmed, returned, nacked), the delivery tags of the current channel,
  and the one error the call ends with. A lost channel turns every sent-unconfirmed
  message back into unsent, so it is re-sent unchanged (same message_id, headers and due
  time: at-least-once) and never reported as confirmed, nor a confirmed one as failed.
* `Recovery`: when to try reconnecting again, and when to give up (the deadline counts
  from the loss; a confirm on the new connection ends the outage).
* `BlockedState`: the broker's connection.blocked / unblocked as seen on one
  connection, the warnings, and when a waiting publish gives up.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from enum import Enum

from rabbit_delay._durations import DurationLike, parse_ms
from rabbit_delay._envelope import Outgoing
from rabbit_delay._errors import (
    BrokerBlocked,
    BrokerUnavailable,
    ConfigError,
    ConnectionLost,
    DurationError,
    NackError,
    PublishError,
    RabbitDelayError,
    UnconfirmedError,
    UnroutableError,
)

log = logging.getLogger("rabbit_delay.publisher")

DEFAULT_RECOVERY_TIMEOUT_S = 30.0
# A worker's retry publish must not hold its connection for long while the broker is
# blocked: past this, the delivery program's publish-failure policy applies.
WORKER_BLOCKED_TIMEOUT_S = 5.0


class State(Enum):
    UNSENT = "unsent"
    SENT = "sent"  # on the wire, no confirm yet
    CONFIRMED = "confirmed"
    RETURNED = "returned"  # basic.return under mandatory: no queue bound
    NACKED = "nacked"  # basic.nack: the broker did not take responsibility


def seconds(value: DurationLike, name: str) -> float:
    """A publisher timeout given as seconds, a timedelta or "30s"; ConfigError if bad."""
    try:
        ms = parse_ms(value)
    except DurationError as exc:
        raise ConfigError(f"{name}: {exc}") from None
    return ms / 1000


def confirm_failure(returned: dict[str, str], nacked: Sequence[str]) -> PublishError | None:
    """The one error for publishes the broker returned (message_id -> reply text) or
    nacked, or None. Returned ones win: they need the topology fixed, a nack only a retry.
    """
    if returned:
        reasons = ", ".join(sorted(set(returned.values())))
        return UnroutableError(
            f"{len(returned)} message(s) returned by the broker ({reasons}): no queue is bound "
            "for them; check the topology is declared (`rabbit-delay plan`)",
            message_ids=list(returned),
            replies=returned,
        )
    if nacked:
        return NackError(
            f"{len(nacked)} message(s) nacked by the broker; publish them again",
            message_ids=list(nacked),
        )
    return None


class Ledger:
    """Every message of one publish call, in send order, with its state.

    The transports call `take()` for the next message to send, `sent(index, tag)` once
    it is on the wire, then `ack`/`nack` (by delivery tag, pika) or `settle` (by index,
    aio-pika) and `returned(message_id)`; `channel_lost()` when the channel is gone.
    """

    def __init__(self, outs: Sequence[Outgoing]) -> None:
        self.outs = list(outs)
        self.states = [State.UNSENT] * len(self.outs)
        self.replies: dict[int, str] = {}  # index -> the broker's reply to a return
        self._tags: dict[int, int] = {}  # delivery tag on the current channel -> index
        self._cursor = 0  # every index below it was taken
        self.in_flight = 0  # SENT
        self.settled = 0  # CONFIRMED, RETURNED or NACKED
        self.confirmed = 0
        self.trace: object | None = None  # the call's publish span (rabbit_delay._observe.tracing)

    def __len__(self) -> int:
        return len(self.outs)

    @property
    def done(self) -> bool:
        """Every message has its outcome (confirmed, returned or nacked)."""
        return self.settled == len(self.outs)

    def take(self) -> int | None:
        """The index of the next message to send (in call order), or None."""
        states = self.states
        while self._cursor < len(states):
            index = self._cursor
            self._cursor += 1
            if states[index] is State.UNSENT:
                return index
        return None

    def sent(self, index: int, tag: int | None = None) -> None:
        """Message `index` is on the wire (as delivery `tag` of the current channel)."""
        self.states[index] = State.SENT
        self.in_flight += 1
        if tag is not None:
            self._tags[tag] = index

    # -- outcomes --------------------------------------------------------------------------

    def settle(self, index: int, state: State, reply: str = "") -> None:
        """Message `index` has its outcome. Only a sent message can get one: a late
        confirm for a message already re-sent or settled changes nothing."""
        if self.states[index] is not State.SENT:
            return
        self.states[index] = state
        self.in_flight -= 1
        self.settled += 1
        if state is State.CONFIRMED:
            self.confirmed += 1
        elif state is State.RETURNED:
            self.replies[index] = reply

    def ack(self, tag: int, *, multiple: bool = False, nack: bool = False) -> None:
        """basic.ack / basic.nack for delivery `tag` (and every lower one, `multiple`)."""
        state = State.NACKED if nack else State.CONFIRMED
        tags = self._tags
        if not multiple:
            index = tags.pop(tag, None)
            if index is not None:
                self.settle(index, state)
            return
        # tags were recorded in increasing order, so the dict's order is tag order
        for t in list(tags):
            if t > tag:
                break
            self.settle(tags.pop(t), state)

    def returned(self, message_id: str, reply: str) -> None:
        """basic.return of `message_id` (it precedes the ack of the same message): the
        earliest sent-unconfirmed message with that id."""
        for tag, index in self._tags.items():
            if self.states[index] is State.SENT and self.outs[index].message_id == message_id:
                self.settle(index, State.RETURNED, reply)
                del self._tags[tag]
                return

    def channel_lost(self) -> int:
        """The channel (or connection) is gone: its confirms will never come. Every
        sent-unconfirmed message becomes unsent again, to be re-sent unchanged; sending
        starts again from the first unsent one. Returns how many were sent again."""
        lost = 0
        first: int | None = None
        for index, state in enumerate(self.states):
            if state is State.SENT:
                self.states[index] = State.UNSENT
                lost += 1
            if first is None and self.states[index] is State.UNSENT:
                first = index
        self._tags.clear()
        self.in_flight = 0
        self._cursor = len(self.states) if first is None else first
        return lost

    # -- reporting -------------------------------------------------------------------------

    def ids(self, *states: State) -> list[str]:
        return [o.message_id for o, s in zip(self.outs, self.states, strict=True) if s in states]

    def unconfirmed_ids(self) -> list[str]:
        """The ids with no outcome yet (unsent or sent-unconfirmed), in call order."""
        return self.ids(State.UNSENT, State.SENT)

    def failure(self) -> PublishError | None:
        """Once `done`: UnroutableError / NackError naming exactly those ids, or None."""
        returned = {
            self.outs[i].message_id: self.replies.get(i, "")
            for i, s in enumerate(self.states)
            if s is State.RETURNED
        }
        return confirm_failure(returned, self.ids(State.NACKED))

    def unconfirmed(self, cause: RabbitDelayError | str) -> UnconfirmedError:
        """The error for a call that ends before every message has its outcome (a lost
        connection past the deadline, a blocked broker): exactly the unconfirmed ids."""
        ids = self.unconfirmed_ids()
        failed = len(self.outs) - len(ids) - self.confirmed
        others = f"; {failed} other(s) were returned or nacked" if failed else ""
        text = (
            f"{len(ids)} of {len(self.outs)} message(s) not confirmed ({cause}){others}; "
            "publish them again with the same message ids"
        )
        if isinstance(cause, BrokerBlocked):
            return BrokerBlocked(text, message_ids=ids, reason=cause.reason)
        return UnconfirmedError(text, message_ids=ids)

    def error_for(self, error: RabbitDelayError) -> RabbitDelayError:
        """What a call raises for `error` met while publishing: an UnconfirmedError
        naming exactly the unconfirmed ids for a lost connection, no broker or a
        blocked broker; any other error (403, 404, ...) as it is."""
        if isinstance(error, UnconfirmedError | BrokerUnavailable):
            return self.unconfirmed(error)
        return error


def recoverable(error: RabbitDelayError) -> bool:
    """A lost connection or channel, or no broker answering (yet), is worth a reconnect
    by a publisher that owns its connection; a refusal (403, 404, 406) or a blocked
    broker is not."""
    return isinstance(error, BrokerUnavailable)


def log_lost(error: RabbitDelayError, ledger: Ledger, recovery: Recovery) -> None:
    log.warning(
        "publisher: %s; reconnecting, %d unconfirmed message(s) of the call will be sent "
        "again (gives up %gs after the loss)",
        error,
        len(ledger) - ledger.settled,
        recovery.timeout_s,
    )


def log_recovered(url: str, recovery: Recovery, now: float) -> None:
    assert recovery.started is not None
    log.warning("publisher: reconnected to %s after %.1fs", url, now - recovery.started)


def recovery_failed(recovery: Recovery, error: RabbitDelayError) -> ConnectionLost:
    """The error once the deadline has passed (the call names its unconfirmed ids)."""
    return ConnectionLost(
        f"connection lost and not recovered within {recovery.timeout_s:g}s (last: {error})"
    )


class Recovery:
    """When a publisher that lost its connection tries again, and when it gives up.

    An outage starts at a loss; it ends when a message is confirmed after it (a loss
    after that starts a new outage, with a fresh deadline and backoff). Past
    `timeout_s` from its start, `next_delay` answers None: give up.
    """

    def __init__(self, timeout_s: float, backoff: Callable[[], Iterator[float]]) -> None:
        self.timeout_s = timeout_s
        self._backoff = backoff
        self.started: float | None = None
        self._confirmed_at_loss = -1
        self._delays: Iterator[float] = iter(())
        self.outages = 0

    def lost(self, now: float, confirmed: int) -> None:
        """The connection was lost at `now`, with `confirmed` messages of the call
        confirmed so far."""
        if self.started is None or confirmed > self._confirmed_at_loss:
            self.started = now
            self._delays = self._backoff()
            self.outages += 1
        self._confirmed_at_loss = confirmed

    @property
    def deadline(self) -> float:
        assert self.started is not None, "no outage"
        return self.started + self.timeout_s

    def next_delay(self, now: float) -> float | None:
        """Seconds to wait before the next reconnect attempt (never past the deadline);
        None once the deadline has passed."""
        left = self.deadline - now
        if left <= 0:
            return None
        return min(next(self._delays), left)


class BlockedState:
    """connection.blocked / connection.unblocked on one connection (a resource alarm:
    the broker stops reading from publishing connections). Shared by every publisher on
    that connection; logs a WARNING at each change."""

    def __init__(self, name: str = "connection") -> None:
        self.name = name
        self.reason: str | None = None  # None: not blocked
        self.since: float | None = None

    @property
    def blocked(self) -> bool:
        return self.reason is not None

    def block(self, reason: str, now: float) -> None:
        if self.reason is None:
            self.since = now
            log.warning(
                "the broker blocked publishing on %s (%s): publishes wait until it clears",
                self.name,
                reason or "no reason given",
            )
        self.reason = reason or "no reason given"

    def unblock(self, now: float) -> None:
        if self.reason is not None:
            waited = now - self.since if self.since is not None else 0.0
            log.warning(
                "the broker unblocked publishing on %s after %.1fs (was: %s)",
                self.name,
                waited,
                self.reason,
            )
        self.reason = None
        self.since = None

    def deadline(self, timeout_s: float) -> float | None:
        """When publishes stop waiting for the block to clear: once it is `timeout_s`
        old (a publish made later in the same block fails at once). None if not
        blocked."""
        if self.since is None:
            return None
        return self.since + timeout_s

    def error(self, timeout_s: float) -> BrokerBlocked:
        reason = self.reason or "no reason given"
        return BrokerBlocked(
            f"the broker blocked publishing for more than {timeout_s:g}s ({reason}); "
            "a resource alarm (memory or disk) must clear on the broker",
            reason=reason,
        )
