"""Topology: delay tiers, business queues and their policies, as frozen pydantic models.

A topology is what the user writes under `topology/` (TOML, read with the standard
library). Every model forbids unknown keys, so a typo is an error naming the file and
the field, never a setting silently ignored.
"""

from __future__ import annotations

import os
import re
import tomllib
import types
import typing
from enum import StrEnum
from functools import cached_property
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from rabbit_delay._durations import MAX_TTL_MS, format_ms, parse_ms, parse_positive_ms
from rabbit_delay._errors import TopologyError
from rabbit_delay._names import Names
from rabbit_delay._urls import redact


class QueueType(StrEnum):
    """Queue type for every queue of a topology. Quorum is the default: replicated, and
    the only type with at-least-once dead-lettering."""

    QUORUM = "quorum"
    CLASSIC = "classic"


def _tier_ms(value: object) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        raise ValueError(
            f"{value!r}: write a duration with its unit, such as '{value}s' or '{value}m'"
        )
    return parse_positive_ms(value, maximum=MAX_TTL_MS)  # type: ignore[arg-type]


def _any_ms(value: object) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        raise ValueError(f"{value!r}: write a duration with its unit, such as '{value}s'")
    return parse_ms(value)  # type: ignore[arg-type]


# Durations are written as text ("5m") and held as whole milliseconds.
TierDuration = Annotated[int, BeforeValidator(_tier_ms)]
Duration = Annotated[int, BeforeValidator(_any_ms)]
TierName = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]{0,31}$")]
QueueName = Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9._-]{0,119}$")]
RoutingKey = Annotated[str, Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._:-]+$")]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RetryBackoff(_Model):
    """Exponential retry delays (exact, through the cascade): initial * factor^(n-1), capped."""

    initial: Duration = Field(default=2_000, gt=0)
    """The delay of the first retry."""
    factor: float = Field(default=2.0, ge=1.0)
    """Each retry waits `factor` times the one before."""
    max: Duration = Field(default=300_000, gt=0)
    """The longest delay: every later retry waits this long."""

    def delay_ms(self, retry_number: int) -> int:
        return int(min(self.max, self.initial * self.factor ** (retry_number - 1)))


class RetryBackend(StrEnum):
    """Who waits out a retry's delay.

    TIERS (the default): the worker re-publishes a copy through the delay tiers (or the
    cascade / plugin for `backoff`), confirmed, then acks the original; any broker.
    BROKER: the worker requeues the delivery (basic.reject) and the quorum queue holds it
    back itself (RabbitMQ 4.3+ delayed retry, `x-delayed-retry-*`): no re-publish.
    """

    TIERS = "tiers"
    BROKER = "broker"


PositiveDuration = Annotated[Duration, Field(gt=0, le=MAX_TTL_MS)]


