"""The `rabbit-delay` command line: plan, declare, publish, on the real broker.

Most commands run in-process through typer's CliRunner (stdout and stderr apart); the
help screens and one password check run the installed console script.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pika
import pytest
from conftest import message_count, wait_for
from typer.testing import CliRunner, Result

from rabbit_delay import Topology
from rabbit_delay._cli.app import app
from rabbit_delay._durations import iso_ms
from rabbit_delay._urls import MANAGEMENT_URL_ENV, URL_ENV, ManagementEndpoint

from ._publishers import broker_state, delete_queue, queue_info, toml_for

pytestmark = pytest.mark.integration

_INSTALLED = Path(sys.executable).with_name("rabbit-delay")
# the console script installed beside this interpreter (pip install -e .)
SCRIPT = (
    [str(_INSTALLED)]
    if _INSTALLED.exists()
    else [sys.executable, "-c", "from rabbit_delay._cli.app import main; main()"]
)
UNREACHABLE_MGMT = "http://127.0.0.1:1"
BAD_URL = "amqp://user:s3cret@127.0.0.1:1/"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, broker_url: str) -> None:
    """Commands without --url reach the broker under test (RABBIT_DELAY_URL), never the
    machine's default one; nothing else leaks in from the environment."""
    for name in (MANAGEMENT_URL_ENV, "RABBIT_DELAY_TOPOLOGY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(URL_ENV, broker_url)


def with_password(url: str, password: str) -> str:
    """`url` (the broker under test) with another password."""
    parts = urlsplit(url)
    netloc = f"{parts.username or 'guest'}:{password}@{parts.hostname}:{parts.port or 5672}"
    return urlunsplit((parts.scheme, netloc, parts.path or "/", parts.query, ""))


def cli(*args: str, stdin: str | None = None, env: dict[str, str] | None = None) -> Result:
    result = CliRunner().invoke(app, list(args), input=stdin, env=env)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


@pytest.fixture
def topo(make_topology: Any, tmp_path: Path) -> tuple[Topology, Path]:
    """A topology in a unique namespace (deleted afterwards) and its TOML file."""
    topology: Topology = make_topology()
    path = tmp_path / "topology.toml"
    path.write_text(toml_for(topology), encoding="utf-8")
    return topology, path


# -- help ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "command", [[], ["plan"], ["declare"], ["publish"]], ids=["main", "plan", "declare", "publish"]
)
def test_help_of_each_command(command: list[str]) -> None:
    done = subprocess.run(
        [*SCRIPT, *command, "--help"], capture_output=True, text=True, timeout=30, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "Usage" in done.stdout
    if command:
        assert "--url" in done.stdout
    else:
        for name in ("plan", "declare", "publish"):
            assert name in done.stdout


# -- plan -----------------------------------------------------------------------------------


def test_plan_exit_codes(topo: tuple[Topology, Path], tmp_path: Path) -> None:
    _topology, path = topo
    assert cli("plan", str(path)).exit_code == 2  # everything pending
    assert cli("declare", str(path)).exit_code == 0
    assert cli("plan", str(path)).exit_code == 0  # in sync
    assert cli("plan", str(path), "--no-management").exit_code == 0
    bad = tmp_path / "bad.toml"
    bad.write_text('namespace = "x"\ncolour = 1\n', encoding="utf-8")
    assert cli("plan", str(bad)).exit_code == 1  # error: bad file
    assert cli("plan", str(path), "--url", BAD_URL).exit_code == 1  # error: no broker


def test_plan_json_parses(topo: tuple[Topology, Path]) -> None:
    topology, path = topo
    result = cli("plan", str(path), "--json")
    assert result.exit_code == 2
    data = json.loads(result.stdout)
    assert data["in_sync"] is False
    assert data["source"].startswith("management API at ")
    assert len(data["items"]) == 12 + 8
    assert {i["action"] for i in data["items"]} == {"create"}
    assert {(i["kind"], i["name"]) for i in data["items"] if i["kind"] == "queue"} >= {
        ("queue", topology.names.tier_queue("1s")),
        ("queue", topology.names.business_queue("push")),
    }

    cli("declare", str(path))
    after = json.loads(cli("plan", str(path), "--json").stdout)
    assert after["in_sync"] is True
    assert {i["action"] for i in after["items"]} == {"in place"}


def test_plan_reports_a_conflict_as_pending(topo: tuple[Topology, Path], broker_url: str) -> None:
    topology, path = topo
    precreate_conflicting_buffer(broker_url, topology)
    result = cli("plan", str(path), "--json")
    assert result.exit_code == 2
    items = {(i["kind"], i["name"]): i for i in json.loads(result.stdout)["items"]}
    conflict = items[("queue", topology.names.tier_queue("1s"))]
    assert conflict["action"] == "conflict"
    assert conflict["conflicts"] == [
        {"argument": "x-message-ttl", "on_broker": 5000, "wanted": 1000}
    ]
    delete_queue(broker_url, topology.names.tier_queue("1s"))


# -- declare --------------------------------------------------------------------------------


def test_declare_twice_second_has_nothing_to_do(
    topo: tuple[Topology, Path], management: ManagementEndpoint
) -> None:
    topology, path = topo
    first = cli("declare", str(path))
    assert first.exit_code == 0, first.stderr
    assert "object(s) created" in first.stdout
    state = broker_state(management, topology.names.prefix + ".")
    assert len(state.queues) == 7
    assert len(state.exchanges) == 5
    assert len(state.bindings) == 8

    second = cli("declare", str(path))
    assert second.exit_code == 0
    assert "nothing to do" in second.stdout
    assert broker_state(management, topology.names.prefix + ".") == state

    as_json = cli("declare", str(path), "--json")
    assert as_json.exit_code == 0
    data = json.loads(as_json.stdout)
    assert data["ok"] is True
    assert data["changed"] is False
    assert data["source"].startswith("management API at ")
    assert {i["action"] for i in data["items"]} == {"in place"}


def precreate_conflicting_buffer(url: str, topology: Topology) -> dict[str, Any]:
    arguments: dict[str, Any] = {
        "x-queue-type": "quorum",
        "x-dead-letter-strategy": "at-least-once",
        "x-overflow": "reject-publish",
        "x-dead-letter-exchange": topology.names.due_exchange(),
        "x-message-ttl": 5000,
    }
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        connection.channel().queue_declare(
            topology.names.tier_queue("1s"), durable=True, arguments=arguments
        )
    finally:
        connection.close()
    return arguments


@pytest.mark.parametrize(
    "extra", [[], ["--no-management"], ["--json"]], ids=["management", "passive", "json"]
)
def test_declare_conflict_exits_1_and_creates_nothing(
    topo: tuple[Topology, Path], broker_url: str, management: ManagementEndpoint, extra: list[str]
) -> None:
    topology, path = topo
    buffer = topology.names.tier_queue("1s")
    arguments = precreate_conflicting_buffer(broker_url, topology)

    result = cli("declare", str(path), *extra)

    assert result.exit_code == 1
    assert f"queue '{buffer}': argument 'x-message-ttl' is 5000 on the broker" in result.stderr
    assert "the topology wants 1000" in result.stderr
    assert "Nothing was changed" in result.stderr
    if "--json" in extra:
        document = json.loads(result.stdout)  # one document: the plan with the error
        assert document["ok"] is False
        assert document["kind"] == "DeclarationConflict"
        assert "Nothing was changed" in document["error"]
    state = broker_state(management, topology.names.prefix + ".")
    assert state.names == {buffer}
    assert not state.exchanges
    assert not state.bindings
    assert queue_info(management, buffer)["arguments"] == arguments
    delete_queue(broker_url, buffer)


def test_management_unreachable_falls_back_to_passive_declares(
    topo: tuple[Topology, Path], management: ManagementEndpoint
) -> None:
    topology, path = topo
    plan = cli("plan", str(path), "--management-url", UNREACHABLE_MGMT, "--json")
    assert plan.exit_code == 2
    data = json.loads(plan.stdout)
    assert data["source"].startswith("passive declares")
    assert {i["action"] for i in data["items"] if i["kind"] != "binding"} == {"create"}

    declared = cli("declare", str(path), "--management-url", UNREACHABLE_MGMT)
    assert declared.exit_code == 0, declared.stderr
    state = broker_state(management, topology.names.prefix + ".")
    assert len(state.queues) == 7
    assert len(state.exchanges) == 5
    assert len(state.bindings) == 8

    again = cli("declare", str(path), "--management-url", UNREACHABLE_MGMT)
    assert again.exit_code == 0
    assert "nothing to do" in again.stdout
    in_sync = cli("plan", str(path), "--management-url", UNREACHABLE_MGMT)
    assert in_sync.exit_code == 0


# -- publish --------------------------------------------------------------------------------


def test_publish_one_message_that_arrives(topo: tuple[Topology, Path], broker_url: str) -> None:
    topology, path = topo
    assert cli("declare", str(path)).exit_code == 0
    result = cli(
        "publish",
        '{"order_id": 42}',
        "-q",
        "orders.cancel",
        "-t",
        "1s",
        "-f",
        str(path),
        "--message-id",
        "cli-1",
        "--json",
    )
    assert result.exit_code == 0, result.stderr
    sent = json.loads(result.stdout)
    assert sent["message_id"] == "cli-1"
    assert sent["tier"] == "1s"
    assert sent["exchange"] == topology.names.tier_exchange("1s")
    # instants ISO-8601 UTC, durations as written; the exact figures beside them
    assert sent["due_at"] == iso_ms(sent["due_at_ms"])
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", sent["due_at"])
    assert (sent["delay"], sent["delay_ms"]) == ("1s", 1000)

    by_stdin = cli(
        "publish",
        "-",
        "--routing-key",
        "push.any",
        "--delay",
        "1s",
        "-f",
        str(path),
        stdin="[1, 2]",
    )
    assert by_stdin.exit_code == 0, by_stdin.stderr
    shown = re.fullmatch(
        r"published (\S+) via (\S+) \(1s\), due at (\S+) \(in 1s\)\n", by_stdin.stdout
    )
    assert shown is not None, by_stdin.stdout  # not "due at ms 1796150495995"
    due = datetime.fromisoformat(shown[3])
    assert shown[3].endswith("Z")
    assert abs(due - datetime.now(UTC)) < timedelta(seconds=30)

    connection = pika.BlockingConnection(pika.URLParameters(broker_url))
    try:
        channel = connection.channel()

        def get(queue: str) -> Any:
            method, properties, body = channel.basic_get(queue, auto_ack=True)
            return (properties, body) if method is not None else None

        properties, body = wait_for(
            lambda: get(topology.names.business_queue("orders.cancel")), 1 + 5, "the CLI message"
        )
        assert json.loads(body) == {"order_id": 42}
        assert properties.message_id == "cli-1"
        assert properties.headers["rd-tier"] == "1s"
        _props, body = wait_for(
            lambda: get(topology.names.business_queue("push")), 5, "the stdin message"
        )
        assert json.loads(body) == [1, 2]
    finally:
        connection.close()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["not json", "-q", "push", "-t", "1s"], "MESSAGE is not valid JSON"),
        (["42", "-q", "push", "-t", "1s"], "MESSAGE must be a JSON object or array"),
        (["{}", "-q", "nope", "-t", "1s"], "unknown queue 'nope'"),
        (["{}", "-q", "push", "-t", "9s"], "unknown tier '9s'"),
        (["{}", "-q", "push", "-d", "2s"], "no tier has a delay of 2s"),
        (["{}", "-q", "push", "-d", "[bold]soon"], "'[bold]soon' is not a duration"),
        (["{}", "-q", "push", "-d", "-1s"], "negative"),
    ],
)
def test_publish_refuses_bad_input(
    topo: tuple[Topology, Path], broker_url: str, args: list[str], message: str
) -> None:
    topology, path = topo
    assert cli("declare", str(path)).exit_code == 0
    result = cli("publish", *args, "-f", str(path))
    assert result.exit_code == 1
    assert message in result.stderr
    for tier in ("1s", "3s"):
        assert message_count(broker_url, topology.names.tier_queue(tier)) == 0


