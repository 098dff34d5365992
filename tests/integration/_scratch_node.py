"""A throwaway RabbitMQ node on free ports, for tests that stop, kill or reconfigure a
broker, and a consumer thread that survives it.

Never the broker under test, never the machine's broker on 5672: the scratch node is
started by `.ci/brokers.sh` (the one place that knows how to run a node here) with its
own node name, ports, data and log directories and Erlang cookie, and it is of the SAME
RabbitMQ version as the broker the suite runs against (`RABBIT_DELAY_TEST_URL`): the
machine's own rabbitmq-server for 3.10, a debootstrapped root for 4.0 and 4.3.

Skips when no node of that version can be started here, and FAILS instead when CI is set.
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import pika
import pika.exceptions
import pytest
from conftest import server_info

from rabbit_delay import ManagementUnavailable
from rabbit_delay._broker import BrokerInfo
from rabbit_delay._envelope import now_ms
from rabbit_delay._io.management import get_json
from rabbit_delay._urls import management_endpoint

BROKERS_SH = Path(__file__).resolve().parents[2] / ".ci" / "brokers.sh"
START_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 60.0
# brokers.sh derives management (+10000), distribution (+20000) and CLI (+30000..+30009)
# ports from the AMQP port: all must be free.
_DERIVED = (0, 10000, 20000, *range(30000, 30010))


def brokers_sh(*args: str, timeout: float = START_TIMEOUT_S) -> str:
    """Run .ci/brokers.sh; its stdout. Raises RuntimeError with its output on failure."""
    try:
        done = subprocess.run(
            ["bash", str(BROKERS_SH), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"brokers.sh {' '.join(args)}: no answer in {timeout}s") from exc
    if done.returncode != 0:
        raise RuntimeError(f"brokers.sh {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return done.stdout.strip()


@cache
def _installed(kind: str) -> str | None:
    try:
        return brokers_sh("version", kind, timeout=600)
    except RuntimeError:
        return None


def installed_version(kind: str) -> tuple[int, ...] | None:
    """The RabbitMQ version nodes of `kind` (brokers.sh VERSION) run, e.g. (4, 3, 6)."""
    installed = _installed(kind)
    return None if installed is None else tuple(int(p) for p in installed.split(".") if p.isdigit())


def node_kind_for(info: BrokerInfo) -> str | None:
    """The brokers.sh VERSION that runs the same RabbitMQ major.minor as `info`."""
    version = info.version
    if version is None:
        return None
    for kind in ("host", "4.0", "4.3"):
        installed = _installed(kind)
        if installed is not None and tuple(int(p) for p in installed.split(".")[:2]) == version[:2]:
            return kind
    return None


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


# Where scratch nodes take their AMQP ports: 6000-9999, or a range of one's own
# ("5970-5999") when several people share the machine.
SCRATCH_PORTS_ENV = "RABBIT_DELAY_SCRATCH_PORTS"


def _free_base_port(members: int = 1) -> int:
    """A port P with every derived port free for `members` nodes at P, P+10, P+20..."""
    low, _, high = os.environ.get(SCRATCH_PORTS_ENV, "6000-9999").partition("-")
    while True:
        port = random.randint(int(low), int(high) - 10 * (members - 1))
        if all(_port_free(port + 10 * i + d) for i in range(members) for d in _DERIVED):
            return port


def _amqp_ready(url: str) -> bool:
    params = pika.URLParameters(url)
    params.connection_attempts = 1
    params.socket_timeout = 2
    params.blocked_connection_timeout = 2
    try:
        pika.BlockingConnection(params).close()
    except (pika.exceptions.AMQPError, OSError):
        return False
    return True


@dataclass
class ScratchNode:
    """One RabbitMQ node of `kind` (brokers.sh VERSION), started and stopped by its test."""

    kind: str
    name: str = field(default_factory=lambda: f"s{uuid.uuid4().hex[:8]}")
    port: int = field(default_factory=_free_base_port)
    management: bool = False
    conf: Sequence[str] = ()
    starts: int = 0
    _started: bool = False

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}/%2F"

    @property
    def management_url(self) -> str:
        return f"http://127.0.0.1:{self.port + 10000}"

    @property
    def running(self) -> bool:
        return self._started and _amqp_ready(self.url)

    def start(self, timeout: float = START_TIMEOUT_S) -> None:
        """Start the node and wait until it accepts AMQP connections (boot is complete)."""
        args = ["start", self.kind, self.name, "--port", str(self.port)]
        if not self.management:
            args.append("--no-management")
        for line in self.conf:
            args += ["--conf", line]
        self.starts += 1
        self._started = True
        brokers_sh(*args, timeout=timeout)
        deadline = time.monotonic() + 30
        while not _amqp_ready(self.url):
            if time.monotonic() > deadline:
                raise TimeoutError(f"scratch node {self.name} does not answer:\n{self.log_tail()}")
            time.sleep(0.2)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Graceful stop (rabbitmqctl stop); SIGKILL at brokers.sh's deadline."""
        brokers_sh("stop", self.kind, self.name, timeout=timeout + 30)

    def kill(self) -> None:
        """Hard stop: SIGKILL of the node's VM and its process group (a crash)."""
        brokers_sh("kill", self.kind, self.name, timeout=60)

    def ctl(self, *args: str) -> str:
        """rabbitmqctl against this node."""
        return brokers_sh("ctl", self.kind, self.name, *args, timeout=120)

    def cleanup(self) -> None:
        with contextlib.suppress(RuntimeError):
            brokers_sh("rm", self.kind, self.name, timeout=STOP_TIMEOUT_S + 60)

    def log_tail(self, lines: int = 30) -> str:
        with contextlib.suppress(RuntimeError):
            return brokers_sh("logs", self.kind, self.name, str(lines), timeout=30)
        return "(no logs)"

    @property
    def node_name(self) -> str:
        """Its Erlang node name (what the management API calls it: `leader`, `members`)."""
        return _node_name(self.kind, self.name)