class RetryPolicy(_Model):
    """How a failed message is tried again.

    `max_attempts` counts every delivery attempt, the first included. With the `tiers`
    backend, retry n waits `tiers[n-1]` (the last tier repeats), or the exponential
    `backoff` when set; with neither, the topology's shortest tier. With the `broker`
    backend, retry n waits min(`min` x n, `max`) in the queue itself (RabbitMQ 4.3+).
    """

    max_attempts: int = Field(default=3, ge=1, le=1000)
    """Every delivery attempt counts, the first included; the last failure parks the
    message."""
    backend: RetryBackend = RetryBackend.TIERS
    """Who waits out a retry's delay: `tiers` (the worker re-publishes a copy through a
    delay tier, the cascade or the plugin; any broker) or `broker` (the quorum queue delays
    the requeued message itself: RabbitMQ 4.3+ delayed retry)."""
    tiers: tuple[TierName, ...] = ()
    """Backend `tiers`, in order: retry n waits `tiers[n-1]`, the last one repeats.
    Empty: the shortest tier the queue accepts."""
    backoff: RetryBackoff | None = None
    """Backend `tiers`: exponential delays, exact (needs `[cascade]` or `[plugin]`), e.g.
    `{ initial = "2s", factor = 2.0, max = "5m" }`; not with `tiers`."""
    min: PositiveDuration | None = None  # backend "broker": x-delayed-retry-min
    """Backend `broker` (required there): `x-delayed-retry-min`, the delay of the first
    retry; retry n waits `min` x n."""
    max: PositiveDuration | None = None  # backend "broker": x-delayed-retry-max (no cap if unset)
    """Backend `broker`: `x-delayed-retry-max`, the longest delay (at least `min`); not
    set: no cap."""

    @model_validator(mode="after")
    def _one_schedule(self) -> RetryPolicy:
        if self.backend is RetryBackend.BROKER:
            if self.tiers or self.backoff is not None:
                raise ValueError(
                    'backend = "broker" waits in the queue itself: remove `tiers`/`backoff` '
                    '(they belong to backend = "tiers"), give `min` (and `max`)'
                )
            if self.min is None:
                raise ValueError(
                    'backend = "broker" needs `min`, the delay of the first retry (retry n '
                    'waits min x n, capped by `max`), e.g. min = "1s", max = "5m"'
                )
            if self.max is not None and self.max < self.min:
                raise ValueError(
                    f"`max` ({format_ms(self.max)}) must be at least `min` ({format_ms(self.min)})"
                )
            return self
        if self.min is not None or self.max is not None:
            raise ValueError(
                '`min`/`max` belong to backend = "broker" (RabbitMQ 4.3+ delayed retry); '
                'backend = "tiers" (the default) takes `tiers` or `backoff`'
            )
        if self.tiers and self.backoff is not None:
            raise ValueError("give either `tiers` or `backoff`, not both")
        return self

    def broker_delay_ms(self, delivery_count: int) -> int:
        """Backend "broker": how long the queue holds a message back after the failure
        that brought its x-delivery-count to `delivery_count`: min(min x count, max)."""
        assert self.min is not None
        delay = self.min * max(delivery_count, 1)
        return delay if self.max is None else min(delay, self.max)


class QueueConfig(_Model):
    """A business queue: where due messages land and handlers consume."""

    bindings: tuple[RoutingKey, ...] = ()
    """Extra routing keys binding this queue to the due exchange: publish with
    `routing_key=` to reach every queue bound with it."""
    tiers: tuple[TierName, ...] | None = None  # None: every tier may target this queue
    """Tiers publishers may use for this queue (others are refused at publish); not set:
    every tier. The queue's retry tiers are always accepted."""
    retry: RetryPolicy = RetryPolicy()
    """How a failed message is tried again (the table below)."""
    # Quorum only: deliveries (crashes, lost connections) before the broker dead-letters
    # the message to the parking lot. Always explicit: RabbitMQ 4.0 defaults to 20.
    delivery_limit: int = Field(default=10, ge=1, le=10_000)
    """Quorum only: `x-delivery-limit`; a message delivered this often (crashing workers)
    is dead-lettered to the parking lot. Always set: RabbitMQ 4.0 defaults to 20. At least
    `retry.max_attempts` with retry backend `broker`."""
    # Short name used in cascade routing keys, which are limited to 255 bytes.
    alias: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,32}$")] | None = None

    @model_validator(mode="after")
    def _limit_fits_retries(self) -> QueueConfig:
        retry = self.retry
        if retry.backend is RetryBackend.BROKER and self.delivery_limit < retry.max_attempts:
            # Every broker retry is a counted delivery: below max_attempts, the broker would
            # dead-letter the message before its last attempt, without the failure headers.
            raise ValueError(
                f"delivery_limit ({self.delivery_limit}) must be at least retry.max_attempts "
                f'({retry.max_attempts}) with retry backend = "broker": each retry counts as a '
                "delivery, and the broker would dead-letter the message before the worker's "
                "last attempt parks it with the reason"
            )
        return self


