"""The pure side of `rabbit-delay parked` (rabbit_delay._ops.parked.rules): listing from
peeked messages (through `rabbit_delay._ops.stored.Stored.summary`), pages, bodies,
headers as JSON."""

from __future__ import annotations

import base64
import json
from datetime import UTC, datetime
from decimal import Decimal

import pytest

from rabbit_delay import ConfigError
from rabbit_delay import _headers as h
from rabbit_delay._ops.parked.rules import (
    ParkedItem,
    check_page,
    detail,
    find,
    json_safe,
    page,
    render_body,
)
from rabbit_delay._ops.stored import Stored

T0 = 1_800_000_000_000


def parked(i: int, **headers: object) -> Stored:
    return Stored(
        body=json.dumps({"n": i}).encode(),
        message_id=f"m{i}",
        content_type="application/json",
        headers={
            h.H_ATTEMPT: 4,
            h.H_ERROR_TYPE: "ValueError",
            h.H_ERROR_MESSAGE: f"boom {i}",
            h.H_ERROR_TRACEBACK: "Traceback (most recent call last):\n  ...\nValueError: boom",
            h.H_ORIGINAL_QUEUE: "orders",
            h.H_FIRST_FAILURE: T0 + i,
            h.H_LAST_FAILURE: T0 + 60_000 + i,
            h.H_PARK_REASON: "max_attempts",
            h.H_TARGET: "shop.v1.q.orders",
            **headers,
        },
        exchange="shop.v1.parking",
        routing_key="shop.v1.q.orders",
        timestamp=T0 // 1000,
    )


def test_a_listed_item_reads_the_parking_headers_through_the_summary() -> None:
    item = ParkedItem.of(7, parked(3))
    assert item == ParkedItem(
        position=7,
        message_id="m3",
        reason="max_attempts",
        error_type="ValueError",
        error_message="boom 3",
        attempts=4,
        first_failure="2027-01-15T08:00:00.003Z",
        last_failure="2027-01-15T08:01:00.003Z",
        parked_at="2027-01-15T08:01:00.003Z",
        original_queue="orders",
        target="shop.v1.q.orders",
    )


def test_a_message_the_broker_dead_lettered() -> None:
    """No rd-error headers: the reason and time come from x-death."""
    when = datetime(2027, 1, 2, 3, 4, 5, tzinfo=UTC)
    msg = Stored(b"{}", "d1", None, {"x-death": [{"reason": b"delivery_limit", "time": when}]})
    item = ParkedItem.of(0, msg)
    assert (item.reason, item.parked_at, item.error_type) == (
        "delivery_limit",
        "2027-01-02T03:04:05.000Z",
        None,
    )
    assert item.first_failure is None


def test_pages() -> None:
    lot = [parked(i) for i in range(5)]
    first = page("orders", "shop.v1.parking.orders", 12, 0, 5, lot)
    assert [i.position for i in first.items] == [0, 1, 2, 3, 4]
    assert first.next_offset == 5
    later = page("orders", "shop.v1.parking.orders", 12, 10, 5, lot[:2])
    assert [i.position for i in later.items] == [10, 11]
    assert later.next_offset is None  # the last page
    assert page("orders", "lot", 0, 0, 5, []).next_offset is None
    data = first.as_json()
    assert (data["total"], data["offset"], data["limit"], data["next_offset"]) == (12, 0, 5, 5)
    assert data["messages"][2]["message_id"] == "m2"
    # A page never holds more than its limit, even if more was peeked.
    assert len(page("orders", "lot", 12, 0, 2, lot).items) == 2


def test_bad_pages_are_refused() -> None:
    check_page(0, 1)
    with pytest.raises(ConfigError, match="negative"):
        check_page(-1, 10)
    with pytest.raises(ConfigError, match="at least 1"):
        check_page(0, 0)


def test_bodies() -> None:
    pretty = render_body(b'{"order_id":42,"items":[1,2]}')
    assert pretty.encoding == "json"
    assert pretty.text == '{\n  "order_id": 42,\n  "items": [\n    1,\n    2\n  ]\n}'
    assert json.loads(pretty.text) == {"order_id": 42, "items": [1, 2]}
    assert render_body("tür zu\nzweite Zeile".encode()).encoding == "text"
    assert render_body("tür zu".encode()).text == "tür zu"
    binary = render_body(b"\xff\x00\x01")
    assert (binary.encoding, base64.b64decode(binary.text), binary.size) == (
        "base64",
        b"\xff\x00\x01",
        3,
    )
    # Valid UTF-8 with a terminal escape: never printed raw.
    assert render_body(b"\x1b[2Jcleared").encoding == "base64"
    assert render_body(b"").encoding == "text"


def test_headers_as_json() -> None:
    when = datetime(2027, 1, 2, 3, 4, 5, tzinfo=UTC)
    value = {
        "x-death": [{"time": when, "reason": b"expired", "count": 1}],
        "raw": b"\xff",
        "price": Decimal("1.50"),
        "flag": True,
    }
    assert json_safe(value) == {
        "x-death": [{"time": "2027-01-02T03:04:05.000Z", "reason": "expired", "count": 1}],
        "raw": {"base64": "/w=="},
        "price": "1.50",
        "flag": True,
    }
    json.dumps(json_safe(value))  # serialisable


def test_detail_and_find() -> None:
    lot = [parked(0), parked(1), parked(0, tenant="acme")]  # m0 parked twice
    copies = find(lot, "m0")
    assert [d.item.position for d in copies] == [0, 2]
    d = copies[1]
    assert d.traceback is not None
    assert d.traceback.endswith("ValueError: boom")
    assert d.headers["tenant"] == "acme"
    assert d.body.encoding == "json"
    assert d.timestamp == "2027-01-15T08:00:00.000Z"
    data = d.as_json()
    assert (data["message_id"], data["exchange"], data["body"]["encoding"]) == (
        "m0",
        "shop.v1.parking",
        "json",
    )
    json.dumps(data)
    assert find(lot, "nope") == []
    assert detail(0, Stored(b"\x00", None, None)).item.message_id is None
