"""`rabbit-delay scheduled list|show|cancel|reschedule|sweep`: the schedule of a topology
with a [schedule] table, on a real SQLite file store beside a temporary topology file,
and the real broker for what publishes (reschedule, sweep).

Records are placed in the store directly (`SQLiteStore.schedule`, as a publisher and the
workers write them: scheduled, handled, parked) where a test needs states and due times
of its own; a reschedule and a sweep go through a real keyed publish first. The topology
is declared in a namespace of its own and deleted afterwards (`make_topology`).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import MakeTopology, message_count, wait_for
from typer.testing import CliRunner, Result

from rabbit_delay import Topology, load_topology
from rabbit_delay._cli.app import app
from rabbit_delay._envelope import now_ms
from rabbit_delay._schedule.records import (
    Entry,
    Finished,
    OnConflict,
    Payload,
    Ref,
    Update,
)
from rabbit_delay._urls import MANAGEMENT_URL_ENV, URL_ENV
from rabbit_delay.stores import SQLiteStore
from rabbit_delay.sync import Publisher, connected, declare

pytestmark = pytest.mark.integration

SECRET = "s3cret-pw"
MINUTE = 60_000
LONG_KEY = "k" * 256


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, broker_url: str) -> None:
    """Commands that publish reach the broker under test ($RABBIT_DELAY_URL); nothing
    else leaks in from the environment."""
    for name in (MANAGEMENT_URL_ENV, "RABBIT_DELAY_TOPOLOGY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(URL_ENV, broker_url)


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
    assert data["error"] in result.stderr
    return dict(data)


def one_line_error(result: Result) -> str:
    """An error a person reads: exit 1, one `error:` line, no traceback."""
    assert result.exit_code == 1, (result.stdout, result.stderr)
    assert result.stderr.startswith("error: "), result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    return result.stderr


# -- a topology with a schedule, and its store --------------------------------------------

TOML = """namespace = "{namespace}"
queue_type = "{queue_type}"
[tiers]
1s = "1s"
10m = "10m"
[queues."orders.cancel"]
[queues.push]
[schedule]
grace = "1s"
[idempotency]
path = "idem.sqlite3"
"""


@dataclass
class Scheduled:
    topology: Topology
    path: Path  # the topology file
    store_path: Path  # the SQLite file beside it

    @property
    def f(self) -> tuple[str, str]:
        return ("-f", str(self.path))

    @property
    def scope(self) -> str:
        return self.topology.names.prefix

    def place(self, key: str, queue: str, due_ms: int, *, now: int | None = None) -> None:
        """Record a keyed publish as the publisher records it (nothing is sent)."""
        entry = Entry(
            scope=self.scope,
            key=key,
            queue=queue,
            due_ms=due_ms,
            message_id=uuid.uuid4().hex,
            payload=Payload(b'{"order": 42}', "application/json", {}),
            on_conflict=OnConflict.REPLACE,
            sweep_ms=due_ms + 1_000,
        )
        with self.store() as store:
            store.schedule.place_many([entry], now_ms=now if now is not None else now_ms())

    def finish(self, key: str, finished: Finished, error: str | None = None) -> None:
        """What a worker records of the key's generation 1: handled, or parked."""
        update = Update(Ref(self.scope, key, 1), finished, 3_600_000, error=error)
        with self.store() as store:
            store.scheduled_batch(
                [(f"claim:{key}", "worker-1", finished is Finished.HANDLED, update)],
                [],
                now_ms=now_ms(),
                lease_ms=60_000,
                retention_ms=3_600_000,
            )

    def store(self) -> Any:
        return _Closing(SQLiteStore(self.store_path))


class _Closing:
    def __init__(self, store: SQLiteStore) -> None:
        self.store = store

    def __enter__(self) -> SQLiteStore:
        return self.store

    def __exit__(self, *exc: object) -> None:
        self.store.close()


@pytest.fixture
def sched(make_topology: MakeTopology, tmp_path: Path) -> Scheduled:
    """A topology with [schedule] (grace 1s) in a namespace of its own, its file, and the
    SQLite store beside it. Nothing declared yet: `declared` does that."""
    store_path = tmp_path / "idem.sqlite3"
    topology = make_topology(
        tiers={"1s": "1s", "10m": "10m"},
        queues={"orders.cancel": {}, "push": {}},
        schedule={"grace": "1s"},
        idempotency={"path": str(store_path)},
    )
    path = tmp_path / "topology.toml"
    path.write_text(
        TOML.format(namespace=topology.namespace, queue_type=topology.queue_type.value),
        encoding="utf-8",
    )
    assert load_topology(path).idempotency.path == str(store_path)
    return Scheduled(topology, path, store_path)