class CascadeConfig(_Model):
    """Plugin-free arbitrary delays: `levels` TTL levels of 2^L * `resolution` each."""

    levels: int = Field(default=22, ge=1, le=32)
    """Number of levels: level L holds a message 2^L units; the longest delay is
    (2^levels - 1) units (22 levels at 1 s: 48.5 days)."""
    resolution: Duration = Field(default=1_000, ge=1)
    """The time unit: delays are rounded up to it, never down."""

    @property
    def max_delay_ms(self) -> int:
        return ((1 << self.levels) - 1) * self.resolution

    @model_validator(mode="after")
    def _ttl_fits(self) -> CascadeConfig:
        # The top level's queue TTL is 2^(levels-1) units. RabbitMQ 3.10 accepts a larger
        # x-message-ttl without complaint, but its TTL timers are 32-bit milliseconds.
        top = (1 << (self.levels - 1)) * self.resolution
        if top > MAX_TTL_MS:
            raise ValueError(
                f"the top level would hold messages {format_ms(top)}, over RabbitMQ's TTL maximum "
                f"{format_ms(MAX_TTL_MS)}: lower `levels` or `resolution`"
            )
        return self


class PluginConfig(_Model):
    """Arbitrary delays through the rabbitmq_delayed_message_exchange plugin (`[plugin]`,
    an empty table: the plugin exchange only delays; the due exchange routes)."""


# The [held] backend has no broker limit (x-opt-delivery-time is an absolute time); the
# longest delay it accepts is still bounded, because the idempotency retention must
# cover it (`longest_delay_ms`): the cascade's default reach, raised in the table.
DEFAULT_HELD_MAX_DELAY_MS = 49 * 86_400_000


class HeldConfig(_Model):
    """Exact delays on RabbitMQ 4.3+ (`[held]`): publishers send to one quorum holding
    queue, and holders (`rabbit-delay hold`, AMQP 1.0) have the queue hold each message
    until its due time, then dead-letter it to the due exchange (docs/held.md)."""

    max_delay: Duration = Field(default=DEFAULT_HELD_MAX_DELAY_MS, gt=0)
    """The longest delay a publish may ask (default 49d); longer ones are refused. The
    idempotency retention is kept at least this long."""


# One buffer is one quorum queue: one Raft leader, and one dead-letter worker taking 32
# messages at a time. Measured (docs/scaling.md): 8 shards already bring p99 lateness of
# a 26k msg/s burst under 1 s on one node; past 32, each shard costs a Raft group and
# brings nothing a cluster would not bring better.
MAX_SHARDS = 32
# Raft needs a majority: more than 7 replicas only slows every write.
MAX_REPLICAS = 7
ShardCount = Annotated[int, Field(ge=1, le=MAX_SHARDS)]


class LeaderLocator(StrEnum):
    """Where a new quorum queue's leader goes (`x-queue-leader-locator`).

    BALANCED: the node with the fewest leaders (random among nodes past 1,000 queues);
    CLIENT_LOCAL: the node the declaring connection is on; BROKER: the argument is not
    set, the broker's `queue_leader_locator` setting decides (client-local by default).
    """

    BALANCED = "balanced"
    CLIENT_LOCAL = "client-local"
    BROKER = "broker"


class ScalingConfig(_Model):
    """`[scaling]`: buffers per tier, and where quorum queues are placed in a cluster.

    `shards` (default 1) is every tier's buffer count, `tier_shards` overrides it per
    tier. `leader_locator` and `replicas` are placement: they apply when a queue is
    created, and an existing queue keeps its own (docs/scaling.md#placement).
    """

    shards: ShardCount = 1
    """Buffers per tier (1..32): each is a fanout exchange and a TTL queue, same TTL, same
    due exchange; publishers spread messages over them by `message_id`."""
    tier_shards: dict[TierName, ShardCount] = Field(default_factory=dict)
    """Per-tier override of `shards`, e.g. `{ "3s" = 8 }`; a tier that is not in
    `[tiers]` is an error."""
    leader_locator: LeaderLocator = LeaderLocator.BALANCED
    """Quorum queues: `x-queue-leader-locator` of every queue created: `balanced`
    (fewest leaders), `client-local` (the declaring connection's node) or `broker` (not set:
    the node's `queue_leader_locator` setting decides)."""
    replicas: Annotated[int, Field(ge=1, le=MAX_REPLICAS)] | None = None  # None: broker default
    """Quorum queues: `x-quorum-initial-group-size` of every queue created (1..7; odd
    numbers: Raft needs a majority); not set: the broker's default."""


