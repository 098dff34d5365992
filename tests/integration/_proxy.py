"""A TCP proxy for fault tests: clients connect to `proxy.port`, every connection is
forwarded to an upstream address (a broker's AMQP port), and `cut_all()` drops every
connection at once, as a network cut would.

A cut RESETS both halves of every connection (SO_LINGER 0, then close: a TCP RST, not a
FIN): the client sees ECONNRESET at once instead of an orderly end of stream, and the
broker sees its peer vanish and releases what the connection held (unacked deliveries go
back to their queues, unconfirmed publishes are the client's problem). A silent
black-hole (packets dropped, no RST) would only be noticed by heartbeats, 60 s by
default: too slow for a test, and not what is tested here (reconnect and re-send).

The proxy keeps accepting after a cut, so clients can reconnect through it. It runs on
an asyncio loop in a thread of its own; `cut_all()` and `stop()` are thread-safe and
return once done. Use as a context manager:

    with CutProxy("127.0.0.1", node.port) as proxy:
        url = proxy.url_for(node.url)
        ...
        closed = proxy.cut_all()   # number of client connections cut
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self, TypeVar
from urllib.parse import urlsplit, urlunsplit

T = TypeVar("T")
_CHUNK = 65536
_LINGER_RST = struct.pack("ii", 1, 0)  # l_onoff=1, l_linger=0: close() sends RST


@dataclass(eq=False)  # hashed by identity: kept in a set
class _Pair:
    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close the socket under `writer` with an RST (no FIN, unsent data dropped)."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RST)
    writer.transport.abort()


class CutProxy:
    """Forwards 127.0.0.1:`port` to `upstream_host`:`upstream_port`; see module doc.

    Counters: `accepted` (client connections ever accepted), `cuts` (cut_all calls),
    `cut_connections` (client connections dropped by cuts), `refused` (clients dropped
    because the upstream did not answer), and `active` (connections open now).
    """

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.port = 0
        self.accepted = 0
        self.cuts = 0
        self.cut_connections = 0
        self.refused = 0
        self.cut_times: list[float] = []  # time.monotonic() of each cut
        self._pairs: set[_Pair] = set()
        self._loop: asyncio.AbstractEventLoop | None = None  # made by start()
        self._server: asyncio.Server | None = None
        self._thread = threading.Thread(target=self._run, name="cut-proxy", daemon=True)

    # -- public -------------------------------------------------------------------------

    @property
    def active(self) -> int:
        return len(self._pairs)

    def url_for(self, url: str) -> str:
        """`url` (an AMQP URL of the upstream) with its host and port replaced by the
        proxy's: the same credentials and vhost, through the proxy."""
        parts = urlsplit(url)
        userinfo = parts.netloc.rpartition("@")[0]
        netloc = f"{userinfo}@127.0.0.1:{self.port}" if userinfo else f"127.0.0.1:{self.port}"
        return urlunsplit(parts._replace(netloc=netloc))

    def start(self) -> Self:
        self._loop = asyncio.new_event_loop()
        self._thread.start()
        self._call(self._listen())
        return self

    def cut_all(self) -> int:
        """Reset every open connection, both halves, at once; the number of client
        connections cut. New connections are accepted as before."""
        return self._call(self._cut())

    def stop(self) -> None:
        loop = self._loop
        if loop is None or not self._thread.is_alive():
            return
        self._call(self._close())
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join(5)
        loop.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, _t: type[BaseException] | None, _e: BaseException | None, _tb: TracebackType | None
    ) -> None:
        self.stop()

    # -- the loop's side ------------------------------------------------------------------

    def _run(self) -> None:
        assert self._loop is not None
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._loop is None:
            raise RuntimeError("the proxy is not started: use it as a context manager")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=10)

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _cut(self) -> int:
        self.cuts += 1
        self.cut_times.append(time.monotonic())
        pairs, self._pairs = list(self._pairs), set()
        for pair in pairs:
            _reset(pair.client)
            _reset(pair.upstream)
            for task in pair.tasks:
                task.cancel()
        self.cut_connections += len(pairs)
        return len(pairs)

    async def _close(self) -> None:
        if self._server is not None:
            self._server.close()
        await self._cut()
        self.cuts -= 1  # closing is not a cut
        self.cut_times.pop()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        try:
            up_reader, up_writer = await asyncio.wait_for(
                asyncio.open_connection(*self.upstream), timeout=5
            )
        except (OSError, TimeoutError):
            self.refused += 1  # the client sees its connection reset, as with no broker
            _reset(writer)
            return
        pair = _Pair(writer, up_writer)
        self._pairs.add(pair)
        pair.tasks = [
            asyncio.create_task(self._pump(reader, up_writer, pair)),
            asyncio.create_task(self._pump(up_reader, writer, pair)),
        ]

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, pair: _Pair
    ) -> None:
        """Copy one direction until end of stream; then close both halves (FIN) so that
        an orderly close on one side is an orderly close on the other."""
        try:
            while data := await reader.read(_CHUNK):
                writer.write(data)
                await writer.drain()  # back-pressure: a peer that stops reading stops us
        except (OSError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:
            return  # cut: the sockets were already reset
        if pair in self._pairs:
            self._pairs.discard(pair)
            for w in (pair.client, pair.upstream):
                with contextlib.suppress(OSError, RuntimeError):
                    w.close()