@cache
def _node_name(kind: str, name: str) -> str:
    return brokers_sh("node-name", kind, name, timeout=30)


def _skip_or_fail(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(reason)
    pytest.skip(reason)


def scratch_kind(broker_url: str) -> str:
    """The brokers.sh VERSION matching the broker under test; skips (fails in CI) if none."""
    info = server_info(broker_url)
    kind = node_kind_for(info)
    if kind is None:
        _skip_or_fail(
            f"cannot start a scratch node of {info.describe()} here (the broker under test): "
            "bash .ci/brokers.sh runs the machine's rabbitmq-server, 4.0 and 4.3"
        )
    assert kind is not None
    return kind


@contextlib.contextmanager
def started_node(kind: str, **options: Any) -> Iterator[ScratchNode]:
    """A started scratch node of `kind`; stopped and deleted afterwards."""
    node = ScratchNode(kind, **options)
    try:
        try:
            node.start()
        except RuntimeError:  # a free port taken in the meantime: once more on new ports
            node.cleanup()
            node = ScratchNode(kind, **options)
            node.start()
        yield node
    finally:
        node.cleanup()


@pytest.fixture
def scratch_node(broker_url: str) -> Iterator[ScratchNode]:
    """A started scratch node of the broker-under-test's version; deleted afterwards."""
    with started_node(scratch_kind(broker_url)) as node:
        yield node


# -- a cluster --------------------------------------------------------------------------


@dataclass
class ScratchCluster:
    """`size` scratch nodes of `kind` joined into one RabbitMQ cluster by
    `brokers.sh cluster-start` (members NAME-1..NAME-size on ports P, P+10, ...), with the
    management API on each. Each member is a ScratchNode: kill one, start it again (it
    rejoins with its data)."""

    kind: str
    size: int = 3
    name: str = field(default_factory=lambda: f"c{uuid.uuid4().hex[:8]}")
    port: int = 0  # 0: free ports for every member
    conf: Sequence[str] = ()
    started_s: float | None = None  # how long cluster-start took
    members: list[ScratchNode] = field(init=False)

    def __post_init__(self) -> None:
        if not self.port:
            self.port = _free_base_port(self.size)
        self.members = [
            ScratchNode(
                self.kind,
                name=f"{self.name}-{i + 1}",
                port=self.port + 10 * i,
                management=True,
                conf=self.conf,
            )
            for i in range(self.size)
        ]

    @property
    def urls(self) -> list[str]:
        return [node.url for node in self.members]

    def start(self, timeout: float = START_TIMEOUT_S) -> None:
        """Start every member and join them (once); returns when all run in one cluster."""
        args = ["cluster-start", self.kind, self.name, "--nodes", str(self.size)]
        args += ["--port", str(self.port)]
        for line in self.conf:
            args += ["--conf", line]
        began = time.monotonic()
        for node in self.members:
            node.starts += 1
            node._started = True
        brokers_sh(*args, timeout=timeout + 60)
        for node in self.members:
            deadline = time.monotonic() + 30
            while not _amqp_ready(node.url):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"cluster member {node.name} does not answer")
                time.sleep(0.2)
        running = self.running_nodes()
        if len(running) != self.size:
            raise RuntimeError(f"cluster {self.name}: {len(running)} of {self.size} running")
        self.started_s = time.monotonic() - began

    def running_nodes(self) -> list[str]:
        """The nodes the first member's management API lists as running."""
        try:
            nodes = get_json(management_endpoint(self.members[0].url), "nodes?columns=name,running")
        except ManagementUnavailable as exc:
            raise RuntimeError(f"cluster {self.name}: {exc}") from None
        return [n["name"] for n in nodes if isinstance(n, dict) and n.get("running")]

    def member(self, node_name: str) -> ScratchNode:
        """The member whose Erlang node name is `node_name`."""
        for node in self.members:
            if node.node_name == node_name:
                return node
        raise KeyError(f"{node_name} is not a member of cluster {self.name}")

    def cleanup(self) -> None:
        with contextlib.suppress(RuntimeError):
            brokers_sh("cluster-rm", self.kind, self.name, timeout=STOP_TIMEOUT_S + 60)