DEFAULT_IDEMPOTENCY_FILE = "rabbit-delay-idempotency.sqlite3"
# The URL schemes each network store takes (what redis-py's from_url and libpq accept).
REDIS_SCHEMES = ("redis", "rediss", "unix")
POSTGRES_SCHEMES = ("postgresql", "postgres")
# How long a claim holds a key unrenewed, and how long a handled key is remembered.
DEFAULT_LEASE_MS = 30_000
DEFAULT_RETENTION_MS = 7 * 86_400_000
# The validation context key naming the directory a relative idempotency path is
# resolved against: the topology file's directory, set by `load_topology`.
BASE_DIR_CONTEXT = "base_dir"


class IdempotencyConfig(_Model):
    """Where the consumer framework records claimed and done message keys.

    `path` (the SQLite file) is absolute once validated. A relative one is resolved
    against the directory of the topology file (`load_topology`), so a worker finds the
    same file from whatever directory it starts; in a topology built in code
    (`topology_from_dict` without `base_dir`, or this model directly) against the
    current directory at validation time, which is then the caller's choice.

    `lease` is how long a claim holds a key without being renewed; the workers renew it
    every lease / 3 while the handler runs, so it bounds how long a crashed worker
    blocks its messages, not how long a handler may run.

    `url` is a network store's server: a Redis URL for "redis" (the local server when
    absent), a PostgreSQL URL for "postgres" (required); a URL of the other kind is
    refused.
    """

    store: Literal["sqlite", "memory", "redis", "postgres"] = "sqlite"
    """The store: `sqlite` (a file shared by the workers of one machine), `redis` or
    `postgres` (any number of machines) or `memory` (one process)."""
    path: str = Field(default=DEFAULT_IDEMPOTENCY_FILE, min_length=1, validate_default=True)
    """The SQLite file; a relative path is resolved against the topology file's
    directory."""
    url: str = "redis://127.0.0.1:6379/0"
    """The server of `store = "redis"` (a `redis://` URL) or `store = "postgres"` (a
    `postgresql://` URL, required)."""
    lease: Duration = Field(default=DEFAULT_LEASE_MS, gt=0)
    """How long a claim holds a key unrenewed; renewed every lease / 3 while the handler
    runs."""
    retention: Duration = Field(default=DEFAULT_RETENTION_MS, gt=0)
    """How long a handled key is remembered (duplicates within it are skipped)."""

    @field_validator("path")
    @classmethod
    def _absolute_path(cls, value: str, info: ValidationInfo) -> str:
        base = (info.context or {}).get(BASE_DIR_CONTEXT)
        return os.path.abspath(os.path.join(base if base is not None else os.getcwd(), value))

    @model_validator(mode="after")
    def _url_fits_the_store(self) -> IdempotencyConfig:
        scheme = self.url.partition("://")[0].lower() if "://" in self.url else ""
        shown = redact(self.url)
        if self.store == "postgres":
            if "url" not in self.model_fields_set:
                raise ValueError(
                    'store = "postgres" needs the database\'s url, e.g. '
                    'url = "postgresql://user:password@host:5432/dbname"'
                )
            if scheme not in POSTGRES_SCHEMES:
                raise ValueError(
                    f'store = "postgres": url {shown!r} is not a PostgreSQL URL; write '
                    '"postgresql://user:password@host:5432/dbname"'
                )
        elif self.store == "redis" and scheme not in REDIS_SCHEMES:
            hint = ' (a PostgreSQL URL: store = "postgres"?)' if scheme in POSTGRES_SCHEMES else ""
            raise ValueError(
                f'store = "redis": url {shown!r} is not a Redis URL{hint}; write '
                '"redis://host:6379/0" (or rediss://, unix://)'
            )
        return self


