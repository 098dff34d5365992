"""TLS options: where they come from, that verification can never be turned off, and
what a failed handshake is called. (The handshakes themselves: tests/integration/test_tls.py.)"""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest

from rabbit_delay import ConfigError, TLSOptions
from rabbit_delay._tls import REFUSED_KEYS, describe_tls_error, split_tls
from rabbit_delay._urls import management_endpoints


def test_our_query_keys_leave_the_url_and_the_others_stay() -> None:
    clean, tls = split_tls(
        "amqps://u:p@rabbit:5671/%2F?heartbeat=30&cafile=/ca.pem&certfile=/c.pem&keyfile=/k.pem"
        "&server_name=rabbit.internal"
    )
    assert clean == "amqps://u:p@rabbit:5671/%2F?heartbeat=30"
    assert tls == TLSOptions("/ca.pem", "/c.pem", "/k.pem", "rabbit.internal")


def test_the_query_wins_over_options_per_key() -> None:
    options = TLSOptions(cafile="/settings-ca.pem", certfile="/settings-cert.pem")
    _, tls = split_tls("amqps://rabbit/?cafile=/url-ca.pem", options)
    assert tls == TLSOptions(cafile="/url-ca.pem", certfile="/settings-cert.pem")
    _, tls = split_tls("amqps://rabbit/", options)
    assert tls == options
    _, tls = split_tls("amqps://rabbit/")
    assert tls == TLSOptions()  # TLS with the system's CAs, verified


def test_a_plain_url_has_no_tls_and_refuses_tls_options() -> None:
    assert split_tls("amqp://rabbit/") == ("amqp://rabbit/", None)
    assert split_tls("amqp://rabbit/", TLSOptions()) == ("amqp://rabbit/", None)
    with pytest.raises(ConfigError, match=r"use amqps:// \(port 5671"):
        split_tls("amqp://rabbit/?cafile=/ca.pem")
    with pytest.raises(ConfigError, match="TLSOptions"):
        split_tls("amqp://rabbit/", TLSOptions(cafile="/ca.pem"))
    with pytest.raises(ConfigError, match=r"use https:// \(port 15671"):
        split_tls("http://rabbit:15672?cafile=/ca.pem")


@pytest.mark.parametrize("key", REFUSED_KEYS)
@pytest.mark.parametrize("scheme", ["amqps", "amqp", "https"])
def test_no_query_key_can_turn_verification_off(key: str, scheme: str) -> None:
    with pytest.raises(ConfigError, match="always verifies"):
        split_tls(f"{scheme}://rabbit/?{key}=1")


def test_every_context_verifies_the_certificate_and_the_host_name() -> None:
    for options in (TLSOptions(), TLSOptions(server_name="rabbit.internal")):
        context = options.context()
        assert context.verify_mode is ssl.CERT_REQUIRED
        assert context.check_hostname is True
        assert context.minimum_version >= ssl.TLSVersion.TLSv1_2


def test_files_that_cannot_be_used_are_named(tmp_path: Path) -> None:
    missing = str(tmp_path / "missing.pem")
    with pytest.raises(ConfigError, match=r"cannot read the CA file .*missing\.pem"):
        TLSOptions(cafile=missing).context()
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    with pytest.raises(ConfigError, match="CA file"):
        TLSOptions(cafile=str(garbage)).context()
    with pytest.raises(ConfigError, match="client certificate"):
        TLSOptions(certfile=str(garbage)).context()
    with pytest.raises(ConfigError, match="without certfile"):
        TLSOptions(keyfile=str(garbage)).context()


def _verify_error(message: str) -> ssl.SSLCertVerificationError:
    error = ssl.SSLCertVerificationError(1, f"[SSL: CERTIFICATE_VERIFY_FAILED] {message}")
    error.verify_message = message
    error.reason = "CERTIFICATE_VERIFY_FAILED"
    return error


def test_a_failed_verification_is_described_wherever_the_client_wrapped_it() -> None:
    inner = _verify_error("Hostname mismatch, certificate is not valid for 'rabbit'.")
    pika_like = RuntimeError("workflow failed", OSError("transport setup", inner))
    urllib_like = OSError("<urlopen error>")
    urllib_like.reason = inner  # type: ignore[attr-defined]
    try:
        raise ConnectionError("aiormq-like") from inner
    except ConnectionError as exc:
        aiormq_like = exc
    for wrapped in (inner, pika_like, urllib_like, aiormq_like):
        text = describe_tls_error(wrapped)
        assert text is not None
        assert "failed verification (Hostname mismatch" in text
        assert "cafile=" in text
        assert "server_name=" in text
    assert describe_tls_error(ConnectionRefusedError(111, "refused")) is None


def test_other_handshake_failures_say_what_to_fix() -> None:
    plain = ssl.SSLError(1, "[SSL: WRONG_VERSION_NUMBER] wrong version number")
    plain.reason = "WRONG_VERSION_NUMBER"
    assert "TLS listener (5671" in (describe_tls_error(plain) or "")
    required = ssl.SSLError(1, "[SSL: TLSV13_ALERT_CERTIFICATE_REQUIRED] alert")
    required.reason = "TLSV13_ALERT_CERTIFICATE_REQUIRED"
    assert "certfile= and keyfile=" in (describe_tls_error(required) or "")


def test_management_endpoints_take_the_tls_options_of_the_amqp_url(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("RABBIT_DELAY_MANAGEMENT_URL", raising=False)
    url = "amqps://u:p@rabbit:5671/%2F?cafile=/ca.pem&certfile=/c.pem&keyfile=/k.pem"
    [derived] = management_endpoints(url)
    assert derived.base == "https://rabbit:15671"
    assert derived.tls == TLSOptions("/ca.pem", "/c.pem", "/k.pem")
    assert not derived.explicit
    # an explicit https URL inherits them; its own query wins per key
    [explicit] = management_endpoints(url, "https://mgmt:443?cafile=/other.pem")
    assert explicit.base == "https://mgmt:443"
    assert explicit.tls == TLSOptions("/other.pem", "/c.pem", "/k.pem")
    assert explicit.explicit
    # plain http: nothing to verify, nothing inherited
    [plain] = management_endpoints(url, "http://mgmt:15672")
    assert plain.tls is None
    [amqp] = management_endpoints("amqp://u:p@rabbit/%2F")
    assert amqp.tls is None
    assert amqp.base == "http://rabbit:15672"
    with pytest.raises(ConfigError, match="always verifies"):
        management_endpoints(url, "https://mgmt:443?no_verify_ssl=1")
