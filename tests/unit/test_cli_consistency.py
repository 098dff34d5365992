"""The command line behaves alike on every command (issue 11, point 5), without a broker:
`--version` and `python -m rabbit_delay`; with `--json`, errors are one JSON document
on stdout (same exit codes, redacted); the topology file as `-f FILE` everywhere (and
as FILE where it always was); URLs other than amqp:// / amqps:// refused by every
command, the worker included; times as ISO-8601 UTC and durations as `5m`, never a
timedelta's repr.

Every command here stops before it connects (a bad file, a bad URL, a bad option), so
nothing reaches a broker; the real runs are in tests/integration/test_cli.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from importlib.metadata import version
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

import rabbit_delay
from rabbit_delay import DelayError, DurationError, topology_from_dict
from rabbit_delay._cli.app import app
from rabbit_delay._cli.options import wants_json
from rabbit_delay._durations import format_ms, iso, iso_ms, parse_ms
from rabbit_delay._publishing.core import PublisherCore
from rabbit_delay._urls import URL_ENV

SECRET = "s3cret-pw"
# Each command that takes a topology, with what it needs besides (never a broker: the
# topology or the URL is refused first).
COMMANDS = {
    "plan": ["plan"],
    "declare": ["declare"],
    "status": ["status"],
    "replay": ["replay", "push"],
    "publish": ["publish", "{}", "-q", "push", "-t", "1s"],
    "permissions": ["permissions", "worker"],
    "dashboard": ["dashboard"],
    "hold": ["hold"],
    "asyncapi": ["asyncapi"],
    "scheduled reschedule": ["scheduled", "reschedule", "order-42", "--in", "5m"],
    "scheduled sweep": ["scheduled", "sweep"],
}
# The commands that take a topology but no broker URL (they read its idempotency store).
STORE_COMMANDS = {
    "scheduled list": ["scheduled", "list"],
    "scheduled show": ["scheduled", "show", "order-42"],
    "scheduled cancel": ["scheduled", "cancel", "order-42"],
}
TOPOLOGY_COMMANDS = COMMANDS | STORE_COMMANDS
# Command groups: their commands are two words (`scheduled list`).
GROUPS = ("scheduled",)
# The commands that also take the file as their FILE argument (as they always did).
POSITIONAL = ("plan", "declare", "status", "replay", "dashboard", "asyncapi", "hold")
GOOD_TOML = 'namespace = "shop"\n[tiers]\n1s = "1s"\n[queues.push]\n'


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (URL_ENV, "RABBIT_DELAY_MANAGEMENT_URL", "RABBIT_DELAY_TOPOLOGY"):
        monkeypatch.delenv(name, raising=False)


def cli(*args: str) -> Result:
    result = CliRunner().invoke(app, list(args))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def json_error(result: Result) -> dict[str, str]:
    """stdout is exactly one JSON document {"error", "kind"}; stderr the `error:` line."""
    data = json.loads(result.stdout)
    assert set(data) == {"error", "kind"}, data
    assert result.stderr.startswith("error: "), result.stderr
    assert data["error"] in result.stderr  # the same words for humans and programs
    return dict(data)


@pytest.fixture
def bad_file(tmp_path: Path) -> Path:
    path = tmp_path / "bad.toml"
    path.write_text('namespace = "shop"\ncolour = 1\n', encoding="utf-8")
    return path


@pytest.fixture
def good_file(tmp_path: Path) -> Path:
    path = tmp_path / "good.toml"
    path.write_text(GOOD_TOML, encoding="utf-8")
    return path


# -- --version, python -m ---------------------------------------------------------------


def test_version_prints_the_installed_version() -> None:
    result = cli("--version")
    assert result.exit_code == 0, result.stderr
    assert result.stdout == f"rabbit-delay {version('rabbit-delay')}\n"
    assert rabbit_delay.__version__ == version("rabbit-delay")  # one version, not two


def test_python_dash_m_runs_the_cli() -> None:
    env = {k: v for k, v in os.environ.items() if k != URL_ENV}
    helped = subprocess.run(
        [sys.executable, "-m", "rabbit_delay", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
    )
    assert helped.returncode == 0, helped.stderr
    assert "--version" in helped.stdout
    for command in ("plan", "declare", "publish", "status", "replay", "worker"):
        assert command in helped.stdout


# -- JSON errors --------------------------------------------------------------------------


@pytest.mark.parametrize("command", TOPOLOGY_COMMANDS, ids=list(TOPOLOGY_COMMANDS))
def test_json_errors_are_json_with_the_same_exit_code(command: str, bad_file: Path) -> None:
    args = [*TOPOLOGY_COMMANDS[command], "-f", str(bad_file)]
    text = cli(*args)
    as_json = cli(*args, "--json")
    assert text.exit_code == as_json.exit_code == 1
    assert text.stdout == ""
    error = json_error(as_json)
    assert error["kind"] == "TopologyError"
    assert str(bad_file) in error["error"]
    assert "colour: unknown key" in error["error"]


def test_a_broker_error_under_json_names_its_class(good_file: Path) -> None:
    url = f"amqp://guest:{SECRET}@127.0.0.1:1/"  # nothing listens on port 1
    result = cli("plan", str(good_file), "--url", url, "--json")
    assert result.exit_code == 1
    error = json_error(result)
    assert error["kind"] == "BrokerUnavailable"
    assert "nothing is listening on 127.0.0.1:1" in error["error"]
    assert SECRET not in result.stdout + result.stderr


def test_json_errors_are_redacted(good_file: Path) -> None:
    url = f"http://app:{SECRET}@rabbit.example/"
    for command in COMMANDS:
        result = cli(*COMMANDS[command], "-f", str(good_file), "--url", url, "--json")
        assert result.exit_code == 1, (command, result.stdout, result.stderr)
        error = json_error(result)
        assert error["kind"] == "ConfigError", command
        assert "http://app:***@rabbit.example/" in error["error"]
        assert SECRET not in result.stdout + result.stderr, command


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["plan", "--bogus"], "No such option: --bogus"),
        (["replay", "push", "--limit", "0"], "--limit"),
        (["publish", "-q", "push"], "Missing argument 'message'"),
        (["status", "--url"], "requires an argument"),
        (["nosuchcommand"], "No such command 'nosuchcommand'"),
        (["scheduled", "list", "--limit", "0"], "--limit"),
        (["scheduled", "show"], "Missing argument 'key'"),
        (["scheduled", "list", "--url", "amqp://h/"], "No such option: --url"),
    ],
    ids=[
        "unknown-option",
        "bad-value",
        "missing-argument",
        "option-without-value",
        "command",
        "scheduled-bad-value",
        "scheduled-missing-key",
        "scheduled-list-takes-no-url",
    ],
)
def test_usage_errors_exit_1_and_are_json_under_json(args: list[str], words: str) -> None:
    text = cli(*args)
    assert text.exit_code == 1  # an error, as every command documents: not click's 2
    assert words in text.stderr
    assert text.stdout == ""
    # --json before the bad part, where click has not parsed it yet
    head = 2 if args[0] in GROUPS else 1
    as_json = cli(*args[:head], "--json", *args[head:]) if args[0] != "nosuchcommand" else None
    if as_json is not None:
        assert as_json.exit_code == 1
        error = json_error(as_json)
        assert error["kind"] == "usage"
        assert words in error["error"]


def test_usage_errors_before_the_command_exit_1_too() -> None:
    bogus = cli("--bogus")
    assert bogus.exit_code == 1
    assert "No such option: --bogus" in bogus.stderr
    misplaced = cli("--json", "plan")  # --json belongs to the command
    assert misplaced.exit_code == 1
    error = json_error(misplaced)
    assert error["kind"] == "usage"
    assert error["error"].startswith("No such option: --json")
    helped = cli()  # no command at all: the help screen
    assert "Usage" in helped.stdout + helped.stderr
    assert "plan" in helped.stdout + helped.stderr


def test_errors_of_a_command_itself_are_json(good_file: Path) -> None:
    both = cli("replay", "push", "-f", str(good_file), "--tier", "1s", "--now", "--json")
    assert both.exit_code == 1
    assert json_error(both) == {"error": "give either --tier or --now, not both", "kind": "usage"}
    not_json = cli("publish", "not json", "-q", "push", "-t", "1s", "-f", str(good_file), "--json")
    assert not_json.exit_code == 1
    assert json_error(not_json)["error"].startswith("MESSAGE is not valid JSON")
    delay = cli("publish", "{}", "-q", "push", "-d", "soon", "-f", str(good_file), "--json")
    assert delay.exit_code == 1
    assert json_error(delay) == {
        "error": "--delay: 'soon' is not a duration; use a number of seconds, a timedelta, "
        "or a string such as '500ms', '90s', '5m', '2h', '1d', '1h30m'",
        "kind": "DurationError",
    }


def test_json_is_asked_for_by_the_flag_before_a_double_dash() -> None:
    assert wants_json(["plan", "--json"])
    assert wants_json(["--json"])
    assert not wants_json(["plan"])
    assert not wants_json(["publish", "--", "--json"])  # a value, not the flag


# -- the topology file -------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["-f", "--topology"])
@pytest.mark.parametrize("command", TOPOLOGY_COMMANDS, ids=list(TOPOLOGY_COMMANDS))
def test_every_command_takes_the_topology_as_dash_f(
    command: str, flag: str, bad_file: Path
) -> None:
    result = cli(*TOPOLOGY_COMMANDS[command], flag, str(bad_file))
    assert result.exit_code == 1
    assert str(bad_file) in result.stderr  # the file given was the one read
    assert "colour: unknown key" in result.stderr


@pytest.mark.parametrize("command", POSITIONAL)
def test_the_file_argument_still_works_where_it_did(command: str, bad_file: Path) -> None:
    result = cli(*COMMANDS[command], str(bad_file))
    assert result.exit_code == 1
    assert str(bad_file) in result.stderr
    assert "colour: unknown key" in result.stderr


@pytest.mark.parametrize("command", POSITIONAL)
def test_a_topology_given_twice_is_refused(command: str, bad_file: Path, good_file: Path) -> None:
    result = cli(*COMMANDS[command], str(good_file), "-f", str(bad_file))
    assert result.exit_code == 1
    assert "the topology file is given twice" in result.stderr
    assert "colour" not in result.stderr  # refused before either was read


def test_every_command_help_shows_dash_f() -> None:
    for args in TOPOLOGY_COMMANDS.values():
        command = args[:2] if args[0] in GROUPS else args[:1]
        result = cli(*command, "--help")
        assert result.exit_code == 0
        assert "--topology" in result.stdout, command


# -- broker URLs -------------------------------------------------------------------------


@pytest.mark.parametrize("url", ["http://guest:guest@127.0.0.1:15672/", "redis://127.0.0.1/"])
@pytest.mark.parametrize("command", COMMANDS, ids=list(COMMANDS))
def test_every_command_refuses_a_url_that_is_not_amqp(
    command: str, url: str, good_file: Path
) -> None:
    result = cli(*COMMANDS[command], "-f", str(good_file), "--url", url)
    assert result.exit_code == 1
    assert "is not a broker URL: only amqp:// and amqps:// are accepted" in result.stderr
    assert "guest:guest" not in result.stderr


def test_a_url_that_is_not_amqp_in_the_environment_is_refused(good_file: Path) -> None:
    result = CliRunner().invoke(app, ["plan", str(good_file)], env={URL_ENV: "http://h:15672/"})
    assert result.exit_code == 1
    assert "$RABBIT_DELAY_URL: 'http://h:15672/' is not a broker URL" in result.stderr


def test_the_worker_refuses_a_url_that_is_not_amqp(tmp_path: Path, good_file: Path) -> None:
    """Refused before the app is imported (the module would raise if it were)."""
    (tmp_path / "loud_app.py").write_text("raise SystemExit('imported')\n", encoding="utf-8")
    done = subprocess.run(
        [
            *(sys.executable, "-m", "rabbit_delay", "worker", "loud_app:app"),
            *("--app-dir", str(tmp_path), "--url", f"http://guest:{SECRET}@127.0.0.1:15672/"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1, done.stderr
    assert "is not a broker URL: only amqp:// and amqps:// are accepted" in done.stderr
    assert "imported" not in done.stderr
    assert SECRET not in done.stderr


# -- times and durations -----------------------------------------------------------------


def test_instants_are_iso_utc_to_the_millisecond() -> None:
    assert iso_ms(1_796_150_495_995) == "2026-12-01T18:41:35.995Z"
    # a float division would show .994 here and there: every millisecond is exact
    for ms in range(1_796_150_495_000, 1_796_150_496_000):
        assert iso_ms(ms).endswith(f".{ms % 1000:03d}Z")
    assert iso_ms(None) is None
    assert iso(datetime(2026, 12, 2, 11, 0, tzinfo=UTC) + timedelta(hours=0)) == (
        "2026-12-02T11:00:00.000Z"
    )
    back = datetime.fromisoformat(iso_ms(1_796_150_495_995))
    assert back == datetime(2026, 12, 1, 18, 41, 35, 995000, tzinfo=UTC)


def test_durations_read_as_users_write_them() -> None:
    assert format_ms(-300_000) == "-5m"
    assert format_ms(5_400_000) == "1h30m"


@pytest.mark.parametrize(
    ("delay", "shown"),
    [(timedelta(seconds=-1), "-1s"), (timedelta(minutes=-5), "-5m"), (-90, "-1m30s")],
)
def test_a_negative_delay_reads_like_a_duration(delay: timedelta | int, shown: str) -> None:
    topology = topology_from_dict(
        {"namespace": "shop", "tiers": {"5m": "5m"}, "queues": {"push": {}}}
    )
    with pytest.raises(DelayError) as caught:
        PublisherCore(topology).route(queue="push", delay=delay)
    assert str(caught.value) == f"delay {shown} is negative; a delay must be zero or more"
    with pytest.raises(DurationError) as parsed:
        parse_ms(delay)
    assert "timedelta" not in str(parsed.value)
    assert shown in str(parsed.value)


def test_an_at_in_the_past_says_when_in_utc() -> None:
    topology = topology_from_dict(
        {"namespace": "shop", "tiers": {"5m": "5m"}, "queues": {"push": {}}}
    )
    now = 1_796_150_495_995
    at = datetime.fromtimestamp(1_796_150_195, UTC)  # 5m0.995s before
    with pytest.raises(DelayError) as caught:
        PublisherCore(topology).route(queue="push", at=at, now=now)
    assert str(caught.value) == (
        "at=2026-12-01T18:36:35.000Z is 5m995ms in the past; a delayed message must be due later"
    )
    with pytest.raises(DelayError) as naive:
        PublisherCore(topology).route(queue="push", at=datetime(2026, 12, 2, 10, 0))
    assert "datetime.datetime" not in str(naive.value)
    assert "at=2026-12-02T10:00:00.000 has no timezone" in str(naive.value)
