"""The transactional outbox: delayed messages written in the application's own
database transaction (SQLite or PostgreSQL), published by a relay once it committed.

    from rabbit_delay.outbox import Outbox, Relay

    outbox = Outbox(topology)
    with conn:                                   # your transaction
        conn.execute("INSERT INTO orders ...")
        outbox.add(conn, {"order_id": 42}, "30m", queue="orders.cancel-unpaid")

    with Relay(topology, "sqlite:///shop.db") as relay:   # or `rabbit-delay relay`
        relay.run_once()                                  # or run() until stop()

Importing this package imports neither pika nor psycopg: the relay imports pika (the
sync publisher) when it opens, psycopg when it connects to PostgreSQL. See
docs/outbox.md.
"""

from rabbit_delay.outbox._core import (
    DEFAULT_TABLE,
    POSTGRESQL,
    SQLITE,
    Database,
    parse_database,
)
from rabbit_delay.outbox._outbox import Outbox
from rabbit_delay.outbox._relay import BatchResult, Relay, RelayStats

__all__ = [
    "DEFAULT_TABLE",
    "POSTGRESQL",
    "SQLITE",
    "BatchResult",
    "Database",
    "Outbox",
    "Relay",
    "RelayStats",
    "parse_database",
]
