"""The pure rules of `status` (rabbit_delay._ops.status.rules): what needs attention, the age of
a buffer's oldest message and when a buffer is stuck, the plugin store, the report."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from io import StringIO

import pytest
from rich.console import Console

from rabbit_delay import Topology, topology_from_dict
from rabbit_delay._broker import BrokerInfo, QueueCounts
from rabbit_delay._cli.replay import shows_progress
from rabbit_delay._cli.status import render_status
from rabbit_delay._io.management import counts_from_api, delayed_messages
from rabbit_delay._ops.status.rules import (
    AGE_FROM_API,
    AGE_FROM_PEEK,
    DECLARE_HINT,
    STUCK_MARGIN_MS,
    PluginStore,
    QueueRole,
    QueueRow,
    Status,
    oldest_cell,
    status_rows,
    stuck_after_ms,
)
from rabbit_delay._ops.stored import Stored
from rabbit_delay._plan.desired import desired

NOW = 1_800_000_000_000


@dataclass(frozen=True)
class Counts:
    ready: int
    consumers: int = 0


def topology(**extra: object) -> Topology:
    data: dict[str, object] = {
        "namespace": "st",
        "tiers": {"1s": "1s", "30m": "30m"},
        "queues": {"orders": {}},
    }
    data.update(extra)
    return topology_from_dict(data)


def everything(t: Topology, **counts: Counts | None) -> dict[str, Counts | None]:
    """Live counts: every queue present and empty, unless named (by full name)."""
    live: dict[str, Counts | None] = {spec.name: Counts(0) for spec in desired(t).queues}
    live.update(counts)
    return live


def by_name(
    t: Topology,
    live: Mapping[str, Counts | None] | None,
    api: Mapping[str, QueueCounts] | None = None,
    heads: Mapping[str, int | None] | None = None,
) -> dict[str, QueueRow]:
    return {r.name: r for r in status_rows(t, live, api, heads=heads, now_ms=NOW)}


def report(t: Topology, rows: list[QueueRow], missing_exchanges: tuple[str, ...] = ()) -> Status:
    return Status(
        namespace=t.names.prefix,
        broker="amqp://guest:***@127.0.0.1:5672/",
        broker_version="4.3.6",
        broker_description="RabbitMQ 4.3.6",
        checked_at_ms=NOW,
        rows=rows,
        missing_exchanges=missing_exchanges,
        plugin=None,
        sources={},
        management_api="ok",
    )


# -- missing objects (the observed failure) ---------------------------------------


def test_a_topology_never_declared_needs_attention() -> None:
    t = topology()
    never: dict[str, Counts | None] = dict.fromkeys(everything(t))
    rows = status_rows(t, never, None)
    assert rows
    assert all(not r.exists and r.attention for r in rows)
    assert all(r.hints == [DECLARE_HINT] for r in rows)
    status = report(t, rows)
    assert status.attention
    (item,) = status.attention_items()  # one line for every missing object
    assert item.hint == DECLARE_HINT
    assert item.subject.startswith("missing queue st.v1.delay.1s, queue st.v1.delay.30m")
    assert status.as_json()["attention"] is True


def test_a_missing_exchange_alone_needs_attention() -> None:
    t = topology()
    rows = status_rows(t, everything(t), None)
    assert not any(r.attention for r in rows)
    assert not report(t, rows).attention
    status = report(t, rows, missing_exchanges=(t.names.due_exchange(),))
    assert status.attention
    (item,) = status.attention_items()
    assert item.subject == f"missing exchange {t.names.due_exchange()}"
    assert status.as_json()["missing_exchanges"] == [t.names.due_exchange()]


def test_a_missing_queue_is_in_the_rendered_text_and_nothing_else_is_claimed() -> None:
    t = topology()
    lot = t.names.parking_queue("orders")
    rows = status_rows(t, everything(t, **{lot: None}), None)
    console = Console(file=StringIO(), width=300, color_system=None)
    console.print(render_status(report(t, rows)))
    text = console.file.getvalue()  # type: ignore[attr-defined]
    assert f"needs attention: missing queue {lot}: {DECLARE_HINT}" in text
    assert "nothing needs attention" not in text


# -- the age of a buffer's oldest message -------------------------------------------------


def test_stuck_threshold() -> None:
    assert stuck_after_ms(1000) == 1000 + STUCK_MARGIN_MS
    assert stuck_after_ms(1_800_000) == 1_800_000 + 180_000  # a tenth of a long TTL


def test_age_from_a_peek_and_the_stuck_flag() -> None:
    t = topology()
    fast, slow = t.names.tier_queue("1s"), t.names.tier_queue("30m")
    live = everything(t, **{fast: Counts(3), slow: Counts(1)})
    heads = {fast: NOW - 60_000, slow: NOW - 60_000}
    rows = by_name(t, live, heads=heads)
    stuck, fine = rows[fast], rows[slow]
    assert (stuck.oldest_age_ms, stuck.age_source) == (60_000, AGE_FROM_PEEK)
    assert stuck.stuck
    assert stuck.attention
    assert stuck.notes == ["stuck: oldest message 1m old, TTL 1s"]
    assert "should have been dead-lettered 59s ago" in stuck.hints[0]
    assert oldest_cell(stuck) == "1m"
    assert not fine.stuck
    assert not fine.attention
    assert fine.as_json()["oldest_age"] == "1m"
    # Just within the margin: not stuck.
    edge = by_name(t, live, heads={fast: NOW - 11_000})[fast]
    assert not edge.stuck


def test_age_unknown_or_empty() -> None:
    t = topology()
    fast, slow = t.names.tier_queue("1s"), t.names.tier_queue("30m")
    live = everything(t, **{fast: Counts(2)})
    rows = by_name(t, live, heads={fast: None})
    assert rows[fast].oldest_age_ms is None
    assert oldest_cell(rows[fast]) == "?"  # non-empty, age unknown
    assert oldest_cell(rows[slow]) == ""  # empty
    business = rows[t.names.business_queue("orders")]
    assert oldest_cell(business) == ""  # only buffers have an age
    # A clock that disagrees a little with the message's timestamp: never a negative age.
    ahead = by_name(t, live, heads={fast: NOW + 900})[fast]
    assert ahead.oldest_age_ms == 0


def test_age_from_the_management_api_only_for_tier_buffers() -> None:
    """`head_message_timestamp` (classic queues) is the publish time: a tier buffer's
    arrival time, but not a cascade level's (a message reaches it later)."""
    t = topology(queue_type="classic", cascade={"levels": 4})
    fast, level = t.names.tier_queue("1s"), t.names.cascade_queue(2)
    live = everything(t, **{fast: Counts(1), level: Counts(1)})
    api = {
        fast: QueueCounts(1, 0, 0, head_timestamp=(NOW - 30_000) // 1000),
        level: QueueCounts(1, 0, 0, head_timestamp=(NOW - 30_000) // 1000),
    }
    rows = by_name(t, live, api)
    assert (rows[fast].oldest_age_ms, rows[fast].age_source) == (30_000, AGE_FROM_API)
    assert rows[fast].stuck
    assert rows[level].oldest_age_ms is None
    assert rows[level].role is QueueRole.CASCADE


def test_head_message_timestamp_is_read_from_the_api() -> None:
    row = {"name": "q", "type": "classic", "messages_ready": 1, "head_message_timestamp": 1_700}
    assert counts_from_api(row).head_timestamp == 1_700
    assert counts_from_api({"name": "q", "type": "quorum"}).head_timestamp is None
    assert counts_from_api({"name": "q", "head_message_timestamp": ""}).head_timestamp is None


def test_when_a_message_entered_its_queue() -> None:
    """The most recent dead-lettering (the level above, for a cascade level), else the
    AMQP timestamp; pika gives x-death times as datetimes, the API as epoch seconds."""
    when = datetime(2027, 1, 2, 3, 4, 5, tzinfo=UTC)
    from_level = Stored(
        b"",
        "m",
        None,
        {"x-death": [{"queue": "st.v1.cascade.03", "reason": "expired", "time": when}]},
        timestamp=1_000,
    )
    assert from_level.queued_at_ms == int(when.timestamp() * 1000)
    api = Stored(b"", "m", None, {"x-death": [{"time": 1_700_000_000}]}, timestamp=1)
    assert api.queued_at_ms == 1_700_000_000_000
    assert Stored(b"", "m", None, timestamp=1_234).queued_at_ms == 1_234_000
    assert Stored(b"", "m", None).queued_at_ms is None


# -- peeking a buffer is only done where it cannot cost the message -----------------------


@pytest.mark.parametrize(
    ("version", "risk"),
    [
        ("3.10.8", "back behind the others (late)"),
        ("3.13.7", "back behind the others (late)"),
        ("4.0.5", "default delivery limit (20) and could deliver its oldest message early"),
        ("4.2.1", "default delivery limit (20)"),
        ("4.3.6", None),
        ("4.4.0", None),
        ("", "did not say its version"),
    ],
)
def test_peeking_quorum_buffers_by_version(version: str, risk: str | None) -> None:
    info = BrokerInfo(version_text=version)
    assert info.peeks_quorum_buffers_freely is (risk is None)
    if risk is None:
        assert info.quorum_buffer_peek_risk is None
    else:
        assert risk in (info.quorum_buffer_peek_risk or "")


# -- plugin store -------------------------------------------------------------------------


def test_messages_delayed_of_a_plugin_exchange() -> None:
    assert delayed_messages({"name": "x", "type": "x-delayed-message", "messages_delayed": 7}) == 7
    assert delayed_messages({"name": "x", "type": "x-delayed-message"}) is None
    assert delayed_messages({"messages_delayed": True}) is None
    assert delayed_messages([]) is None
    assert PluginStore("st.v1.delayed", 7).as_json() == {"exchange": "st.v1.delayed", "delayed": 7}


def test_the_plugin_store_is_shown() -> None:
    t = topology()
    status = report(t, status_rows(t, everything(t), None))
    status.plugin = PluginStore(t.names.plugin_exchange(), 12)
    console = Console(file=StringIO(), width=300, color_system=None)
    console.print(render_status(status))
    text = console.file.getvalue()  # type: ignore[attr-defined]
    assert f"plugin store ({t.names.plugin_exchange()}): 12 message(s) delayed" in text
    assert "nothing needs attention" in text
    assert status.as_json()["plugin_store"] == {"exchange": "st.v1.delayed", "delayed": 12}


# -- the report ---------------------------------------------------------------------------


def test_parked_messages_point_to_the_parked_command() -> None:
    t = topology()
    lot = t.names.parking_queue("orders")
    rows = by_name(t, everything(t, **{lot: Counts(2)}))
    assert rows[lot].attention
    assert "rabbit-delay parked list orders" in rows[lot].hints[0]


def test_report_json_keys() -> None:
    t = topology()
    data = report(t, status_rows(t, everything(t), None)).as_json()
    assert data["broker_version"] == "4.3.6"
    assert data["checked_at"] == "2027-01-15T08:00:00.000Z"
    assert data["attention"] is False
    assert data["attention_items"] == []
    row = data["queues"][0]
    assert {"oldest_age_ms", "oldest_age", "age_source", "stuck", "hints"} <= set(row)


def test_progress_bar_only_on_long_runs_at_a_terminal() -> None:
    assert shows_progress(True, True, 50)
    assert not shows_progress(True, True, 49)
    assert not shows_progress(False, True, 10_000)  # piped
    assert not shows_progress(True, False, 10_000)  # --json


# -- status --watch and Ctrl-C ----------------------------------------------------------


def test_ctrl_c_during_a_read_lets_the_read_finish_then_stops_the_watch() -> None:
    """Ctrl-C is taken between reads, never inside one: a KeyboardInterrupt raised in the
    middle of pika left a connection that `close()` then waited on forever (`status
    --watch` hung after Ctrl-C, seen in CI), or one half open (pika's AttributeError)."""
    import os
    import signal
    import time

    from rabbit_delay import BrokerUnavailable
    from rabbit_delay._cli.status import _watch

    reads: list[str] = []

    def read() -> Status:
        reads.append("started")
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while the broker is being read
        time.sleep(0.05)  # Python runs the signal handler here
        reads.append("finished")
        raise BrokerUnavailable("no broker in this test")  # shown in place, like a real one

    previous = signal.getsignal(signal.SIGINT)
    try:
        _watch(read, 60_000)  # returns at the next check, not after the 60 s interval
    except KeyboardInterrupt:
        pytest.fail(f"Ctrl-C interrupted the read (reads: {reads})")
    assert reads == ["started", "finished"]
    assert signal.getsignal(signal.SIGINT) is previous  # the handlers are put back


def test_a_second_ctrl_c_interrupts_a_read_at_once() -> None:
    import os
    import signal
    import time

    from rabbit_delay._cli.status import _watch

    reads: list[str] = []

    def read() -> Status:
        for _ in range(2):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
        reads.append("finished")
        raise AssertionError("not reached")

    previous = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        _watch(read, 60_000)
    assert reads == []
    assert signal.getsignal(signal.SIGINT) is previous