@pytest.fixture
def declared(sched: Scheduled, broker_url: str) -> Scheduled:
    with connected(broker_url, name="rabbit-delay test declare") as connection:
        declare(connection, sched.topology)
    return sched  # make_topology deletes it


def a_few(sched: Scheduled) -> dict[str, int]:
    """Seven records: five scheduled (two queues, one overdue), one handled, one parked.
    Their due times, by key."""
    now = now_ms()
    due = {
        "late": now - 3 * MINUTE,
        "p-1": now + 5 * MINUTE,
        "p-2": now + 6 * MINUTE,
        "o-1": now + 7 * MINUTE,
        "p-3": now + 2 * 60 * MINUTE,
        "done": now + 8 * MINUTE,
        "stuck": now + 9 * MINUTE,
    }
    for key, at in due.items():
        sched.place(key, "orders.cancel" if key.startswith("o") else "push", at)
    sched.finish("done", Finished.HANDLED)
    sched.finish(
        "stuck", Finished.PARKED, error=f"ValueError: cannot reach amqp://app:{SECRET}@db/ now"
    )
    return due


# -- list -----------------------------------------------------------------------------------


def test_list_shows_a_page_in_due_order(sched: Scheduled) -> None:
    due = a_few(sched)
    text = cli("scheduled", "list", *sched.f)
    assert text.exit_code == 0, text.stderr
    out = text.stdout
    for key in due:
        assert key in out
    # seconds show under an hour: on a loaded machine, a second or two may pass between
    # the records and the look ("in 4m59s", "3m1s ago")
    assert re.search(r"in (5m|4m5\ds)\b", out), out  # p-1, due in five minutes
    assert re.search(r"\b3m(\ds)? ago", out), out  # late, overdue
    assert "in 2h" in out
    assert "parked" in out
    assert "handled" in out
    assert SECRET not in out  # the parked one's last error names a URL: redacted
    assert out.rstrip().endswith("7 record(s)")
    assert out.index("late") < out.index("p-1") < out.index("p-3")

    data = json.loads(cli("scheduled", "list", *sched.f, "--json").stdout)
    assert set(data) == {"records", "next"}
    assert data["next"] is None
    keys = [r["key"] for r in data["records"]]
    assert keys == sorted(due, key=lambda k: due[k])  # in due order
    first = data["records"][0]
    assert first["due_ms"] == due["late"]
    assert first["state"] == "scheduled"
    assert first["due_at"].endswith("Z")
    states = {r["key"]: r["state"] for r in data["records"]}
    assert (states["done"], states["stuck"]) == ("handled", "parked")


def test_list_pages_with_the_cursor(sched: Scheduled) -> None:
    due = a_few(sched)
    ordered = sorted(due, key=lambda k: due[k])
    first = json.loads(cli("scheduled", "list", *sched.f, "--limit", "3", "--json").stdout)
    assert [r["key"] for r in first["records"]] == ordered[:3]
    assert first["next"] == f"{due[ordered[2]]}:{ordered[2]}"
    second = json.loads(
        cli("scheduled", "list", *sched.f, "-n", "3", "--after", first["next"], "--json").stdout
    )
    assert [r["key"] for r in second["records"]] == ordered[3:6]
    third = json.loads(
        cli("scheduled", "list", *sched.f, "-n", "3", "--after", second["next"], "--json").stdout
    )
    assert [r["key"] for r in third["records"]] == ordered[6:]
    assert third["next"] is None
    text = cli("scheduled", "list", *sched.f, "--limit", "3")
    assert f"3 record(s); next page: --after {first['next']}" in text.stdout
    bad = cli("scheduled", "list", *sched.f, "--after", "garbage", "--json")
    assert bad.exit_code == 1
    assert "malformed cursor 'garbage'" in json_error(bad)["error"]


