"""Testing an app's delayed work with rabbit_delay.testing: no RabbitMQ, no waiting.

    .venv/bin/python -m pytest examples/test_order_timeout.py    # or run it as a script:
    .venv/bin/python examples/test_order_timeout.py

The app below is what a shop would ship (topology/orders.toml: an order still unpaid 30
minutes after it was placed is cancelled; a failure is retried after 5 m, 5 m, 30 m,
then parked). Each test publishes as the shop's code does, lets virtual time pass with
`broker.advance(...)` and asserts what the handler did: 30 minutes take a few
milliseconds. The broker is emulated; the declaring, publishing, retrying and parking
are rabbit-delay's own code, the same that runs against RabbitMQ (docs/testing.md).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import BaseModel

from rabbit_delay import App, HandlerContext, Publisher, Reject
from rabbit_delay.testing import MemoryPublisher, TestBroker

TOPOLOGY = Path(__file__).resolve().parent.parent / "topology" / "orders.toml"
QUEUE = "orders.cancel-unpaid"


# -- the application (in a real project: myapp.py) -------------------------------------


class CancelOrder(BaseModel):
    order_id: int


class OrderService:
    """Stands in for the shop's orders database and payment service."""

    def __init__(self) -> None:
        self.unpaid = {1, 2, 3}
        self.cancelled: list[int] = []
        self.payments_down = False

    def cancel_if_unpaid(self, order_id: int) -> None:
        if self.payments_down:
            raise ConnectionError("payment service unreachable")
        if order_id in self.unpaid:
            self.unpaid.discard(order_id)
            self.cancelled.append(order_id)


def make_app(orders: OrderService) -> App:
    app = App(TOPOLOGY)

    @app.consumer(QUEUE, model=CancelOrder)
    def cancel_unpaid(msg: CancelOrder, ctx: HandlerContext) -> None:
        if msg.order_id not in orders.unpaid | set(orders.cancelled):
            raise Reject(f"no order {msg.order_id}")  # parked at once, with the reason
        orders.cancel_if_unpaid(msg.order_id)  # any exception: retried through the tiers

    return app


# The shop's code takes a sync publisher: rabbit_delay.Publisher in production, the
# kit's MemoryPublisher in tests (the same API).
SyncPublisher = Publisher | MemoryPublisher


def place_order(publisher: SyncPublisher, order_id: int) -> str:
    """What the shop does when an order is placed: schedule its payment timeout."""
    return publisher.publish_delayed(
        CancelOrder(order_id=order_id), "30m", queue=QUEUE, message_id=f"order-{order_id}-timeout"
    )


# -- the tests ---------------------------------------------------------------------------


@pytest.fixture
def orders() -> OrderService:
    return OrderService()


@pytest.fixture
def app(orders: OrderService) -> App:
    return make_app(orders)


@pytest.fixture
def broker(app: App) -> Iterator[TestBroker]:
    with TestBroker(app) as made:  # RabbitMQ 4.3 emulated; version="3.10.8" for its rules
        yield made


def test_an_unpaid_order_is_cancelled_30_minutes_after_it_was_placed(
    broker: TestBroker, orders: OrderService
) -> None:
    place_order(broker.publisher, 1)
    broker.advance("29m59s")
    assert orders.cancelled == []  # not a second early
    broker.advance("1s")
    assert orders.cancelled == [1]
    assert broker.outcomes(QUEUE) == ["acked"]


def test_a_paid_order_is_not_cancelled(broker: TestBroker, app: App, orders: OrderService) -> None:
    timeout = place_order(broker.publisher, 2)
    app.cancel(timeout)  # the payment arrived: drop the timeout when it comes due
    broker.advance("30m")
    assert orders.cancelled == []
    assert broker.outcomes(QUEUE) == ["cancelled"]


def test_a_cancellation_that_fails_is_retried_then_parked_with_the_reason(
    broker: TestBroker, orders: OrderService
) -> None:
    orders.payments_down = True
    place_order(broker.publisher, 3)
    broker.run_until_idle()  # 30 m, then retries after 5 m, 5 m and 30 m
    assert broker.outcomes(QUEUE) == ["retried", "retried", "retried", "parked"]
    [parked] = broker.parked(QUEUE)
    assert parked.header("rd-error-type") == "ConnectionError"
    assert parked.header("rd-attempt") == 4
    assert orders.cancelled == []


def test_the_service_recovering_between_retries(broker: TestBroker, orders: OrderService) -> None:
    orders.payments_down = True
    place_order(broker.publisher, 1)
    broker.advance("30m")  # attempt 1 fails
    orders.payments_down = False
    broker.advance("5m")  # attempt 2 succeeds
    assert broker.outcomes(QUEUE) == ["retried", "acked"]
    assert [h.attempt for h in broker.handled(QUEUE)] == [1, 2]
    assert orders.cancelled == [1]


def test_an_unknown_order_is_parked_at_once(broker: TestBroker) -> None:
    place_order(broker.publisher, 99)
    broker.advance("30m")
    assert broker.outcomes(QUEUE) == ["parked"]
    assert broker.parked(QUEUE)[0].header("rd-error-message") == "no order 99"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