DEFAULT_SCHEDULE_GRACE_MS = 60_000
DEFAULT_SWEEP_EVERY_MS = 60_000
DEFAULT_SWEEP_BATCH = 1_000


class ScheduleConfig(_Model):
    """`[schedule]`: every delayed publish is recorded by key in the idempotency store
    (state, queue, due time, generation), so it can be looked up, listed, cancelled and
    rescheduled, and the workers' sweeper republishes what should have fired and did
    not (docs/schedule.md).

    `on_conflict` is what a publish does to a key that is still scheduled: "replace"
    (the default: the next generation wins) or "keep" (publish nothing). `grace` is how
    long past its due time a record may stay scheduled before the sweeper republishes
    it (more while the workers are running late: see docs/schedule.md#the-sweeper);
    `sweep_every` how often the workers look; `sweep_batch` the most records one sweep
    republishes. `retention` keeps finished records (handled, cancelled, parked) this
    long (default: the idempotency retention).
    """

    on_conflict: Literal["replace", "keep"] = "replace"
    """What a publish does to a key still scheduled: `replace` (its next generation wins,
    the older copy is dropped) or `keep` (nothing is published). A call's `on_conflict=`
    overrides it."""
    grace: Duration = Field(default=DEFAULT_SCHEDULE_GRACE_MS, gt=0)
    """How long past its due time a record may stay scheduled before the sweeper
    republishes it (longer while the workers run late)."""
    sweep_every: Duration = Field(default=DEFAULT_SWEEP_EVERY_MS, ge=100)
    """How often the workers run the sweeper (one worker at a time)."""
    sweep_batch: int = Field(default=DEFAULT_SWEEP_BATCH, ge=1, le=100_000)
    """The most records one sweep republishes."""
    retention: Duration | None = Field(default=None, gt=0)
    """How long finished records (handled, cancelled, parked) are kept before they are
    purged; default: `[idempotency] retention`."""