def test_list_filters_by_queue_state_and_due_time(sched: Scheduled) -> None:
    a_few(sched)

    def keys(*args: str) -> list[str]:
        result = cli("scheduled", "list", *sched.f, *args, "--json")
        assert result.exit_code == 0, result.stderr
        return [r["key"] for r in json.loads(result.stdout)["records"]]

    assert keys("--queue", "orders.cancel") == ["o-1"]
    assert keys("-q", "push", "--state", "scheduled") == ["late", "p-1", "p-2", "p-3"]
    assert keys("--state", "parked") == ["stuck"]
    assert keys("--due-before", "now") == ["late"]
    assert keys("--due-after", "+1h") == ["p-3"]
    assert keys("--due-after=-1h", "--due-before", "+5m30s") == ["late", "p-1"]
    assert keys("--due-after", "-1h", "--due-before", "6m30s") == ["late", "p-1", "p-2"]
    far = "2099-01-01T00:00:00Z"
    assert keys("--due-after", "2000-01-01T00:00:00+02:00", "--due-before", far) == keys()
    assert keys("--due-after", far) == []
    empty = cli("scheduled", "list", *sched.f, "--due-after", far)
    assert empty.exit_code == 0
    assert empty.stdout.strip() == "no record matches"


@pytest.mark.parametrize(
    ("option", "value", "words"),
    [
        ("--due-before", "2026-12-05T10:00:00", "has no timezone"),
        ("--due-after", "2026-12-05", "has no timezone"),
        ("--due-before", "yesterday", "is not a time"),
        ("--due-after", "+soon", "is not a duration from now"),
        ("--due-after", "", "is not a time"),
    ],
    ids=["naive", "a-date", "garbage", "bad-duration", "empty"],
)
def test_list_refuses_a_bad_time_naming_the_option(
    sched: Scheduled, option: str, value: str, words: str
) -> None:
    text = cli("scheduled", "list", *sched.f, option, value)
    stderr = one_line_error(text)
    assert f"{option} {value!r} {words}" in stderr
    assert "+10m" in stderr  # the accepted forms are named
    as_json = cli("scheduled", "list", *sched.f, option, value, "--json")
    assert as_json.exit_code == 1
    error = json_error(as_json)
    assert error["kind"] == "usage"
    assert error["error"].startswith(f"{option} {value!r}")
    assert not sched.store_path.exists()  # refused before the store was opened


def test_list_refuses_an_unknown_queue_state_or_limit(sched: Scheduled) -> None:
    queue = cli("scheduled", "list", *sched.f, "--queue", "nope", "--json")
    assert queue.exit_code == 1
    assert json_error(queue) == {
        "error": "unknown queue 'nope'; the topology has: orders.cancel, push",
        "kind": "ConfigError",
    }
    state = cli("scheduled", "list", *sched.f, "--state", "bogus")
    assert "unknown state 'bogus'; states are: scheduled, cancelled, handled, parked" in (
        one_line_error(state)
    )
    superseded = cli("scheduled", "list", *sched.f, "--state", "superseded")
    assert "no record is superseded" in one_line_error(superseded)
    limit = cli("scheduled", "list", *sched.f, "--limit", "0")
    assert limit.exit_code == 1
    assert "--limit" in limit.stderr


# -- show ------------------------------------------------------------------------------------


def test_show_prints_the_whole_record(sched: Scheduled) -> None:
    due = a_few(sched)
    text = cli("scheduled", "show", "p-1", *sched.f)
    assert text.exit_code == 0, text.stderr
    out = text.stdout
    assert out.startswith("p-1\n")
    for line in (
        "  state: scheduled",
        "  queue: push",
        "  generation: 1",
        "  attempts: 0",
        "  body: 13 bytes (application/json)",
        "  message id: ",
        "  created: ",
        "  swept after: ",
    ):
        assert line in out, line
    assert "(in 5m)" in out

    data = json.loads(cli("scheduled", "show", "p-1", *sched.f, "--json").stdout)
    assert data["key"] == "p-1"
    assert (data["state"], data["queue"], data["generation"]) == ("scheduled", "push", 1)
    assert data["due_ms"] == due["p-1"]
    assert (data["body_bytes"], data["content_type"]) == (13, "application/json")
    assert {"attempts", "last_error", "created_at", "updated_at", "expires_at", "sweep_at"} <= (
        set(data)
    )

    parked = cli("scheduled", "show", "stuck", *sched.f)
    assert "  state: parked" in parked.stdout
    assert "amqp://app:***@db/" in parked.stdout
    assert "  purged after: " in parked.stdout
    assert SECRET not in parked.stdout
    parked_json = cli("scheduled", "show", "stuck", *sched.f, "--json").stdout
    assert SECRET not in parked_json
    assert (
        json.loads(parked_json)["last_error"] == "ValueError: cannot reach amqp://app:***@db/ now"
    )


