"""Where a delayed message is published, for each delay backend. Pure.

Three backends sit behind the one `publish_delayed` call:

- tiers: one TTL buffer queue per tier (always present); exact delays only. A tier may
  have several buffers (shards, `[scaling]`): the message's id picks one (`shard_index`).
- cascade: plugin-free arbitrary delays. Level L holds messages for 2^L time units;
  the routing key spells the delay in binary, most significant bit first, then the
  destination, so each level either parks the message (bit 1) or passes it on (bit 0).
  Every level is a queue with a queue-level TTL, so no message waits behind a longer one.
  Levels are not sharded: a level passes messages on by routing key (topic exchanges),
  and spreading them would need a hash exchange (a plugin before RabbitMQ 4.3).
- plugin: the x-delayed-message exchange; the delay travels in the `x-delay` header.
- held (RabbitMQ 4.3+): the holding queue, through its fanout exchange, with the
  message's own routing key; the holders keep it there until its `rd-due-at` (exact to
  the millisecond), then the queue dead-letters it, key kept, to the due exchange.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field

from rabbit_delay._durations import MAX_TTL_MS, format_ms, negative
from rabbit_delay._errors import DelayError, UnknownTargetError
from rabbit_delay._headers import H_PLUGIN_DELAY
from rabbit_delay._names import CASCADE_KIND, HELD_KIND
from rabbit_delay._topology.model import Topology

# AMQP 0-9-1 short strings: routing keys are limited to 255 bytes.
MAX_ROUTING_KEY_BYTES = 255
CASCADE = CASCADE_KIND
PLUGIN = "plugin"
HELD = HELD_KIND
# `rd-tier` of a message sent straight to the due exchange (already due: a replay, or a
# pending message moved after its due time).
IMMEDIATE = "now"


@dataclass(frozen=True, slots=True)
class Route:
    """Where and how to publish one delayed message."""

    exchange: str
    routing_key: str
    tier: str  # the tier name, or "cascade" / "plugin" / "held"
    delay_ms: int  # the delay that will actually apply (rounded up to the resolution)
    target: str  # the business routing key the message is for
    headers: Mapping[str, object] = field(default_factory=dict)
    # The plugin cannot honour `mandatory`; every other route can.
    mandatory: bool = True
    # A sharded tier: the exchange of each of its buffers (the first is `exchange`).
    shards: tuple[str, ...] = ()
    # The delay asked for, when `delay_ms` had to round it up (the cascade's resolution,
    # a longer tier for what remains); None: exactly `delay_ms`.
    asked_ms: int | None = None

    @property
    def asked_delay_ms(self) -> int:
        """The delay the caller asked for (`delay_ms` is what applies: never shorter)."""
        return self.delay_ms if self.asked_ms is None else self.asked_ms

    def exchange_for(self, message_id: str) -> str:
        """The exchange a message with this id is published to: `exchange`, or for a
        sharded tier the shard its id hashes to (`shard_index`)."""
        if not self.shards:
            return self.exchange
        return self.shards[shard_index(message_id, len(self.shards))]


def shard_index(message_id: str, shards: int) -> int:
    """Which of `shards` buffers a message goes to: CRC-32 of its id, modulo.

    By id, not round robin: the same in every process and thread with no shared counter
    (many short-lived publishers would all start at shard 0), and a message sent again
    with its id (a recovered publish, a worker's retry, a replay) takes the same buffer.
    CRC-32 spreads random and sequential ids alike evenly (tests/unit/test_router.py).
    """
    return zlib.crc32(message_id.encode()) % shards if shards > 1 else 0


class Router:
    """Resolves (target, tier | delay) to a Route for one topology.

    Everything that can be refused is refused here, before anything is sent.
    """

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        n = topology.names
        self._names = n
        # routing key -> business queues it reaches, for tier permission checks
        self._key_queues: dict[str, tuple[str, ...]] = {}
        for queue, cfg in topology.queues.items():
            for key in (n.queue_key(queue), *cfg.bindings):
                self._key_queues[key] = (*self._key_queues.get(key, ()), queue)
        self._tier_ms = dict(topology.tiers)
        self._tier_exchanges = {t: topology.tier_exchanges(t) for t in topology.tiers}
        self._by_ms = {ms: t for t, ms in topology.tiers.items()}
        self._allowed: dict[str, frozenset[str]] = {
            q: frozenset(topology.accepted_tiers(q)) for q in topology.queues
        }

    # -- targets ----------------------------------------------------------------------

    def target_key(self, queue: str | None, routing_key: str | None) -> str:
        """The routing key for a business queue name or a declared binding key."""
        if (queue is None) == (routing_key is None):
            raise UnknownTargetError("name exactly one target: queue=... or routing_key=...")
        if queue is not None:
            if queue not in self.topology.queues:
                known = ", ".join(sorted(self.topology.queues))
                raise UnknownTargetError(
                    f"unknown queue {queue!r}; the topology {self._names.prefix!r} has: {known}"
                )
            return self._names.queue_key(queue)
        assert routing_key is not None
        if routing_key not in self._key_queues:
            known = ", ".join(sorted(k for q in self.topology.queues.values() for k in q.bindings))
            raise UnknownTargetError(
                f"no queue is bound with routing key {routing_key!r}; declared binding keys: "
                f"{known or 'none'} (or target a queue with queue=...)"
            )
        return routing_key

    def queues_for_key(self, key: str) -> tuple[str, ...]:
        return self._key_queues[key]

    # -- resolution -------------------------------------------------------------------

    def resolve(self, key: str, *, tier: str | None = None, delay_ms: int | None = None) -> Route:
        """Route for `key` (from `target_key`) after a tier, or an exact delay in ms.

        Raises DelayError for an unknown tier, a tier the target does not accept, or a
        delay that no tier (nor the topology's arbitrary-delay backend) can serve.
        """
        if tier is not None:
            if delay_ms is not None and self._tier_ms.get(tier) != delay_ms:
                raise DelayError(
                    f"give either a tier or a delay, not both (tier {tier!r}, delay "
                    f"{format_ms(delay_ms)})"
                )
            return self._tier_route(key, tier)
        if delay_ms is None:
            raise DelayError("give a tier (e.g. '30m') or a delay (timedelta or seconds)")
        if delay_ms < 0:
            raise DelayError(negative(delay_ms))
        exact = self._by_ms.get(delay_ms)
        if exact is not None and self._tier_allowed(key, exact):
            return self._tier_route(key, exact)
        if self.topology.cascade is not None:
            return self._cascade_route(key, delay_ms)
        if self.topology.plugin is not None:
            return self._plugin_route(key, delay_ms)
        if self.topology.held is not None:
            return self._held_route(key, delay_ms)
        if exact is not None:
            return self._tier_route(key, exact)  # raises: the target does not accept that tier
        tiers = ", ".join(f"{t}={format_ms(ms)}" for t, ms in self._tier_ms.items())
        raise DelayError(
            f"no tier has a delay of {format_ms(delay_ms)} (tiers: {tiers}); use one of "
            "these delays, or enable arbitrary delays with a [cascade] table in the topology"
        )

    def immediate(self, key: str) -> Route:
        """Straight to the due exchange with `key`: delivered now."""
        return Route(self._names.due_exchange(), key, IMMEDIATE, 0, key)

    def resolve_remaining(self, key: str, remaining_ms: int) -> Route:
        """The route for a message that must wait `remaining_ms` more (its due time
        already fixed: a pending message moved to another topology or broker, an outbox
        row relayed late). Never early, as little late as the topology allows:

        - due already (<= 0): the due exchange, now;
        - with a cascade, the plugin or [held]: the exact remaining delay (cascade:
          rounded up to its resolution);
        - else the shortest tier the target accepts that is not shorter than what
          remains; `route.delay_ms - remaining_ms` is how late that makes it.

        Raises DelayError when what remains is longer than every tier the target
        accepts (it would be early), naming the longest.
        """
        if remaining_ms <= 0:
            return self.immediate(key)
        if self.topology.exact_delays:
            try:
                return self.resolve(key, delay_ms=remaining_ms)
            except UnknownTargetError:
                pass  # a binding key, which the cascade cannot carry: the tiers may
        fitting = sorted(
            (ms, tier)
            for tier, ms in self._tier_ms.items()
            if ms >= remaining_ms and self._tier_allowed(key, tier)
        )
        if not fitting:
            accepted = [t for t in self._tier_ms if self._tier_allowed(key, t)]
            longest = max(accepted, key=self._tier_ms.__getitem__) if accepted else None
            raise DelayError(
                f"{format_ms(remaining_ms)} remain, longer than every tier target {key!r} "
                f"accepts (longest: {longest or 'none'}"
                + (f" = {format_ms(self._tier_ms[longest])}" if longest else "")
                + "); it would arrive early: add a longer tier or a [cascade] to the topology"
            )
        route = self._tier_route(key, fitting[0][1])
        if route.delay_ms == remaining_ms:
            return route
        return dataclasses.replace(route, asked_ms=remaining_ms)

    def _tier_allowed(self, key: str, tier: str) -> bool:
        return all(tier in self._allowed[q] for q in self._key_queues[key])

    def _tier_route(self, key: str, tier: str) -> Route:
        exchanges = self._tier_exchanges.get(tier)
        if exchanges is None:
            known = ", ".join(self._tier_ms)
            raise DelayError(f"unknown tier {tier!r}; the topology's tiers are: {known}")
        if not self._tier_allowed(key, tier):
            refused = [q for q in self._key_queues[key] if tier not in self._allowed[q]]
            allowed = ", ".join(sorted(self._allowed[refused[0]]))
            raise DelayError(
                f"queue {refused[0]!r} does not accept tier {tier!r}; it accepts: {allowed}"
            )
        shards = exchanges if len(exchanges) > 1 else ()
        return Route(exchanges[0], key, tier, self._tier_ms[tier], key, shards=shards)

    # -- cascade ----------------------------------------------------------------------

    def _cascade_route(self, key: str, delay_ms: int) -> Route:
        cfg = self.topology.cascade
        assert cfg is not None
        queues = self._key_queues[key]
        if len(queues) != 1 or key != self._names.queue_key(queues[0]):
            raise UnknownTargetError(
                "cascade delays target one queue: use queue=..., not a binding key"
            )
        if delay_ms > cfg.max_delay_ms:
            raise DelayError(
                f"delay {format_ms(delay_ms)} exceeds the cascade maximum "
                f"{format_ms(cfg.max_delay_ms)} ({cfg.levels} levels at "
                f"{format_ms(cfg.resolution)}); raise `cascade.levels`"
            )
        # Round UP to the resolution: a message may be late by < 1 unit, never early.
        units = math.ceil(delay_ms / cfg.resolution)
        rk = cascade_routing_key(units, cfg.levels, self._cascade_destination(queues[0]))
        if len(rk.encode()) > MAX_ROUTING_KEY_BYTES:
            raise DelayError(
                f"cascade routing key for queue {queues[0]!r} is {len(rk.encode())} bytes, over "
                f"AMQP's {MAX_ROUTING_KEY_BYTES}; give the queue a short `alias` in the topology"
            )
        exchange = (
            self._names.cascade_entry_exchange(units.bit_length() - 1)
            if units
            else self._names.cascade_deliver_exchange()
        )
        applied = units * cfg.resolution
        return Route(
            exchange, rk, CASCADE, applied, key, asked_ms=delay_ms if applied != delay_ms else None
        )

    def _cascade_destination(self, queue: str) -> str:
        return self.topology.queues[queue].alias or queue

    # -- plugin -----------------------------------------------------------------------

    def _plugin_route(self, key: str, delay_ms: int) -> Route:
        # The plugin delivers at once, silently, any x-delay outside 1..2^32-1.
        if delay_ms < 1:
            raise DelayError("the delayed-message plugin needs a delay of at least 1 ms")
        if delay_ms > MAX_TTL_MS:
            raise DelayError(
                f"delay {format_ms(delay_ms)} exceeds the plugin maximum {format_ms(MAX_TTL_MS)} "
                "(x-delay is a 32-bit count of milliseconds)"
            )
        return Route(
            self._names.plugin_exchange(),
            key,
            PLUGIN,
            delay_ms,
            key,
            headers={H_PLUGIN_DELAY: delay_ms},
            mandatory=False,
        )

    # -- held -------------------------------------------------------------------------

    def _held_route(self, key: str, delay_ms: int) -> Route:
        # Any key the due exchange routes (a queue's own or a binding key): the holding
        # queue dead-letters the message with the key it was published with.
        cfg = self.topology.held
        assert cfg is not None
        if delay_ms > cfg.max_delay:
            raise DelayError(
                f"delay {format_ms(delay_ms)} exceeds the [held] maximum "
                f"{format_ms(cfg.max_delay)}; raise `held.max_delay`"
            )
        return Route(self._names.held_exchange(), key, HELD, delay_ms, key)


def cascade_routing_key(units: int, levels: int, destination: str) -> str:
    """`b(levels-1). ... .b0.destination`: the delay's bits, most significant first."""
    return ".".join(format(units, f"0{levels}b")) + "." + destination
