"""The broker's version and what it really does: pure rules, one place."""

from __future__ import annotations

import pytest

from rabbit_delay._broker import UNKNOWN, BrokerInfo, normalise_queue_arguments, parse_version


@pytest.mark.parametrize(
    ("text", "version"),
    [
        ("3.10.8", (3, 10, 8)),
        ("4.3.6", (4, 3, 6)),
        ("4.0", (4, 0, 0)),
        ("3.13.0-rc.1", (3, 13, 0)),
        (" 4.1.2+12.gabc ", (4, 1, 2)),
        ("", None),
        ("unknown", None),
    ],
)
def test_parse_version(text: str, version: tuple[int, int, int] | None) -> None:
    assert parse_version(text) == version


def props(version: str, **extra: object) -> dict[str, object]:
    return {"product": "RabbitMQ", "version": version, "cluster_name": "rabbit@a", **extra}


def test_from_server_properties_reads_text_and_bytes() -> None:
    info = BrokerInfo.from_server_properties(
        {"product": b"RabbitMQ", "version": b"4.3.6", "cluster_name": b"c1", "platform": "OTP"}
    )
    assert (info.product, info.version, info.cluster_name) == ("RabbitMQ", (4, 3, 6), "c1")
    assert info.describe() == "RabbitMQ 4.3.6 (cluster c1, OTP)"
    assert BrokerInfo.from_server_properties(None).version is None
    assert "version unknown" in UNKNOWN.describe()


@pytest.mark.parametrize(
    ("version", "nack_counts", "plugin", "delayed_retry", "cancels"),
    [
        ("3.10.8", True, True, False, False),
        ("3.13.7", True, True, False, False),
        ("4.0.5", True, True, False, False),
        ("4.2.1", True, True, False, False),
        ("4.3.0", False, False, True, True),
        ("4.3.6", False, False, True, True),
        ("5.0.0", False, False, True, True),
        ("garbage", True, True, False, False),  # unknown: the conservative side
    ],
)
def test_version_rules(
    version: str, nack_counts: bool, plugin: bool, delayed_retry: bool, cancels: bool
) -> None:
    info = BrokerInfo.from_server_properties(props(version))
    assert info.nack_requeue_counts is nack_counts
    assert info.supports_plugin is plugin
    assert info.supports_delayed_retry is delayed_retry
    assert info.cancels_timed_out_quorum_consumers is cancels


def test_at_least() -> None:
    info = BrokerInfo.from_server_properties(props("4.0.5"))
    assert info.at_least(4)
    assert info.at_least(3, 13)
    assert not info.at_least(4, 1)
    assert not UNKNOWN.at_least(0)


def test_classic_queue_type_is_made_explicit_on_both_sides() -> None:
    # 4.x records x-queue-type=classic on a classic queue declared without it
    assert normalise_queue_arguments({}) == normalise_queue_arguments({"x-queue-type": "classic"})
    assert normalise_queue_arguments({"x-queue-type": "quorum"}) == {"x-queue-type": "quorum"}
    assert normalise_queue_arguments({"x-message-ttl": 5}) == {
        "x-queue-type": "classic",
        "x-message-ttl": 5,
    }


@pytest.mark.parametrize(
    ("version", "limit"), [("3.10.8", None), ("3.13.7", None), ("4.0.5", 20), ("4.3.6", 20)]
)
def test_default_delivery_limit(version: str, limit: int | None) -> None:
    # 4.0 gave every quorum queue declared without x-delivery-limit a limit of 20
    assert BrokerInfo.from_server_properties(props(version)).default_delivery_limit == limit
    assert UNKNOWN.default_delivery_limit == 20  # unknown: assume the limit
