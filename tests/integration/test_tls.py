"""TLS end to end, on one scratch node of the broker-under-test's version with a TLS
listener (AMQP and the management API), certificates made by `openssl` (`_certs.py`).

Shown: `amqps://...?cafile=CA` declares, publishes and consumes with both transports; a
certificate signed by another CA, one for another host name, and a server the client's
CA never signed are refused with one clear error (BrokerUnavailable saying the
certificate failed verification: no client-library class, no fallback to an unverified
connection); a client certificate and key given in the URL are presented (the broker
asks for one); the management API over https is verified with the same CA and client
certificate as the AMQP URL.

The node: `ssl_options.verify = verify_peer` (a client certificate is checked when
given, not required) on AMQP; the management listener REQUIRES a client certificate
(`fail_if_no_peer_cert`), so mutual TLS is shown on one node.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import ssl
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest
from conftest import unique_namespace, wait_for
from typer.testing import CliRunner

from rabbit_delay import (
    App,
    BrokerUnavailable,
    ConfigError,
    ConnectionSettings,
    HandlerContext,
    RabbitDelayError,
    TLSOptions,
    Topology,
    aio,
    topology_from_dict,
)
from rabbit_delay._cli.app import app as cli_app
from rabbit_delay._io.management import checked, read_queue_counts
from rabbit_delay._urls import management_endpoints
from rabbit_delay.stores import MemoryStore
from rabbit_delay.sync import Publisher, broker_info, connect, connected, declare

from ._certs import Pki, make_pki
from ._scratch_node import ScratchNode, _free_base_port, _port_free, scratch_kind, started_node
from .workers.harness import RunningWorker

# One node per module and xdist worker; under `--dist loadgroup` one for the whole run.
pytestmark = [pytest.mark.integration, pytest.mark.scratch, pytest.mark.xdist_group("tls-node")]

QUEUE = "orders.cancel"
TLS_OFFSET = 5  # amqps on node port + 5, management https on node port + 10005
CLIENT_CN = "rd-client"


def node_root(kind: str) -> str:
    """Where brokers.sh keeps the Debian root a 4.x node runs in ("" for the host's own
    rabbitmq-server): the node reads its certificates from inside it, as its own uid."""
    if kind == "host":
        return ""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    base = os.environ.get("RD_BROKERS_DIR") or os.path.join(cache, "rabbit-delay", "brokers")
    return os.path.join(base, f"rabbitmq-{kind}", "root")


@dataclass(frozen=True)
class TLSNode:
    node: ScratchNode
    pki: Pki  # paths as this process sees them
    amqps_port: int
    https_port: int

    def url(self, **query: object) -> str:
        tail = f"?{urlencode({k: str(v) for k, v in query.items()})}" if query else ""
        return f"amqps://guest:guest@127.0.0.1:{self.amqps_port}/%2F{tail}"

    def trusted(self, **extra: object) -> str:
        """The URL with the right CA (and `extra` query keys)."""
        return self.url(cafile=self.pki.ca, **extra)

    def mutual(self) -> str:
        """The URL with the right CA and our client certificate."""
        return self.trusted(certfile=self.pki.client, keyfile=self.pki.client_key)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def _tls_ports() -> int:
    while True:
        port = _free_base_port()
        if _port_free(port + TLS_OFFSET) and _port_free(port + 10000 + TLS_OFFSET):
            return port


@pytest.fixture(scope="module")
def tls(broker_url: str, pki: Pki) -> Iterator[TLSNode]:
    """One TLS scratch node for the module (per xdist worker)."""
    kind = scratch_kind(broker_url)
    name = f"tls{uuid.uuid4().hex[:8]}"
    root = node_root(kind)
    certs = Path(f"{root}/tmp/rd-tls-{name}")
    inside = pki.copy_to(certs).relocated(root)
    port = _tls_ports()
    amqps, https = port + TLS_OFFSET, port + 10000 + TLS_OFFSET
    conf = [
        f"listeners.ssl.1 = 127.0.0.1:{amqps}",
        f"ssl_options.cacertfile = {inside.ca}",
        f"ssl_options.certfile = {inside.server}",
        f"ssl_options.keyfile = {inside.server_key}",
        "ssl_options.verify = verify_peer",
        "ssl_options.fail_if_no_peer_cert = false",
        f"management.ssl.port = {https}",
        "management.ssl.ip = 127.0.0.1",
        f"management.ssl.cacertfile = {inside.ca}",
        f"management.ssl.certfile = {inside.server}",
        f"management.ssl.keyfile = {inside.server_key}",
        "management.ssl.verify = verify_peer",
        "management.ssl.fail_if_no_peer_cert = true",
    ]
    try:
        with started_node(kind, name=name, port=port, management=True, conf=conf) as node:
            yield TLSNode(node, pki, amqps, https)
    finally:
        shutil.rmtree(certs, ignore_errors=True)


def _topology() -> Topology:
    return topology_from_dict(
        {"namespace": unique_namespace(), "tiers": {"1s": "1s"}, "queues": {QUEUE: {}}}
    )


def _consume_one(kind: str, topology: Topology, url: str) -> list[str]:
    """Run the `kind` worker on `url` until it handled one message; the ids it handled."""
    got: list[str] = []

    def handle(_message: Any, ctx: HandlerContext) -> None:
        got.append(ctx.message_id)

    async def handle_async(message: Any, ctx: HandlerContext) -> None:
        handle(message, ctx)

    app = App(topology, store=MemoryStore())
    app.add_consumer(QUEUE, handle if kind == "sync" else handle_async)
    worker = RunningWorker(kind, app, url).start()
    try:
        wait_for(lambda: got, 20, f"the {kind} worker to handle the message over TLS")
    finally:
        worker.stop()
    return got


# -- connecting -------------------------------------------------------------------------------


def test_amqps_with_the_ca_declares_publishes_and_consumes_sync(tls: TLSNode) -> None:
    topology = _topology()
    url = tls.trusted()
    with connected(url, name="rd-test tls declare") as connection:
        assert broker_info(connection).version is not None
        report = declare(connection, topology)
    assert report.changed
    with Publisher(topology, url) as publisher:
        message_id = publisher.publish_delayed({"n": 1}, "1s", queue=QUEUE)
    assert _consume_one("sync", topology, url) == [message_id]


def test_amqps_with_the_ca_declares_publishes_and_consumes_async(tls: TLSNode) -> None:
    topology = _topology()
    url = tls.trusted()

    async def declare_and_publish() -> str:
        connection = await aio.connect(url, name="rd-test tls declare")
        try:
            report = await aio.declare(connection, topology)
            assert report.changed
        finally:
            await connection.close()
        async with aio.AsyncPublisher(topology, url) as publisher:
            return await publisher.publish_delayed({"n": 2}, "1s", queue=QUEUE)

    message_id = asyncio.run(declare_and_publish())
    assert _consume_one("async", topology, url) == [message_id]


class WrongHostServer:
    """A TLS server on a free loopback port presenting a certificate signed by the right
    CA for another host name (wrong.example): only the handshake matters."""

    def __init__(self, pki: Pki) -> None:
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.context.load_cert_chain(pki.wrong_host, pki.wrong_host_key)
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.sock.settimeout(0.2)
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            try:
                conn.settimeout(5)
                with self.context.wrap_socket(conn, server_side=True):
                    pass  # the client refuses the certificate before anything else
            except (ssl.SSLError, OSError):
                pass
            finally:
                conn.close()

    def __enter__(self) -> WrongHostServer:
        self.thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self.thread.join(5)
        self.sock.close()


def _refusal(connect_to: Callable[[], object]) -> BrokerUnavailable:
    with pytest.raises(RabbitDelayError) as caught:
        connect_to()
    error = caught.value
    assert type(error) is BrokerUnavailable, repr(error)
    text = str(error)
    for client_class in ("pika", "aiormq", "aio_pika", "SSLCertVerificationError", "Traceback"):
        assert client_class not in text, text
    return error


def _both_refuse(url: str) -> list[str]:
    """Connect with both transports; both must be refused. Their messages."""

    async def connect_async() -> None:
        connection = await aio.connect(url, name="rd-test tls refused")
        await connection.close()  # not reached when refused

    sync_error = _refusal(lambda: connect(url, name="rd-test tls refused").close())
    async_error = _refusal(lambda: asyncio.run(connect_async()))
    return [str(sync_error), str(async_error)]


def test_a_certificate_that_fails_verification_is_refused_with_a_clear_error(
    tls: TLSNode,
) -> None:
    # OpenSSL's words for a chain it cannot trust (the broker sends its CA along or not)
    untrusted = ("self-signed certificate in certificate chain", "unable to get local issuer")
    cases = {
        # the broker's certificate, but the client trusts another CA only
        "other CA": (tls.url(cafile=tls.pki.other_ca), untrusted),
        # no cafile: the system's trust store, which never signed a test CA
        "system CAs": (tls.url(), untrusted),
        # the broker's certificate is for 127.0.0.1/localhost, checked as another name
        "host name": (tls.trusted(server_name="wrong.example"), ("hostname mismatch",)),
    }
    for case, (url, details) in cases.items():
        for message in _both_refuse(url):
            assert "failed verification" in message, (case, message)
            assert any(d in message.lower() for d in details), (case, message)
            assert "guest:guest" not in message  # the URL is redacted
    # a server presenting a certificate of the right CA, issued for another host
    with WrongHostServer(tls.pki) as server:
        url = f"amqps://guest:guest@127.0.0.1:{server.port}/%2F?cafile={tls.pki.ca}"
        for message in _both_refuse(url):
            assert "failed verification" in message, message
            assert "address mismatch" in message.lower(), message  # an IP in the URL


def test_the_cli_reports_a_refused_certificate_in_one_line(tls: TLSNode, tmp_path: Path) -> None:
    path = tmp_path / "t.toml"
    path.write_text(f'namespace = "{unique_namespace()}"\n[tiers]\n1s = "1s"\n[queues.q]\n')
    result = CliRunner().invoke(
        cli_app, ["plan", str(path), "--url", tls.url(cafile=tls.pki.other_ca)]
    )
    assert result.exit_code == 1, result.output
    assert "failed verification" in result.output
    assert "Traceback" not in result.output
    assert "guest:guest" not in result.output


def test_verification_can_never_be_turned_off(tls: TLSNode) -> None:
    for key in ("no_verify_ssl", "ssl_options", "verify"):
        with pytest.raises(ConfigError, match="always verifies"):
            connect(tls.url(**{key: "1"}))


def test_tls_options_in_the_settings_work_like_the_query_which_wins(tls: TLSNode) -> None:
    pki = tls.pki
    good = ConnectionSettings(
        tls=TLSOptions(cafile=str(pki.ca), certfile=str(pki.client), keyfile=str(pki.client_key))
    )
    wrong_ca = ConnectionSettings(tls=TLSOptions(cafile=str(pki.other_ca)))

    async def connect_async(url: str, settings: ConnectionSettings) -> None:
        connection = await aio.connect(url, name="rd-test tls settings", settings=settings)
        await connection.close()

    for url, settings in ((tls.url(), good), (tls.trusted(), wrong_ca)):
        connect(url, name="rd-test tls settings", settings=settings).close()
        asyncio.run(connect_async(url, settings))
    with pytest.raises(BrokerUnavailable, match="failed verification"):
        connect(tls.url(), name="rd-test tls settings", settings=wrong_ca)


# -- client certificates (mutual TLS) ---------------------------------------------------------


def _peer_subjects(tls: TLSNode) -> str:
    return tls.node.ctl("-q", "list_connections", "peer_cert_subject")


def test_a_client_certificate_from_the_url_is_presented_by_both_transports(tls: TLSNode) -> None:
    url = tls.mutual()
    connection = connect(url, name="rd-test tls client cert")
    try:
        wait_for(lambda: CLIENT_CN in _peer_subjects(tls), 10, "the sync client's certificate")
    finally:
        connection.close()

    async def check_async() -> None:
        aconnection = await aio.connect(url, name="rd-test tls client cert async")
        try:
            seen = await asyncio.to_thread(
                wait_for, lambda: CLIENT_CN in _peer_subjects(tls), 10, "the async client's cert"
            )
            assert seen
        finally:
            await aconnection.close()

    asyncio.run(check_async())

    # a client certificate the broker's CA did not sign: the broker refuses the handshake
    foreign = tls.trusted(certfile=tls.pki.foreign_client, keyfile=tls.pki.foreign_client_key)
    sync_message, async_message = _both_refuse(foreign)
    # (TLS 1.3: the broker's alert may be lost in the close; then the message says the
    # broker most likely refused it)
    assert "refused our client certificate" in sync_message, sync_message
    # asyncio loses TLS 1.3's alert, sent after the client finished its handshake: the
    # broker's refusal reaches aio-pika as a reset connection
    assert "client certificate" in async_message or "reset" in async_message, async_message
    # an encrypted key: a clear ConfigError, never a passphrase prompt
    encrypted = tls.trusted(certfile=tls.pki.client, keyfile=tls.pki.client_key_encrypted)
    with pytest.raises(ConfigError, match="unencrypted key"):
        connect(encrypted)


# -- the management API over https --------------------------------------------------------------


def test_the_management_api_over_https_uses_the_ca_and_client_certificate_of_the_url(
    tls: TLSNode,
) -> None:
    url = tls.mutual()
    with connected(url, name="rd-test tls management") as connection:
        info = broker_info(connection)
    endpoints = management_endpoints(url)
    # derived from the amqps port: https on port + 10000, with the URL's TLS options
    assert endpoints[0].base == f"https://127.0.0.1:{tls.https_port}"
    access = checked(endpoints, info)
    assert access.endpoint is not None, access.note
    assert read_queue_counts(access.endpoint, "nothing-here.") == {}

    # The management listener requires a client certificate: without one, the API is
    # not used, and the note says why (passive declares instead, never unverified).
    access = checked(management_endpoints(tls.trusted()), info)
    assert access.endpoint is None
    assert "client certificate" in access.note, access.note
    # A management URL whose own query names another CA: refused, said so.
    other = f"https://127.0.0.1:{tls.https_port}?cafile={tls.pki.other_ca}"
    access = checked(management_endpoints(url, other), info)
    assert access.endpoint is None
    assert "failed verification" in access.note, access.note


def test_plan_and_status_read_the_management_api_over_https(tls: TLSNode, tmp_path: Path) -> None:
    namespace = unique_namespace()
    path = tmp_path / "t.toml"
    path.write_text(f'namespace = "{namespace}"\n[tiers]\n1s = "1s"\n[queues.q]\n')
    url = tls.mutual()
    runner = CliRunner()
    declared = runner.invoke(cli_app, ["declare", str(path), "--url", url])
    assert declared.exit_code == 0, declared.output
    planned = runner.invoke(cli_app, ["plan", str(path), "--url", url])
    assert planned.exit_code == 0, planned.output
    assert f"read via management API at https://127.0.0.1:{tls.https_port}" in planned.output
    status = runner.invoke(cli_app, ["status", str(path), "--url", url, "--json"])
    assert status.exit_code == 0, status.output
    assert '"management_api": "ok"' in status.output
