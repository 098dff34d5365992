"""rabbit-delay: reliable "do this later" on RabbitMQ.

What an application writes, in one namespace:

    from rabbit_delay import App, HandlerContext, Publisher, Retry, Worker, load_topology

    app = App("topology/orders.toml")

    @app.consumer("orders.cancel-unpaid")
    def cancel(order: dict, ctx: HandlerContext) -> None: ...

    with Publisher.connect(app.topology) as publisher:
        publisher.publish_delayed({"order_id": 42}, "30m", queue="orders.cancel-unpaid")

    Worker(app).run()

The transports are imported lazily: `Publisher` and `Worker` bring in pika,
`AsyncPublisher` and `AsyncWorker` aio-pika, and importing `rabbit_delay` imports
neither. Documented submodules keep their own small surface: `rabbit_delay.sync` and
`rabbit_delay.aio` (the transports), `rabbit_delay.stores` (idempotency stores),
`rabbit_delay.outbox`, `rabbit_delay.testing`, `rabbit_delay.metrics` and
`rabbit_delay.tracing`. Every other module is private (a leading underscore).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rabbit_delay._connection import ConnectionSettings, ReconnectBackoff
from rabbit_delay._consumer.app import App
from rabbit_delay._consumer.context import HandlerContext
from rabbit_delay._consumer.control import Reject, Retry
from rabbit_delay._errors import (
    AccessRefused,
    BrokerBlocked,
    BrokerError,
    BrokerUnavailable,
    ConfigError,
    ConnectionLost,
    DeclarationConflict,
    DecodeError,
    DelayError,
    DuplicateMessageError,
    DurationError,
    EncodeError,
    IncompatibleBroker,
    ManagementUnavailable,
    MissingObjectError,
    MissingPluginError,
    NackError,
    OutboxError,
    PublishError,
    RabbitDelayError,
    StoreError,
    TopologyError,
    UnconfirmedError,
    UnknownTargetError,
    UnroutableError,
)
from rabbit_delay._reconcile import AsyncReconcileContext, ReconcileContext, Resubmit
from rabbit_delay._schedule.messages import Scheduled
from rabbit_delay._schedule.records import ScheduleRecord, ScheduleState
from rabbit_delay._tls import TLSOptions
from rabbit_delay._topology.model import Topology, load_topology, topology_from_dict
from rabbit_delay._urls import redact
from rabbit_delay._version import __version__

if TYPE_CHECKING:
    from rabbit_delay.aio import AsyncPublisher, AsyncWorker
    from rabbit_delay.sync import Publisher, Worker


__all__ = [
    "AccessRefused",
    "App",
    "AsyncPublisher",
    "AsyncReconcileContext",
    "AsyncWorker",
    "BrokerBlocked",
    "BrokerError",
    "BrokerUnavailable",
    "ConfigError",
    "ConnectionLost",
    "ConnectionSettings",
    "DeclarationConflict",
    "DecodeError",
    "DelayError",
    "DuplicateMessageError",
    "DurationError",
    "EncodeError",
    "HandlerContext",
    "IncompatibleBroker",
    "ManagementUnavailable",
    "MissingObjectError",
    "MissingPluginError",
    "NackError",
    "OutboxError",
    "PublishError",
    "Publisher",
    "RabbitDelayError",
    "ReconcileContext",
    "ReconnectBackoff",
    "Reject",
    "Resubmit",
    "Retry",
    "ScheduleRecord",
    "ScheduleState",
    "Scheduled",
    "StoreError",
    "TLSOptions",
    "Topology",
    "TopologyError",
    "UnconfirmedError",
    "UnknownTargetError",
    "UnroutableError",
    "Worker",
    "__version__",
    "load_topology",
    "redact",
    "topology_from_dict",
]

# Public classes defined in private modules are shown (repr, error types in the
# rd-error-type header, pickling) under the name a user imports them by.
for _name in __all__:
    _obj = globals().get(_name)
    if isinstance(_obj, type) and _obj.__module__.startswith("rabbit_delay._"):
        _obj.__module__ = "rabbit_delay"
del _name, _obj

# name -> the transport package that defines it, imported on first use
_LAZY = {
    "Publisher": "rabbit_delay._sync.publisher",
    "Worker": "rabbit_delay._sync.worker",
    "AsyncPublisher": "rabbit_delay._aio.publisher",
    "AsyncWorker": "rabbit_delay._aio.worker",
}


def __getattr__(name: str) -> Any:
    # Lazy, so `import rabbit_delay` pulls in only the transport actually used.
    package = _LAZY.get(name)
    if package is None:
        raise AttributeError(f"module 'rabbit_delay' has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(package), name)


def __dir__() -> list[str]:
    return sorted(__all__)