@contextlib.contextmanager
def started_cluster(kind: str, **options: Any) -> Iterator[ScratchCluster]:
    """A started cluster of `kind`; its members killed and deleted afterwards. Skips
    when it cannot be started here (FAILS when CI is set), naming why."""
    cluster = ScratchCluster(kind, **options)
    try:
        try:
            cluster.start()
        except (RuntimeError, TimeoutError):  # a free port taken meanwhile: once more
            cluster.cleanup()
            cluster = ScratchCluster(kind, **options)
            try:
                cluster.start()
            except (RuntimeError, TimeoutError) as exc:
                logs = "\n".join(node.log_tail(15) for node in cluster.members)
                _skip_or_fail(
                    f"cannot start a {cluster.size}-node cluster of {kind}: {exc}\n{logs}"
                )
        yield cluster
    finally:
        cluster.cleanup()


# -- consuming --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Received:
    arrival_ms: int  # this machine's clock, taken first thing in the delivery callback
    message_id: str
    headers: dict[str, Any]
    redelivered: bool

    def header_int(self, name: str) -> int:
        return int(self.headers[name])


class Collector(threading.Thread):
    """Consumes one queue in its own thread (pika is per-thread), acking every message,
    and reconnects after a broker restart until stopped. Use as a context manager."""

    def __init__(self, url: str, queue: str, *, prefetch: int = 1000) -> None:
        super().__init__(daemon=True, name=f"collector {queue}")
        self.url = url
        self.queue = queue
        self.prefetch = prefetch
        self._stop_event = threading.Event()
        self._ready = threading.Event()
        self._lock = threading.Lock()
        self._received: list[Received] = []
        self.errors: list[str] = []

    def __enter__(self) -> Collector:
        self.start()
        if not self._ready.wait(15):
            raise TimeoutError(f"consumer on {self.queue} not ready within 15s: {self.errors}")
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop_event.set()
        self.join(15)

    @property
    def received(self) -> list[Received]:
        with self._lock:
            return list(self._received)

    def _on_message(
        self,
        ch: Any,
        method: pika.spec.Basic.Deliver,
        props: pika.spec.BasicProperties,
        _body: bytes,
    ) -> None:
        arrival = now_ms()
        with self._lock:
            self._received.append(
                Received(
                    arrival,
                    props.message_id or "",
                    dict(props.headers or {}),
                    bool(method.redelivered),
                )
            )
        ch.basic_ack(method.delivery_tag)

    def run(self) -> None:
        while not self._stop_event.is_set():
            conn: pika.BlockingConnection | None = None
            try:
                params = pika.URLParameters(self.url)
                params.connection_attempts = 1
                params.socket_timeout = 2
                conn = pika.BlockingConnection(params)
                ch = conn.channel()
                ch.basic_qos(prefetch_count=self.prefetch)
                ch.basic_consume(self.queue, self._on_message)
                self._ready.set()
                while not self._stop_event.is_set():
                    conn.process_data_events(time_limit=0.02)
            except (pika.exceptions.AMQPError, OSError) as exc:  # broker restarting: try again
                self.errors.append(repr(exc))
                self._stop_event.wait(0.2)
            except Exception as exc:  # never let a thread die silently
                self.errors.append(repr(exc))
                self._stop_event.wait(0.2)
            finally:
                if conn is not None and conn.is_open:
                    with contextlib.suppress(Exception):
                        conn.close()

    def wait_for(self, message_ids: Collection[str], timeout: float) -> dict[str, Received]:
        """First arrival of each id (duplicates are allowed: dead-lettering is at-least-once).

        Fails the test at the deadline, naming how many are missing.
        """
        wanted = set(message_ids)
        deadline = time.monotonic() + timeout
        while True:
            first: dict[str, Received] = {}
            for r in self.received:
                if r.message_id in wanted and r.message_id not in first:
                    first[r.message_id] = r
            if len(first) == len(wanted):
                return first
            if time.monotonic() > deadline:
                pytest.fail(
                    f"{len(wanted) - len(first)} of {len(wanted)} messages did not arrive in "
                    f"{self.queue} within {timeout}s (consumer errors: {self.errors[-3:]})"
                )
            time.sleep(0.05)
