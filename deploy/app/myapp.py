"""The worker app the deployment examples run (`rabbit-delay worker myapp:app`): one
handler per queue of topology/orders.toml. Replace it with your own module; the
Dockerfile copies this directory into the image.

    rabbit-delay worker myapp:app --app-dir deploy/app --metrics-port 9100
"""

from __future__ import annotations

import logging
import os

from rabbit_delay import App, HandlerContext

log = logging.getLogger("myapp")

# $RABBIT_DELAY_TOPOLOGY names the file (the image sets it); relative to the directory
# the worker runs in.
app = App(os.environ.get("RABBIT_DELAY_TOPOLOGY", "topology/orders.toml"))


@app.consumer("orders.cancel-unpaid")
def cancel_unpaid(message: dict[str, object], ctx: HandlerContext) -> None:
    log.info("cancel order %s if still unpaid (%s)", message.get("order_id"), ctx.message_id)


@app.consumer("coupons.expire")
def expire_coupon(message: dict[str, object], ctx: HandlerContext) -> None:
    log.info("expire coupon %s (%s)", message.get("coupon"), ctx.message_id)


@app.consumer("push.send")
def send_push(message: dict[str, object], ctx: HandlerContext) -> None:
    log.info("push to user %s (%s)", message.get("user"), ctx.message_id)
