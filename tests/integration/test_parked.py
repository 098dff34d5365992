"""`rabbit-delay parked list|show|purge` and the replay progress bar, on the real broker.

The claim under test: looking at a parking lot loses and reorders nothing. A quorum
queue puts back more than 32 messages of one requeue out of order (measured on 3.10.8
and 4.3.6, see `rabbit_delay._ops.queues.REQUEUE_BATCH`), so the lots here hold 300.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import MakeTopology

from rabbit_delay import _headers as h
from rabbit_delay._envelope import BINARY, JSON, Outgoing
from rabbit_delay.sync import Publisher

from ._terminal import Terminal
from .test_ops import Ops, cli, declared

pytestmark = pytest.mark.integration

MANY = 300  # well past the 32 a quorum queue puts back in order at once
T0 = 1_700_000_000_000


@pytest.fixture
def lot(make_topology: MakeTopology, tmp_path: Path, broker_url: str) -> Iterator[Ops]:
    with declared(make_topology(), tmp_path, broker_url) as handle:
        yield handle


def park_many(ops: Ops, queue: str, n: int, *, body: bytes | None = None) -> list[str]:
    """Park `n` messages for `queue` as the worker does (confirmed, 256 in flight)."""
    names = ops.names
    outs = []
    for i in range(n):
        headers: dict[str, object] = {
            h.H_ATTEMPT: 3,
            h.H_TARGET: names.queue_key(queue),
            h.H_ERROR_TYPE: "ValueError",
            h.H_ERROR_MESSAGE: f"boom {i}",
            h.H_ERROR_TRACEBACK: f"Traceback (most recent call last):\nValueError: boom {i}",
            h.H_ORIGINAL_QUEUE: queue,
            h.H_FIRST_FAILURE: T0 + i,
            h.H_LAST_FAILURE: T0 + 60_000 + i,
            h.H_PARK_REASON: "max_attempts",
            "tenant": "acme",
        }
        outs.append(
            Outgoing(
                exchange=names.parking_exchange(),
                routing_key=names.queue_key(queue),
                body=body if body is not None else json.dumps({"n": i}).encode(),
                message_id=f"p{i:04d}",
                content_type=JSON if body is None else BINARY,
                headers=headers,
                mandatory=True,
                timestamp=T0 // 1000,
            )
        )
    with Publisher(ops.topology, connection=ops.conn) as publisher:
        return publisher.publish_outgoing(outs)


def listed(ops: Ops, *args: str) -> dict[str, Any]:
    result = cli("parked", "list", *args, "-f", str(ops.path), "--url", ops.url, "--json")
    assert result.exit_code == 0, result.stdout + result.stderr
    data: dict[str, Any] = json.loads(result.stdout)
    return data


def test_list_twice_then_consume_nothing_lost_nothing_reordered(lot: Ops) -> None:
    ids = park_many(lot, "orders.cancel", MANY)
    parking = lot.names.parking_queue("orders.cancel")
    first = listed(lot, "orders.cancel", "--limit", str(MANY))
    second = listed(lot, "orders.cancel", "--limit", str(MANY))
    assert [m["message_id"] for m in first["messages"]] == ids
    assert second["messages"] == first["messages"]
    assert (first["total"], first["next_offset"]) == (MANY, None)
    m = first["messages"][7]
    assert (m["position"], m["reason"], m["error_type"], m["error_message"]) == (
        7,
        "max_attempts",
        "ValueError",
        "boom 7",
    )
    assert (m["attempts"], m["first_failure"], m["last_failure"]) == (
        3,
        "2023-11-14T22:13:20.007Z",
        "2023-11-14T22:14:20.007Z",
    )
    # Pages: the default page, one in the middle, the last one.
    default = listed(lot, "orders.cancel")
    assert [m["position"] for m in default["messages"]] == list(range(50))
    assert default["next_offset"] == 50
    middle = listed(lot, "orders.cancel", "--offset", "100", "--limit", "40")
    assert [m["message_id"] for m in middle["messages"]] == ids[100:140]
    assert middle["next_offset"] == 140
    last = listed(lot, "orders.cancel", "--offset", str(MANY - 10), "--limit", "50")
    assert [m["message_id"] for m in last["messages"]] == ids[-10:]
    assert last["next_offset"] is None
    beyond = listed(lot, "orders.cancel", "--offset", str(MANY + 5))
    assert beyond["messages"] == []
    # The table says the same, and where the next page starts.
    table = cli("parked", "list", "orders.cancel", "-f", str(lot.path), "--url", lot.url)
    assert table.exit_code == 0, table.stderr
    assert "p0000" in table.stdout
    assert "boom 0" in table.stdout
    assert f"messages 0-49 of {MANY} (0 = the oldest); next page: --offset 50" in table.stdout
    # Then consume: every message, in the order it was parked.
    assert lot.count(parking) == MANY
    got = lot.drain(parking)
    assert [props.message_id for props, _ in got] == ids
    assert [json.loads(body)["n"] for _, body in got] == list(range(MANY))


def test_show_prints_headers_traceback_and_body(lot: Ops) -> None:
    park_many(lot, "push", 2)
    base = ("-f", str(lot.path), "--url", lot.url)
    shown = cli("parked", "show", "push", "p0001", *base)
    assert shown.exit_code == 0, shown.stderr
    text = shown.stdout
    assert "message p0001 (position 1 of 2)" in text
    assert "error: ValueError: boom 1" in text
    assert "tenant: acme" in text
    assert f"{h.H_ERROR_TRACEBACK}:" in text
    assert "Traceback (most recent call last):\nValueError: boom 1" in text
    assert 'body (8 bytes, shown as json):\n{\n  "n": 1\n}' in text
    data = json.loads(cli("parked", "show", "push", "p0001", *base, "--json").stdout)
    (copy,) = data["copies"]
    assert (copy["position"], copy["message_id"], copy["attempts"]) == (1, "p0001", 3)
    assert copy["headers"]["tenant"] == "acme"
    assert copy["traceback"].endswith("ValueError: boom 1")
    assert copy["body"] == {"encoding": "json", "text": '{\n  "n": 1\n}', "size": 8}
    # Not there: a clear error, exit 1, nothing moved.
    missing = cli("parked", "show", "push", "nope", *base)
    assert missing.exit_code == 1
    assert f"no message with id 'nope' in {lot.names.parking_queue('push')}" in missing.stderr
    assert lot.count(lot.names.parking_queue("push")) == 2


def test_show_a_binary_body_as_base64(lot: Ops) -> None:
    park_many(lot, "push", 1, body=b"\xff\x00\x1b[2J")
    base = ("-f", str(lot.path), "--url", lot.url)
    data = json.loads(cli("parked", "show", "push", "p0000", *base, "--json").stdout)
    assert data["copies"][0]["body"] == {"encoding": "base64", "text": "/wAbWzJK", "size": 6}
    text = cli("parked", "show", "push", "p0000", *base).stdout
    assert "body (6 bytes, shown as base64):\n/wAbWzJK" in text


def test_unknown_queue_and_missing_lot(lot: Ops) -> None:
    base = ("-f", str(lot.path), "--url", lot.url)
    unknown = cli("parked", "list", "nope", *base)
    assert unknown.exit_code == 1
    assert "unknown queue 'nope'" in unknown.stderr
    channel = lot.conn.channel()
    channel.queue_delete(lot.names.parking_queue("push"))
    channel.close()
    gone = cli("parked", "list", "push", *base)
    assert gone.exit_code == 1
    assert "does not exist; run `rabbit-delay declare`" in gone.stderr


def test_purge_refuses_without_a_terminal_unless_yes(lot: Ops) -> None:
    park_many(lot, "push", 3)
    parking = lot.names.parking_queue("push")
    base = ("-f", str(lot.path), "--url", lot.url)
    refused = cli("parked", "purge", "push", *base)
    assert refused.exit_code == 1
    assert "pass --yes" in refused.stderr
    assert "stdin is not one" in refused.stderr
    assert lot.count(parking) == 3
    done = cli("parked", "purge", "push", *base, "--yes", "--json")
    assert done.exit_code == 0, done.stderr
    assert json.loads(done.stdout) == {"parking_queue": parking, "counted": 3, "purged": 3}
    assert lot.count(parking) == 0
    empty = cli("parked", "purge", "push", *base)
    assert empty.exit_code == 0
    assert "nothing to purge" in empty.stdout


def test_purge_asks_at_a_terminal(lot: Ops) -> None:
    park_many(lot, "push", 4)
    parking = lot.names.parking_queue("push")
    question = f"Purge 4 message(s) from {parking}? They cannot be recovered [y/N]"
    for answer, code, left in (("n", 1, 4), ("y", 0, 0)):
        term = Terminal("parked", "purge", "push", "-f", str(lot.path), "--url", lot.url)
        try:
            term.read_until(lambda out: question in out, 30, "confirmation prompt")
            term.send(answer + "\n")
            assert term.wait() == code, term.output
        finally:
            term.kill()
        assert lot.count(parking) == left
    assert "purged 4 message(s)" in term.output


def test_replay_shows_a_progress_bar_at_a_terminal(lot: Ops) -> None:
    park_many(lot, "push", 60)
    term = Terminal("replay", "push", str(lot.path), "--url", lot.url)
    try:
        assert term.wait(60) == 0, term.output
    finally:
        term.kill()
    assert f"replaying from {lot.names.parking_queue('push')}" in term.output
    assert "/60" in term.output  # the M/N column
    assert "moved 60 message(s)" in term.output
    assert lot.count(lot.names.parking_queue("push")) == 0
    # Piped (CliRunner): no bar, the same summary.
    park_many(lot, "push", 60)
    piped = cli("replay", "push", str(lot.path), "--url", lot.url)
    assert piped.exit_code == 0, piped.stderr
    assert "replaying from" not in piped.stdout
    assert "moved 60 message(s)" in piped.stdout


def test_a_failed_replay_after_a_listing_keeps_the_order(lot: Ops) -> None:
    """After a listing, the lot's messages are all "requeued" ones, which a quorum queue
    serves first, each new requeue behind them: the message whose copy failed must not
    go behind the others."""
    ids = park_many(lot, "orders.cancel", 40)
    assert [m["message_id"] for m in listed(lot, "orders.cancel", "-n", "40")["messages"]] == ids
    channel = lot.conn.channel()
    channel.exchange_delete(lot.names.tier_exchange("1s"))
    channel.close()
    failed = cli("replay", "orders.cancel", str(lot.path), "--url", lot.url, "--tier", "1s")
    assert failed.exit_code == 1
    assert "could not be re-published" in failed.stderr
    again = listed(lot, "orders.cancel", "-n", "40")
    assert [m["message_id"] for m in again["messages"]] == ids
    assert [
        props.message_id for props, _ in lot.drain(lot.names.parking_queue("orders.cancel"))
    ] == ids