class Topology(_Model):
    """One namespace of delay tiers and business queues."""

    namespace: Annotated[str, Field(pattern=r"^[a-z][a-z0-9_-]{0,39}$")]
    """Prefix of every name declared (`shop` -> `shop.v1.*`)."""
    version: int = Field(default=1, ge=1, le=999)
    """Version segment of every name: raise it to declare an incompatible topology beside
    the old one (`shop.v1.*` and `shop.v2.*` coexist while v1 drains)."""
    queue_type: QueueType = QueueType.QUORUM
    """Type of every queue. Quorum: replicated, at-least-once dead-lettering. Classic:
    at-most-once between a buffer and its business queue."""
    tiers: dict[TierName, TierDuration] = Field(min_length=1)
    """Delay tiers, name = duration: one TTL buffer queue (and its fanout exchange) per
    tier. Names: letters, digits, `_`, `-` (up to 32); two tiers may not share a duration."""
    queues: dict[QueueName, QueueConfig] = Field(min_length=1)
    """Business queues, by name (lower-case letters, digits, `.`, `_`, `-`), declared as
    `{namespace}.v{version}.q.{NAME}`: that full name is also its own routing key."""
    cascade: CascadeConfig | None = None
    """Plugin-free arbitrary delays (docs/arbitrary-delays.md)."""
    plugin: PluginConfig | None = None
    """Arbitrary delays through `x-delayed-message` (docs/arbitrary-delays.md); not on
    RabbitMQ 4.3+."""
    held: HeldConfig | None = None
    """Exact delays held by the quorum queue itself, RabbitMQ 4.3+ (docs/held.md)."""
    scaling: ScalingConfig = ScalingConfig()
    """Buffers per tier and where quorum queues are placed (docs/scaling.md)."""
    idempotency: IdempotencyConfig = Field(default_factory=IdempotencyConfig)
    """Where workers record the message ids they claimed and handled
    (docs/idempotency.md)."""
    schedule: ScheduleConfig | None = None
    """The schedule: every delayed publish recorded by key, to look up, list, cancel and
    reschedule, with a built-in sweeper (docs/schedule.md). Absent: no schedule."""

    @model_validator(mode="before")
    @classmethod
    def _idempotency_in_context(cls, data: Any) -> Any:
        # Without an [idempotency] table the default would be built outside this
        # validation, and its path resolved without the topology's directory.
        if isinstance(data, dict) and "idempotency" not in data:
            return {**data, "idempotency": {}}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> Topology:
        chosen = [b for b in ("cascade", "plugin", "held") if getattr(self, b) is not None]
        if len(chosen) > 1:
            raise ValueError(
                "choose one arbitrary-delay backend: "
                + " or ".join(f"`{b}`" for b in chosen)
                + (", not both" if len(chosen) == 2 else ", not all three")
            )
        if self.held is not None and self.queue_type is not QueueType.QUORUM:
            raise ValueError(
                "[held] needs quorum queues: only a quorum queue holds a message until a "
                'given time (queue_type = "quorum")'
            )
        durations: dict[int, str] = {}
        for tier, ms in self.tiers.items():
            if ms in durations:
                raise ValueError(f"tiers {durations[ms]!r} and {tier!r} have the same duration")
            durations[ms] = tier
        known = sorted(self.tiers)
        for tier in self.scaling.tier_shards:
            if tier not in self.tiers:
                raise ValueError(f"scaling.tier_shards: unknown tier {tier!r}; tiers are {known}")
        placement = {"leader_locator", "replicas"} & self.scaling.model_fields_set
        if self.queue_type is not QueueType.QUORUM and placement:
            raise ValueError(
                f"scaling.{sorted(placement)[0]} places quorum queues (leaders, replicas); "
                'classic queues are not replicated: remove it, or use queue_type = "quorum"'
            )
        own_keys = {self.names.queue_key(q) for q in self.queues}
        aliases: dict[str, str] = {}
        for queue, cfg in self.queues.items():
            for field, tiers in (("tiers", cfg.tiers or ()), ("retry.tiers", cfg.retry.tiers)):
                for tier in tiers:
                    if tier not in self.tiers:
                        raise ValueError(
                            f"queues.{queue}.{field}: unknown tier {tier!r}; tiers are {known}"
                        )
            if cfg.retry.backend is RetryBackend.BROKER and self.queue_type is not QueueType.QUORUM:
                raise ValueError(
                    f'queues.{queue}.retry.backend = "broker" needs quorum queues: only they delay '
                    'a requeued message (queue_type = "quorum", or backend = "tiers")'
                )
            if cfg.retry.backoff is not None and not self.exact_delays:
                raise ValueError(
                    f"queues.{queue}.retry.backoff needs exact delays: add a [cascade] "
                    "(or [held], [plugin]) table, or retry through `tiers`"
                )
            for key in cfg.bindings:
                if key in own_keys:
                    raise ValueError(f"queues.{queue}.bindings: {key!r} is reserved for a queue")
            if cfg.alias is not None:
                if cfg.alias in aliases:
                    raise ValueError(
                        f"queues.{queue}.alias {cfg.alias!r} is also used by {aliases[cfg.alias]!r}"
                    )
                aliases[cfg.alias] = queue
        return self

    @cached_property
    def names(self) -> Names:
        return Names(self.namespace, self.version)

    @property
    def exact_delays(self) -> bool:
        """Whether the topology has an arbitrary-delay backend (cascade, plugin, held)."""
        return self.cascade is not None or self.plugin is not None or self.held is not None

    def shards(self, tier: str) -> int:
        """How many buffers `tier` has: `scaling.tier_shards`, else `scaling.shards`."""
        if tier not in self.tiers:
            raise KeyError(tier)
        return self.scaling.tier_shards.get(tier, self.scaling.shards)

    def tier_queues(self, tier: str) -> tuple[str, ...]:
        """The buffer queues of `tier`, shard 0 (the tier's own name) first: a tier's
        depth is the sum of theirs."""
        return tuple(self.names.tier_queue(tier, i) for i in range(self.shards(tier)))

    def tier_exchanges(self, tier: str) -> tuple[str, ...]:
        """The fanout exchange of each of `tier`'s buffers, in shard order."""
        return tuple(self.names.tier_exchange(tier, i) for i in range(self.shards(tier)))

    def tier_for_ms(self, ms: int) -> str | None:
        """The tier whose duration is exactly `ms`, if any."""
        for tier, duration in self.tiers.items():
            if duration == ms:
                return tier
        return None

    def accepted_tiers(self, queue: str) -> tuple[str, ...]:
        """Tiers that may target `queue`: its `tiers` (default: all), plus its retry tiers,
        which the consumer framework must always be able to use."""
        cfg = self.queues[queue]
        publish = cfg.tiers if cfg.tiers is not None else tuple(self.tiers)
        return tuple(dict.fromkeys((*publish, *cfg.retry.tiers)))

    def shortest_tier(self, queue: str) -> str:
        """The shortest tier `queue` accepts."""
        return min(self.accepted_tiers(queue), key=self.tiers.__getitem__)

    def retry_tiers(self, queue: str) -> tuple[str, ...]:
        """Retry n waits tiers[n-1] (the last repeats); default: the shortest accepted tier."""
        cfg = self.queues[queue]
        return cfg.retry.tiers or (self.shortest_tier(queue),)

    def retry_delay_ms(self, queue: str, retry_number: int) -> int:
        """How long retry `retry_number` (1 = first) of `queue` waits."""
        retry = self.queues[queue].retry
        if retry.backend is RetryBackend.BROKER:
            return retry.broker_delay_ms(retry_number)
        if retry.backoff is not None:
            return retry.backoff.delay_ms(retry_number)
        tiers = self.retry_tiers(queue)
        return self.tiers[tiers[min(retry_number, len(tiers)) - 1]]

    def retry_span_ms(self, queue: str) -> int:
        """The longest a message of `queue` can spend in its retries' delays: every retry
        up to `max_attempts` (handler time and lateness not included)."""
        retries = self.queues[queue].retry.max_attempts - 1
        return sum(self.retry_delay_ms(queue, n) for n in range(1, retries + 1))

    def longest_delay_ms(self) -> int:
        """The longest delay a publish can ask of this topology: the longest tier, or the
        cascade's, the plugin's or the held backend's maximum."""
        longest = max(self.tiers.values())
        if self.held is not None:
            longest = max(longest, self.held.max_delay)
        if self.cascade is not None:
            longest = max(longest, self.cascade.max_delay_ms)
        if self.plugin is not None:
            longest = max(longest, MAX_TTL_MS)
        return longest

    def schedule_retention_ms(self) -> int:
        """How long finished schedule records are kept."""
        cfg = self.schedule
        if cfg is not None and cfg.retention is not None:
            return cfg.retention
        return self.idempotency.retention