def test_show_an_unknown_key_exits_1(sched: Scheduled) -> None:
    a_few(sched)
    text = cli("scheduled", "show", "nope", *sched.f)
    assert "unknown key 'nope'" in one_line_error(text)
    assert text.stdout == ""
    as_json = cli("scheduled", "show", "nope", *sched.f, "--json")
    assert as_json.exit_code == 1
    assert json_error(as_json) == {
        "error": "unknown key 'nope': never scheduled, or purged after its retention",
        "kind": "UnknownKey",
    }


@pytest.mark.parametrize(
    ("key", "words"),
    [("", "KEY is empty"), (LONG_KEY, "KEY is 256 bytes long"), ("é" * 128, "256 bytes")],
    ids=["empty", "256-bytes", "256-bytes-of-utf8"],
)
@pytest.mark.parametrize("command", ["show", "cancel", "reschedule"])
def test_a_bad_key_is_refused_before_anything_is_opened(
    tmp_path: Path, command: str, key: str, words: str
) -> None:
    missing = tmp_path / "nowhere.toml"  # never read: the key is refused first
    extra = ["--in", "10m"] if command == "reschedule" else []
    text = cli("scheduled", command, key, "-f", str(missing), *extra)
    stderr = one_line_error(text)
    assert words in stderr
    assert "at most 255 bytes" in stderr
    assert LONG_KEY not in stderr  # a long key is not echoed whole
    as_json = cli("scheduled", command, key, "-f", str(missing), *extra, "--json")
    assert json_error(as_json)["kind"] == "usage"


def test_a_key_of_255_bytes_is_a_key(sched: Scheduled) -> None:
    key = "k" * 255
    sched.place(key, "push", now_ms() + MINUTE)
    assert json.loads(cli("scheduled", "show", key, *sched.f, "--json").stdout)["key"] == key


# -- cancel ----------------------------------------------------------------------------------


def test_cancel_says_what_it_found(sched: Scheduled) -> None:
    a_few(sched)
    scheduled = cli("scheduled", "cancel", "p-1", *sched.f)
    assert scheduled.exit_code == 0, scheduled.stderr
    assert scheduled.stdout.startswith("cancelled p-1: it was scheduled")
    again = cli("scheduled", "cancel", "p-1", *sched.f, "--json")
    assert again.exit_code == 0
    data = json.loads(again.stdout)
    assert (data["key"], data["found"], data["cancelled"]) == ("p-1", "cancelled", False)
    assert data["note"] == "p-1 was already cancelled: nothing to do"
    assert data["record"]["state"] == "cancelled"

    parked = json.loads(cli("scheduled", "cancel", "stuck", *sched.f, "--json").stdout)
    assert (parked["found"], parked["cancelled"]) == ("parked", True)
    assert "a replay of it is dropped" in parked["note"]
    assert SECRET not in json.dumps(parked)

    handled = cli("scheduled", "cancel", "done", *sched.f)
    assert handled.exit_code == 0
    assert handled.stdout.strip() == "done was already handled: nothing to cancel"

    unknown = cli("scheduled", "cancel", "nope", *sched.f, "--json")
    assert unknown.exit_code == 1
    assert json_error(unknown)["kind"] == "UnknownKey"
    assert "unknown key 'nope'" in one_line_error(cli("scheduled", "cancel", "nope", *sched.f))

    states = {
        r["key"]: r["state"]
        for r in json.loads(cli("scheduled", "list", *sched.f, "--json").stdout)["records"]
    }
    assert states == {
        "late": "scheduled",
        "p-1": "cancelled",
        "p-2": "scheduled",
        "o-1": "scheduled",
        "done": "handled",
        "stuck": "cancelled",
        "p-3": "scheduled",
    }


# -- what cannot be read -------------------------------------------------------------------


def test_a_topology_without_a_readable_schedule_is_refused(tmp_path: Path) -> None:
    plain = tmp_path / "plain.toml"
    plain.write_text('namespace = "shop"\n[tiers]\n1s = "1s"\n[queues.push]\n', encoding="utf-8")
    refused = cli("scheduled", "list", "-f", str(plain), "--json")
    assert refused.exit_code == 1
    error = json_error(refused)
    assert error["kind"] == "ConfigError"
    assert "has no schedule: add a [schedule] table" in error["error"]
    memory = tmp_path / "memory.toml"
    memory.write_text(
        'namespace = "shop"\n[tiers]\n1s = "1s"\n[queues.push]\n[schedule]\n'
        '[idempotency]\nstore = "memory"\n',
        encoding="utf-8",
    )
    stderr = one_line_error(cli("scheduled", "show", "k", "-f", str(memory)))
    assert 'store = "memory" keeps the schedule inside the process that publishes' in stderr


