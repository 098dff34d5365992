"""The fault tests' TCP proxy (tests/integration/_proxy.py) against a plain echo server:
it forwards both ways, a cut resets every connection on both sides at once, and it keeps
accepting afterwards. Pure sockets, no broker."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from integration._proxy import CutProxy


class EchoServer:
    """Echoes every connection on a thread each; records how each one ended."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.endings: list[str] = []  # "eof" or "reset", one per finished connection
        self._lock = threading.Lock()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    def _echo(self, conn: socket.socket) -> None:
        ending = "eof"
        with conn:
            try:
                while data := conn.recv(65536):
                    conn.sendall(data)
            except ConnectionResetError:
                ending = "reset"
        with self._lock:
            self.endings.append(ending)

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def echo() -> Iterator[EchoServer]:
    server = EchoServer()
    yield server
    server.close()


def roundtrip(sock: socket.socket, data: bytes) -> bytes:
    sock.sendall(data)
    got = b""
    while len(got) < len(data):
        chunk = sock.recv(65536)
        if not chunk:
            break
        got += chunk
    return got


def wait_until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_forwards_both_ways_and_a_cut_resets_every_connection(echo: EchoServer) -> None:
    with CutProxy("127.0.0.1", echo.port) as proxy:
        clients = [socket.create_connection(("127.0.0.1", proxy.port), timeout=5) for _ in range(3)]
        big = bytes(range(256)) * 4096  # 1 MiB: more than one read, back-pressure included
        for c in clients:
            assert roundtrip(c, b"hello") == b"hello"
        assert roundtrip(clients[0], big) == big
        wait_until(lambda: proxy.active == 3)

        assert proxy.cut_all() == 3
        assert (proxy.cuts, proxy.cut_connections, proxy.active) == (1, 3, 0)
        for c in clients:  # the client side: reset, not an orderly end of stream
            with pytest.raises(ConnectionResetError):
                c.recv(10)
            c.close()
        wait_until(lambda: len(echo.endings) == 3)
        assert echo.endings == ["reset"] * 3  # the upstream side too

        again = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
        assert roundtrip(again, b"after the cut") == b"after the cut"
        assert proxy.accepted == 4
        again.close()  # an orderly close passes through as one
        wait_until(lambda: len(echo.endings) == 4)
        assert echo.endings[-1] == "eof"
        wait_until(lambda: proxy.active == 0)
        assert proxy.cut_all() == 0


def test_a_client_of_a_dead_upstream_is_reset_and_counted() -> None:
    with socket.create_server(("127.0.0.1", 0)) as placeholder:
        port = placeholder.getsockname()[1]
    with CutProxy("127.0.0.1", port) as proxy:  # nothing listens there any more
        # on loopback the reset may even beat connect() returning
        with (
            pytest.raises(ConnectionResetError),
            socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as client,
        ):
            assert client.recv(10) == b"", "closed without a reset"
        assert (proxy.accepted, proxy.refused, proxy.active) == (1, 1, 0)


def test_url_for_keeps_credentials_and_vhost() -> None:
    proxy = CutProxy("127.0.0.1", 5672)
    proxy.port = 40000
    assert proxy.url_for("amqp://u:p@127.0.0.1:6123/%2F?heartbeat=5") == (
        "amqp://u:p@127.0.0.1:40000/%2F?heartbeat=5"
    )
    assert proxy.url_for("amqp://broker/v") == "amqp://127.0.0.1:40000/v"
