"""Which way `.ci/services.sh` gets a RabbitMQ broker, for each state of the machine.

The real `ensure_rabbitmq` (and `ensure_management`) run in bash with `set -euo pipefail`,
like `.ci/demo` and `.ci/test` run them, on a PATH holding fake `docker`,
`rabbitmq-server`, `rabbitmqctl`, `rabbitmq-plugins`, `apt-get` and `id` plus a few core
tools, and nothing else from the machine: neither the machine's Docker nor its broker is
ever reached. The AMQP and management ports are free ports nobody listens on. The fakes
record their calls; where the real command would start a broker, they start a tiny TCP
listener on those ports in the background (killed at teardown).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVICES_SH = ROOT / ".ci" / "services.sh"
COMPOSE_FILE = ROOT / "docker-compose.yml"
BASH = shutil.which("bash") or "/bin/bash"
CP = shutil.which("cp") or "/bin/cp"
CORE_TOOLS = ("bash", "timeout", "sleep", "dirname")

# Accepts connections on PORT (after DELAY seconds) and answers each one with an HTTP 200,
# which is enough for both probes: the AMQP port check only connects, the management
# check GETs /api/overview. Exits by itself after a minute in case teardown misses it.
LISTENER = """
import socket, sys, time
port, delay = int(sys.argv[1]), float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
time.sleep(delay)
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind(("127.0.0.1", port))
server.listen(16)
server.settimeout(1)
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    try:
        conn, _ = server.accept()
    except TimeoutError:
        continue
    with conn:
        conn.settimeout(1)
        try:
            conn.recv(4096)
            conn.sendall(b"HTTP/1.0 200 OK\\r\\nContent-Length: 2\\r\\n\\r\\n{}")
        except OSError:
            pass
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


class Machine:
    """A fake machine state: which commands exist and how they behave."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.bin = tmp / "bin"
        self.tools = tmp / "tools"
        self.calls_file = tmp / "calls"
        self.pids_file = tmp / "pids"
        self.listener = tmp / "listener.py"
        self.amqp_port = _free_port()
        self.management_port = _free_port()
        for d in (self.bin, self.tools):
            d.mkdir()
        self.calls_file.touch()
        self.pids_file.touch()
        self.listener.write_text(LISTENER)
        for tool in CORE_TOOLS:
            real = shutil.which(tool)
            assert real, f"{tool} is needed to run these tests"
            (self.tools / tool).symlink_to(real)
        # management_answers falls back to python3 when curl is missing (it is, here)
        self._script(self.tools / "python3", f'exec {sys.executable} "$@"')

    # -- building blocks of the fakes ------------------------------------------------

    def _script(self, path: Path, body: str) -> None:
        path.write_text(f"#!{BASH}\n{body}\n")
        path.chmod(0o755)

    def _fake(self, name: str, body: str, into: Path | None = None) -> None:
        record = f'printf "%s\\n" "${{0##*/}} $*" >> {self.calls_file}'
        self._script((into or self.bin) / name, f"{record}\n{body}")

    def _listen(self, port: int, delay: float = 0) -> str:
        """Shell line that starts a listener on `port` in the background."""
        return (
            f"{sys.executable} {self.listener} {port} {delay} </dev/null >/dev/null 2>&1 &\n"
            f"echo $! >> {self.pids_file}"
        )

    # -- machine states ----------------------------------------------------------------

    def docker(self, engine: bool = True, compose: bool = True, up_rc: int = 0) -> None:
        """`docker`: `info` answers if `engine`; `compose up` starts the broker (AMQP at
        once, management 2s later, like a booting container) unless `up_rc` fails it."""
        starts = ""
        if not up_rc:
            starts = self._listen(self.amqp_port) + "\n" + self._listen(self.management_port, 2)
        self._fake(
            "docker",
            f"""case "$1" in
    info) exit {0 if engine else 1} ;;
    compose)
        [ "$2" = version ] && exit {0 if compose else 1}
        case " $* " in *" up "*)
{starts}
            exit {up_rc} ;;
        esac ;;