# -- loading ----------------------------------------------------------------------------


def _describe_location(loc: tuple[int | str, ...]) -> str:
    return ".".join(str(part) for part in loc) or "(top level)"


def _model_at(loc: tuple[int | str, ...]) -> type[BaseModel] | None:
    """The model that owns `loc`, so an unknown key can be answered with the allowed ones."""
    tp: Any = Topology
    for part in loc:
        while True:
            origin = typing.get_origin(tp)
            if origin is typing.Annotated:
                tp = typing.get_args(tp)[0]
            elif origin in (typing.Union, types.UnionType):
                tp = next(a for a in typing.get_args(tp) if a is not type(None))
            else:
                break
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            field = tp.model_fields.get(str(part))
            if field is None:
                return None
            tp = field.annotation
        elif typing.get_origin(tp) is dict:
            tp = typing.get_args(tp)[1]
        else:
            return None
    while typing.get_origin(tp) in (typing.Union, types.UnionType):
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    return tp if isinstance(tp, type) and issubclass(tp, BaseModel) else None


def format_validation_error(error: ValidationError, source: str) -> str:
    lines = [f"{source}: invalid topology"]
    for err in error.errors():
        loc = tuple(err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            owner = _model_at(loc[:-1])
            if owner is None:
                msg = f"unknown key {loc[-1]!r}; see docs/topology.md"
            elif not owner.model_fields:
                msg = f"unknown key {loc[-1]!r}; this table takes no keys"
            else:
                allowed = ", ".join(owner.model_fields)
                msg = f"unknown key {loc[-1]!r}; allowed keys here: {allowed}"
        elif err["type"] == "string_pattern_mismatch":
            msg = f"{err['input']!r} is not allowed: {msg}"
        # A whole-topology check (loc ()) already names its fields in the message.
        lines.append(f"  {_describe_location(loc)}: {msg}" if loc else f"  {msg}")
    return "\n".join(lines)


def topology_from_dict(
    data: dict[str, Any], source: str = "<topology>", *, base_dir: str | Path | None = None
) -> Topology:
    """Validate a mapping; raises TopologyError naming `source` and each bad field.

    A relative `idempotency.path` is resolved against `base_dir` (made absolute first),
    by default the current directory: the validated topology holds an absolute path.
    """
    context = {BASE_DIR_CONTEXT: os.path.abspath(base_dir if base_dir is not None else os.getcwd())}
    try:
        return Topology.model_validate(data, context=context)
    except ValidationError as exc:
        raise TopologyError(format_validation_error(exc, source)) from None


def load_topology(path: str | Path) -> Topology:
    """Read and validate a TOML topology file.

    A relative `idempotency.path` is resolved against the file's directory, never the
    current directory.

    Raises TopologyError for a missing file, TOML syntax errors and invalid content.
    """
    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("*.toml"))
        if len(files) != 1:
            found = ", ".join(f.name for f in files) or "none"
            raise TopologyError(
                f"{path}: expected one *.toml topology file, found {found}; name the file"
            )
        path = files[0]
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise TopologyError(f"{path}: cannot read topology file ({exc.strerror})") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise TopologyError(f"{path}: not valid TOML: {_toml_error(exc, text)}") from None
    return topology_from_dict(data, str(path), base_dir=os.path.abspath(path.parent))