def test_a_store_error_is_one_line(sched: Scheduled, tmp_path: Path) -> None:
    broken = tmp_path / "broken.toml"
    text = sched.path.read_text().replace(
        'path = "idem.sqlite3"', 'path = "no/such/folder/idem.sqlite3"'
    )
    broken.write_text(text, encoding="utf-8")
    for args in (["list"], ["show", "k"], ["cancel", "k"]):
        result = cli("scheduled", *args, "-f", str(broken))
        stderr = one_line_error(result)
        assert "opening the schedule's store failed" in stderr, args
        as_json = cli("scheduled", *args, "-f", str(broken), "--json")
        assert json_error(as_json)["kind"] == "StoreError"


# -- reschedule and sweep: on the broker ----------------------------------------------------


def test_reschedule_moves_a_key_and_publishes_its_next_generation(
    declared: Scheduled, broker_url: str
) -> None:
    topology = declared.topology
    buffer = topology.names.tier_queue("10m")
    with Publisher(topology, broker_url) as publisher:
        first = publisher.publish_delayed({"order": 1}, "10m", queue="push", key="order-1")
        publisher.publish_delayed({"order": 2}, "10m", queue="push", key="order-2")
    assert first.generation == 1
    assert wait_for(lambda: message_count(broker_url, buffer) == 2, 10, "two buffered")

    before = now_ms()
    text = cli("scheduled", "reschedule", "order-1", "--in", "5m", *declared.f)
    assert text.exit_code == 0, text.stderr
    assert text.stdout.startswith("rescheduled order-1: generation 2, due ")
    assert "(in 5m)" in text.stdout
    assert wait_for(lambda: message_count(broker_url, buffer) == 3, 10, "the next generation")

    at = "2099-01-01T00:00:00Z"  # beyond what the tiers reach: refused before any write
    too_far = cli("scheduled", "reschedule", "order-2", "--at", at, *declared.f, "--json")
    assert too_far.exit_code == 1
    assert json_error(too_far)["kind"] == "DelayError"

    moved = cli("scheduled", "reschedule", "order-2", "--at", "+6m", *declared.f, "--json")
    assert moved.exit_code == 0, moved.stderr
    data = json.loads(moved.stdout)
    assert (data["key"], data["found"], data["rescheduled"]) == ("order-2", "scheduled", True)
    record = data["record"]
    assert (record["generation"], record["state"]) == (2, "scheduled")
    assert before + 6 * MINUTE <= record["due_ms"] <= now_ms() + 6 * MINUTE
    assert wait_for(lambda: message_count(broker_url, buffer) == 4, 10, "the next generation")

    shown = json.loads(cli("scheduled", "show", "order-1", *declared.f, "--json").stdout)
    assert (shown["generation"], shown["replaced"]) == (2, 1)
    assert before + 5 * MINUTE <= shown["due_ms"] <= now_ms() + 5 * MINUTE


