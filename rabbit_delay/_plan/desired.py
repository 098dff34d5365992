"""What a topology needs on the broker: every exchange, queue and binding, with its
arguments. Pure.

`desired(topology)` is the one place that decides the `x-arguments` of each object; the
names come from `Topology.names`. What the broker already has is compared with this in
`diff`, and declared by the programs of `program`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from rabbit_delay._names import Names
from rabbit_delay._topology.model import (
    LeaderLocator,
    QueueType,
    RetryBackend,
    RetryPolicy,
    Topology,
)

# The delayed-message plugin's exchange type (the [plugin] backend).
PLUGIN_EXCHANGE_TYPE = "x-delayed-message"


class Kind(StrEnum):
    EXCHANGE = "exchange"
    QUEUE = "queue"
    BINDING = "binding"


@dataclass(frozen=True, slots=True)
class ExchangeSpec:
    name: str
    type: str
    arguments: Mapping[str, object] = field(default_factory=dict)
    durable: bool = True

    kind = Kind.EXCHANGE


@dataclass(frozen=True, slots=True)
class QueueSpec:
    name: str
    arguments: Mapping[str, object] = field(default_factory=dict)
    durable: bool = True

    kind = Kind.QUEUE


@dataclass(frozen=True, slots=True)
class BindingSpec:
    source: str  # exchange
    destination: str  # queue or exchange
    routing_key: str
    destination_type: Kind = Kind.QUEUE

    kind = Kind.BINDING

    @property
    def name(self) -> str:
        arrow = "->" if self.destination_type is Kind.QUEUE else "=>"
        return f"{self.source} {arrow} {self.destination} [{self.routing_key}]"


ObjectSpec = ExchangeSpec | QueueSpec


@dataclass(frozen=True, slots=True)
class Desired:
    exchanges: tuple[ExchangeSpec, ...]
    queues: tuple[QueueSpec, ...]
    bindings: tuple[BindingSpec, ...]
    # Each tier's shard count and the names to build shard names with: a plan reports
    # the buffers of shards past the count (left by a lowered count) as extra.
    tier_shards: Mapping[str, int] = field(default_factory=dict)
    names: Names | None = None
    # The [held] backend's holding queue, if any (RabbitMQ 4.3+ only: `refusals`).
    held_queue: str | None = None

    @property
    def objects(self) -> tuple[ObjectSpec, ...]:
        # Exchanges first: a queue's dead-letter exchange should exist before the queue.
        return (*self.exchanges, *self.queues)


# Placement arguments: the broker reads them once, when it creates a quorum queue (where
# its leader goes, how many replicas it starts with); afterwards leadership moves with
# failures and membership with `rabbitmq-queues add_member/grow`. So they are declared
# on new queues and never compared: a topology that adds or changes them is in place on
# existing queues (the plan notes the difference), never a 406 (docs/scaling.md).
LEADER_LOCATOR = "x-queue-leader-locator"
INITIAL_GROUP_SIZE = "x-quorum-initial-group-size"
CREATION_ONLY_ARGUMENTS = (LEADER_LOCATOR, INITIAL_GROUP_SIZE)


def placement_args(topology: Topology) -> dict[str, object]:
    """The placement arguments of every quorum queue of the topology (none for classic)."""
    if topology.queue_type is not QueueType.QUORUM:
        return {}
    scaling = topology.scaling
    args: dict[str, object] = {}
    if scaling.leader_locator is not LeaderLocator.BROKER:
        args[LEADER_LOCATOR] = scaling.leader_locator.value
    if scaling.replicas is not None:
        args[INITIAL_GROUP_SIZE] = scaling.replicas
    return args


def _dead_letter_args(topology: Topology, dlx: str) -> dict[str, object]:
    args: dict[str, object] = {"x-dead-letter-exchange": dlx}
    if topology.queue_type is QueueType.QUORUM:
        # All three are needed for at-least-once dead-lettering; with the default
        # overflow, a quorum queue falls back to at-most-once without a word.
        args |= {
            "x-queue-type": "quorum",
            "x-dead-letter-strategy": "at-least-once",
            "x-overflow": "reject-publish",
        }
    return args | placement_args(topology)


# Parking lots and the catch-all hold messages for people. They have no dead-letter
# exchange, and RabbitMQ 4.0 drops a message after 20 requeues of a quorum queue that
# sets no limit: inspecting them (get + requeue) must never cost a message.
HUMAN_QUEUE_DELIVERY_LIMIT = 1_000_000


def _plain_queue_args(topology: Topology) -> dict[str, object]:
    if topology.queue_type is QueueType.QUORUM:
        return {
            "x-queue-type": "quorum",
            "x-delivery-limit": HUMAN_QUEUE_DELIVERY_LIMIT,
            **placement_args(topology),
        }
    return {}


# RabbitMQ 4.3+ quorum queue delayed retry: a requeued message comes back after
# min(min x x-delivery-count, max). Type "failed": only failed deliveries wait (basic.reject,
# a lost channel), so a nack (a delivery handed back unstarted at shutdown, or during an
# idempotency store outage) comes back at once and, on 4.3, uncounted.
DELAYED_RETRY_TYPE = "x-delayed-retry-type"


def _delayed_retry_args(retry: RetryPolicy) -> dict[str, object]:
    assert retry.min is not None  # RetryPolicy validates it for backend "broker"
    args: dict[str, object] = {DELAYED_RETRY_TYPE: "failed", "x-delayed-retry-min": retry.min}
    if retry.max is not None:
        args["x-delayed-retry-max"] = retry.max
    return args


def desired(topology: Topology) -> Desired:
    """Every exchange, queue and binding the topology needs, with its arguments."""
    n = topology.names
    catch_all = n.unroutable_exchange()
    exchanges = [
        ExchangeSpec(catch_all, "fanout"),
        ExchangeSpec(n.due_exchange(), "direct", {"alternate-exchange": catch_all}),
        ExchangeSpec(n.parking_exchange(), "direct", {"alternate-exchange": catch_all}),
    ]
    queues = [QueueSpec(n.unroutable_queue(), _plain_queue_args(topology))]
    bindings = [BindingSpec(catch_all, n.unroutable_queue(), "")]

    for tier, ms in topology.tiers.items():
        # The tier exchange is what publishers target: a fanout into the buffer, so a
        # publish is unroutable (and returned under `mandatory`) only if the buffer is gone.
        # A sharded tier has one such pair per shard, all with the same TTL and the same
        # dead-letter exchange: the Router spreads messages over them by message_id.
        # Queue-level TTL, never per-message expiration: RabbitMQ only expires the head of
        # a queue, so with one TTL per queue, FIFO order equals expiry order.
        args = _dead_letter_args(topology, n.due_exchange()) | {"x-message-ttl": ms}
        for exchange, queue in zip(
            topology.tier_exchanges(tier), topology.tier_queues(tier), strict=True
        ):
            exchanges.append(ExchangeSpec(exchange, "fanout"))
            queues.append(QueueSpec(queue, args))
            bindings.append(BindingSpec(exchange, queue, ""))

    for queue, cfg in topology.queues.items():
        name = n.business_queue(queue)
        args = _dead_letter_args(topology, n.parking_exchange())
        # Whatever key the message arrived with (a shared binding key, a cascade key), a
        # dead-lettered one (delivery limit, a reject) goes to THIS queue's parking lot.
        args["x-dead-letter-routing-key"] = n.queue_key(queue)
        if topology.queue_type is QueueType.QUORUM:
            args["x-delivery-limit"] = cfg.delivery_limit
        if cfg.retry.backend is RetryBackend.BROKER:  # quorum only (Topology validates it)
            args |= _delayed_retry_args(cfg.retry)
        queues.append(QueueSpec(name, args))
        queues.append(QueueSpec(n.parking_queue(queue), _plain_queue_args(topology)))
        for key in (n.queue_key(queue), *cfg.bindings):
            bindings.append(BindingSpec(n.due_exchange(), name, key))
        parking = BindingSpec(n.parking_exchange(), n.parking_queue(queue), n.queue_key(queue))
        bindings.append(parking)

    if topology.cascade is not None:
        _add_cascade(topology, exchanges, queues, bindings)
    if topology.plugin is not None:
        _add_plugin(topology, exchanges, bindings)
    held = _add_held(topology, exchanges, queues, bindings) if topology.held is not None else None
    shards = {tier: topology.shards(tier) for tier in topology.tiers}
    return Desired(tuple(exchanges), tuple(queues), tuple(bindings), shards, n, held)


# The holding queue's x-delivery-limit: none. Measured on 4.3.6: a hold (`modified`,
# delivery_failed false) does not count towards the limit (only x-acquired-count grows),
# but a holder's lost connection does, and a message past the limit would be
# dead-lettered to the due exchange: delivered EARLY. -1 disables the limit (4.0+).
HELD_DELIVERY_LIMIT = -1
# How long the holding queue keeps the deliveries of a holder whose node went away
# before handing them to another holder (`x-consumer-disconnected-timeout`, ms; 60 s by
# default on 4.3). Measured: killing the node that led the holding queue, to which the
# holder was connected, made the messages that holder had in hand 60 s late. A short
# timeout costs nothing here: a delivery handed to another holder is only held again.
HELD_CONSUMER_DISCONNECTED_TIMEOUT_MS = 5_000


def _add_held(
    topology: Topology,
    exchanges: list[ExchangeSpec],
    queues: list[QueueSpec],
    bindings: list[BindingSpec],
) -> str:
    """The holding queue (quorum, at-least-once dead-lettering into the due exchange with
    the message's own routing key: its business queue) and the fanout exchange publishers
    use. The holders keep every message in it until its `rd-due-at`, then reject it."""
    n = topology.names
    name = n.held_queue()
    args = _dead_letter_args(topology, n.due_exchange())
    args["x-delivery-limit"] = HELD_DELIVERY_LIMIT
    args["x-consumer-disconnected-timeout"] = HELD_CONSUMER_DISCONNECTED_TIMEOUT_MS
    exchanges.append(ExchangeSpec(n.held_exchange(), "fanout"))
    queues.append(QueueSpec(name, args))
    bindings.append(BindingSpec(n.held_exchange(), name, ""))
    return name


def _add_cascade(
    topology: Topology,
    exchanges: list[ExchangeSpec],
    queues: list[QueueSpec],
    bindings: list[BindingSpec],
) -> None:
    """Level L: a topic exchange and a queue holding messages 2^L units, dead-lettering
    into level L-1 (level 0 into the delivery exchange). A key's bit for level L decides:
    1 parks the message in queue L, 0 passes it straight to the next exchange."""
    cfg = topology.cascade
    assert cfg is not None
    n = topology.names
    catch_all = n.unroutable_exchange()
    deliver = n.cascade_deliver_exchange()
    exchanges.append(ExchangeSpec(deliver, "topic", {"alternate-exchange": catch_all}))
    for level in range(cfg.levels):
        exchange = n.cascade_exchange(level)
        exchanges.append(ExchangeSpec(exchange, "topic", {"alternate-exchange": catch_all}))
        next_hop = n.cascade_exchange(level - 1) if level else deliver
        ttl = (2**level) * cfg.resolution
        args = _dead_letter_args(topology, next_hop) | {"x-message-ttl": ttl}
        queues.append(QueueSpec(n.cascade_queue(level), args))
        # Publishers enter at their highest set bit, always a 1: a fanout straight into
        # the queue, so the publish path pays no topic match (no AE: under `mandatory`,
        # a missing queue is returned to the publisher rather than hidden).
        entry = n.cascade_entry_exchange(level)
        exchanges.append(ExchangeSpec(entry, "fanout"))
        bindings.append(BindingSpec(entry, n.cascade_queue(level), ""))
        skip = "*." * (cfg.levels - 1 - level)  # the more significant bits
        bindings.append(BindingSpec(exchange, n.cascade_queue(level), f"{skip}1.#"))
        bindings.append(BindingSpec(exchange, next_hop, f"{skip}0.#", Kind.EXCHANGE))
    every_bit = "*." * cfg.levels
    for queue, qcfg in topology.queues.items():
        dest = qcfg.alias or queue
        bindings.append(BindingSpec(deliver, n.business_queue(queue), f"{every_bit}{dest}"))


def _add_plugin(
    topology: Topology, exchanges: list[ExchangeSpec], bindings: list[BindingSpec]
) -> None:
    """The x-delayed-message exchange: a pure delay stage, fanout into the due exchange.

    `x-delayed-type = fanout` with one binding to the due exchange, so routing by key
    happens only there: a due message whose key matches no business queue reaches the
    catch-all through the due exchange's alternate exchange, and no per-key binding of
    the plugin exchange can be missing (the plugin cannot honour `mandatory`, so a
    publish could not tell). No alternate-exchange on the plugin exchange itself: while
    the plugin holds a message its route returns no queue, so the broker would ALSO hand
    every message to the alternate exchange at publish time (plugin issue #36).
    """
    n = topology.names
    name = n.plugin_exchange()
    # First of all objects, so that even without the type probe a missing plugin (503,
    # connection closed) stops `declare` before anything was created.
    exchanges.insert(0, ExchangeSpec(name, PLUGIN_EXCHANGE_TYPE, {"x-delayed-type": "fanout"}))
    bindings.append(BindingSpec(name, n.due_exchange(), "", Kind.EXCHANGE))