# -- errors ---------------------------------------------------------------------------------


def test_bad_topology_file_names_the_file_and_the_field(tmp_path: Path) -> None:
    path = tmp_path / "shop.toml"
    path.write_text(
        'namespace = "shop"\n[tiers]\n1s = "1s"\n'
        "[queues.push]\n[queues.push.retry]\nmax_attempt = 3\n",
        encoding="utf-8",
    )
    for command in ("plan", "declare"):
        result = cli(command, str(path))
        assert result.exit_code == 1
        assert str(path) in result.stderr
        assert "queues.push.retry.max_attempt: unknown key 'max_attempt'" in result.stderr
        assert "max_attempts" in result.stderr
        assert result.stdout == ""
    published = cli("publish", "{}", "-q", "push", "-t", "1s", "-f", str(path))
    assert published.exit_code == 1
    assert str(path) in published.stderr

    missing = cli("plan", str(tmp_path / "nope.toml"))
    assert missing.exit_code == 1
    assert "nope.toml: cannot read topology file" in missing.stderr
    broken = tmp_path / "broken.toml"
    broken.write_text("namespace = \n", encoding="utf-8")
    result = cli("declare", str(broken))
    assert result.exit_code == 1
    assert f"{broken}: not valid TOML" in result.stderr


@pytest.mark.parametrize(
    ("url", "secret", "code"),
    [
        ("GOOD", ":guest@", None),
        (BAD_URL, "s3cret", 1),
        ("amqp://user:s3cret@127.0.0.1:notaport/", "s3cret", 1),
        ("amqp://user:p%40ss-s3cret@127.0.0.1:1/", "s3cret", 1),
        ("REFUSED", "s3cret", 1),  # the broker under test, refused login
    ],
    ids=["good", "unreachable", "malformed", "encoded", "refused"],
)
def test_password_in_url_never_printed(
    topo: tuple[Topology, Path], broker_url: str, url: str, secret: str, code: int | None
) -> None:
    _topology, path = topo
    url = {"GOOD": broker_url, "REFUSED": with_password(broker_url, "s3cret")}.get(url, url)
    runs = [
        ("plan", str(path), "--url", url),
        ("plan", str(path), "--url", url, "--json"),
        ("declare", str(path), "--url", url),
        ("declare", str(path), "--url", url, "--json"),
        ("publish", "{}", "-q", "push", "-t", "1s", "-f", str(path), "--url", url),
        ("publish", "{}", "-q", "push", "-t", "1s", "-f", str(path), "--url", url, "--json"),
    ]
    for args in runs:
        result = cli(*args)
        if code is not None:
            assert result.exit_code == code, (args, result.stdout, result.stderr)
        else:
            assert result.exit_code in (0, 2), (args, result.stderr)
        assert secret not in result.stdout, args
        assert secret not in result.stderr, args
    # and by environment variable
    result = cli("plan", str(path), env={URL_ENV: url})
    assert secret not in result.stdout
    assert secret not in result.stderr


