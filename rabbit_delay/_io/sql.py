"""What the SQL-backed parts (the SQLite idempotency store, the outbox) share about the
connections and names they are given. Pure: checks only, no statement is run.
"""

from __future__ import annotations

import re
import sqlite3

from rabbit_delay._errors import ConfigError

# A table name is pasted into statements (placeholders cannot name a table): letters,
# digits and _ only, starting with a letter or _, at most 63 bytes (PostgreSQL's limit).
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")


def check_table_name(table: str, what: str = "SQLite") -> str:
    """`table`, or ConfigError when it is not a plain SQL identifier."""
    if not isinstance(table, str) or not _IDENTIFIER.match(table):
        raise ConfigError(f"invalid {what} table name {table!r}: letters, digits and _ only")
    return table


def require_sqlite_transaction(conn: sqlite3.Connection) -> None:
    """Raise ConfigError (a ValueError) when a write through `conn` would commit on its
    own: autocommit mode (isolation_level=None, or 3.12's autocommit=True) with no
    transaction open. The point of writing in the caller's transaction is lost then."""
    if conn.in_transaction:
        return
    if conn.isolation_level is None or getattr(conn, "autocommit", None) is True:
        raise ConfigError(
            "the connection is in autocommit mode with no open transaction: "
            "run BEGIN (BEGIN IMMEDIATE) first, then your writes and this call"
        )


def is_busy(exc: sqlite3.Error) -> bool:
    """True for SQLITE_BUSY (and its extended codes): another connection holds the lock."""
    code = getattr(exc, "sqlite_errorcode", None)
    return code is not None and code & 0xFF == sqlite3.SQLITE_BUSY