esac
exit 0""",
        )

    def rabbitmq_installed(self, into: Path | None = None) -> None:
        """`rabbitmq-server -detached` starts the broker; `rabbitmqctl status` says the node
        is down, `await_startup` returns; `rabbitmq-plugins enable` starts management."""
        self._fake(
            "rabbitmq-server",
            f'[ "$1" = -detached ] || exit 2\n{self._listen(self.amqp_port)}',
            into,
        )
        self._fake(
            "rabbitmqctl",
            'case " $* " in *" status "*) exit 1 ;; *" await_startup "*) exit 0 ;; esac\nexit 2',
            into,
        )
        self._fake(
            "rabbitmq-plugins",
            f'[ "$1" = enable ] || exit 2\n{self._listen(self.management_port)}',
            into,
        )

    def apt_get(self) -> None:
        """`apt-get install ... rabbitmq-server` installs the fake rabbitmq-server."""
        package = self.tmp / "apt-archive"
        package.mkdir()
        self.rabbitmq_installed(into=package)
        self._fake(
            "apt-get",
            f"""case " $* " in
    *" install "*"rabbitmq-server"*) {CP} {package}/* {self.bin}/ ;;
esac
exit 0""",
        )

    def user(self, uid: int) -> None:
        self._fake("id", f'[ "$1" = -u ] && echo {uid}')

    # -- running and inspecting ----------------------------------------------------------

    def run(self, functions: str = "ensure_rabbitmq") -> subprocess.CompletedProcess[str]:
        env = {
            "PATH": f"{self.bin}:{self.tools}",
            "HOME": str(self.tmp),
            "RD_AMQP_HOST": "127.0.0.1",
            "RD_AMQP_PORT": str(self.amqp_port),
            "RD_MANAGEMENT_URL": f"http://127.0.0.1:{self.management_port}",
            "RD_START_TIMEOUT": "10",
            "RD_INSTALL_TIMEOUT": "30",
        }
        script = f'set -euo pipefail; source "$1"; {functions}'
        return subprocess.run(
            [BASH, "-c", script, "bash", str(SERVICES_SH)],
            env=env,
            cwd=self.tmp,
            capture_output=True,
            text=True,
            timeout=100,
            check=False,
        )

    def calls(self) -> list[str]:
        return self.calls_file.read_text().splitlines()

    def called(self, prefix: str) -> bool:
        return any(call.startswith(prefix) for call in self.calls())

    def stop_listeners(self) -> None:
        for pid in self.pids_file.read_text().split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGTERM)


@pytest.fixture
def machine(tmp_path: Path) -> Iterator[Machine]:
    m = Machine(tmp_path)
    m.user(1000)
    yield m
    m.stop_listeners()


def _explain(m: Machine, result: subprocess.CompletedProcess[str]) -> str:
    out = f"stdout={result.stdout}\nstderr={result.stderr}"
    return f"rc={result.returncode}\ncalls={m.calls()}\n{out}"


def test_broker_already_answering_nothing_is_called(machine: Machine) -> None:
    machine.docker()
    machine.rabbitmq_installed()
    machine.apt_get()
    machine.user(0)
    listener = subprocess.Popen(
        [sys.executable, str(machine.listener), str(machine.amqp_port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while not _answers(machine.amqp_port):
            assert time.monotonic() < deadline, "the test's listener did not start"
            time.sleep(0.05)
        result = machine.run()
    finally:
        listener.terminate()
        listener.wait(timeout=10)
    assert result.returncode == 0, _explain(machine, result)
    assert machine.calls() == [], _explain(machine, result)
    assert f"RabbitMQ answers on 127.0.0.1:{machine.amqp_port}" in result.stdout


def test_docker_answers_compose_up_and_no_local_server(machine: Machine) -> None:
    machine.docker()
    machine.rabbitmq_installed()  # installed too: Docker still comes first
    machine.apt_get()
    machine.user(0)
    result = machine.run()
    assert result.returncode == 0, _explain(machine, result)
    assert f"docker compose -f {COMPOSE_FILE} up -d --wait rabbitmq" in machine.calls()
    for local in ("rabbitmq-server", "rabbitmqctl", "rabbitmq-plugins", "apt-get"):
        assert not machine.called(local), _explain(machine, result)
    assert _answers(machine.amqp_port)


def test_docker_broker_management_is_waited_for_not_enabled(machine: Machine) -> None:
    machine.docker()  # management answers 2s after compose up
    machine.rabbitmq_installed()
    result = machine.run("ensure_rabbitmq; ensure_management")
    assert result.returncode == 0, _explain(machine, result)
    assert machine.called("docker compose"), _explain(machine, result)
    assert not machine.called("rabbitmq-plugins"), _explain(machine, result)
    assert "management API is up" in result.stdout


def test_docker_compose_failure_is_an_error_not_a_fallback(machine: Machine) -> None:
    machine.docker(up_rc=1)
    machine.rabbitmq_installed()
    result = machine.run()
    assert result.returncode != 0, _explain(machine, result)
    assert "docker compose up -d --wait rabbitmq failed" in result.stderr
    assert not machine.called("rabbitmq-server"), _explain(machine, result)


@pytest.mark.parametrize("docker", ["absent", "engine down", "no compose plugin"])
def test_no_usable_docker_installed_server_is_started(machine: Machine, docker: str) -> None:
    if docker == "engine down":
        machine.docker(engine=False)
    elif docker == "no compose plugin":
        machine.docker(compose=False)
    machine.rabbitmq_installed()
    machine.apt_get()
    machine.user(0)
    result = machine.run("ensure_rabbitmq; ensure_management")
    assert result.returncode == 0, _explain(machine, result)
    assert "rabbitmq-server -detached" in machine.calls(), _explain(machine, result)
    assert machine.called("rabbitmqctl -q await_startup"), _explain(machine, result)
    assert "rabbitmq-plugins enable rabbitmq_management" in machine.calls()
    assert not machine.called("docker compose -f"), _explain(machine, result)
    assert not machine.called("apt-get"), _explain(machine, result)
    if docker != "absent":
        assert "docker info" in machine.calls(), _explain(machine, result)
    assert _answers(machine.amqp_port)


def test_not_installed_root_with_apt_get_installs_then_starts(machine: Machine) -> None:
    machine.docker(engine=False)
    machine.apt_get()
    machine.user(0)
    result = machine.run()
    assert result.returncode == 0, _explain(machine, result)
    calls = machine.calls()
    install = "apt-get install -y -qq rabbitmq-server"
    assert install in calls, _explain(machine, result)
    assert "rabbitmq-server -detached" in calls, _explain(machine, result)
    assert calls.index(install) < calls.index("rabbitmq-server -detached")
    assert not machine.called("docker compose"), _explain(machine, result)
    assert _answers(machine.amqp_port)


@pytest.mark.parametrize(
    ("root", "apt_get", "docker"),
    [(False, True, "engine down"), (True, False, "absent"), (False, False, "absent")],
    ids=["not root", "no apt-get", "nothing at all"],
)
def test_nothing_usable_one_clear_message(
    machine: Machine, root: bool, apt_get: bool, docker: str
) -> None:
    if docker == "engine down":
        machine.docker(engine=False)
    if apt_get:
        machine.apt_get()
    machine.user(0 if root else 1000)
    result = machine.run()
    assert result.returncode != 0, _explain(machine, result)
    assert result.stdout == "", _explain(machine, result)
    assert result.stderr.count("[services]") == 1, _explain(machine, result)
    message = result.stderr
    assert f"no RabbitMQ on 127.0.0.1:{machine.amqp_port}" in message
    assert "Install Docker" in message
    assert "rabbitmq-server" in message
    assert not machine.called("apt-get install"), _explain(machine, result)
    assert not machine.called("docker compose"), _explain(machine, result)