def test_password_never_printed_by_the_installed_script(
    topo: tuple[Topology, Path], broker_url: str
) -> None:
    _topology, path = topo
    for args in (
        ["plan", str(path), "--url", BAD_URL],
        ["declare", str(path), "--url", broker_url],
    ):
        done = subprocess.run(
            [*SCRIPT, *args, "--management-url", UNREACHABLE_MGMT],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert "s3cret" not in done.stdout + done.stderr
        assert ":guest@" not in done.stdout + done.stderr
    assert done.returncode == 0, done.stderr


# -- a broker that cannot be reached: one clean line --------------------------------------

SECRET = "s3cret-pw"
APP_MODULE = """\
from rabbit_delay import App

app = App({topology!r})


@app.consumer("push")
def push(message, ctx):
    pass
"""


def free_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def unreachable(broker_url: str, case: str) -> tuple[str, str]:
    """A URL that fails in the way `case` names, and a word the error line must contain."""
    parts = urlsplit(broker_url)
    no_vhost = urlunsplit((parts.scheme, parts.netloc, "/rd-no-such-vhost", "", ""))
    return {
        "password": (with_password(broker_url, SECRET), "user name and password"),
        "port": (f"amqp://guest:{SECRET}@127.0.0.1:{free_port()}/", "nothing is listening"),
        "dns": (f"amqp://guest:{SECRET}@no-such-host.invalid:5672/", "cannot resolve"),
        "vhost": (no_vhost, "virtual host"),
    }[case]


def one_error_line(done: subprocess.CompletedProcess[str], cause: str) -> None:
    """stderr is one `error:` line naming the cause; nothing else, nothing secret."""
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 1, done.stderr
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("error: "), done.stderr
    assert cause in lines[0], done.stderr
    assert "Traceback" not in done.stderr
    assert SECRET not in done.stdout + done.stderr


@pytest.fixture
def app_dir(topo: tuple[Topology, Path], tmp_path: Path) -> Path:
    """A directory holding `tiny_app.py`: one sync consumer on the topology's `push`."""
    _topology, path = topo
    folder = tmp_path / "app"
    folder.mkdir()
    (folder / "tiny_app.py").write_text(APP_MODULE.format(topology=str(path)), encoding="utf-8")
    return folder


def run_worker(app_dir: Path, url: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*SCRIPT, "worker", "tiny_app:app", "--app-dir", str(app_dir), "--url", url, *extra],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize("transport", ["sync", "async"])
@pytest.mark.parametrize("case", ["password", "port", "dns"])
def test_worker_that_cannot_connect_prints_one_line(
    app_dir: Path, broker_url: str, transport: str, case: str
) -> None:
    url, cause = unreachable(broker_url, case)
    done = run_worker(app_dir, url, "--transport", transport)
    one_error_line(done, cause)
    assert "pika" not in done.stderr
    assert "aiormq" not in done.stderr
    assert "stopped" not in done.stderr  # the worker never started: no zero counts


@pytest.mark.parametrize("transport", ["sync", "async"])
def test_worker_debug_log_shows_the_client_library_details(
    app_dir: Path, broker_url: str, transport: str
) -> None:
    url, cause = unreachable(broker_url, "port")
    done = run_worker(app_dir, url, "--transport", transport, "--log-level", "debug")
    assert done.returncode == 1, done.stderr
    assert ("pika" if transport == "sync" else "aiormq") in done.stderr
    assert "stopped" not in done.stderr  # a worker that never started has no counts to show
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: "), done.stderr
    assert cause in lines[-1]
    assert SECRET not in done.stdout + done.stderr


@pytest.mark.parametrize("case", ["password", "port", "dns", "vhost"])
def test_commands_that_cannot_connect_print_one_line(
    topo: tuple[Topology, Path], broker_url: str, case: str
) -> None:
    _topology, path = topo
    url, cause = unreachable(broker_url, case)
    for command in ("status", "plan", "declare"):
        done = subprocess.run(
            [*SCRIPT, command, str(path), "--url", url, "--management-url", UNREACHABLE_MGMT],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        one_error_line(done, cause)
