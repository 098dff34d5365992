"""Every name rabbit-delay declares or reads on the broker, decided here and only here.

Names are pure functions of (namespace, version, ...). The version segment lets an
incompatible topology be declared beside the old one instead of fighting 406s:
`shop.v1.delay.5m` and `shop.v2.delay.5m` coexist while v1 drains.

The headers a message carries are named in `rabbit_delay._headers`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

TIER_KIND = "delay"
CASCADE_KIND = "cascade"
HELD_KIND = "held"
# A tier may spread over several buffers (`[scaling]`): shard 0 keeps the tier's own
# name, so a topology that adds shards keeps its existing buffer; shard i > 0 is
# `{tier}.{i}`. Tier names have no dot, so the two never collide.
_SHARD_SUFFIX = re.compile(r"^(?P<tier>[^.]+)(?:\.(?P<shard>[1-9][0-9]*))?$")


@dataclass(frozen=True, slots=True)
class Names:
    """Naming scheme for one topology: `{namespace}.v{version}.{kind}[.{detail}]`."""

    namespace: str
    version: int = 1

    @property
    def prefix(self) -> str:
        return f"{self.namespace}.v{self.version}"

    # Delay tiers: one exchange (fanout) and one TTL buffer queue per tier and shard,
    # same name. Shard 0 is the tier's name itself (what a tier of one shard always had).
    def tier_exchange(self, tier: str, shard: int = 0) -> str:
        return self._tier(tier, shard)

    def tier_queue(self, tier: str, shard: int = 0) -> str:
        return self._tier(tier, shard)

    def _tier(self, tier: str, shard: int) -> str:
        if shard < 0:
            raise ValueError(f"shard {shard} of tier {tier!r}: shards count from 0")
        base = f"{self.prefix}.{TIER_KIND}.{tier}"
        return f"{base}.{shard}" if shard else base

    # Due messages (expired from a buffer) are routed to business queues from here.
    def due_exchange(self) -> str:
        return f"{self.prefix}.due"

    # Catch-all for due messages that match no business queue.
    def unroutable_exchange(self) -> str:
        return f"{self.prefix}.unroutable"

    def unroutable_queue(self) -> str:
        return f"{self.prefix}.unroutable"

    # Business queues and the routing key that reaches exactly one of them.
    def business_queue(self, queue: str) -> str:
        return f"{self.prefix}.q.{queue}"

    def queue_key(self, queue: str) -> str:
        """The routing key unique to one business queue: its full name, as on the
        default exchange."""
        return self.business_queue(queue)

    # Parking lots: one durable queue per business queue, behind one direct exchange.
    def parking_exchange(self) -> str:
        return f"{self.prefix}.parking"

    def parking_queue(self, queue: str) -> str:
        return f"{self.prefix}.parking.{queue}"

    # Binary cascade levels (issue: arbitrary delays without the plugin).
    def cascade_exchange(self, level: int) -> str:
        return f"{self.prefix}.{CASCADE_KIND}.{level:02d}"

    def cascade_queue(self, level: int) -> str:
        return f"{self.prefix}.{CASCADE_KIND}.{level:02d}"

    def cascade_entry_exchange(self, level: int) -> str:
        """Fanout into level `level`'s queue, where publishers start: a topic match on a
        key of `levels` words costs the broker about as much as the rest of a publish."""
        return f"{self.prefix}.{CASCADE_KIND}.{level:02d}.in"

    def cascade_deliver_exchange(self) -> str:
        """Topic exchange after level 0: routes by the destination word of the key."""
        return f"{self.prefix}.{CASCADE_KIND}.deliver"

    # The x-delayed-message plugin exchange.
    def plugin_exchange(self) -> str:
        return f"{self.prefix}.delayed"

    # The [held] backend: a fanout exchange (what publishers use) into the quorum holding
    # queue of the same name, which the holders consume over AMQP 1.0.
    def held_exchange(self) -> str:
        return f"{self.prefix}.{HELD_KIND}"

    def held_queue(self) -> str:
        return f"{self.prefix}.{HELD_KIND}"

    def parse_tier(self, name: str) -> tuple[str, int]:
        """`(tier, shard)` of a tier buffer or tier exchange name (shard 0 for a tier's
        own name). Raises ValueError for any other name."""
        kind, detail = self.parse(name)
        m = _SHARD_SUFFIX.match(detail) if kind == TIER_KIND else None
        if m is None:
            raise ValueError(f"{name!r} is not a tier buffer of {self.prefix!r}")
        return m["tier"], int(m["shard"] or 0)

    def parse(self, name: str) -> tuple[str, str]:
        """Inverse of the builders: `(kind, detail)` for a name of this scheme.

        kind is one of delay, due, unroutable, q, parking, cascade, delayed, held. A tier
        shard's detail is `{tier}.{shard}` (see `parse_tier`).
        Raises ValueError for a name this scheme did not produce.
        """
        head = self.prefix + "."
        if not name.startswith(head):
            raise ValueError(f"{name!r} is not in namespace {self.prefix!r}")
        rest = name[len(head) :]
        kind, _, detail = rest.partition(".")
        if kind in ("due", "unroutable", "delayed", HELD_KIND) and not detail:
            return kind, ""
        if kind in (TIER_KIND, "q", "parking", CASCADE_KIND) and detail:
            return kind, detail
        if kind == "parking" and not detail:
            return kind, ""
        raise ValueError(f"{name!r} is not a name of this scheme")
