"""The AsyncAPI 3.0 document of a topology (`rabbit-delay asyncapi`). Pure: no broker.

What a service in another language needs to publish to and consume from a topology, in
the format AsyncAPI tools (and FastStream users) read:

- a channel per tier exchange (one per shard of a sharded tier), per cascade entry
  exchange and for the plugin exchange, addressed by the routing key (`{routingKey}`,
  the keys each one accepts listed), and a channel per business queue;
- AMQP 0-9-1 bindings (binding version 0.3.0): exchange type, durability, vhost, and the
  `x-` arguments of every exchange and queue (the buffer behind a tier exchange, the
  business queue's own) exactly as `rabbit_delay._plan.desired.desired(topology)`
  declares them, so the document cannot drift from what `declare` creates;
- one message whose headers schema names every `rd-*` header of
  `rabbit_delay._headers`, with its type and meaning (the plugin's message adds `x-delay`);
- a `send` operation per publishing channel and a `receive` operation per business queue.

AsyncAPI's AMQP binding knows no exchange type `x-delayed-message`: the plugin exchange
says so in `x-type` (an extension) and leaves `type` out. Arguments go in `x-arguments`
beside the fields the binding defines.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

import rabbit_delay._headers as h
from rabbit_delay._consumer.decide import ParkReason
from rabbit_delay._durations import format_ms
from rabbit_delay._envelope import BINARY, JSON
from rabbit_delay._errors import DelayError
from rabbit_delay._plan.desired import (
    PLUGIN_EXCHANGE_TYPE,
    BindingSpec,
    Desired,
    ExchangeSpec,
    QueueSpec,
    desired,
)
from rabbit_delay._topology.delays import (
    CASCADE,
    HELD,
    IMMEDIATE,
    PLUGIN,
    Router,
    cascade_routing_key,
)
from rabbit_delay._topology.model import Topology
from rabbit_delay._urls import vhost_of
from rabbit_delay._version import __version__

ASYNCAPI_VERSION = "3.0.0"
AMQP_BINDING_VERSION = "0.3.0"
AMQP_PROTOCOL_VERSION = "0.9.1"
DEFAULT_PORTS = {"amqp": 5672, "amqps": 5671}
# The exchange types AsyncAPI's AMQP binding 0.3.0 knows.
BINDING_EXCHANGE_TYPES = frozenset({"topic", "direct", "fanout", "default", "headers"})
PERSISTENT = 2  # AMQP delivery mode

MESSAGE = "delayedMessage"
PLUGIN_MESSAGE = "pluginDelayedMessage"
ROUTING_KEY = "routingKey"

_INTEGER_MS = {"type": "integer", "minimum": 0}
_COUNT = {"type": "integer", "minimum": 0}
_TEXT = {"type": "string"}

# Every header rabbit-delay writes or reads: its JSON schema and meaning. A header added to
# rabbit_delay._headers without a line here fails tests/unit/test_asyncapi.py.
HEADERS: dict[str, tuple[dict[str, Any], str]] = {
    h.H_DUE_AT: (
        _INTEGER_MS,
        "When the message is due, UTC epoch milliseconds: publish time + the delay that "
        "applies. Set by every rabbit-delay publish; a worker measures lateness from it "
        "(without it, lateness is unknown).",
    ),
    h.H_ASKED_DUE_AT: (
        _INTEGER_MS,
        "The due time the publisher asked for, UTC epoch milliseconds; rd-due-at is it "
        "rounded up to what the backend serves (the cascade's resolution), never earlier.",
    ),
    h.H_DELAY_MS: (_INTEGER_MS, "The delay asked for, milliseconds."),
    h.H_TIER: (
        _TEXT,
        "The tier the message waits in (its name), or 'cascade' / 'plugin' for an exact "
        "delay, or 'now' for a message sent straight to the due exchange.",
    ),
    h.H_ATTEMPT: (
        {"type": "integer", "minimum": 1},
        "The delivery attempt: 1 for the first, +1 per retry. Absent: 1.",
    ),
    h.H_TARGET: (_TEXT, "The routing key the message was published for (its business queue)."),
    h.H_KEY: (
        _TEXT,
        "The message's schedule key (a topology with [schedule]; by default its "
        "message_id): what cancel, reschedule and look-up name it by.",
    ),
    h.H_GENERATION: (
        {"type": "integer", "minimum": 1},
        "With rd-key: the key's generation this copy is (1, +1 per replace or "
        "reschedule); a worker drops a copy whose key moved to a newer generation.",
    ),
    h.H_CRASHES: (
        _COUNT,
        "Deliveries of this message lost while its handler may have run (a worker died); "
        "set on the copies a worker re-publishes.",
    ),
    h.H_DEFERRALS: (
        _COUNT,
        "Times this copy was put off because another copy of it was being handled.",
    ),
    h.H_ERROR_TYPE: (
        _TEXT,
        "Parked or retried messages: the class of the last error (e.g. 'ValueError', "
        "'rabbit_delay.Reject', 'pydantic_core.ValidationError').",
    ),
    h.H_ERROR_MESSAGE: (_TEXT, "Parked or retried messages: the last error's message."),
    h.H_ERROR_TRACEBACK: (_TEXT, "Parked or retried messages: the last error's traceback."),
    h.H_ORIGINAL_QUEUE: (_TEXT, "Parked messages: the business queue (logical name) it failed in."),
    h.H_FIRST_FAILURE: (_INTEGER_MS, "Parked messages: the first failure, UTC epoch milliseconds."),
    h.H_LAST_FAILURE: (_INTEGER_MS, "Parked messages: the last failure, UTC epoch milliseconds."),
    h.H_PARK_REASON: (
        {"type": "string", "enum": [reason.value for reason in ParkReason]},
        "Parked messages: why it was parked.",
    ),
    h.H_TRACEPARENT: (_TEXT, "W3C trace context (traceparent), carried unchanged."),
    h.H_TRACESTATE: (_TEXT, "W3C trace context (tracestate), carried unchanged."),
}
PLUGIN_DELAY = (
    {"type": "integer", "minimum": 1, "maximum": 2**32 - 1},
    "The delayed-message plugin's delay, milliseconds (required on the plugin exchange).",
)


def document(topology: Topology, urls: Sequence[str] = ()) -> dict[str, Any]:
    """The AsyncAPI 3.0 document of `topology`; a server per broker URL of `urls` (its
    host, port and vhost: never its credentials). The vhost of the first URL (default
    "/") is the vhost of every channel binding."""
    want = desired(topology)
    vhost = vhost_of(urls[0]) if urls else "/"
    servers = _servers(urls)
    server_refs = [{"$ref": f"#/servers/{_pointer(key)}"} for key in servers]
    builder = _Channels(topology, want, vhost, server_refs)
    builder.build()
    doc: dict[str, Any] = {
        "asyncapi": ASYNCAPI_VERSION,
        "info": _info(topology),
        "defaultContentType": JSON,
    }
    if servers:
        doc["servers"] = servers
    doc["channels"] = builder.channels
    doc["operations"] = builder.operations
    doc["components"] = {"messages": _messages(topology)}
    return doc


# -- info and servers ------------------------------------------------------------------------


def _info(topology: Topology) -> dict[str, Any]:
    n = topology.names
    return {
        "title": f"rabbit-delay topology {n.prefix}",
        "version": f"{n.version}.0.0",
        "description": (
            f"Delayed messages on RabbitMQ for the topology `{n.prefix}` (namespace "
            f"`{topology.namespace}`, version {n.version}), generated by rabbit-delay "
            f"{__version__} from the topology file.\n\n"
            "Publish a delayed message to a tier exchange (or a cascade entry exchange, or "
            "the plugin exchange) with the routing key of a business queue: persistent "
            f"(delivery mode {PERSISTENT}), with a `message_id` (the idempotency key: a "
            f"worker runs each id once) and a content type (`{JSON}` for a JSON body, "
            f"`{BINARY}` for bytes), on a channel in confirm mode, `mandatory` set (but on "
            "the plugin exchange). The `rd-*` headers say when it is due and which attempt "
            "it is; a worker reads `rd-due-at` for lateness and `rd-attempt` (default 1). "
            "When it is due, the broker routes it to the business queue, where a "
            "rabbit-delay worker (or any consumer) receives it."
        ),
    }


def _servers(urls: Sequence[str]) -> dict[str, Any]:
    servers: dict[str, Any] = {}
    for i, url in enumerate(urls, start=1):
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        port = parts.port or DEFAULT_PORTS.get(scheme, 5672)
        host = parts.hostname or "localhost"
        shown = f"[{host}]" if ":" in host else host  # an IPv6 literal
        key = "broker" if len(urls) == 1 else f"broker-{i}"
        servers[key] = {
            "host": f"{shown}:{port}",
            "protocol": scheme,
            "protocolVersion": AMQP_PROTOCOL_VERSION,
            "description": f"RabbitMQ, vhost `{vhost_of(url)}`.",
        }
    return servers


# -- channels and operations -----------------------------------------------------------------


class _Channels:
    """The channels and operations of one document, built from the desired state."""

    def __init__(
        self, topology: Topology, want: Desired, vhost: str, servers: list[dict[str, str]]
    ) -> None:
        self.topology = topology
        self.names = topology.names
        self.vhost = vhost
        self.servers = servers
        self.router = Router(topology)
        self.exchanges = {e.name: e for e in want.exchanges}
        self.queues = {q.name: q for q in want.queues}
        self.bindings = want.bindings
        self.channels: dict[str, Any] = {}
        self.operations: dict[str, Any] = {}
        # Every routing key a publisher may use: each queue's own, then the binding keys.
        self.keys = list(
            dict.fromkeys(
                key
                for queue, cfg in topology.queues.items()
                for key in (self.names.queue_key(queue), *cfg.bindings)
            )
        )

    def build(self) -> None:
        for tier in self.topology.tiers:
            self._tier(tier)
        if self.topology.cascade is not None:
            self._cascade()
        if self.topology.plugin is not None:
            self._plugin()
        if self.topology.held is not None:
            self._held()
        for queue in self.topology.queues:
            self._business_queue(queue)

    def _tier(self, tier: str) -> None:
        keys = [k for k in self.keys if self._tier_accepts(k, tier)]
        exchanges = self.topology.tier_exchanges(tier)
        for shard, exchange in enumerate(exchanges):
            buffer = self.names.tier_queue(tier, shard)
            if len(exchanges) == 1:
                summary = f"Tier {tier}: messages wait {format_ms(self.topology.tiers[tier])} here."
                which = ""
            else:
                summary = (
                    f"Tier {tier}, shard {shard} of {len(exchanges)}: messages wait "
                    f"{format_ms(self.topology.tiers[tier])} here."
                )
                which = (
                    f" A sharded tier: publish to shard crc32(message_id) % {len(exchanges)} "
                    f"(CRC-32 of the message id's UTF-8 bytes, as zlib computes it); this is "
                    f"shard {shard}."
                )
            description = (
                f"Fanout exchange `{exchange}` into the TTL buffer queue `{buffer}`; when the "
                f"message expires it is dead-lettered to `{self.names.due_exchange()}`, "
                f"which routes it by its routing key to the business queue.{which}"
            )
            parameter = {
                "enum": keys,
                "description": f"The routing key of a business queue that accepts tier {tier}.",
            }
            self._publish_channel(exchange, summary, description, parameter, buffer)
            self._send(exchange, f"Publish a message delayed by tier {tier}.", MESSAGE, True)

    def _cascade(self) -> None:
        cfg = self.topology.cascade
        assert cfg is not None
        destinations = {
            queue: cfg_q.alias or queue for queue, cfg_q in self.topology.queues.items()
        }
        first_queue, first_dest = next(iter(destinations.items()))
        for level in range(cfg.levels):
            exchange = self.names.cascade_entry_exchange(level)
            buffer = self.names.cascade_queue(level)
            units = 2**level
            shortest, longest = units * cfg.resolution, (2 * units - 1) * cfg.resolution
            summary = (
                f"Cascade entry, level {level}: delays of {format_ms(shortest)} up to "
                f"{format_ms(longest)} start here."
            )
            description = (
                f"Fanout exchange `{exchange}` into the level queue `{buffer}` (it holds a "
                f"message {format_ms(units * cfg.resolution)}). An exact delay is rounded up to "
                f"whole units of {format_ms(cfg.resolution)}; a delay of U units starts at the "
                f"level of U's highest set bit (this one: {units} <= U < {2 * units}) and "
                "passes the lower levels by its routing key. A delay of 0 goes straight to "
                f"`{self.names.cascade_deliver_exchange()}`."
            )
            destination_list = ", ".join(
                f"`{dest}` (queue {queue})" for queue, dest in destinations.items()
            )
            parameter = {
                "description": (
                    f"The delay in units of {format_ms(cfg.resolution)}, in binary over "
                    f"{cfg.levels} dot-separated bits, most significant first, then the "
                    f"destination: the queue's alias, else its name ({destination_list})."
                ),
                # the shortest delay that starts here, for the first queue
                "examples": [cascade_routing_key(units, cfg.levels, first_dest)],
            }
            self._publish_channel(exchange, summary, description, parameter, buffer)
            self._send(
                exchange,
                f"Publish a message with an exact delay through cascade level {level} "
                f"(e.g. to queue {first_queue}).",
                MESSAGE,
                True,
            )

    def _plugin(self) -> None:
        exchange = self.names.plugin_exchange()
        summary = "The delayed-message plugin: any delay, in the x-delay header."
        description = (
            f"Exchange `{exchange}` of type {PLUGIN_EXCHANGE_TYPE} (x-delayed-type fanout), "
            f"bound to `{self.names.due_exchange()}`, which routes the message by its routing "
            "key when the plugin releases it. The plugin cannot honour `mandatory`: a "
            "message for no queue reaches the catch-all queue."
        )
        parameter = {"enum": self.keys, "description": "The routing key of a business queue."}
        self._publish_channel(exchange, summary, description, parameter, None, PLUGIN_MESSAGE)
        self._send(
            exchange, "Publish a message with an exact delay (x-delay).", PLUGIN_MESSAGE, False
        )

    def _held(self) -> None:
        exchange = self.names.held_exchange()
        queue = self.names.held_queue()
        summary = "The holding queue: any delay, exact, held by the quorum queue (4.3+)."
        description = (
            f"Fanout exchange `{exchange}` into the quorum holding queue `{queue}`. The "
            "holders (AMQP 1.0) have the queue hold each message until its `rd-due-at` "
            "header (UTC epoch ms), then the queue dead-letters it, routing key kept, to "
            f"`{self.names.due_exchange()}`, which routes it to its business queue."
        )
        parameter = {"enum": self.keys, "description": "The routing key of a business queue."}
        self._publish_channel(exchange, summary, description, parameter, queue)
        self._send(exchange, "Publish a message with an exact delay (rd-due-at).", MESSAGE, True)

    def _business_queue(self, queue: str) -> None:
        name = self.names.business_queue(queue)
        spec = self.queues[name]
        bound = [b for b in self.bindings if b.destination == name]
        binding: dict[str, Any] = {
            "is": "queue",
            "queue": {
                "name": name,
                "durable": spec.durable,
                "exclusive": False,
                "autoDelete": False,
                "vhost": self.vhost,
                **_arguments(spec),
            },
            "bindingVersion": AMQP_BINDING_VERSION,
            "x-bindings": [_bound(b) for b in bound],
        }
        self.channels[name] = {
            "address": name,
            "title": f"Business queue {queue}",
            "summary": f"Due messages for {queue}: consumed by its handler.",
            "description": (
                f"Durable queue `{name}`: due messages arrive here with routing key "
                f"`{self.names.queue_key(queue)}` (or a binding key of the queue). A message "
                "that fails for good is parked in "
                f"`{self.names.parking_queue(queue)}` with the rd-error-* headers."
            ),
            "messages": {MESSAGE: {"$ref": f"#/components/messages/{MESSAGE}"}},
            "bindings": {"amqp": binding},
            **self._on_servers(),
        }
        self.operations[f"receive.{queue}"] = {
            "action": "receive",
            "channel": {"$ref": f"#/channels/{_pointer(name)}"},
            "summary": f"Receive the due messages of queue {queue}; ack once handled.",
            "messages": [{"$ref": f"#/channels/{_pointer(name)}/messages/{MESSAGE}"}],
            "bindings": {"amqp": {"ack": True, "bindingVersion": AMQP_BINDING_VERSION}},
        }

    # -- pieces ----------------------------------------------------------------------------

    def _publish_channel(
        self,
        exchange: str,
        summary: str,
        description: str,
        parameter: dict[str, Any],
        buffer: str | None,
        message: str = MESSAGE,
    ) -> None:
        binding: dict[str, Any] = {
            "is": "routingKey",
            "exchange": _exchange(self.exchanges[exchange], self.vhost),
            "bindingVersion": AMQP_BINDING_VERSION,
        }
        if buffer is not None:
            spec = self.queues[buffer]
            binding["x-buffer-queue"] = {
                "name": buffer,
                "durable": spec.durable,
                "arguments": dict(spec.arguments),
            }
        self.channels[exchange] = {
            "address": "{" + ROUTING_KEY + "}",
            "title": exchange,
            "summary": summary,
            "description": description,
            "parameters": {ROUTING_KEY: parameter},
            "messages": {message: {"$ref": f"#/components/messages/{message}"}},
            "bindings": {"amqp": binding},
            **self._on_servers(),
        }

    def _send(self, exchange: str, summary: str, message: str, mandatory: bool) -> None:
        self.operations[f"send.{exchange}"] = {
            "action": "send",
            "channel": {"$ref": f"#/channels/{_pointer(exchange)}"},
            "summary": summary,
            "messages": [{"$ref": f"#/channels/{_pointer(exchange)}/messages/{message}"}],
            "bindings": {
                "amqp": {
                    "deliveryMode": PERSISTENT,
                    "mandatory": mandatory,
                    "timestamp": True,
                    "bindingVersion": AMQP_BINDING_VERSION,
                }
            },
        }

    def _on_servers(self) -> dict[str, Any]:
        return {"servers": list(self.servers)} if self.servers else {}

    def _tier_accepts(self, key: str, tier: str) -> bool:
        try:
            self.router.resolve(key, tier=tier)
        except DelayError:
            return False
        return True


def _exchange(spec: ExchangeSpec, vhost: str) -> dict[str, Any]:
    out: dict[str, Any] = {"name": spec.name}
    if spec.type in BINDING_EXCHANGE_TYPES:
        out["type"] = spec.type
    else:
        out["x-type"] = spec.type  # x-delayed-message: no type AsyncAPI's binding knows
    out |= {"durable": spec.durable, "autoDelete": False, "vhost": vhost, **_arguments(spec)}
    return out


def _arguments(spec: ExchangeSpec | QueueSpec) -> dict[str, Any]:
    return {"x-arguments": dict(spec.arguments)} if spec.arguments else {}


def _bound(binding: BindingSpec) -> dict[str, str]:
    return {"exchange": binding.source, "routingKey": binding.routing_key}


# -- messages --------------------------------------------------------------------------------


def _messages(topology: Topology) -> dict[str, Any]:
    tiers = [*topology.tiers, IMMEDIATE]
    if topology.cascade is not None:
        tiers.append(CASCADE)
    if topology.plugin is not None:
        tiers.append(PLUGIN)
    if topology.held is not None:
        tiers.append(HELD)
    headers = headers_schema(tiers)
    messages = {MESSAGE: _message(MESSAGE, "A delayed message", headers)}
    if topology.plugin is not None:
        schema, said = PLUGIN_DELAY
        plugin_headers = {
            **headers,
            "properties": {
                **headers["properties"],
                h.H_PLUGIN_DELAY: {**schema, "description": said},
            },
            "required": [h.H_PLUGIN_DELAY],
        }
        messages[PLUGIN_MESSAGE] = _message(
            PLUGIN_MESSAGE, "A delayed message for the plugin exchange", plugin_headers
        )
    return messages


def headers_schema(tiers: Sequence[str] = ()) -> dict[str, Any]:
    """The JSON schema of a message's headers: every header of HEADERS (none required: a
    worker reads a message without them as a first attempt of unknown lateness). `tiers`
    lists the values rd-tier may take."""
    properties: dict[str, Any] = {}
    for name, (schema, said) in HEADERS.items():
        properties[name] = {**schema, "description": said}
        if name == h.H_TIER and tiers:
            properties[name]["enum"] = list(tiers)
    return {
        "type": "object",
        "description": (
            "AMQP headers. rabbit-delay's own are rd-*; the broker adds its own x-* "
            "(x-death, x-delivery-count), which rabbit-delay strips before it re-publishes."
        ),
        "properties": properties,
        "additionalProperties": True,
    }


def _message(name: str, title: str, headers: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "name": name,
        "title": title,
        "contentType": JSON,
        "headers": dict(headers),
        "payload": {
            "description": (
                f"The application's message: JSON ({JSON}) for a model, a dict or a list; "
                f"any bytes ({BINARY}) otherwise. A rabbit-delay handler receives it decoded "
                "into its model or the annotation of its first parameter."
            )
        },
        "x-amqp-properties": {
            "message_id": "Required by the idempotency guard: a worker runs each id once "
            "per queue (a message without one is handled, unguarded).",
            "content_type": f"{JSON} or {BINARY}",
            "delivery_mode": PERSISTENT,
            "timestamp": "Publish time, seconds.",
        },
    }


def _pointer(key: str) -> str:
    """`key` as a JSON pointer segment (RFC 6901)."""
    return key.replace("~", "~0").replace("/", "~1")
