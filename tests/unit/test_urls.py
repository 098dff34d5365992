"""URL redaction and the management endpoint derived from an AMQP URL."""

from __future__ import annotations

import pytest

from rabbit_delay._urls import (
    DEFAULT_URL,
    MANAGEMENT_URL_ENV,
    URL_ENV,
    broker_url,
    management_endpoint,
    management_endpoints,
    redact,
    vhost_of,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("amqp://guest:guest@127.0.0.1:5672/", "amqp://guest:***@127.0.0.1:5672/"),
        ("amqp://user:s3cret@127.0.0.1:1/", "amqp://user:***@127.0.0.1:1/"),
        ("amqps://svc:s3cret@rabbit.example:5671/%2F", "amqps://svc:***@rabbit.example:5671/%2F"),
        ("amqp://u:p%40ss%2Fw0rd@h/v", "amqp://u:***@h/v"),  # percent-encoded '@' and '/'
        ("amqp://u:p@ss@h/", "amqp://u:***@h/"),  # an unencoded '@' (pika accepts it)
        ("amqp://us@er:pw@h/", "amqp://us@er:***@h/"),
        ("amqp://u:pa:ss@h", "amqp://u:***@h"),
        ("amqp://:s3cret@h", "amqp://:***@h"),
        ("AMQPS://U:S3CRET@H", "AMQPS://U:***@H"),
        ("http://guest:s3cret@127.0.0.1:15672/api", "http://guest:***@127.0.0.1:15672/api"),
        ("amqp://u:s3cret@h?heartbeat=30", "amqp://u:***@h?heartbeat=30"),
        ("'amqp://u:s3cret@h'", "'amqp://u:***@h'"),
        ('{"url": "amqp://u:s3cret@h/"}', '{"url": "amqp://u:***@h/"}'),
    ],
)
def test_redact_every_url_form(text: str, expected: str) -> None:
    assert redact(text) == expected


def test_several_urls_in_one_line() -> None:
    line = (
        "cannot connect to amqp://a:pw1@h1:5672/ nor amqps://b:pw2@h2/%2F "
        "(tried 'amqp://c:pw3@h3',amqp://d:pw4@h4) via http://e:pw5@h5:15672"
    )
    redacted = redact(line)
    for secret in ("pw1", "pw2", "pw3", "pw4", "pw5"):
        assert secret not in redacted
    for user_host in ("a:***@h1", "b:***@h2", "c:***@h3", "d:***@h4", "e:***@h5"):
        assert user_host in redacted


@pytest.mark.parametrize(
    "text",
    [
        "amqp://127.0.0.1:5672/",
        "amqp://user@host/",
        "no url here: user:pass@host",
        "",
        "mailto:someone@example.com",
    ],
)
def test_nothing_to_redact(text: str) -> None:
    assert redact(text) == text


def test_redact_is_idempotent() -> None:
    once = redact("amqp://u:s3cret@h/")
    assert redact(once) == once


def test_broker_url_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(URL_ENV, raising=False)
    assert broker_url() == DEFAULT_URL
    monkeypatch.setenv(URL_ENV, "amqp://env:pw@envhost/")
    assert broker_url() == "amqp://env:pw@envhost/"
    assert broker_url("amqp://x:y@explicit/") == "amqp://x:y@explicit/"


@pytest.mark.parametrize(
    ("url", "vhost"),
    [
        ("amqp://h/", "/"),
        ("amqp://h", "/"),
        ("amqp://h/%2F", "/"),
        ("amqp://h/shop", "shop"),
        ("amqp://h/a%2Fb", "a/b"),
    ],
)
def test_vhost_of(url: str, vhost: str) -> None:
    assert vhost_of(url) == vhost


def test_management_endpoint_from_amqp(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(MANAGEMENT_URL_ENV, raising=False)
    ep = management_endpoint("amqp://user:p%40ss@rabbit:5672/shop")
    assert ep.base == "http://rabbit:15672"
    assert (ep.username, ep.password, ep.vhost) == ("user", "p@ss", "shop")
    assert ep.url("queues/shop") == "http://rabbit:15672/api/queues/shop"
    assert "p@ss" not in repr(ep)

    tls = management_endpoint("amqps://u:p@rabbit/%2F")
    assert tls.base == "https://rabbit:15671"
    assert tls.vhost_quoted == "%2F"

    ipv6 = management_endpoint("amqp://u:p@[::1]:5672/")
    assert ipv6.base == "http://[::1]:15672"

    default = management_endpoint("amqp://rabbit/")
    assert (default.username, default.password) == ("guest", "guest")


def test_management_endpoint_explicit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(MANAGEMENT_URL_ENV, raising=False)
    ep = management_endpoint("amqp://u:p@rabbit/", "http://127.0.0.1:1/")
    assert ep.base == "http://127.0.0.1:1"
    assert (ep.username, ep.password) == ("u", "p")
    other = management_endpoint("amqp://u:p@rabbit/", "https://admin:adm%21n@mgmt:443/rabbitmq/")
    assert other.base == "https://mgmt:443/rabbitmq"
    assert (other.username, other.password) == ("admin", "adm!n")
    monkeypatch.setenv(MANAGEMENT_URL_ENV, "http://fromenv:8080")
    assert management_endpoint("amqp://u:p@rabbit/").base == "http://fromenv:8080"


def test_management_candidates_follow_a_non_standard_amqp_port(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(MANAGEMENT_URL_ENV, raising=False)
    # 5673 -> 15673 first (Docker mappings, .ci/brokers.sh), then the standard port
    bases = [e.base for e in management_endpoints("amqp://u:p@rabbit:5673/v")]
    assert bases == ["http://rabbit:15673", "http://rabbit:15672"]
    assert [e.base for e in management_endpoints("amqp://u:p@rabbit:5672/v")] == [
        "http://rabbit:15672"
    ]
    assert [e.base for e in management_endpoints("amqps://u:p@rabbit:5676/v")] == [
        "https://rabbit:15676",
        "https://rabbit:15671",
    ]
    # a port that cannot take + 10000, or no number at all: the standard one only
    assert [e.base for e in management_endpoints("amqp://rabbit:60000/")] == ["http://rabbit:15672"]
    assert [e.base for e in management_endpoints("amqp://rabbit:x/")] == ["http://rabbit:15672"]
    # an explicit URL is the only candidate
    assert [e.base for e in management_endpoints("amqp://rabbit:5673/", "http://m:1/")] == [
        "http://m:1"
    ]
    assert management_endpoint("amqp://rabbit:5673/").base == "http://rabbit:15673"
