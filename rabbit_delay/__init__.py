"""rabbit-delay: reliable "do this later" on RabbitMQ.

Importing the package imports neither pika nor aio-pika: the sync transport lives in
`rabbit_delay.sync`, the async one in `rabbit_delay.aio`. `Publisher` and
`AsyncPublisher` are re-exported lazily here for convenience.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rabbit_delay.durations import format_ms, parse_ms
from rabbit_delay.errors import (
    AccessRefused,
    ArgumentConflict,
    BrokerBlocked,
    BrokerError,
    BrokerUnavailable,
    ConfigError,
    ConnectionLost,
    DeclarationConflict,
    DecodeError,
    DelayError,
    DurationError,
    EncodeError,
    IncompatibleBroker,
    ManagementUnavailable,
    MissingObjectError,
    MissingPluginError,
    NackError,
    PublishError,
    RabbitDelayError,
    TopologyError,
    UnconfirmedError,
    UnknownTargetError,
    UnroutableError,
)
from rabbit_delay.names import Names
from rabbit_delay.topology import QueueType, Topology, load_topology, topology_from_dict
from rabbit_delay.urls import redact

if TYPE_CHECKING:
    from rabbit_delay.aio.publisher import AsyncPublisher
    from rabbit_delay.sync.publisher import Publisher

__version__ = "0.1.0"

__all__ = [
    "AccessRefused",
    "ArgumentConflict",
    "AsyncPublisher",
    "BrokerBlocked",
    "BrokerError",
    "BrokerUnavailable",
    "ConfigError",
    "ConnectionLost",
    "DeclarationConflict",
    "DecodeError",
    "DelayError",
    "DurationError",
    "EncodeError",
    "IncompatibleBroker",
    "ManagementUnavailable",
    "MissingObjectError",
    "MissingPluginError",
    "NackError",
    "Names",
    "PublishError",
    "Publisher",
    "QueueType",
    "RabbitDelayError",
    "Topology",
    "TopologyError",
    "UnconfirmedError",
    "UnknownTargetError",
    "UnroutableError",
    "format_ms",
    "load_topology",
    "parse_ms",
    "redact",
    "topology_from_dict",
]


def __getattr__(name: str) -> Any:
    # Lazy, so `import rabbit_delay` pulls in only the transport actually used.
    if name == "Publisher":
        from rabbit_delay.sync.publisher import Publisher

        return Publisher
    if name == "AsyncPublisher":
        from rabbit_delay.aio.publisher import AsyncPublisher

        return AsyncPublisher
    raise AttributeError(f"module 'rabbit_delay' has no attribute {name!r}")
