"""Message encoding and the headers every outgoing message carries."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from decimal import Decimal

import pytest
from pydantic import BaseModel

from rabbit_delay import DecodeError, EncodeError, PublishError, topology_from_dict
from rabbit_delay._envelope import (
    BINARY,
    JSON,
    MAX_MESSAGE_ID,
    Envelope,
    check_message_id,
    encode_body,
    new_message_id,
    strip_broker_headers,
)
from rabbit_delay._publishing.core import PublisherCore


class CancelOrder(BaseModel):
    order_id: int
    reason: str = "unpaid"
    placed_at: datetime


@pytest.fixture
def core() -> PublisherCore:
    return PublisherCore(
        topology_from_dict({"namespace": "shop", "tiers": {"5m": "5m"}, "queues": {"push": {}}})
    )


def test_pydantic_model() -> None:
    body, content_type = encode_body(
        CancelOrder(order_id=42, placed_at=datetime(2024, 1, 2, tzinfo=UTC))
    )
    assert content_type == JSON == "application/json"
    assert json.loads(body) == {
        "order_id": 42,
        "reason": "unpaid",
        "placed_at": "2024-01-02T00:00:00Z",
    }


def test_dict_and_list() -> None:
    body, content_type = encode_body({"order_id": 42, "tags": ["a", "ü"]})
    assert content_type == JSON
    assert json.loads(body) == {"order_id": 42, "tags": ["a", "ü"]}
    assert b" " not in body  # compact
    assert encode_body([1, 2]) == (b"[1,2]", JSON)


@pytest.mark.parametrize("raw", [b"\x00\xffraw", bytearray(b"abc"), memoryview(b"xyz")])
def test_bytes_pass_unchanged(raw: bytes | bytearray | memoryview) -> None:
    assert encode_body(raw) == (bytes(raw), BINARY)


@pytest.mark.parametrize(
    "msg",
    [
        {"when": datetime(2024, 1, 1)},
        {"amount": Decimal("1.5")},
        {"nan": float("nan")},
        {"inf": float("inf")},
        {"set": {1, 2}},
        {("tuple", "key"): 1},
        {"nested": {"obj": object()}},
    ],
)
def test_non_serialisable_dict(msg: dict[object, object]) -> None:
    with pytest.raises(EncodeError, match=r"not JSON-serialisable.*pydantic model or bytes"):
        encode_body(msg)  # type: ignore[arg-type]


@pytest.mark.parametrize("msg", ["text", 42, None, 1.5, object()])
def test_other_types_refused(msg: object) -> None:
    with pytest.raises(EncodeError, match=f"cannot publish a {type(msg).__name__}"):
        encode_body(msg)  # type: ignore[arg-type]


def test_encode_error_is_a_publish_error_and_value_error() -> None:
    assert issubclass(EncodeError, PublishError)
    assert issubclass(EncodeError, ValueError)


def test_message_ids() -> None:
    first, second = new_message_id(), new_message_id()
    assert first != second
    assert len(first) == 32
    assert check_message_id("x" * MAX_MESSAGE_ID) == "x" * MAX_MESSAGE_ID


@pytest.mark.parametrize("bad", ["", "x" * (MAX_MESSAGE_ID + 1), "é" * 128, 42, None])
def test_bad_message_ids(bad: object) -> None:
    with pytest.raises(
        EncodeError, match="message_id must be a non-empty string of at most 255 bytes"
    ):
        check_message_id(bad)  # type: ignore[arg-type]


def test_prepare_sets_every_header(core: PublisherCore) -> None:
    before = int(datetime.now(UTC).timestamp() * 1000)
    out = core.prepare(
        {"order_id": 1}, "5m", queue="push", message_id="order-1", headers={"trace": "t1"}
    )
    after = int(datetime.now(UTC).timestamp() * 1000)
    assert out.exchange == "shop.v1.delay.5m"
    assert out.routing_key == "shop.v1.q.push"
    assert out.body == b'{"order_id":1}'
    assert out.content_type == JSON
    assert out.message_id == "order-1"
    assert out.mandatory is True
    assert before + 300_000 <= out.headers["rd-due-at"] <= after + 300_000  # type: ignore[operator]
    assert out.headers["rd-delay-ms"] == 300_000
    assert out.headers["rd-tier"] == "5m"
    assert out.headers["rd-attempt"] == 1
    assert out.headers["rd-target"] == "shop.v1.q.push"
    assert out.headers["trace"] == "t1"
    assert before // 1000 <= out.timestamp <= after // 1000


def test_prepare_generates_a_message_id(core: PublisherCore) -> None:
    first = core.prepare({"a": 1}, "5m", queue="push")
    second = core.prepare({"a": 1}, "5m", queue="push")
    assert first.message_id
    assert second.message_id
    assert first.message_id != second.message_id


def test_user_headers_cannot_override_ours(core: PublisherCore) -> None:
    out = core.prepare({"a": 1}, "5m", queue="push", headers={"rd-tier": "fake", "rd-attempt": 9})
    assert out.headers["rd-tier"] == "5m"
    assert out.headers["rd-attempt"] == 1


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"msg": {"a": 1}, "message_id": "x" * 256}, EncodeError),
        ({"msg": {"a": datetime(2024, 1, 1)}}, EncodeError),
        ({"msg": "text"}, EncodeError),
    ],
)
def test_prepare_refuses_bad_messages(
    core: PublisherCore, kwargs: dict[str, object], error: type
) -> None:
    with pytest.raises(error):
        core.prepare(tier="5m", queue="push", **kwargs)  # type: ignore[arg-type]


def test_strip_broker_headers() -> None:
    headers = {
        "x-death": [{}],
        "x-first-death-queue": "q",
        "x-last-death-reason": "expired",
        "x-delivery-count": 3,
        "x-delay": 5,
        "rd-attempt": 2,
        "custom": "kept",
    }
    assert strip_broker_headers(headers) == {"x-delay": 5, "rd-attempt": 2, "custom": "kept"}


def test_envelope_reads_headers_back(core: PublisherCore) -> None:
    out = core.prepare({"a": 1}, "5m", queue="push", message_id="m1")
    # the broker hands strings back as bytes with some clients
    delivered = {**out.headers, "rd-tier": b"5m", "rd-target": b"shop.v1.q.push"}
    env = Envelope.from_headers(out.message_id, delivered)
    assert env.message_id == "m1"
    assert env.attempt == 1
    assert env.tier == "5m"
    assert env.target == "shop.v1.q.push"
    assert env.due_at_ms == out.headers["rd-due-at"]
    assert env.lateness_ms(env.due_at_ms + 120) == 120  # type: ignore[operator]
    assert env.due_at is not None
    assert env.due_at.tzinfo is UTC


def test_envelope_without_headers() -> None:
    env = Envelope.from_headers(None, None)
    assert (env.attempt, env.tier, env.due_at_ms, env.due_at) == (1, None, None, None)
    assert env.lateness_ms(5) is None


def test_envelope_malformed_headers() -> None:
    with pytest.raises(DecodeError, match="malformed"):
        Envelope.from_headers("m", {"rd-attempt": "two"})
