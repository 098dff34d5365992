"""An app the process tests run with `rabbit-delay worker crash_app:app`.

Its handler appends `start <message_id> <pid>` to a log file, sleeps, then appends
`effect <message_id> <pid>`: the effect that must happen exactly once, however often
the message is delivered and whichever worker dies on the way.

Environment:
    RD_TEST_TOPOLOGY   path of the topology TOML file
    RD_TEST_LOG        the log file
    RD_TEST_SLOW_S     seconds between start and effect (default 0)
    RD_TEST_ASYNC      "1": the handler is `async def` (else `def`)
"""

from __future__ import annotations

import asyncio
import os
import time

from pydantic import BaseModel

from rabbit_delay import App, HandlerContext

QUEUE = "orders.cancel"

app = App(os.environ["RD_TEST_TOPOLOGY"])
LOG = os.environ["RD_TEST_LOG"]
SLOW_S = float(os.environ.get("RD_TEST_SLOW_S", "0"))


class Order(BaseModel):
    order_id: int


def note(step: str, ctx: HandlerContext) -> None:
    with open(LOG, "a", encoding="utf-8") as log:
        log.write(f"{step} {ctx.message_id} {os.getpid()}\n")


if os.environ.get("RD_TEST_ASYNC") == "1":

    @app.consumer(QUEUE, model=Order)
    async def cancel_order(message: Order, ctx: HandlerContext) -> None:
        note("start", ctx)
        await asyncio.sleep(SLOW_S)
        note("effect", ctx)

else:

    @app.consumer(QUEUE, model=Order)
    def cancel_order_sync(message: Order, ctx: HandlerContext) -> None:
        note("start", ctx)
        time.sleep(SLOW_S)
        note("effect", ctx)
