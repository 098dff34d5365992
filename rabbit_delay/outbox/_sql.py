"""The outbox table on SQLite (sqlite3) and PostgreSQL (psycopg 3): its schema, the
insert of `add()` and the relay's statements. I/O: every function runs statements on
the connection it is given and commits only where it says so.

How relays share a table (docs/outbox.md, "Several relays"):

* PostgreSQL: a relay claims rows with `SELECT ... FOR UPDATE SKIP LOCKED` in a
  transaction it holds across the publish and ends with the marks: other relays skip
  locked rows, so no row is published twice in normal operation, and the rows of a
  relay killed mid-batch are unlocked as soon as PostgreSQL sees its connection drop
  (at once for a killed process, whose socket the kernel closes). A relay that hangs
  with its connection up is cut off by `idle_in_transaction_session_timeout`.
* SQLite has one writer at a time, and the application writes to the same file: a
  transaction held across a publish would block the application's own `add()` calls
  (for up to the publisher's 30 s recovery deadline). So a relay claims rows with a
  lease instead (`claimed_by`, `claimed_until`, in a short BEGIN IMMEDIATE
  transaction), publishes, then marks them sent in another short one. Several relays
  take turns for these statements and publish in parallel, never the same row; the
  rows of a relay that died are taken again once its lease ends.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from rabbit_delay._errors import ConfigError, DuplicateMessageError, OutboxError
from rabbit_delay._io.sql import check_table_name, require_sqlite_transaction
from rabbit_delay.outbox._core import POSTGRESQL, SQLITE, NewRow, Refusal, Row

if TYPE_CHECKING:
    import psycopg

# Ids per statement (mark sent, release): well under SQLite's 32,766 variables.
_CHUNK = 500
_CLEANUP_SLICE = 1_000

_COLUMNS = (
    "id, message_id, queue, routing_key, tier, delay_ms, created_at, body, content_type, "
    "headers, attempts"
)
_INSERT_COLUMNS = (
    "message_id, queue, routing_key, tier, delay_ms, created_at, due_at, body, content_type, "
    "headers"
)

# The columns, for both: `due_at` (= created_at + delay_ms) and `last_error` are there
# for people reading the table; `available_at` keeps a refused row back until then.
SQLITE_SCHEMA = """
CREATE TABLE IF NOT EXISTS {t} (
    id            INTEGER PRIMARY KEY AUTOINCREMENT,
    message_id    TEXT NOT NULL UNIQUE,
    queue         TEXT,
    routing_key   TEXT,
    tier          TEXT NOT NULL,
    delay_ms      INTEGER NOT NULL,
    created_at    INTEGER NOT NULL,
    due_at        INTEGER NOT NULL,
    body          BLOB NOT NULL,
    content_type  TEXT NOT NULL,
    headers       TEXT NOT NULL DEFAULT '{{}}',
    sent_at       INTEGER,
    attempts      INTEGER NOT NULL DEFAULT 0,
    last_error    TEXT,
    available_at  INTEGER NOT NULL DEFAULT 0,
    claimed_by    TEXT,
    claimed_until INTEGER,
    CHECK ((queue IS NULL) <> (routing_key IS NULL))
);
CREATE INDEX IF NOT EXISTS {t}_pending ON {t} (id) WHERE sent_at IS NULL;
CREATE INDEX IF NOT EXISTS {t}_sent ON {t} (sent_at) WHERE sent_at IS NOT NULL;
"""
POSTGRESQL_SCHEMA = """
CREATE TABLE IF NOT EXISTS {t} (
    id            BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    message_id    TEXT NOT NULL UNIQUE,
    queue         TEXT,
    routing_key   TEXT,
    tier          TEXT NOT NULL,
    delay_ms      BIGINT NOT NULL,
    created_at    BIGINT NOT NULL,
    due_at        BIGINT NOT NULL,
    body          BYTEA NOT NULL,
    content_type  TEXT NOT NULL,
    headers       TEXT NOT NULL DEFAULT '{{}}',
    sent_at       BIGINT,
    attempts      INTEGER NOT NULL DEFAULT 0,
    last_error    TEXT,
    available_at  BIGINT NOT NULL DEFAULT 0,
    CHECK ((queue IS NULL) <> (routing_key IS NULL))
);
CREATE INDEX IF NOT EXISTS {t}_pending ON {t} (id) WHERE sent_at IS NULL;
CREATE INDEX IF NOT EXISTS {t}_sent ON {t} (sent_at) WHERE sent_at IS NOT NULL;
"""


def schema(dialect: str, table: str) -> str:
    """The CREATE TABLE / CREATE INDEX statements, for a migration tool of yours."""
    check_table_name(table, "outbox")
    if dialect == SQLITE:
        return SQLITE_SCHEMA.format(t=table).strip() + "\n"
    if dialect == POSTGRESQL:
        return POSTGRESQL_SCHEMA.format(t=table).strip() + "\n"
    raise ConfigError(f"unknown SQL dialect {dialect!r}: {SQLITE!r} or {POSTGRESQL!r}")


def _statements(script: str) -> Iterator[str]:
    for statement in script.split(";"):
        if statement.strip():
            yield statement.strip()


def dialect_of(conn: object) -> str:
    """SQLITE for an sqlite3 connection, POSTGRESQL for a psycopg 3 (sync) one; else
    ConfigError naming what is supported."""
    if isinstance(conn, sqlite3.Connection):
        return SQLITE
    cls = type(conn)
    module = cls.__module__
    if module.startswith("psycopg.") or module == "psycopg":
        if "Async" in cls.__name__:
            raise ConfigError(
                "the outbox takes a sync psycopg.Connection, not an AsyncConnection: "
                "add rows from a sync connection (or run the insert of "
                "docs/outbox.md yourself)"
            )
        return POSTGRESQL
    raise ConfigError(
        f"the outbox needs an sqlite3.Connection or a psycopg (3) Connection, got "
        f"{module}.{cls.__name__}"
    )


def missing_table(table: str, exc: BaseException) -> OutboxError | None:
    """The error for a statement that failed because the table does not exist."""
    text = str(exc)
    if "no such table" in text or type(exc).__name__ == "UndefinedTable":
        return OutboxError(
            f"the outbox table {table!r} does not exist: create it with "
            "Outbox(topology).install(conn) (then commit), `rabbit-delay relay --install`, "
            "or the CREATE TABLE of docs/outbox.md in your migrations"
        )
    return None


# -- the application's side -----------------------------------------------------------


def install(conn: Any, table: str) -> None:
    """Create the table and its indexes if missing, on `conn`, in its transaction when
    one is open; commits nothing (commit yourself). Raises the driver's errors."""
    dialect = dialect_of(conn)
    with _cursor(conn) as cur:
        for statement in _statements(schema(dialect, table)):
            cur.execute(statement)


