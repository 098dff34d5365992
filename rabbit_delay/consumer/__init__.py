"""The consumer framework: register handlers on an App, run them with a worker.

    from rabbit_delay.consumer import App, HandlerContext, Reject, Retry

    app = App("topology/shop.toml")

    @app.consumer("orders.cancel", model=CancelOrder)
    def cancel_order(msg: CancelOrder, ctx: HandlerContext) -> None:
        ...

Run it with `rabbit-delay worker myapp:app`, or `rabbit_delay.sync.worker.Worker(app)`
/ `rabbit_delay.aio.worker.AsyncWorker(app)`. Acks happen only after the handler
returned; failures go back through the delay tiers (`decide`), and a message that
keeps failing ends up in its queue's parking lot. See docs/consumer.md.
`@app.reconcile(every="10m")` registers a reconciler (docs/reconciliation.md).
"""

from rabbit_delay.consumer._app import App, Consumer, Prepared, Transport, is_async_callable
from rabbit_delay.consumer._context import HandlerContext
from rabbit_delay.consumer._decide import (
    ACK,
    Ack,
    Action,
    BrokerRetry,
    Outcome,
    Park,
    ParkReason,
    QueuePolicy,
    Republish,
    RepublishReason,
    Requeue,
    Skip,
    SkipReason,
    Unavailable,
    Undecodable,
    decide,
)
from rabbit_delay.consumer._reconcile import (
    AsyncReconcileContext,
    ReconcileContext,
    Reconciler,
    ReconcileResult,
    Resubmit,
)
from rabbit_delay.consumer._signals import Reject, Retry
from rabbit_delay.consumer._stats import WorkerMetrics, WorkerStats

__all__ = [
    "ACK",
    "Ack",
    "Action",
    "App",
    "AsyncReconcileContext",
    "BrokerRetry",
    "Consumer",
    "HandlerContext",
    "Outcome",
    "Park",
    "ParkReason",
    "Prepared",
    "QueuePolicy",
    "ReconcileContext",
    "ReconcileResult",
    "Reconciler",
    "Reject",
    "Republish",
    "RepublishReason",
    "Requeue",
    "Resubmit",
    "Retry",
    "Skip",
    "SkipReason",
    "Transport",
    "Unavailable",
    "Undecodable",
    "WorkerMetrics",
    "WorkerStats",
    "decide",
    "is_async_callable",
]
