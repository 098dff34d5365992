"""Durations: text, timedelta and numbers become whole milliseconds, rounded up."""

from __future__ import annotations

from datetime import timedelta

import pytest

from rabbit_delay import ConfigError, DurationError
from rabbit_delay._durations import MAX_TTL_MS, format_ms, parse_ms, parse_positive_ms


@pytest.mark.parametrize(
    ("text", "ms"),
    [
        ("5m", 300_000),
        ("30m", 1_800_000),
        ("2h", 7_200_000),
        ("90s", 90_000),
        ("1s", 1_000),
        ("500ms", 500),
        ("1h30m", 5_400_000),
        ("1d", 86_400_000),
        ("1m30s", 90_000),
        ("1s500ms", 1_500),
        ("1.5s", 1_500),
        (" 2H ", 7_200_000),
        ("1h 30m", 5_400_000),
        ("0s", 0),
    ],
)
def test_text(text: str, ms: int) -> None:
    assert parse_ms(text) == ms


@pytest.mark.parametrize(
    ("value", "ms"),
    [
        (timedelta(minutes=5), 300_000),
        (timedelta(hours=1, minutes=30), 5_400_000),
        (timedelta(milliseconds=250), 250),
        (90, 90_000),
        (1.5, 1_500),
        (0, 0),
    ],
)
def test_timedelta_and_seconds(value: timedelta | float, ms: int) -> None:
    assert parse_ms(value) == ms


@pytest.mark.parametrize(
    ("value", "ms"),
    [
        ("1.5ms", 2),
        ("0.0001s", 1),
        (timedelta(microseconds=1), 1),
        (timedelta(microseconds=1_001), 2),
        (0.0004, 1),
        (1.0001, 1_001),
        (0.3, 300),  # 0.3 * 1000 is 300.00000000000006 in binary floating point: not 301
        ("1.1s", 1_100),
    ],
)
def test_fractions_round_up_never_down(value: str | float | timedelta, ms: int) -> None:
    assert parse_ms(value) == ms


@pytest.mark.parametrize("value", [-1, -0.5, timedelta(seconds=-1), "-3s", "-1h30m"])
def test_negative_refused_and_said_so(value: object) -> None:
    with pytest.raises(DurationError, match="negative"):
        parse_ms(value)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "value",
    ["", "5", "5x", "m5", "1e3s", "1s-", "five minutes", "1h30", "ms", "1..5s", "∞s"],
)
def test_garbage_refused_with_the_accepted_forms(value: str) -> None:
    with pytest.raises(DurationError) as info:
        parse_ms(value)
    message = str(info.value)
    assert repr(value) in message
    assert "'5m'" in message
    assert "timedelta" in message


@pytest.mark.parametrize("value", [True, None, [1], float("nan"), float("inf"), object()])
def test_non_durations_refused(value: object) -> None:
    with pytest.raises(DurationError, match="duration"):
        parse_ms(value)  # type: ignore[arg-type]


def test_duration_error_is_a_config_error_and_a_value_error() -> None:
    with pytest.raises(ValueError, match="not a duration"):
        parse_ms("soon")
    assert issubclass(DurationError, ConfigError)


def test_positive_bounds() -> None:
    assert parse_positive_ms("1ms") == 1
    assert parse_positive_ms(timedelta(milliseconds=MAX_TTL_MS)) == MAX_TTL_MS
    with pytest.raises(DurationError, match="longer than zero"):
        parse_positive_ms("0s")
    with pytest.raises(DurationError, match=r"longer than the maximum 49d17h2m47s295ms"):
        parse_positive_ms("50d")
    with pytest.raises(DurationError, match="32-bit"):
        parse_positive_ms(MAX_TTL_MS / 1000 + 0.001)
    with pytest.raises(DurationError, match="longer than the maximum 1m"):
        parse_positive_ms("2m", maximum=60_000)


@pytest.mark.parametrize(
    ("ms", "text"),
    [
        (0, "0s"),
        (500, "500ms"),
        (1_500, "1s500ms"),
        (300_000, "5m"),
        (5_400_000, "1h30m"),
        (86_400_000, "1d"),
    ],
)
def test_format_round_trips(ms: int, text: str) -> None:
    assert format_ms(ms) == text
    assert parse_ms(text) == ms