def insert(conn: Any, table: str, row: NewRow) -> None:
    """Write `row` in the caller's open transaction; commits nothing.

    Raises ConfigError when `conn` would commit the row by itself (autocommit with no
    transaction open), DuplicateMessageError for a message_id the table holds
    (nothing written, the transaction intact), OutboxError when the table is missing
    (on PostgreSQL that aborts the transaction: roll it back), and the driver's own
    errors otherwise.
    """
    dialect = dialect_of(conn)
    values = (
        row.message_id,
        row.queue,
        row.routing_key,
        row.tier,
        row.delay_ms,
        row.created_at,
        row.due_at,
        row.body,
        row.content_type,
        row.headers,
    )
    if dialect == SQLITE:
        require_sqlite_transaction(conn)
        sql = (
            f"INSERT INTO {table} ({_INSERT_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
            "ON CONFLICT (message_id) DO NOTHING"
        )
    else:
        _require_pg_transaction(conn)
        sql = (
            f"INSERT INTO {table} ({_INSERT_COLUMNS}) VALUES "
            "(%s, %s, %s, %s, %s, %s, %s, %s, %s, %s) ON CONFLICT (message_id) DO NOTHING"
        )
    try:
        with _cursor(conn) as cur:
            cur.execute(sql, values)
            written = cur.rowcount
    except Exception as exc:
        missing = missing_table(table, exc)
        if missing is not None:
            raise missing from None
        raise
    if written == 0:
        raise DuplicateMessageError(
            f"message_id {row.message_id!r} is in the outbox table {table!r} already "
            "(pending, or sent within the retention): nothing was written; give each "
            "message its own id, or leave message_id out to get a generated one",
            message_ids=[row.message_id],
        )


def _require_pg_transaction(conn: psycopg.Connection[Any]) -> None:
    # psycopg's autocommit with no transaction block: the insert would commit alone.
    if conn.autocommit and conn.info.transaction_status == 0:  # pq.TransactionStatus.IDLE
        raise ConfigError(
            "the connection is in autocommit mode with no open transaction: add the row "
            "inside `with conn.transaction():`, or use a connection with autocommit=False"
        )


