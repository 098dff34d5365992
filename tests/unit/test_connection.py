"""Connection settings (pure): URL lists, their validation, failover order, reconnect
backoff, and the words for a failed connection attempt."""

from __future__ import annotations

import itertools
import socket

import pytest

from rabbit_delay import ConfigError, ConnectionSettings, ReconnectBackoff, TLSOptions
from rabbit_delay._connection import (
    Cause,
    cause_of,
    describe_failure,
    failover_order,
    query_keys,
    unavailable_message,
)
from rabbit_delay._urls import DEFAULT_URL, URL_ENV, broker_url, broker_urls

A = "amqp://app:pw1@node-a:5672/shop"
B = "amqps://app:pw2@node-b:5671/shop?cafile=/etc/ca.pem"
C = "amqp://app:pw3@node-c/shop"


@pytest.fixture(autouse=True)
def no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(URL_ENV, raising=False)


# -- the URL list --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (A, (A,)),
        (f"{A},{B}", (A, B)),
        (f"{A} , {B},{C}", (A, B, C)),
        (f"  {A}\n{B}\t{C}  ", (A, B, C)),  # whitespace separates too
        ([A, B], (A, B)),
        ((f"{A},{B}", C), (A, B, C)),  # each repeated --url may hold a list itself
    ],
)
def test_several_urls_in_every_form(given: str | list[str], expected: tuple[str, ...]) -> None:
    assert broker_urls(given) == expected
    assert broker_url(given) == expected[0]


def test_not_given_falls_back_to_the_environment_then_the_local_broker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for nothing in (None, "", "   ", [], ()):
        assert broker_urls(nothing) == (DEFAULT_URL,)
    monkeypatch.setenv(URL_ENV, f"{A}, {B}")
    assert broker_urls(None) == (A, B)
    assert broker_url() == A
    assert broker_urls(C) == (C,)  # an explicit URL wins over the environment


@pytest.mark.parametrize(
    ("given", "words"),
    [
        (f"{A},,{B}", "empty entry"),
        (f"{A},", "empty entry"),
        (f",{A}", "empty entry"),
        ([A, ""], "empty entry"),
        ("http://app:pw1@node-a:15672/", "is not a broker URL"),
        ("node-a:5672", "is not a broker URL"),
        ("amqp:/node-a", "is not a broker URL"),
        ("amqp://app:pw1@node-a:56x2/", "not a valid URL"),
    ],
)
def test_a_bad_list_is_refused_without_its_password(given: str | list[str], words: str) -> None:
    with pytest.raises(ConfigError, match=words) as caught:
        broker_urls(given)
    assert "pw1" not in str(caught.value)


def test_a_bad_environment_variable_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(URL_ENV, "redis://u:pw1@h:6379")
    with pytest.raises(ConfigError, match=rf"\${URL_ENV}") as caught:
        broker_urls(None)
    assert "pw1" not in str(caught.value)


def test_query_keys() -> None:
    assert query_keys(B) == {"cafile"}
    assert query_keys(A) == frozenset()


# -- settings ---------------------------------------------------------------------------------


def test_settings_take_a_list_in_one_string_and_resolve_in_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = ConnectionSettings(urls=f"{A},{B}")  # type: ignore[arg-type]
    assert settings.urls == (A, B)
    assert settings.resolve(None) == (A, B)
    assert settings.resolve(C) == (C,)  # an explicit url= wins
    assert settings.resolve([C, A]) == (C, A)
    monkeypatch.setenv(URL_ENV, C)
    assert ConnectionSettings().resolve(None) == (C,)  # no URLs in the settings: the env
    assert ConnectionSettings().blocked_timeout_s == 30.0


