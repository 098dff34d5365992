"""The App: registration, refusals before connecting, decoding, idempotency keys."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from rabbit_delay import App, ConfigError, HandlerContext, Topology, topology_from_dict
from rabbit_delay import _headers as h
from rabbit_delay._consumer.app import Prepared, Transport
from rabbit_delay._consumer.decide import Park, ParkReason
from rabbit_delay._consumer.delivery import outcome_of
from rabbit_delay._observe.report import WorkerMetrics, WorkerStats, log_action
from rabbit_delay.metrics import Metrics
from rabbit_delay.stores import ClaimResult, MemoryStore

NOW = 1_800_000_000_000


def topology() -> Topology:
    return topology_from_dict(
        {
            "namespace": "shop",
            "tiers": {"1s": "1s", "1m": "1m"},
            "queues": {"orders": {"retry": {"max_attempts": 4}}, "mail": {}},
        }
    )


class Order(BaseModel):
    order_id: int


def make_app() -> App:
    return App(topology(), store=MemoryStore())


def test_the_decorator_registers_and_returns_the_handler() -> None:
    app = make_app()

    @app.consumer("orders", model=Order)
    def cancel(message: Order, ctx: HandlerContext) -> None: ...

    consumer = app.consumers["orders"]
    assert cancel.__name__ == "cancel"
    assert consumer.handler is cancel
    assert (consumer.is_async, consumer.takes_context) == (False, True)
    assert consumer.policy.max_attempts == 4
    assert app.select() == [consumer]
    assert app.select(["orders"]) == [consumer]


def test_async_handlers_and_one_argument_handlers_are_recognised() -> None:
    app = make_app()

    @app.consumer("orders", model=Order)
    async def cancel(message: Order) -> None: ...

    class Mailer:
        async def __call__(self, message: bytes, ctx: HandlerContext) -> None: ...

    app.add_consumer("mail", Mailer())
    orders = app.consumers["orders"]
    assert (orders.is_async, orders.takes_context) == (True, False)
    assert app.consumers["mail"].is_async


def test_registration_refuses_unknown_queues_duplicates_and_no_argument_handlers() -> None:
    app = make_app()
    with pytest.raises(ConfigError, match="not in the topology"):
        app.add_consumer("nope", lambda m: None)
    app.add_consumer("orders", lambda m: None)
    with pytest.raises(ConfigError, match="already has a handler"):
        app.add_consumer("orders", lambda m: None)
    with pytest.raises(ConfigError, match="must take the message"):
        app.add_consumer("mail", lambda: None)


def test_select_refuses_queues_without_a_handler() -> None:
    app = make_app()
    with pytest.raises(ConfigError, match="no consumers"):
        app.select()
    app.add_consumer("orders", lambda m: None)
    with pytest.raises(ConfigError, match="no handler for queue 'mail'"):
        app.select(["mail"])
    with pytest.raises(ConfigError, match="nor is it in the topology"):
        app.select(["ghost"])


def test_the_sync_worker_refuses_async_handlers_before_connecting() -> None:
    app = make_app()

    async def cancel(message: Any) -> None: ...

    app.add_consumer("orders", cancel)
    with pytest.raises(ConfigError, match="cannot run async handlers"):
        app.check_runnable(app.select(), Transport.SYNC)
    app.check_runnable(app.select(), Transport.ASYNC)


def test_an_app_loads_its_topology_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "shop.toml"
    path.write_text('namespace = "shop"\n[tiers]\n"1s" = "1s"\n[queues.orders]\n', encoding="utf-8")
    app = App(path, store=MemoryStore(), lease="10s", retention="1h")
    assert app.topology.names.prefix == "shop.v1"
    assert (app.lease_ms, app.retention_ms) == (10_000, 3_600_000)


def headers(attempt: int = 1) -> dict[str, object]:
    return {
        h.H_ATTEMPT: attempt,
        h.H_TIER: "1s",
        h.H_DUE_AT: NOW - 250,
        h.H_TARGET: "shop.v1.q.orders",
    }


def test_prepare_decodes_builds_the_context_and_scopes_the_key_to_the_queue() -> None:
    app = make_app()
    consumer = app.add_consumer("orders", lambda m, c: None, model=Order)
    body = b'{"order_id": 5}'
    prepared = consumer.prepare("m-1", headers(2), True, body, "application/json", NOW)
    assert isinstance(prepared, Prepared)
    assert prepared.message == Order(order_id=5)
    assert prepared.key == "shop.v1.q.orders:m-1"
    ctx = prepared.ctx
    assert (ctx.queue, ctx.message_id, ctx.attempt, ctx.tier) == ("orders", "m-1", 2, "1s")
    assert ctx.redelivered is True
    assert ctx.lateness_ms == 250
    assert ctx.lateness is not None
    assert ctx.lateness.total_seconds() == 0.25
    assert ctx.scheduled_at is not None
    assert ctx.max_attempts == 4
    assert not ctx.is_last_attempt


def test_a_key_function_replaces_the_message_id() -> None:
    app = make_app()
    consumer = app.add_consumer(
        "orders", lambda m: None, model=Order, key=lambda m: f"order-{m.order_id}"
    )
    prepared = consumer.prepare("m-1", headers(), False, b'{"order_id": 5}', None, NOW)
    assert isinstance(prepared, Prepared)
    assert prepared.key == "shop.v1.q.orders:order-5"
    unguarded = app.add_consumer("mail", lambda m: None, idempotent=False)
    prepared = unguarded.prepare("m-1", headers(), False, b"raw", None, NOW)
    assert isinstance(prepared, Prepared)
    assert (prepared.key, prepared.message) == (None, b"raw")


def test_a_non_model_type_is_validated_with_a_type_adapter() -> None:
    app = make_app()
    consumer = app.add_consumer("orders", lambda m: None, model=dict[str, int])
    prepared = consumer.prepare("m-1", headers(), False, b'{"a": 1}', None, NOW)
    assert isinstance(prepared, Prepared)
    assert prepared.message == {"a": 1}


@pytest.mark.parametrize(
    ("body", "hdrs", "reason"),
    [
        (b"{nope", headers(), ParkReason.DECODE_ERROR),
        (b'{"order_id": "five"}', headers(), ParkReason.VALIDATION_ERROR),
        (b'{"order_id": 5}', {h.H_ATTEMPT: "many"}, ParkReason.DECODE_ERROR),
    ],
)
def test_poison_messages_are_parked_by_prepare(
    body: bytes, hdrs: dict[str, object], reason: ParkReason
) -> None:
    app = make_app()
    consumer = app.add_consumer("orders", lambda m: None, model=Order)
    action = consumer.prepare("m-1", hdrs, False, body, "application/json", NOW)
    assert isinstance(action, Park)
    assert action.reason is reason
    assert action.outgoing.headers[h.H_ORIGINAL_QUEUE] == "orders"


def test_cancel_tombstones_the_key_in_every_queue_or_one() -> None:
    store = MemoryStore()
    app = App(topology(), store=store)
    app.cancel("m-1")
    guard = app.guard()
    for queue in ("orders", "mail"):
        assert guard.claim(f"shop.v1.q.{queue}:m-1", "w") is ClaimResult.CANCELLED
    app.cancel("m-2", queue="mail")
    assert guard.claim("shop.v1.q.mail:m-2", "w") is ClaimResult.CANCELLED
    assert guard.claim("shop.v1.q.orders:m-2", "w") is ClaimResult.CLAIMED
    with pytest.raises(ConfigError, match="unknown queue"):
        app.cancel("m-3", queue="ghost")
    with pytest.raises(ValueError, match="non-empty"):
        app.cancel("")


async def test_acancel_goes_through_the_async_store() -> None:
    app = make_app()
    await app.acancel("m-1", queue="orders")
    result = await app.async_guard().claim("shop.v1.q.orders:m-1", "w")
    assert result is ClaimResult.CANCELLED
    await app.aclose()


def test_stats_and_metrics_count_each_action() -> None:
    app = make_app()
    consumer = app.add_consumer("orders", lambda m: None, model=Order)
    stats = WorkerStats()
    metrics = Metrics()
    worker_metrics = WorkerMetrics(metrics, ["orders"])
    prepared = consumer.prepare("m-1", headers(4), False, b'{"order_id": 1}', None, NOW)
    assert isinstance(prepared, Prepared)
    actions = [
        consumer.decide(prepared, None, NOW),
        consumer.decide(prepared, ClaimResult.DONE, NOW),
        consumer.decide(prepared, ClaimResult.IN_PROGRESS, NOW),
        consumer.decide(prepared, RuntimeError("x"), NOW),  # attempt 4 of 4: parked
    ]
    for action in actions:
        stats.count(outcome_of(action))
        worker_metrics.handled("orders", outcome_of(action))
        log_action("orders", "m-1", 4, action)
    assert (stats.acked, stats.duplicate, stats.deferred, stats.parked) == (1, 1, 1, 1)

    def sample(outcome: str) -> float | None:
        return metrics.registry.get_sample_value(
            "rabbit_delay_handled_total", {"queue": "orders", "outcome": outcome}
        )

    assert [sample(o) for o in ("acked", "duplicate", "deferred", "parked")] == [1, 1, 1, 1]