def test_reschedule_refuses_what_it_cannot_move(declared: Scheduled, broker_url: str) -> None:
    topology = declared.topology
    with Publisher(topology, broker_url) as publisher:
        publisher.publish_delayed({"order": 3}, "10m", queue="push", key="order-3")
    buffer = topology.names.tier_queue("10m")
    assert wait_for(lambda: message_count(broker_url, buffer) == 1, 10, "one buffered")
    f = declared.f

    unknown = cli("scheduled", "reschedule", "nope", "--in", "5m", *f, "--json")
    assert unknown.exit_code == 1
    assert json_error(unknown)["kind"] == "UnknownKey"

    assert cli("scheduled", "cancel", "order-3", *f).exit_code == 0
    cancelled = cli("scheduled", "reschedule", "order-3", "--in", "5m", *f)
    assert "order-3 is cancelled, not scheduled: nothing was moved" in one_line_error(cancelled)
    as_json = cli("scheduled", "reschedule", "order-3", "--in", "5m", *f, "--json")
    assert as_json.exit_code == 1
    data = json.loads(as_json.stdout)
    assert (data["found"], data["rescheduled"], data["kind"]) == (
        "cancelled",
        False,
        "NotScheduled",
    )
    assert data["record"]["generation"] == 1

    past = cli("scheduled", "reschedule", "order-3", "--at", "-5m", *f)
    assert "in the past" in one_line_error(past)
    naive = cli("scheduled", "reschedule", "order-3", "--at", "2026-12-05T10:00:00", *f)
    assert "--at '2026-12-05T10:00:00' has no timezone" in one_line_error(naive)
    neither = cli("scheduled", "reschedule", "order-3", *f, "--json")
    assert json_error(neither)["error"].startswith("say when: --in DURATION")
    both = cli("scheduled", "reschedule", "order-3", "--in", "5m", "--at", "+5m", *f)
    assert "give either --in or --at, not both" in one_line_error(both)
    bad = cli("scheduled", "reschedule", "order-3", "--in", "soon", *f, "--json")
    assert json_error(bad) == {
        "error": "--in: 'soon' is not a duration; use a number of seconds, a timedelta, or a "
        "string such as '500ms', '90s', '5m', '2h', '1d', '1h30m'",
        "kind": "DurationError",
    }
    assert message_count(broker_url, buffer) == 1  # nothing was published


def test_sweep_republishes_what_should_have_fired(declared: Scheduled, broker_url: str) -> None:
    topology = declared.topology
    business = topology.names.business_queue("push")
    with Publisher(topology, broker_url) as publisher:
        publisher.publish_delayed({"order": 4}, "1s", queue="push", key="order-4")
    # Swept at once: due in 1 s, nothing is past due + grace 1 s (a loaded machine once
    # took over 2 s to deliver the 1 s delay, and a sweep after it found it overdue).
    quiet = cli("scheduled", "sweep", *declared.f)
    assert quiet.exit_code == 0, quiet.stderr
    assert quiet.stdout.startswith("nothing to republish: no record is still scheduled past")
    # No worker: the message waits in its queue, its record stays scheduled.
    assert wait_for(lambda: message_count(broker_url, business) == 1, 15, "the first copy")

    def swept() -> dict[str, Any] | None:  # due 1s + grace 1s later
        result = cli("scheduled", "sweep", *declared.f, "--json")
        assert result.exit_code == 0, result.stderr
        data: dict[str, Any] = json.loads(result.stdout)
        return data if data["republished"] else None

    data = wait_for(swept, 15, "the sweep to republish order-4", interval=0.5)
    assert data["republished"] == ["order-4"]
    assert data["grace_ms"] >= 1_000
    assert set(data) == {"grace_ms", "lateness_ms", "republished", "message_ids"}
    assert len(data["message_ids"]) == 1
    assert wait_for(lambda: message_count(broker_url, business) == 2, 10, "the swept copy")
    record = json.loads(cli("scheduled", "show", "order-4", *declared.f, "--json").stdout)
    assert (record["state"], record["republished"]) == ("scheduled", 1)


def test_broker_errors_are_one_line_without_the_password(declared: Scheduled) -> None:
    url = f"amqp://app:{SECRET}@127.0.0.1:1/"  # nothing listens on port 1
    for args in (["reschedule", "k", "--in", "5m"], ["sweep"]):
        result = cli("scheduled", *args, *declared.f, "--url", url)
        stderr = one_line_error(result)
        assert "nothing is listening on 127.0.0.1:1" in stderr
        assert "amqp://app:***@127.0.0.1:1/" in stderr
        as_json = cli("scheduled", *args, *declared.f, "--url", url, "--json")
        assert json_error(as_json)["kind"] == "BrokerUnavailable"
        assert SECRET not in result.stdout + result.stderr + as_json.stdout + as_json.stderr
    http = cli("scheduled", "sweep", *declared.f, "--url", f"http://app:{SECRET}@h/")
    assert "is not a broker URL" in one_line_error(http)
    assert SECRET not in http.stderr


def test_help_names_every_command() -> None:
    helped = cli("scheduled", "--help")
    assert helped.exit_code == 0
    for command in ("list", "show", "cancel", "reschedule", "sweep"):
        assert command in helped.stdout
    for command in ("list", "show", "cancel", "reschedule", "sweep"):
        assert "--topology" in cli("scheduled", command, "--help").stdout
    assert "--url" in cli("scheduled", "reschedule", "--help").stdout
    assert "--url" not in cli("scheduled", "list", "--help").stdout