@pytest.mark.parametrize(
    "bad",
    [
        {"heartbeat_s": -1},
        {"connect_timeout_s": 0},
        {"blocked_timeout_s": -5},
        {"urls": ("amqp://a", "")},
        {"urls": ("ftp://a",)},
    ],
)
def test_settings_refuse_bad_values(bad: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        ConnectionSettings(**bad)  # type: ignore[arg-type]


def test_settings_are_frozen_and_carry_tls() -> None:
    settings = ConnectionSettings(tls=TLSOptions(cafile="/etc/ca.pem"))
    assert settings.tls is not None
    assert settings.tls.cafile == "/etc/ca.pem"
    with pytest.raises(AttributeError):
        settings.heartbeat_s = 5  # type: ignore[misc]


# -- failover and backoff ------------------------------------------------------------------


def test_after_a_loss_the_next_nodes_come_first_and_the_lost_one_last() -> None:
    urls = (A, B, C)
    assert failover_order(urls, A) == (B, C, A)
    assert failover_order(urls, B) == (C, A, B)
    assert failover_order(urls, C) == (A, B, C)
    assert failover_order(urls, None) == urls
    assert failover_order(urls, "amqp://elsewhere/") == urls
    assert failover_order((A,), A) == (A,)


def test_backoff_doubles_up_to_its_maximum() -> None:
    delays = ReconnectBackoff(initial_s=0.25, max_s=2.0, jitter=0).delays()
    assert list(itertools.islice(delays, 6)) == [0.25, 0.5, 1.0, 2.0, 2.0, 2.0]


def test_backoff_jitter_stays_within_its_spread_and_under_the_maximum() -> None:
    low = ReconnectBackoff(initial_s=1.0, max_s=4.0, jitter=0.5).delays(rand=lambda: 0.0)
    high = ReconnectBackoff(initial_s=1.0, max_s=4.0, jitter=0.5).delays(rand=lambda: 0.999999)
    assert [round(d, 3) for d in itertools.islice(low, 4)] == [0.5, 1.0, 2.0, 2.0]
    assert [round(d, 3) for d in itertools.islice(high, 4)] == [1.5, 3.0, 4.0, 4.0]
    spread = ReconnectBackoff(initial_s=1.0, max_s=8.0, jitter=0.2).delays()
    first = [next(spread) for _ in range(3)]
    assert 0.8 <= first[0] <= 1.2
    assert 1.6 <= first[1] <= 2.4


@pytest.mark.parametrize(
    "bad",
    [
        {"initial_s": 0},
        {"initial_s": 5, "max_s": 1},
        {"jitter": 1.0},
        {"jitter": -0.1},
    ],
)
def test_backoff_refuses_a_bad_range(bad: dict[str, float]) -> None:
    with pytest.raises(ConfigError, match="backoff"):
        ReconnectBackoff(**bad)


# -- why an attempt failed ---------------------------------------------------------------------


def test_each_url_is_named_with_its_own_reason() -> None:
    refused = ConnectionRefusedError(111, "Connection refused")
    unknown = socket.gaierror(-2, "Name or service not known")
    line = unavailable_message([(A, refused), (C, unknown)])
    assert line.startswith("cannot connect to any of 2 brokers: ")
    assert "amqp://app:***@node-a:5672/shop: nothing is listening on node-a:5672" in line
    assert "amqp://app:***@node-c/shop: cannot resolve the host name 'node-c'" in line
    assert "pw1" not in line
    assert "pw3" not in line
    assert "\n" not in line
    single = unavailable_message([(A, refused)])
    assert single.startswith("cannot connect to amqp://app:***@node-a:5672/shop: nothing is")


def test_an_unknown_cause_keeps_the_detail_redacted() -> None:
    odd = ValueError("odd thing at amqp://app:pw1@node-a/")
    assert cause_of(odd) is None
    said = describe_failure(A, odd)
    assert "odd thing" in said
    assert "pw1" not in said


def test_a_timeout_and_a_default_port() -> None:
    assert cause_of(TimeoutError("timed out")) is Cause.TIMEOUT
    assert "node-c:5672" in describe_failure(C, TimeoutError())
    tls_default = "amqps://app:pw@node-d/"
    assert "node-d:5671" in describe_failure(tls_default, ConnectionRefusedError(111, "x"))


def test_a_server_that_speaks_no_amqp_is_named() -> None:
    said = describe_failure(A, EOFError("0 bytes read"))
    assert cause_of(EOFError()) is Cause.PROTOCOL
    assert "node-a:5672 closed the connection without speaking AMQP" in said


def test_the_aio_context_checks_server_name_instead_of_the_host() -> None:
    """aio-pika passes the URL's host to the context; with server_name the certificate
    is checked against that name instead (pika takes it as SSLOptions' server_hostname)."""
    import ssl

    from rabbit_delay._aio.connection import tls_context

    plain = tls_context(TLSOptions())
    named = tls_context(TLSOptions(server_name="rabbit.internal"))
    bio = ssl.MemoryBIO
    assert plain.wrap_bio(bio(), bio(), server_hostname="10.0.0.5").server_hostname == "10.0.0.5"
    checked = named.wrap_bio(bio(), bio(), server_hostname="10.0.0.5")
    assert checked.server_hostname == "rabbit.internal"
    assert named.verify_mode is ssl.CERT_REQUIRED
    assert named.check_hostname