class _cursor:
    """`with _cursor(conn) as cur`: a cursor closed afterwards, on either driver."""

    def __init__(self, conn: Any) -> None:
        self.cur = conn.cursor()

    def __enter__(self) -> Any:
        return self.cur

    def __exit__(self, *_exc: object) -> None:
        self.cur.close()


def count_pending(conn: Any, table: str) -> int:
    """Rows not sent yet."""
    with _cursor(conn) as cur:
        cur.execute(f"SELECT count(*) FROM {table} WHERE sent_at IS NULL")
        return int(cur.fetchone()[0])


# -- the relay's side: each on the relay's own connection -------------------------------


class SQLiteRelayStore:
    """The relay's statements on SQLite: leases (see the module docstring). The
    connection is in autocommit mode (isolation_level=None): each method is one short
    BEGIN IMMEDIATE ... COMMIT of its own."""

    dialect = SQLITE

    def __init__(self, conn: sqlite3.Connection, table: str, owner: str, lease_ms: int) -> None:
        conn.isolation_level = None
        # As on PostgreSQL: a mark lost in a power cut only means a second publish.
        # (In rollback-journal mode NORMAL still syncs at each commit.)
        conn.execute("PRAGMA synchronous = NORMAL")
        self.conn = conn
        self.table = table
        self.owner = owner
        self.lease_ms = lease_ms

    def check(self) -> None:
        self._one(f"SELECT count(*) FROM {self.table} WHERE 0")

    def claim(self, limit: int, now: int) -> list[Row]:
        sql = (
            f"UPDATE {self.table} SET claimed_by = ?, claimed_until = ? WHERE id IN ("
            f"SELECT id FROM {self.table} WHERE sent_at IS NULL AND available_at <= ? "
            "AND (claimed_until IS NULL OR claimed_until <= ?) ORDER BY id LIMIT ?"
            f") RETURNING {_COLUMNS}"
        )
        with self._write():
            found = self.conn.execute(
                sql, (self.owner, now + self.lease_ms, now, now, limit)
            ).fetchall()
        return sorted((_row(r) for r in found), key=lambda r: r.id)  # RETURNING is unordered

    def finish(
        self, sent: Sequence[Row], refused: Sequence[Refusal], retry: Sequence[Row], now: int
    ) -> None:
        with self._write():
            for ids in _chunks([r.id for r in sent]):
                self.conn.execute(
                    f"UPDATE {self.table} SET sent_at = ?, last_error = NULL, claimed_by = NULL, "
                    f"claimed_until = NULL WHERE id IN ({_marks(ids, '?')})",
                    (now, *ids),
                )
            for refusal in refused:
                self.conn.execute(
                    f"UPDATE {self.table} SET attempts = attempts + 1, last_error = ?, "
                    "available_at = ?, claimed_by = NULL, claimed_until = NULL WHERE id = ?",
                    (refusal.error, refusal.retry_at, refusal.row.id),
                )
            for ids in _chunks([r.id for r in retry]):
                self.conn.execute(
                    f"UPDATE {self.table} SET claimed_by = NULL, claimed_until = NULL "
                    f"WHERE claimed_by = ? AND id IN ({_marks(ids, '?')})",
                    (self.owner, *ids),
                )

    def abandon(self) -> None:
        """Nothing to undo: an unfinished claim runs out with its lease."""

    def cleanup(self, before: int) -> int:
        sql = _cleanup_sql(self.table, "?")

        def one_slice() -> int:
            with self._write():
                return int(self.conn.execute(sql, (before, _CLEANUP_SLICE)).rowcount)

        return _in_slices(one_slice)

    def pending(self) -> int:
        return int(self._one(f"SELECT count(*) FROM {self.table} WHERE sent_at IS NULL"))

    def close(self) -> None:
        self.conn.close()

    def _one(self, sql: str) -> Any:
        return self.conn.execute(sql).fetchone()[0]

    def _write(self) -> _SQLiteWrite:
        return _SQLiteWrite(self.conn)


