"""An app whose handler can kill its own worker process, for `test_worker_crashes.py`.

    rabbit-delay worker poison_app:app --app-dir tests/integration/workers

The message says what the handler does: `{"order_id": N, "crash": "never" | "always" |
"once"}`. Every run appends `start <message_id> <pid> <redelivered 0|1>` to the log file
first. Then "always" kills the process (`os._exit(1)`: no ack, no done-record, a live
lease); "once" does so only on the first run for its message_id (a marker file beside
the log remembers it); otherwise the handler applies its effect.

The effect is a row in the table `effects` of the idempotency SQLite file, committed in
one transaction with the message's done-record (the inbox pattern,
examples/inbox_sqlite.py). A sibling handler killing the process can then never leave
an effect without its done-record, so "exactly one effect per message" is something
the worker and the guard must deliver, not a matter of luck around the crash.

Environment:
    RD_TEST_TOPOLOGY   path of the topology TOML file (store = "sqlite")
    RD_TEST_LOG        the log file
    RD_TEST_ASYNC      "1": the handler is `async def` (else `def`)
"""

from __future__ import annotations

import os
import sqlite3
import threading
from pathlib import Path
from typing import Literal

from pydantic import BaseModel

from rabbit_delay import App, HandlerContext
from rabbit_delay._consumer.context import clock_ms
from rabbit_delay.stores import SQLiteStore

QUEUE = "orders.cancel"
EFFECTS = "CREATE TABLE IF NOT EXISTS effects (message_id TEXT NOT NULL, pid INTEGER NOT NULL)"

app = App(os.environ["RD_TEST_TOPOLOGY"])
LOG = os.environ["RD_TEST_LOG"]
DATABASE = app.topology.idempotency.path
# Only for its SQL (mark_done_in): the worker's guard opens its own store on the file.
_inbox = SQLiteStore(DATABASE)
_local = threading.local()  # one connection per handler thread (sqlite3 objects are not shared)


class Order(BaseModel):
    order_id: int
    crash: Literal["never", "always", "once"] = "never"


def note(step: str, ctx: HandlerContext) -> None:
    with open(LOG, "a", encoding="utf-8") as log:
        log.write(f"{step} {ctx.message_id} {os.getpid()} {int(ctx.redelivered)}\n")


def connection() -> sqlite3.Connection:
    conn: sqlite3.Connection | None = getattr(_local, "conn", None)
    if conn is None:
        conn = sqlite3.connect(DATABASE, isolation_level=None, timeout=30)
        conn.execute(EFFECTS)
        _local.conn = conn
    return conn


def run(message: Order, ctx: HandlerContext) -> None:
    note("start", ctx)
    if message.crash == "always":
        os._exit(1)
    if message.crash == "once":
        marker = Path(f"{LOG}.crashed.{ctx.message_id}")
        if not marker.exists():
            marker.touch()
            os._exit(1)
    assert ctx.message_id is not None
    key = f"{app.topology.names.business_queue(QUEUE)}:{ctx.message_id}"  # the guard's key
    conn = connection()
    # IMMEDIATE: the write lock up front, never a read lock upgraded (SQLITE_BUSY).
    conn.execute("BEGIN IMMEDIATE")
    try:
        conn.execute("INSERT INTO effects VALUES (?, ?)", (ctx.message_id, os.getpid()))
        now = clock_ms()
        _inbox.mark_done_in(conn, key, now_ms=now, retention_ms=app.retention_ms)
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


if os.environ.get("RD_TEST_ASYNC") == "1":

    @app.consumer(QUEUE, model=Order)
    async def cancel_order(message: Order, ctx: HandlerContext) -> None:
        run(message, ctx)  # blocks the loop for one small commit: fine in a test

else:

    @app.consumer(QUEUE, model=Order)
    def cancel_order_sync(message: Order, ctx: HandlerContext) -> None:
        run(message, ctx)
