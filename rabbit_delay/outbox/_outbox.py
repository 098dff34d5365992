"""The application's side of the outbox: `Outbox(topology).add(conn, ...)` writes a row
in the caller's own transaction."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any, Unpack

import rabbit_delay.outbox._sql as _sql
from rabbit_delay._envelope import Body, now_ms
from rabbit_delay._io.sql import check_table_name
from rabbit_delay._publishing.core import MessageOptions, PublisherCore
from rabbit_delay._topology.model import Topology
from rabbit_delay.outbox._core import DEFAULT_TABLE, new_row


class Outbox:
    """Delayed messages written in the application's own database transaction, and
    published by a relay (`rabbit_delay.outbox.Relay`, `rabbit-delay relay`) once that
    transaction committed: a rolled-back transaction publishes nothing, a committed one
    is published at least once.

    `conn` is an `sqlite3.Connection` or a `psycopg.Connection` (psycopg 3, sync). The
    table (`table`, default `rabbit_delay_outbox`) is created by `install(conn)` or by
    your migrations (`schema(dialect)` gives the statements). `clock` gives the
    creation time in UTC ms (the application's clock): the due time counts from it.

    Raises ConfigError for a table name that is not a plain SQL identifier.
    """

    def __init__(
        self,
        topology: Topology,
        *,
        table: str = DEFAULT_TABLE,
        clock: Callable[[], int] = now_ms,
    ) -> None:
        self.topology = topology
        self.table = check_table_name(table, "outbox")
        self.clock = clock
        # For its validation only (route, encoding): it never connects.
        self._core: PublisherCore[Any, Any] = PublisherCore(topology)

    def add(
        self,
        conn: Any,
        msg: Body,
        tier: str | timedelta | None = None,
        **options: Unpack[MessageOptions],
    ) -> str:
        """Write one delayed message into the outbox, in `conn`'s open transaction; its
        message_id. Commits nothing: the row is published once your transaction commits,
        and never if it rolls back.

        The arguments are those of `Publisher.publish_delayed` (`tier` may also be a
        timedelta, as `delay=`); `headers` must be JSON values. Everything is validated
        and encoded here, before anything is written, so bad input fails inside your
        transaction: DelayError, UnknownTargetError, EncodeError. Also raises
        DuplicateMessageError for a message_id the table holds (nothing written),
        ConfigError for a connection in autocommit mode with no transaction open (or
        not sqlite3 / psycopg 3), OutboxError when the table does not exist; the
        driver's own errors otherwise.
        """
        row = new_row(self._core, msg, tier, now=self.clock(), **options)
        _sql.insert(conn, self.table, row)
        return row.message_id

    def install(self, conn: Any) -> None:
        """Create the table and its indexes unless they exist, in `conn`'s transaction
        when one is open; commit it yourself. Raises ConfigError for an unsupported
        connection, the driver's errors otherwise."""
        _sql.install(conn, self.table)

    def schema(self, dialect: str) -> str:
        """The CREATE statements of the table for `dialect` ("sqlite" or "postgresql"),
        for your migrations. Raises ConfigError for another dialect."""
        return _sql.schema(dialect, self.table)

    def pending(self, conn: Any) -> int:
        """How many rows are not sent yet (committed ones, and `conn`'s own). Raises
        OutboxError when the table does not exist, the driver's errors otherwise."""
        _sql.dialect_of(conn)
        try:
            return _sql.count_pending(conn, self.table)
        except Exception as exc:
            missing = _sql.missing_table(self.table, exc)
            if missing is not None:
                raise missing from None
            raise
