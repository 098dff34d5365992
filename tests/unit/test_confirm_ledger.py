"""The ledger of one publish call, the recovery deadline and the blocked rule: pure, the
same for both publishers."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

from rabbit_delay import (
    AccessRefused,
    BrokerBlocked,
    BrokerUnavailable,
    ConfigError,
    ConnectionLost,
    ConnectionSettings,
    MissingObjectError,
    NackError,
    UnconfirmedError,
    UnroutableError,
    topology_from_dict,
)
from rabbit_delay._envelope import Outgoing
from rabbit_delay._publishing.confirms import BlockedState, Ledger, Recovery, State, recoverable
from rabbit_delay._publishing.core import PublisherCore


def outs(n: int, prefix: str = "m") -> list[Outgoing]:
    return [
        Outgoing(
            exchange="x",
            routing_key="k",
            body=b"{}",
            message_id=f"{prefix}{i}",
            content_type="application/json",
            headers={"rd-due-at": 1000 + i},
            mandatory=True,
            timestamp=1,
        )
        for i in range(n)
    ]


def send_all(ledger: Ledger, first_tag: int = 1, limit: int | None = None) -> list[int]:
    """Send (as pika would, with increasing delivery tags) up to `limit` messages."""
    tags: list[int] = []
    tag = first_tag
    while limit is None or len(tags) < limit:
        index = ledger.take()
        if index is None:
            break
        ledger.sent(index, tag)
        tags.append(tag)
        tag += 1
    return tags


def test_all_confirmed_in_order() -> None:
    ledger = Ledger(outs(5))
    send_all(ledger)
    assert ledger.in_flight == 5
    assert not ledger.done
    ledger.ack(5, multiple=True)
    assert ledger.done
    assert ledger.confirmed == 5
    assert ledger.failure() is None
    assert ledger.unconfirmed_ids() == []


def test_multiple_ack_covers_only_lower_tags() -> None:
    ledger = Ledger(outs(6))
    send_all(ledger)
    ledger.ack(3, multiple=True)
    assert ledger.states[:3] == [State.CONFIRMED] * 3
    assert ledger.states[3:] == [State.SENT] * 3
    assert ledger.unconfirmed_ids() == ["m3", "m4", "m5"]
    ledger.ack(5)  # single
    assert ledger.unconfirmed_ids() == ["m3", "m5"]


def test_returned_then_acked_stays_returned_and_is_the_only_failure() -> None:
    ledger = Ledger(outs(4))
    send_all(ledger)
    ledger.returned("m1", "312 NO_ROUTE")
    ledger.ack(4, multiple=True)  # the broker acks the returned message too
    assert ledger.done
    error = ledger.failure()
    assert isinstance(error, UnroutableError)
    assert error.message_ids == ("m1",)
    assert error.replies == {"m1": "312 NO_ROUTE"}


def test_nacked_ones_are_named_exactly_and_returned_win() -> None:
    ledger = Ledger(outs(4))
    send_all(ledger)
    ledger.ack(2, nack=True)
    ledger.ack(4, multiple=True)
    error = ledger.failure()
    assert isinstance(error, NackError)
    assert error.message_ids == ("m1",)

    both = Ledger(outs(3))
    send_all(both)
    both.ack(1, nack=True)
    both.returned("m2", "312 NO_ROUTE")
    both.ack(3, multiple=True)
    assert isinstance(both.failure(), UnroutableError)


def test_a_lost_channel_resends_exactly_the_unconfirmed_in_order() -> None:
    ledger = Ledger(outs(10))
    send_all(ledger, limit=6)  # window of 6
    ledger.ack(2, multiple=True)
    ledger.ack(4)
    assert ledger.channel_lost() == 3  # m2, m4, m5 were sent and not confirmed
    assert ledger.in_flight == 0
    # late confirms of the old channel must not count: tags are per channel
    ledger.ack(6, multiple=True)
    assert ledger.confirmed == 3
    # the new channel starts at tag 1 again; order: m2, m4, m5, then m6.. m9
    resent = []
    while (index := ledger.take()) is not None:
        resent.append(ledger.outs[index].message_id)
        ledger.sent(index, len(resent))
    assert resent == ["m2", "m4", "m5", "m6", "m7", "m8", "m9"]
    assert resent[:3] == ["m2", "m4", "m5"]  # the 3 lost, first
    ledger.ack(7, multiple=True)
    assert ledger.done
    assert ledger.failure() is None
    # the same message objects: same message_id, headers, due time
    assert ledger.outs[2].headers == {"rd-due-at": 1002}


def test_settle_by_index_for_the_async_transport() -> None:
    ledger = Ledger(outs(3))
    for _ in range(3):
        index = ledger.take()
        assert index is not None
        ledger.sent(index)
    ledger.settle(2, State.CONFIRMED)
    ledger.settle(0, State.RETURNED, "312 NO_ROUTE")
    ledger.settle(2, State.NACKED)  # a second outcome changes nothing
    assert ledger.states == [State.RETURNED, State.SENT, State.CONFIRMED]
    assert ledger.unconfirmed_ids() == ["m1"]


def test_unconfirmed_error_names_exactly_the_ids_without_a_confirm() -> None:
    ledger = Ledger(outs(8))
    send_all(ledger, limit=5)
    ledger.ack(2, multiple=True)
    ledger.returned("m3", "312 NO_ROUTE")
    error = ledger.error_for(ConnectionLost("connection lost while publishing"))
    assert type(error) is UnconfirmedError
    assert error.message_ids == ("m2", "m4", "m5", "m6", "m7")  # sent-unconfirmed and unsent
    assert "1 other(s) were returned or nacked" in str(error)
    # every id not named was confirmed, or is counted in the text
    confirmed = set(ledger.ids(State.CONFIRMED))
    assert confirmed == {"m0", "m1"}
    assert confirmed.isdisjoint(error.message_ids)


def test_error_for_keeps_refusals_and_names_ids_when_blocked() -> None:
    ledger = Ledger(outs(2))
    send_all(ledger)
    refused = AccessRefused("403", permission="write")
    assert ledger.error_for(refused) is refused
    missing = MissingObjectError("404")
    assert ledger.error_for(missing) is missing
    blocked = ledger.error_for(BrokerBlocked("blocked", reason="low on memory"))
    assert isinstance(blocked, BrokerBlocked)
    assert blocked.message_ids == ("m0", "m1")
    assert blocked.reason == "low on memory"
    never = ledger.error_for(BrokerUnavailable("cannot connect"))
    assert type(never) is UnconfirmedError


def test_recoverable() -> None:
    assert recoverable(ConnectionLost("x"))
    assert recoverable(BrokerUnavailable("x"))
    assert not recoverable(AccessRefused("x"))
    assert not recoverable(MissingObjectError("x"))
    assert not recoverable(BrokerBlocked("x"))


def fixed_backoff() -> Iterator[float]:
    return itertools.chain([0.25, 0.5, 1.0], itertools.repeat(2.0))


def test_recovery_deadline_counts_from_the_loss_and_clips_the_last_wait() -> None:
    recovery = Recovery(3.0, fixed_backoff)
    recovery.lost(100.0, confirmed=0)
    assert recovery.next_delay(100.0) == 0.25
    assert recovery.next_delay(100.3) == 0.5
    assert recovery.next_delay(100.9) == 1.0
    assert recovery.next_delay(102.5) == pytest.approx(0.5)  # 2.0, clipped to the deadline
    assert recovery.next_delay(103.0) is None


def test_recovery_progress_starts_a_new_outage() -> None:
    recovery = Recovery(3.0, fixed_backoff)
    recovery.lost(100.0, confirmed=10)
    recovery.next_delay(100.0)
    recovery.lost(101.0, confirmed=10)  # lost again before any confirm: same outage
    assert recovery.deadline == 103.0
    assert recovery.outages == 1
    recovery.lost(150.0, confirmed=11)  # a confirm came in between: a new outage
    assert recovery.deadline == 153.0
    assert recovery.outages == 2
    assert recovery.next_delay(150.0) == 0.25  # backoff starts again


def test_blocked_state_deadline_and_warnings(caplog: pytest.LogCaptureFixture) -> None:
    state = BlockedState("127.0.0.1:5672")
    assert state.deadline(30.0) is None
    with caplog.at_level(logging.WARNING, logger="rabbit_delay.publisher"):
        state.block("low on memory", 10.0)
        state.block("low on memory", 12.0)  # a repeat does not move the start
        assert state.deadline(2.0) == 12.0
        error = state.error(2.0)
        assert error.reason == "low on memory"
        assert "low on memory" in str(error)
        state.unblock(15.0)
    assert state.deadline(2.0) is None
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2, warnings
    assert "blocked publishing on 127.0.0.1:5672 (low on memory)" in warnings[0]
    assert "unblocked" in warnings[1]
    assert "5.0s" in warnings[1]


# -- the options both publishers share (PublisherCore, no I/O) -----------------------------


def core(**options: Any) -> PublisherCore:
    topology = topology_from_dict({"namespace": "unit", "tiers": {"1s": "1s"}, "queues": {"q": {}}})
    return PublisherCore(topology, **options)


def test_publisher_options_defaults_and_durations() -> None:
    default = core()
    assert default.owns_connection
    assert default.recovery_timeout_s == 30.0
    assert default.blocked_timeout_s == 30.0
    assert default.window == 256
    given = core(recovery_timeout="2m", blocked_timeout=timedelta(seconds=5), window=8)
    assert given.recovery_timeout_s == 120.0
    assert given.blocked_timeout_s == 5.0
    from_settings = core(settings=ConnectionSettings(blocked_timeout_s=7))
    assert from_settings.blocked_timeout_s == 7.0
    assert not core(borrowed=True).owns_connection


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"url": "amqp://localhost/", "borrowed": True}, "not both"),
        ({"window": 0}, "window must be"),
        ({"window": True}, "window must be"),
        ({"recovery_timeout": "soon"}, "recovery_timeout"),
        ({"blocked_timeout": -1}, "blocked_timeout"),
    ],
)
def test_publisher_options_refused_clearly(options: dict[str, Any], says: str) -> None:
    url = options.pop("url", None)
    with pytest.raises(ConfigError, match=says):
        PublisherCore(
            topology_from_dict({"namespace": "unit", "tiers": {"1s": "1s"}, "queues": {"q": {}}}),
            url,
            **options,
        )


def test_finish_records_confirmed_and_failed_exactly() -> None:
    from prometheus_client import CollectorRegistry

    from rabbit_delay.metrics import Metrics

    registry = CollectorRegistry()
    publisher = core(metrics=Metrics(registry))
    messages = [publisher.prepare({"n": n}, "1s", queue="q") for n in range(4)]
    ledger = publisher.ledger(messages)
    send_all(ledger, limit=3)
    ledger.ack(2, multiple=True)
    with pytest.raises(UnconfirmedError) as raised:
        publisher.result(ledger, ConnectionLost("lost"))
    assert raised.value.message_ids == (messages[2].message_id, messages[3].message_id)
    key = publisher.topology.names.queue_key("q")
    published = registry.get_sample_value(
        "rabbit_delay_published_total", {"queue": key, "tier": "1s"}
    )
    failed = registry.get_sample_value(
        "rabbit_delay_publish_errors_total", {"queue": key, "reason": "broker"}
    )
    assert (published, failed) == (2, 2)