# tomllib says "Cannot overwrite a value (at line 7, column 9)" for a key written twice,
# without the key: the line it points at names it.
_OVERWRITE = re.compile(r"^Cannot overwrite a value \(at line (?P<line>\d+), column \d+\)$")
_SIMPLE_KEY = r"""(?:[A-Za-z0-9_-]+|"[^"]*"|'[^']*')"""
_KEY = re.compile(rf"^\s*(?P<key>{_SIMPLE_KEY}(?:\s*\.\s*{_SIMPLE_KEY})*)\s*=")
_TABLE = re.compile(r"^\s*\[\[?\s*(?P<table>[^\]]+?)\s*\]\]?\s*(?:#.*)?$")


def _toml_error(exc: tomllib.TOMLDecodeError, text: str) -> str:
    """tomllib's message, with the key's name when it is a key defined twice."""
    message = str(exc)
    m = _OVERWRITE.match(message)
    lines = text.splitlines()
    if m is None or not 1 <= int(m["line"]) <= len(lines):
        return message
    number = int(m["line"])
    key = _KEY.match(lines[number - 1])
    if key is None:
        return message
    table = next(
        (t["table"] for line in reversed(lines[: number - 1]) if (t := _TABLE.match(line))),
        None,
    )
    where = f" in table [{table}]" if table else ""
    return (
        f"key {key['key']}{where} is defined twice (line {number}): a key may be written "
        f"once per table ({message})"
    )