class _SQLiteWrite:
    """BEGIN IMMEDIATE (the write lock up front, waiting up to the busy timeout) ...
    COMMIT, or ROLLBACK on an error."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def __enter__(self) -> None:
        self.conn.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if exc_type is None:
            self.conn.execute("COMMIT")
        elif self.conn.in_transaction:
            self.conn.execute("ROLLBACK")


class PostgresRelayStore:
    """The relay's statements on PostgreSQL: `FOR UPDATE SKIP LOCKED` in a transaction
    held from `claim` to `finish` (see the module docstring)."""

    dialect = POSTGRESQL

    def __init__(self, conn: psycopg.Connection[Any], table: str, idle_timeout_ms: int) -> None:
        if conn.info.transaction_status != 0:
            conn.rollback()
        conn.autocommit = False
        self.conn = conn
        self.table = table
        # A relay that hangs (stopped, partitioned) with its locks: the server ends its
        # session after this long idle in a transaction, and the rows are free again.
        with _cursor(conn) as cur:
            cur.execute(f"SET idle_in_transaction_session_timeout = {int(idle_timeout_ms)}")
            # The relay's commits only mark rows sent: one lost in a server crash means
            # those rows are published again (same message_id), never a row lost. So
            # they need not wait for the WAL flush (a batch's largest fixed cost).
            cur.execute("SET synchronous_commit = off")
        conn.commit()

    def check(self) -> None:
        try:
            with _cursor(self.conn) as cur:
                cur.execute(f"SELECT count(*) FROM {self.table} WHERE false")
        finally:
            self.conn.rollback()

    def claim(self, limit: int, now: int) -> list[Row]:
        with _cursor(self.conn) as cur:
            cur.execute(
                f"SELECT {_COLUMNS} FROM {self.table} WHERE sent_at IS NULL AND "
                "available_at <= %s ORDER BY id LIMIT %s FOR UPDATE SKIP LOCKED",
                (now, limit),
            )
            found = cur.fetchall()
        if not found:
            self.conn.rollback()
        return [_row(r) for r in found]

    def finish(
        self, sent: Sequence[Row], refused: Sequence[Refusal], retry: Sequence[Row], now: int
    ) -> None:
        # `retry` needs nothing: the commit unlocks every row of the claim.
        with _cursor(self.conn) as cur:
            if sent:
                cur.execute(
                    f"UPDATE {self.table} SET sent_at = %s, last_error = NULL WHERE id = ANY(%s)",
                    (now, [r.id for r in sent]),
                )
            for refusal in refused:
                cur.execute(
                    f"UPDATE {self.table} SET attempts = attempts + 1, last_error = %s, "
                    "available_at = %s WHERE id = %s",
                    (refusal.error, refusal.retry_at, refusal.row.id),
                )
        self.conn.commit()

    def abandon(self) -> None:
        """Unlock the claimed rows without marking any (the relay could not publish)."""
        self.conn.rollback()

    def cleanup(self, before: int) -> int:
        sql = _cleanup_sql(self.table, "%s")

        def one_slice() -> int:
            with _cursor(self.conn) as cur:
                cur.execute(sql, (before, _CLEANUP_SLICE))
                n = int(cur.rowcount)
            self.conn.commit()
            return n

        return _in_slices(one_slice)

    def pending(self) -> int:
        try:
            return count_pending(self.conn, self.table)
        finally:
            self.conn.rollback()

    def close(self) -> None:
        self.conn.close()


RelayStore = SQLiteRelayStore | PostgresRelayStore


def _cleanup_sql(table: str, mark: str) -> str:
    """Delete one slice of sent rows sent before the first parameter (`mark`: the
    dialect's placeholder), at most the second."""
    return (
        f"DELETE FROM {table} WHERE id IN (SELECT id FROM {table} "
        f"WHERE sent_at IS NOT NULL AND sent_at <= {mark} LIMIT {mark})"
    )


def _in_slices(delete_slice: Callable[[], int]) -> int:
    """Sent rows deleted a slice at a time, each slice its own transaction (a relay
    never holds a long lock for cleaning up), until one comes back short; how many."""
    deleted = 0
    while True:
        n = delete_slice()
        deleted += n
        if n < _CLEANUP_SLICE:
            return deleted


def _row(r: Sequence[Any]) -> Row:
    return Row(
        id=int(r[0]),
        message_id=str(r[1]),
        queue=r[2],
        routing_key=r[3],
        tier=str(r[4]),
        delay_ms=int(r[5]),
        created_at=int(r[6]),
        body=bytes(r[7]),
        content_type=str(r[8]),
        headers=str(r[9]),
        attempts=int(r[10]),
    )


def _chunks(ids: Sequence[int]) -> Iterator[Sequence[int]]:
    for start in range(0, len(ids), _CHUNK):
        yield ids[start : start + _CHUNK]


def _marks(ids: Sequence[int], mark: str) -> str:
    return ",".join([mark] * len(ids))
