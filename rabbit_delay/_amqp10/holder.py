"""A holder of the [held] backend: an AMQP 1.0 consumer of the holding queue that settles
each delivery as `rabbit_delay._held.rules.decide` says. I/O: python-qpid-proton.

    holder = Holder(topology, ["amqp://guest:guest@node1:5672/"])
    holder.start()   # a thread of its own; or holder.run() to block
    ...
    holder.stop()

It reconnects after a lost connection, to the next URL first (`failover_order`), with the
waits of its `ReconnectBackoff`; it stops with the project's error when reconnecting
cannot help (access refused, no holding queue, a broker without AMQP 1.0 or before 4.3).
Several holders may run at once (in several processes or machines): the queue hands
each delivery to one of them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from proton import Condition, Connection, Disposition, SSLDomain, symbol
from proton.handlers import MessagingHandler
from proton.reactor import Container

from rabbit_delay._amqp10.errors import condition_error, fatal, mapped
from rabbit_delay._broker import BrokerInfo
from rabbit_delay._connection import ReconnectBackoff, failover_order
from rabbit_delay._errors import ConfigError, IncompatibleBroker, RabbitDelayError
from rabbit_delay._held.rules import (
    DEFAULT_CREDIT,
    DELIVERY_TIME,
    Endpoint,
    Hold,
    Release,
    decide,
    endpoint_of,
    holding_address,
)
from rabbit_delay._tls import TLSOptions, split_tls
from rabbit_delay._topology.model import Topology
from rabbit_delay._urls import redact

log = logging.getLogger("rabbit_delay.hold")

# How often the event loop looks at a stop asked from another thread.
_STOP_POLL_S = 0.1


@dataclass
class HolderStats:
    """What one holder did since it started (read from other threads: plain counters)."""

    held: int = 0
    released: int = 0
    released_without_due_time: int = 0
    connects: int = 0
    connected_ms: int = 0  # when it last connected (epoch ms)
    max_late_ms: int = 0
    late_ms: list[int] = field(default_factory=list)  # the last releases' lateness


_KEEP_LATE = 10_000


class Holder:
    """Holds every message of `topology`'s holding queue until its `rd-due-at`.

    Raises ConfigError for a topology without a [held] table, no URL, or a URL that is
    not amqp:// or amqps://."""

    def __init__(
        self,
        topology: Topology,
        urls: Sequence[str],
        *,
        tls: TLSOptions | None = None,
        credit: int = DEFAULT_CREDIT,
        backoff: ReconnectBackoff | None = None,
        clock: Callable[[], float] = time.time,
        name: str = "rabbit-delay holder",
    ) -> None:
        if topology.held is None:
            raise ConfigError(
                f"topology {topology.names.prefix!r} has no [held] table: nothing to hold"
            )
        if not urls:
            raise ConfigError("a holder needs at least one broker URL")
        self.topology = topology
        self.urls = tuple(urls)
        # Each URL's TLS query keys (cafile, certfile...) win over `tls` (rabbit_delay._tls).
        self.endpoints: dict[str, Endpoint] = {}
        self.tls_of: dict[str, TLSOptions | None] = {}
        for url in self.urls:
            plain, options = split_tls(url, tls)
            self.endpoints[url] = endpoint_of(plain)
            self.tls_of[url] = options
        self.credit = credit
        self.backoff = backoff or ReconnectBackoff()
        self.clock = clock
        self.name = name
        self.address = holding_address(topology.names)
        self.stats = HolderStats()
        self.ready = threading.Event()  # the link is attached (set again after a reconnect)
        self._stop = threading.Event()
        self._error: RabbitDelayError | None = None
        self._thread: threading.Thread | None = None

    # -- running -----------------------------------------------------------------------

    def run(self) -> None:
        """Hold until `stop()`. Raises AccessRefused, MissingObjectError or
        IncompatibleBroker when reconnecting cannot help."""
        handler = _Handler(self)
        with mapped("holding messages"):
            Container(handler).run()
        if self._error is not None:
            raise self._error

    def start(self) -> threading.Thread:
        """Run in a daemon thread; `stop()` ends it, `error` tells why it ended early."""
        thread = threading.Thread(target=self._run_quietly, name=self.name, daemon=True)
        self._thread = thread
        thread.start()
        return thread

    def _run_quietly(self) -> None:
        try:
            self.run()
        except RabbitDelayError as exc:
            log.error("holder stopped: %s", exc)

    @property
    def error(self) -> RabbitDelayError | None:
        return self._error

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def stop(self, wait_s: float = 10.0) -> None:
        """Close the connection (unsettled deliveries go back to the queue) and end."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(wait_s)

    def fail(self, error: RabbitDelayError) -> None:
        self._error = error
        self._stop.set()


class _Handler(MessagingHandler):
    """proton's event handler: connect, attach, settle as decided, reconnect."""

    def __init__(self, holder: Holder) -> None:
        super().__init__(prefetch=holder.credit, auto_accept=False, auto_settle=True)
        self.holder = holder
        self.url: str | None = None
        self.delays: Iterator[float] = holder.backoff.delays()
        self.connection: Connection | None = None
        self.container: Container | None = None

    # -- connecting --------------------------------------------------------------------

    def on_start(self, event) -> None:  # type: ignore[no-untyped-def]
        self.container = event.container
        self._connect(self.holder.urls[0])
        event.container.schedule(_STOP_POLL_S, self)

    def on_timer_task(self, event) -> None:  # type: ignore[no-untyped-def]
        if self.holder.stopping:
            if self.connection is not None:
                self.connection.close()
            event.container.stop()
            return
        event.container.schedule(_STOP_POLL_S, self)

    def _connect(self, url: str) -> None:
        assert self.container is not None
        self.url = url
        ep: Endpoint = self.holder.endpoints[url]
        ssl_domain = None
        if ep.tls:
            ssl_domain = SSLDomain(SSLDomain.MODE_CLIENT)
            opts = self.holder.tls_of[url] or TLSOptions()
            if opts.cafile:
                ssl_domain.set_trusted_ca_db(opts.cafile)
            ssl_domain.set_peer_authentication(SSLDomain.VERIFY_PEER_NAME, opts.cafile)
            if opts.certfile:
                ssl_domain.set_credentials(opts.certfile, opts.keyfile or opts.certfile, None)
        self.connection = self.container.connect(
            url=f"{'amqps' if ep.tls else 'amqp'}://{ep.address}",
            user=ep.user,
            password=ep.password,
            allowed_mechs="PLAIN",
            virtual_host=ep.open_hostname,
            sasl_enabled=True,
            reconnect=False,
            ssl_domain=ssl_domain,
            heartbeat=30,
        )

    def on_connection_opened(self, event) -> None:  # type: ignore[no-untyped-def]
        props = event.connection.remote_properties or {}
        info = BrokerInfo.from_server_properties(
            {str(k): v for k, v in props.items()} if hasattr(props, "items") else {}
        )
        if not info.supports_held:
            self._fail(
                IncompatibleBroker(
                    f"the [held] backend needs RabbitMQ 4.3+ (a quorum queue that holds a "
                    f"message until x-opt-delivery-time); {info.describe()} does not have it"
                )
            )
            return
        self.holder.stats.connects += 1
        self.holder.stats.connected_ms = int(time.time() * 1000)
        self.delays = self.holder.backoff.delays()
        event.container.create_receiver(
            event.connection, self.holder.address, name=self.holder.name
        )
        log.info("holding %s on %s", self.holder.address, redact(self.url or ""))

    def on_link_opened(self, event) -> None:  # type: ignore[no-untyped-def]
        if event.receiver is not None and event.link.remote_source.address:
            self.holder.ready.set()

    # -- the deliveries ----------------------------------------------------------------

    def on_message(self, event) -> None:  # type: ignore[no-untyped-def]
        delivery = event.delivery
        properties = event.message.properties
        decision = decide(properties, int(self.holder.clock() * 1000))
        stats = self.holder.stats
        if isinstance(decision, Hold):
            # A SYMBOL key: a string key makes RabbitMQ 4.3 close the session.
            delivery.local.annotations = {symbol(DELIVERY_TIME): decision.until_ms}
            delivery.local.failed = False
            delivery.local.undeliverable = False
            stats.held += 1
        else:
            assert isinstance(decision, Release)
            delivery.local.failed = False
            delivery.local.undeliverable = True  # the queue dead-letters it: due exchange
            stats.released += 1
            if decision.late_ms is None:
                stats.released_without_due_time += 1
            else:
                stats.max_late_ms = max(stats.max_late_ms, decision.late_ms)
                if len(stats.late_ms) < _KEEP_LATE:
                    stats.late_ms.append(decision.late_ms)
        delivery.update(Disposition.MODIFIED)
        delivery.settle()

    # -- failures ----------------------------------------------------------------------

    def _condition(self, condition: Condition | None, doing: str) -> None:
        name = condition.name if condition is not None else None
        description = condition.description if condition is not None else None
        error = condition_error(name, description, doing=doing, address=self.holder.address)
        if fatal(error):
            self._fail(error)
        else:
            log.warning("%s", error)

    def on_connection_error(self, event) -> None:  # type: ignore[no-untyped-def]
        self._condition(event.connection.remote_condition, "connected")

    def on_session_error(self, event) -> None:  # type: ignore[no-untyped-def]
        self._condition(event.session.remote_condition, "holding messages")
        event.connection.close()

    def on_link_error(self, event) -> None:  # type: ignore[no-untyped-def]
        self._condition(event.link.remote_condition, f"consuming {self.holder.address}")
        event.connection.close()

    def on_transport_error(self, event) -> None:  # type: ignore[no-untyped-def]
        self._condition(event.transport.condition, "connecting")

    def on_transport_closed(self, event) -> None:  # type: ignore[no-untyped-def]
        # Whatever closed it (the broker's close with an error, a lost socket, a failed
        # connect): proton's own `on_disconnected` skips a connection closed locally.
        self.holder.ready.clear()
        if self.holder.stopping:
            return
        nxt = failover_order(self.holder.urls, self.url)[0]
        wait = next(self.delays)
        log.warning(
            "holder disconnected from %s; reconnecting in %.1fs", redact(self.url or ""), wait
        )
        event.container.schedule(wait, _Reconnect(self, nxt))

    def _fail(self, error: RabbitDelayError) -> None:
        self.holder.fail(error)
        if self.connection is not None:
            self.connection.close()


class _Reconnect:
    def __init__(self, handler: _Handler, url: str) -> None:
        self.handler = handler
        self.url = url

    def on_timer_task(self, event) -> None:  # type: ignore[no-untyped-def]
        if not self.handler.holder.stopping:
            self.handler._connect(self.url)
