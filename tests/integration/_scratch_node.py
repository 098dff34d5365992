"""A throwaway RabbitMQ node on free ports, for tests that stop and start a broker, and
a consumer thread that survives it.

Never the shared broker on 5672: other people's tests run there. The scratch node has
its own node name, AMQP and distribution ports, data and log directories, config file,
empty enabled-plugins file (so no management or Prometheus listener can clash with the
main node's) and its own HOME with its own Erlang cookie: nothing it does can reach the
main node. Every wait has a deadline. The node is stopped (SIGTERM, then SIGKILL of its
own process group) and its directory removed on teardown.

Skips when `rabbitmq-server` is not installed, and FAILS instead when CI is set.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pika
import pika.exceptions
import pytest

from rabbit_delay.message import now_ms

SERVER_ENV = "RABBIT_DELAY_RABBITMQ_SERVER"  # path of the rabbitmq-server script to use
START_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 45.0
# Ports the shared broker uses (AMQP, management, distribution, Prometheus): never ours.
_RESERVED_PORTS = frozenset({4369, 5671, 5672, 15672, 15692, 25672})


def find_rabbitmq_server() -> Path | None:
    """The rabbitmq-server script to run as the current user.

    Debian's /usr/sbin/rabbitmq-server is a wrapper that re-runs itself as the
    `rabbitmq` user through `su`, which would lose our HOME (and cookie): prefer the
    real script behind it.
    """
    explicit = os.environ.get(SERVER_ENV)
    candidates = [Path(explicit)] if explicit else []
    candidates.append(Path("/usr/lib/rabbitmq/bin/rabbitmq-server"))
    found = shutil.which("rabbitmq-server")
    if found:
        candidates.append(Path(found))
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


def _free_port() -> int:
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port: int = s.getsockname()[1]
        if port not in _RESERVED_PORTS:
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
    """One RabbitMQ node under `base`, started and stopped by the test that owns it."""

    server: Path
    base: Path
    name: str = field(default_factory=lambda: f"rdscratch-{uuid.uuid4().hex[:8]}@localhost")
    port: int = field(default_factory=_free_port)
    dist_port: int = field(default_factory=_free_port)
    _proc: subprocess.Popen[bytes] | None = None
    starts: int = 0

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}/%2F"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _prepare(self) -> dict[str, str]:
        home = self.base / "home"
        for sub in ("home", "mnesia", "log"):
            (self.base / sub).mkdir(parents=True, exist_ok=True)
        cookie = home / ".erlang.cookie"
        if not cookie.exists():
            cookie.write_text(uuid.uuid4().hex.upper())
            cookie.chmod(0o400)
        (self.base / "enabled_plugins").write_text("[].\n")
        (self.base / "rabbitmq-env.conf").write_text("")
        (self.base / "rabbitmq.conf").write_text(
            f"listeners.tcp.1 = 127.0.0.1:{self.port}\ndisk_free_limit.absolute = 50MB\n"
        )
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RABBITMQ_", "ERL_"))}
        env |= {
            "HOME": str(home),
            "RABBITMQ_NODENAME": self.name,
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_MNESIA_BASE": str(self.base / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.base / "log"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.base / "enabled_plugins"),
            "RABBITMQ_CONFIG_FILE": str(self.base / "rabbitmq.conf"),
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(self.base / "advanced.config"),
            "RABBITMQ_CONF_ENV_FILE": str(self.base / "rabbitmq-env.conf"),
            "RABBITMQ_PID_FILE": str(self.base / "node.pid"),
            "ERL_EPMD_ADDRESS": "127.0.0.1",
            # Keep the distribution listener on loopback, like the main node's.
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "-kernel inet_dist_use_interface {127,0,0,1}",
        }
        return env

    def start(self, timeout: float = START_TIMEOUT_S) -> None:
        """Start the node and wait until it accepts AMQP connections (boot is then complete)."""
        if self.running:
            return
        env = self._prepare()
        self.starts += 1
        log = (self.base / f"stdout.{self.starts}.log").open("wb")
        try:
            self._proc = subprocess.Popen(
                [str(self.server)],
                env=env,
                cwd=self.base,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: teardown kills exactly it
            )
        finally:
            log.close()
        deadline = time.monotonic() + timeout
        while not _amqp_ready(self.url):
            if not self.running:
                raise RuntimeError(
                    f"scratch node {self.name} exited while booting:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(
                    f"scratch node {self.name} not up within {timeout}s:\n{self.log_tail()}"
                )
            time.sleep(0.2)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Graceful stop (the script passes SIGTERM on to the VM); SIGKILL at the deadline."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """Hard stop: SIGKILL to the node's own process group (the script and the VM)."""
        proc = self._proc
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)

    def cleanup(self) -> None:
        try:
            self.stop()
            # The VM may outlive the script on an unclean exit: same process group.
            if self._proc is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self._proc.pid, signal.SIGKILL)
        finally:
            shutil.rmtree(self.base, ignore_errors=True)

    def log_tail(self, lines: int = 30) -> str:
        out = []
        for path in sorted(self.base.glob("stdout.*.log")) + sorted(
            (self.base / "log").glob("*.log")
        ):
            with contextlib.suppress(OSError):
                out.append(
                    f"--- {path.name}\n"
                    + "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
                )
        return "\n".join(out)


@pytest.fixture
def scratch_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ScratchNode]:
    """A started scratch node; stopped and deleted afterwards."""
    server = find_rabbitmq_server()
    if server is None:
        reason = (
            f"rabbitmq-server is not installed (or set {SERVER_ENV}): cannot start a scratch node"
        )
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    base = tmp_path_factory.mktemp("rabbit-node")
    node = ScratchNode(server, base)
    try:
        try:
            node.start()
        except RuntimeError:  # a free port taken in the meantime: once more on new ports
            node.cleanup()
            node = ScratchNode(server, tmp_path_factory.mktemp("rabbit-node"))
            node.start()
        yield node
    finally:
        node.cleanup()


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
