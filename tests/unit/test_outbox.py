"""The outbox without a broker: what add() stores and refuses, what a relayed row becomes
(the due time counts from the row's creation), how each publish outcome settles a row,
and the SQLite table itself (real files: transactions, leases, retention)."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from rabbit_delay import (
    ConfigError,
    DelayError,
    DuplicateMessageError,
    EncodeError,
    OutboxError,
    Topology,
    UnknownTargetError,
    topology_from_dict,
)
from rabbit_delay import _headers as h
from rabbit_delay._publishing.confirms import Ledger, State
from rabbit_delay._topology.delays import IMMEDIATE, Router
from rabbit_delay.outbox import Outbox, parse_database
from rabbit_delay.outbox._core import (
    INVALID,
    UNROUTABLE,
    Row,
    outgoing,
    plan_batch,
    refused_until,
    settle,
)
from rabbit_delay.outbox._sql import SQLiteRelayStore, schema

NOW = 1_800_000_000_000


@pytest.fixture
def topology() -> Topology:
    return topology_from_dict(
        {
            "namespace": "shop",
            "tiers": {"1s": "1s", "3s": "3s", "30m": "30m"},
            "queues": {
                "orders.cancel": {"tiers": ["30m"], "bindings": ["order.timeout"]},
                "push": {},  # every tier
            },
        }
    )


@pytest.fixture
def cascade() -> Topology:
    return topology_from_dict(
        {
            "namespace": "shop",
            "tiers": {"1s": "1s"},
            "queues": {"push": {}},
            "cascade": {"levels": 12, "resolution": "100ms"},
        }
    )


def clock_at(ms: int) -> Any:
    return lambda: ms


def row(outbox: Outbox, conn: sqlite3.Connection, message_id: str) -> dict[str, Any]:
    cur = conn.execute(f"SELECT * FROM {outbox.table} WHERE message_id = ?", (message_id,))
    names = [d[0] for d in cur.description]
    found = cur.fetchone()
    assert found is not None, f"no row {message_id!r}"
    return dict(zip(names, found, strict=True))


def as_row(values: dict[str, Any]) -> Row:
    return Row(
        id=values["id"],
        message_id=values["message_id"],
        queue=values["queue"],
        routing_key=values["routing_key"],
        tier=values["tier"],
        delay_ms=values["delay_ms"],
        created_at=values["created_at"],
        body=values["body"],
        content_type=values["content_type"],
        headers=values["headers"],
        attempts=values["attempts"],
    )


@pytest.fixture
def db(tmp_path: Path) -> Iterator[sqlite3.Connection]:
    conn = sqlite3.connect(tmp_path / "app.db")
    yield conn
    conn.close()


# -- add(): validated, encoded, in the caller's transaction ------------------------------


def test_add_writes_the_row_in_the_callers_transaction(
    topology: Topology, db: sqlite3.Connection
) -> None:
    outbox = Outbox(topology, clock=clock_at(NOW))
    outbox.install(db)
    message_id = outbox.add(
        db, {"order_id": 42}, "30m", queue="orders.cancel", headers={"source": "web", "n": 1}
    )
    assert db.in_transaction, "add() must leave the transaction open: it never commits"
    other = sqlite3.connect(db.execute("PRAGMA database_list").fetchone()[2])
    try:
        assert other.execute(f"SELECT count(*) FROM {outbox.table}").fetchone()[0] == 0
        db.commit()
        assert other.execute(f"SELECT count(*) FROM {outbox.table}").fetchone()[0] == 1
    finally:
        other.close()
    stored = row(outbox, db, message_id)
    assert len(message_id) == 32  # generated
    assert stored["queue"] == "orders.cancel"
    assert stored["routing_key"] is None
    assert (stored["tier"], stored["delay_ms"]) == ("30m", 1_800_000)
    assert (stored["created_at"], stored["due_at"]) == (NOW, NOW + 1_800_000)
    assert stored["body"] == b'{"order_id":42}'
    assert stored["content_type"] == "application/json"
    assert json.loads(stored["headers"]) == {"source": "web", "n": 1}
    assert stored["sent_at"] is None
    assert outbox.pending(db) == 1


def test_a_rolled_back_row_is_gone(topology: Topology, db: sqlite3.Connection) -> None:
    outbox = Outbox(topology)
    outbox.install(db)
    db.commit()
    outbox.add(db, {"order_id": 1}, "30m", queue="orders.cancel")
    db.rollback()
    assert outbox.pending(db) == 0


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"tier": "2h", "queue": "push"}, DelayError, "unknown tier '2h'"),
        ({"tier": "1s", "queue": "orders.cancel"}, DelayError, "does not accept tier '1s'"),
        ({"tier": "1s", "queue": "nope"}, UnknownTargetError, "unknown queue 'nope'"),
        ({"tier": "30m", "routing_key": "nope"}, UnknownTargetError, "routing key 'nope'"),
        ({"delay": 17, "queue": "push"}, DelayError, "no tier has a delay of 17s"),
        ({"delay": 5, "tier": timedelta(seconds=5), "queue": "push"}, ConfigError, "once"),
        ({"tier": "1s", "queue": "push", "message_id": ""}, EncodeError, "message_id"),
        ({"tier": "1s", "queue": "push", "headers": {"b": b"x"}}, EncodeError, "JSON"),
        ({"tier": "1s", "queue": "push", "msg": object()}, EncodeError, "cannot publish"),
        (
            {"queue": "push", "at": datetime(2020, 1, 1, tzinfo=UTC)},
            DelayError,
            "in the past",
        ),
    ],
)
def test_bad_input_fails_inside_the_transaction_and_writes_nothing(
    topology: Topology,
    db: sqlite3.Connection,
    kwargs: dict[str, Any],
    error: type[Exception],
    match: str,
) -> None:
    outbox = Outbox(topology)
    outbox.install(db)
    db.execute("CREATE TABLE orders (id INTEGER)")
    db.execute("INSERT INTO orders VALUES (1)")  # the application's own write
    msg = kwargs.pop("msg", {"order_id": 1})
    with pytest.raises(error, match=match):
        outbox.add(db, msg, **kwargs)
    assert db.in_transaction, "the caller's transaction is left as it was"
    assert outbox.pending(db) == 0
    db.commit()
    assert db.execute("SELECT count(*) FROM orders").fetchone()[0] == 1


def test_a_timedelta_as_the_tier_is_a_delay(topology: Topology, db: sqlite3.Connection) -> None:
    outbox = Outbox(topology, clock=clock_at(NOW))
    outbox.install(db)
    message_id = outbox.add(db, b"raw", timedelta(seconds=3), queue="push")
    stored = row(outbox, db, message_id)
    assert (stored["tier"], stored["delay_ms"], stored["content_type"]) == (
        "3s",
        3_000,
        "application/octet-stream",
    )


def test_duplicate_message_id_is_refused_and_the_transaction_survives(
    topology: Topology, db: sqlite3.Connection
) -> None:
    outbox = Outbox(topology)
    outbox.install(db)
    outbox.add(db, {"n": 1}, "1s", queue="push", message_id="order-1-timeout")
    with pytest.raises(DuplicateMessageError, match="order-1-timeout") as caught:
        outbox.add(db, {"n": 2}, "1s", queue="push", message_id="order-1-timeout")
    assert caught.value.message_ids == ("order-1-timeout",)
    assert isinstance(caught.value, ValueError)
    outbox.add(db, {"n": 3}, "1s", queue="push", message_id="order-2-timeout")
    db.commit()
    assert outbox.pending(db) == 2


def test_autocommit_without_a_transaction_is_refused(tmp_path: Path, topology: Topology) -> None:
    conn = sqlite3.connect(tmp_path / "auto.db", isolation_level=None)
    try:
        outbox = Outbox(topology)
        outbox.install(conn)
        with pytest.raises(ConfigError, match="autocommit"):
            outbox.add(conn, {"n": 1}, "1s", queue="push")
        assert outbox.pending(conn) == 0
        conn.execute("BEGIN IMMEDIATE")
        outbox.add(conn, {"n": 1}, "1s", queue="push")
        conn.execute("COMMIT")
        assert outbox.pending(conn) == 1
    finally:
        conn.close()


def test_missing_table_names_the_fix(topology: Topology, db: sqlite3.Connection) -> None:
    with pytest.raises(OutboxError, match=r"'rabbit_delay_outbox' does not exist.*install"):
        Outbox(topology).add(db, {"n": 1}, "1s", queue="push")


def test_unsupported_connection_and_table_name(topology: Topology) -> None:
    with pytest.raises(ConfigError, match=r"sqlite3\.Connection or a psycopg"):
        Outbox(topology).add(object(), {"n": 1}, "1s", queue="push")
    with pytest.raises(ConfigError, match="invalid outbox table name"):
        Outbox(topology, table="outbox; DROP TABLE orders")


def test_schema_for_migrations(topology: Topology) -> None:
    outbox = Outbox(topology, table="shop_outbox")
    for dialect in ("sqlite", "postgresql"):
        text = outbox.schema(dialect)
        assert "CREATE TABLE IF NOT EXISTS shop_outbox" in text
        assert "message_id    TEXT NOT NULL UNIQUE" in text
        assert "shop_outbox_pending" in text
        assert "shop_outbox_sent" in text
    assert "FOR UPDATE" not in outbox.schema("postgresql")
    assert "claimed_until" in schema("sqlite", "t")
    assert "claimed_until" not in schema("postgresql", "t")
    with pytest.raises(ConfigError, match="unknown SQL dialect"):
        outbox.schema("mysql")


# -- relayed: the due time counts from the row's creation --------------------------------


def stored_row(topology: Topology, tmp_path: Path, *args: Any, **kwargs: Any) -> Row:
    conn = sqlite3.connect(tmp_path / f"r{len(list(tmp_path.iterdir()))}.db")
    try:
        outbox = Outbox(topology, clock=clock_at(NOW))
        outbox.install(conn)
        message_id = outbox.add(conn, *args, **kwargs)
        return as_row(row(outbox, conn, message_id))
    finally:
        conn.close()


def test_relayed_at_once_keeps_the_tier(topology: Topology, tmp_path: Path) -> None:
    stored = stored_row(topology, tmp_path, {"n": 1}, "3s", queue="push", message_id="m1")
    out = outgoing(Router(topology), stored, NOW + 5)
    assert out.exchange == "shop.v1.delay.3s"
    assert out.routing_key == "shop.v1.q.push"
    assert out.message_id == "m1"
    assert out.body == b'{"n":1}'
    assert out.headers[h.H_DUE_AT] == NOW + 3_000
    assert out.headers[h.H_DELAY_MS] == 3_000
    assert out.headers[h.H_TIER] == "3s"
    assert out.mandatory is True


@pytest.mark.parametrize(
    ("lag_ms", "tier", "arrives_after_creation_ms"),
    [
        (0, "3s", 3_000),
        (1_500, "3s", 4_500),  # 1.5 s remain: no tier that short but 3s: late by the lag
        (2_000, "1s", 3_000),  # 1 s remains: the 1s tier, exactly on time
        (2_500, "1s", 3_500),  # 0.5 s remains: 1s, late by 0.5 s, never early
        (3_000, IMMEDIATE, 3_000),  # due already: the due exchange, now
        (60_000, IMMEDIATE, 60_000),
    ],
)
def test_tiers_shortest_accepted_tier_not_shorter_than_what_remains(
    topology: Topology, tmp_path: Path, lag_ms: int, tier: str, arrives_after_creation_ms: int
) -> None:
    stored = stored_row(topology, tmp_path, {"n": 1}, "3s", queue="push")
    out = outgoing(Router(topology), stored, NOW + lag_ms)
    assert out.headers[h.H_TIER] == tier
    assert out.headers[h.H_DUE_AT] == NOW + 3_000, "rd-due-at stays creation + delay"
    assert out.headers[h.H_DELAY_MS] == 3_000
    used = 0 if tier == IMMEDIATE else topology.tiers[tier]
    assert lag_ms + used == arrives_after_creation_ms
    assert lag_ms + used >= 3_000, "never early"
    if tier == IMMEDIATE:
        assert out.exchange == "shop.v1.due"


def test_tiers_a_queue_that_accepts_only_its_tier_is_late_by_the_lag(
    topology: Topology, tmp_path: Path
) -> None:
    stored = stored_row(topology, tmp_path, {"n": 1}, "30m", queue="orders.cancel")
    out = outgoing(Router(topology), stored, NOW + 29 * 60_000)
    assert out.headers[h.H_TIER] == "30m"  # the only tier it accepts: 29 minutes late
    assert out.headers[h.H_DUE_AT] == NOW + 1_800_000


def test_cascade_exact_remaining(cascade: Topology, tmp_path: Path) -> None:
    stored = stored_row(cascade, tmp_path, {"n": 1}, delay=timedelta(seconds=3.05), queue="push")
    assert (stored.tier, stored.delay_ms) == ("cascade", 3_100)  # rounded up to 100 ms
    out = outgoing(Router(cascade), stored, NOW + 2_000)
    assert out.headers[h.H_TIER] == "cascade"
    assert out.headers[h.H_DUE_AT] == NOW + 3_100
    assert out.headers[h.H_DELAY_MS] == 3_100
    # 1.1 s remain = 11 units of 100 ms: bits 0b1011 at the end of the key
    assert out.routing_key.startswith("0.0.0.0.0.0.0.0.1.0.1.1.")


def test_an_application_clock_ahead_never_waits_longer_than_asked(
    topology: Topology, tmp_path: Path
) -> None:
    stored = stored_row(topology, tmp_path, {"n": 1}, "30m", queue="orders.cancel")
    # the relay's clock is 5 s behind the application's: 30m + 5s "remain"
    out = outgoing(Router(topology), stored, NOW - 5_000)
    assert out.headers[h.H_TIER] == "30m"


def test_binding_key_target(topology: Topology, tmp_path: Path) -> None:
    stored = stored_row(topology, tmp_path, {"n": 1}, "30m", routing_key="order.timeout")
    out = outgoing(Router(topology), stored, NOW)
    assert (out.routing_key, out.headers[h.H_TARGET]) == ("order.timeout", "order.timeout")


def test_a_version_raised_between_add_and_relay_is_followed(
    topology: Topology, tmp_path: Path
) -> None:
    stored = stored_row(topology, tmp_path, {"n": 1}, "3s", queue="push")
    v2 = topology_from_dict(
        {"namespace": "shop", "version": 2, "tiers": {"3s": "3s"}, "queues": {"push": {}}}
    )
    out = outgoing(Router(v2), stored, NOW)
    assert out.exchange == "shop.v2.delay.3s"
    assert out.routing_key == "shop.v2.q.push"


def test_rows_the_relays_topology_cannot_serve_are_refused_not_lost(
    topology: Topology, tmp_path: Path
) -> None:
    good = stored_row(topology, tmp_path, {"n": 1}, "3s", queue="push")
    gone = stored_row(topology, tmp_path, {"n": 2}, "30m", queue="orders.cancel")
    smaller = topology_from_dict(
        {"namespace": "shop", "tiers": {"1s": "1s", "3s": "3s"}, "queues": {"push": {}}}
    )
    planned, outs, refused = plan_batch(Router(smaller), [good, gone], NOW)
    assert planned == [good]
    assert [o.message_id for o in outs] == [good.message_id]
    assert [r.row for r in refused] == [gone]
    assert refused[0].reason == INVALID
    assert "UnknownTargetError: unknown queue 'orders.cancel'" in refused[0].error
    assert refused[0].retry_at == NOW + 1_000


def test_refused_rows_back_off_to_five_minutes() -> None:
    waits = [refused_until(n, 0) for n in (1, 2, 3, 4, 9, 10, 50)]
    assert waits == [1_000, 2_000, 4_000, 8_000, 256_000, 300_000, 300_000]


def test_settle_each_row_by_its_outcome(topology: Topology, tmp_path: Path) -> None:
    rows = [stored_row(topology, tmp_path, {"n": i}, "1s", queue="push") for i in range(5)]
    _, outs, _ = plan_batch(Router(topology), rows, NOW)
    ledger = Ledger(outs)
    ledger.states = [State.CONFIRMED, State.RETURNED, State.NACKED, State.SENT, State.UNSENT]
    ledger.replies[1] = "312 NO_ROUTE"
    result = settle(rows, ledger, NOW)
    assert result.sent == [rows[0]]
    assert [r.row for r in result.refused] == [rows[1]]
    assert result.refused[0].reason == UNROUTABLE
    assert "312 NO_ROUTE" in result.refused[0].error
    assert result.retry == rows[2:]


# -- the SQLite relay store: leases, marks, retention -------------------------------------


def relay_store(path: Path, owner: str, lease_ms: int = 10_000) -> SQLiteRelayStore:
    return SQLiteRelayStore(sqlite3.connect(path), "rabbit_delay_outbox", owner, lease_ms)


def filled(path: Path, topology: Topology, n: int) -> list[str]:
    conn = sqlite3.connect(path)
    try:
        outbox = Outbox(topology, clock=clock_at(NOW))
        outbox.install(conn)
        ids = [outbox.add(conn, {"n": i}, "1s", queue="push") for i in range(n)]
        conn.commit()
        return ids
    finally:
        conn.close()


def test_two_sqlite_relays_claim_disjoint_rows_and_a_lease_runs_out(
    topology: Topology, tmp_path: Path
) -> None:
    path = tmp_path / "app.db"
    ids = filled(path, topology, 10)
    a, b = relay_store(path, "a"), relay_store(path, "b")
    try:
        first = a.claim(4, NOW)
        second = b.claim(100, NOW + 5_000)
        assert [r.message_id for r in first] == ids[:4]  # in insertion order
        assert [r.message_id for r in second] == ids[4:]
        assert b.claim(100, NOW + 9_999) == [], "claimed rows are not claimed twice"
        # a dies: its rows are free once its lease (10 s) ran out
        assert [r.message_id for r in b.claim(100, NOW + 10_000)] == ids[:4]
    finally:
        a.close()
        b.close()


def test_finish_marks_sent_refuses_and_releases(topology: Topology, tmp_path: Path) -> None:
    path = tmp_path / "app.db"
    filled(path, topology, 3)
    store = relay_store(path, "a")
    try:
        rows = store.claim(10, NOW)
        _, outs, _ = plan_batch(Router(topology), rows, NOW)
        ledger = Ledger(outs)
        ledger.states = [State.CONFIRMED, State.RETURNED, State.NACKED]
        result = settle(rows, ledger, NOW)
        store.finish(result.sent, result.refused, result.retry, NOW + 7)
        assert store.pending() == 2
        # the nacked row is free at once, the refused one after its backoff
        assert [r.id for r in store.claim(10, NOW + 8)] == [rows[2].id]
        again = store.claim(10, NOW + 1_000)
        assert [(r.id, r.attempts) for r in again] == [(rows[1].id, 1)]
        values = store.conn.execute(
            "SELECT sent_at, last_error FROM rabbit_delay_outbox ORDER BY id"
        ).fetchall()
        assert values[0] == (NOW + 7, None)
        assert values[1][0] is None
        assert "UnroutableError" in values[1][1]
    finally:
        store.close()


def test_cleanup_deletes_only_sent_rows_past_the_retention(
    topology: Topology, tmp_path: Path
) -> None:
    path = tmp_path / "app.db"
    filled(path, topology, 2_500)
    store = relay_store(path, "a")
    try:
        rows = store.claim(2_000, NOW)
        store.finish(rows[:1_500], [], [], NOW)  # sent long ago
        store.finish(rows[1_500:], [], [], NOW + 60_000)  # sent recently
        assert store.cleanup(NOW + 1) == 1_500  # in slices of 1,000
        assert store.conn.execute("SELECT count(*) FROM rabbit_delay_outbox").fetchone()[0] == 1_000
        assert store.pending() == 500, "pending rows are never cleaned up"
    finally:
        store.close()


# -- --db URLs --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "dialect", "target"),
    [
        ("sqlite:///app.db", "sqlite", "app.db"),
        ("sqlite:///data/app.db", "sqlite", "data/app.db"),
        ("sqlite:////var/lib/app.db", "sqlite", "/var/lib/app.db"),
        ("postgresql://u:secret@db:5432/shop", "postgresql", "postgresql://u:secret@db:5432/shop"),
        ("postgres://u:secret@db/shop", "postgresql", "postgresql://u:secret@db/shop"),
        ("postgresql+psycopg://u@db/shop", "postgresql", "postgresql://u@db/shop"),
    ],
)
def test_database_urls(url: str, dialect: str, target: str) -> None:
    database = parse_database(url)
    assert (database.dialect, database.target) == (dialect, target)
    assert "secret" not in repr(database)
    assert "secret" not in database.shown


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("app.db", "write sqlite:///path"),
        ("sqlite:///:memory:", "in-memory"),
        ("sqlite://", "name an SQLite file"),
        ("mysql://root:secret@db/shop", "unsupported scheme 'mysql'"),
    ],
)
def test_bad_database_urls(url: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as caught:
        parse_database(url)
    assert "secret" not in str(caught.value)


# -- the command line, before it connects to anything ------------------------------------


def cli(*args: str, env: dict[str, str] | None = None) -> Any:
    from rabbit_delay._cli.app import app

    return CliRunner().invoke(app, list(args), env=env or {})


def test_cli_relay_refuses_bad_arguments(tmp_path: Path) -> None:
    toml = tmp_path / "t.toml"
    toml.write_text('namespace = "shop"\n[tiers]\n1s = "1s"\n[queues.push]\n')
    both = cli("relay", str(toml), "-f", str(toml), "--db", "sqlite:///x.db")
    assert both.exit_code == 1
    assert "give the topology file once" in both.stderr
    no_db = cli("relay", "-f", str(toml), env={"RABBIT_DELAY_OUTBOX_DB": ""})
    assert no_db.exit_code == 1
    assert "--db URL" in no_db.stderr
    bad = cli("relay", "-f", str(toml), "--db", "mysql://root:hunter2@db/x")
    assert bad.exit_code == 1
    assert "unsupported scheme 'mysql'" in bad.stderr
    assert "hunter2" not in bad.stderr + bad.stdout
    missing = cli("relay", "-f", str(toml), "--db", f"sqlite:///{tmp_path}/none.db", "--once")
    assert missing.exit_code == 1
    assert "no SQLite database file at" in missing.stderr
    assert not (tmp_path / "none.db").exists(), "a mistyped path must not create a database"
    sqlite3.connect(tmp_path / "empty.db").close()
    no_table = cli("relay", "-f", str(toml), "--db", f"sqlite:///{tmp_path}/empty.db", "--once")
    assert no_table.exit_code == 1
    assert "'rabbit_delay_outbox' does not exist" in no_table.stderr
    assert "--install" in no_table.stderr


def test_importing_the_outbox_imports_neither_pika_nor_psycopg() -> None:
    import subprocess
    import sys

    code = (
        "import sys\nimport rabbit_delay.outbox\n"
        "print(','.join(m for m in ('pika', 'psycopg', 'aio_pika') if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == ""


def test_relay_metrics() -> None:
    from rabbit_delay._observe.metrics import PublishErrorReason
    from rabbit_delay.metrics import Metrics

    metrics = Metrics()
    metrics.relayed("shop.v1.q.push", "1s", [0.02, 0.3, -1.0])
    metrics.relay_refused("shop.v1.q.push", PublishErrorReason.INVALID)
    assert metrics.outbox_relayed_total.labels(queue="shop.v1.q.push", tier="1s")._value.get() == 3
    lag = metrics.registry.get_sample_value(
        "rabbit_delay_outbox_relay_lag_seconds_sum", {"queue": "shop.v1.q.push"}
    )
    assert lag == pytest.approx(0.32)  # a negative lag (clock skew) counts as 0
    refused = metrics.registry.get_sample_value(
        "rabbit_delay_outbox_refused_total", {"queue": "shop.v1.q.push", "reason": "invalid"}
    )
    assert refused == 1
