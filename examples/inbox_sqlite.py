"""The inbox pattern: a handler's change and its done-record commit in one transaction.

The idempotency store and the business tables live in one SQLite file. The payment
handler, in a single transaction on its own connection, records the payment, marks
the message done (`mark_done_in`) and cancels the order's scheduled timeout
(`cancel_in`). Whatever happens around it, the payment is applied exactly once:

1. a duplicate delivery of the same message_id has no second effect;
2. a worker crash after the handler's commit, before it acks: the redelivery is
   recognised as done (without the inbox write it would run again once the lease ends);
3. a handler that fails rolls back its change and the done-record together, and the
   retry applies the payment once;
4. the order's timeout, cancelled in the payment's transaction, is dropped when due.

Deliveries are simulated, so no broker is needed. Run it:

    python examples/inbox_sqlite.py

It prints each step and exits 0 when every check holds, 1 otherwise.
"""

from __future__ import annotations

import sqlite3
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from rabbit_delay.stores import ClaimResult, Guard, SQLiteStore

DAY_MS = 86_400_000
failures: list[str] = []


def check(condition: bool, what: str) -> None:
    print(f"  [{'ok' if condition else 'FAILED'}] {what}")
    if not condition:
        failures.append(what)


@contextmanager
def transaction(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    # IMMEDIATE: take the write lock up front, so the transaction never has to upgrade
    # a read lock (which SQLite may refuse with "database is locked").
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


class Shop:
    """The business side: orders and payments, in the idempotency store's file."""

    def __init__(self, path: Path, store: SQLiteStore, guard: Guard) -> None:
        self.store = store
        self.guard = guard
        # The handler's own connection; autocommit, with explicit transactions.
        self.conn = sqlite3.connect(path, isolation_level=None)
        self.conn.executescript(
            """
            CREATE TABLE orders (id TEXT PRIMARY KEY, status TEXT NOT NULL);
            CREATE TABLE payments (message_id TEXT NOT NULL, order_id TEXT NOT NULL,
                                   amount_cents INTEGER NOT NULL);
            """
        )

    def open_order(self, order_id: str) -> str:
        """Open an order; returns the message_id of its (scheduled) timeout message."""
        self.conn.execute("INSERT INTO orders VALUES (?, 'open')", (order_id,))
        return f"order-timeout:{order_id}"

    def pay(self, message_id: str, order_id: str, amount_cents: int) -> None:
        """Handler of a payment message. Raises ValueError for a non-positive amount."""
        now = self.guard.clock()
        with transaction(self.conn):
            self.conn.execute(
                "INSERT INTO payments VALUES (?, ?, ?)", (message_id, order_id, amount_cents)
            )
            self.conn.execute("UPDATE orders SET status = 'paid' WHERE id = ?", (order_id,))
            if amount_cents <= 0:  # found out late, after writing: the rollback undoes it all
                raise ValueError(f"bad amount {amount_cents}")
            self.store.mark_done_in(
                self.conn, message_id, now_ms=now, retention_ms=self.guard.retention_ms
            )
            # The timeout must stay cancelled until it is due: keep the tombstone 30 days.
            self.store.cancel_in(
                self.conn, f"order-timeout:{order_id}", now_ms=now, retention_ms=30 * DAY_MS
            )

    def expire(self, order_id: str) -> None:
        """Handler of the order-timeout message: an unpaid order expires."""
        self.conn.execute(
            "UPDATE orders SET status = 'expired' WHERE id = ? AND status = 'open'", (order_id,)
        )

    def payments(self, order_id: str) -> int:
        row = self.conn.execute(
            "SELECT count(*) FROM payments WHERE order_id = ?", (order_id,)
        ).fetchone()
        return int(row[0])

    def status(self, order_id: str) -> str:
        row = self.conn.execute("SELECT status FROM orders WHERE id = ?", (order_id,)).fetchone()
        return str(row[0])


def deliver(
    guard: Guard, message_id: str, handler: Callable[[], None], *, crash_before_ack: bool = False
) -> str:
    """What the worker does with one delivery; returns what happened to it."""
    owner = uuid.uuid4().hex  # one token per delivery attempt
    result = guard.claim(message_id, owner)
    if result is not ClaimResult.CLAIMED:
        return result.value  # the worker acks: done, cancelled (or defers: in progress)
    try:
        handler()
    except Exception as exc:
        guard.failed(message_id, owner)  # drop the claim so the retry can run
        return f"failed ({exc})"
    if crash_before_ack:
        return "crashed"  # no complete, no ack: the broker will redeliver
    guard.done(message_id, owner)  # a no-op here: the handler's commit recorded it
    return "handled"


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "shop.sqlite3"
        store = SQLiteStore(path)
        guard = Guard(store, lease_ms=300_000, retention_ms=7 * DAY_MS)
        shop = Shop(path, store, guard)
        try:
            run(shop, guard)
        finally:
            shop.conn.close()
            store.close()
    if failures:
        print(f"{len(failures)} check(s) failed", file=sys.stderr)
        return 1
    print("all checks passed")
    return 0


def run(shop: Shop, guard: Guard) -> None:
    print("1. duplicate delivery of one payment message")
    timeout_a = shop.open_order("A")
    pay_a = "pay-A-1"
    first = deliver(guard, pay_a, lambda: shop.pay(pay_a, "A", 1999))
    second = deliver(guard, pay_a, lambda: shop.pay(pay_a, "A", 1999))
    check(first == "handled", f"first delivery handled (got {first!r})")
    check(second == "done", f"duplicate acked and skipped (got {second!r})")
    check(shop.payments("A") == 1, "order A has one payment")

    print("2. crash after the handler's commit, before the ack")
    shop.open_order("B")
    pay_b = "pay-B-1"
    crashed = deliver(guard, pay_b, lambda: shop.pay(pay_b, "B", 500), crash_before_ack=True)
    redelivered = deliver(guard, pay_b, lambda: shop.pay(pay_b, "B", 500))
    check(crashed == "crashed", "the worker died holding the claim")
    check(redelivered == "done", f"redelivery recognised as done (got {redelivered!r})")
    check(shop.payments("B") == 1, "order B has one payment")

    print("3. the handler fails, then the retry succeeds")
    shop.open_order("C")
    pay_c = "pay-C-1"
    failed = deliver(guard, pay_c, lambda: shop.pay(pay_c, "C", 0))
    check(failed.startswith("failed"), f"first attempt failed (got {failed!r})")
    check(shop.payments("C") == 0 and shop.status("C") == "open", "its writes were rolled back")
    retried = deliver(guard, pay_c, lambda: shop.pay(pay_c, "C", 700))
    again = deliver(guard, pay_c, lambda: shop.pay(pay_c, "C", 700))
    check(retried == "handled" and again == "done", f"retry handled once ({retried}, {again})")
    check(shop.payments("C") == 1, "order C has one payment")

    print("4. the order timeout comes due after the payment")
    dropped = deliver(guard, timeout_a, lambda: shop.expire("A"))
    check(dropped == "cancelled", f"timeout of order A dropped (got {dropped!r})")
    check(shop.status("A") == "paid", "order A is still paid")
    timeout_d = shop.open_order("D")  # never paid: its timeout does run
    expired = deliver(guard, timeout_d, lambda: shop.expire("D"))
    check(expired == "handled" and shop.status("D") == "expired", "unpaid order D expired")

    stats = guard.stats
    check(
        (stats.duplicates_skipped, stats.cancelled_dropped) == (3, 1),
        f"guard counted 3 duplicates and 1 cancelled ({stats.as_dict()})",
    )


if __name__ == "__main__":
    sys.exit(main())
