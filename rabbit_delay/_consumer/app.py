"""The application object: a topology, its consumers, and the idempotency guard.

    app = App("topology/orders.toml")

    @app.consumer("orders.cancel", model=CancelOrder)
    def cancel_order(msg: CancelOrder, ctx: HandlerContext) -> None: ...

    rabbit-delay worker myapp:app

Registration is pure: nothing connects until a worker runs the app.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, TypeVar, cast

from rabbit_delay._broker import UNKNOWN, BrokerInfo
from rabbit_delay._consumer.context import HandlerContext, clock_ms
from rabbit_delay._consumer.decide import (
    Action,
    QueuePolicy,
    Result,
    Undecodable,
    decide,
)
from rabbit_delay._consumer.inputs import annotated_input, decoder_for
from rabbit_delay._durations import DurationLike, parse_positive_ms
from rabbit_delay._envelope import Envelope
from rabbit_delay._errors import ConfigError, DecodeError
from rabbit_delay._idempotency.guard import (
    AsyncGuard,
    AsyncIdempotencyStore,
    Clock,
    Guard,
    IdempotencyStore,
    SyncStoreAsAsync,
    run,
    run_async,
)
from rabbit_delay._reconcile import (
    SWEEPER,
    Reconciler,
    asweep_schedule,
    make_reconciler,
    sweep_schedule,
)
from rabbit_delay._schedule.operations import ScheduleCore
from rabbit_delay._schedule.records import Keeping, ScheduleState
from rabbit_delay._schedule.rules import keeping
from rabbit_delay._stores.factory import as_async, async_store_from_config, store_from_config
from rabbit_delay._topology.delays import Router
from rabbit_delay._topology.model import DEFAULT_LEASE_MS, Topology, load_topology

F = TypeVar("F", bound=Callable[..., Any])
KeyFunction = Callable[[Any], str]


class Transport(StrEnum):
    """Which worker runs an app: pika (threads), aio-pika (asyncio), or the in-memory
    worker of rabbit_delay.testing (no broker; `def` and `async def` handlers)."""

    SYNC = "sync"
    ASYNC = "async"
    MEMORY = "memory"


class _NotDecoded:
    """The body is decoded where the handler runs (`Prepared.decoded`)."""

    def __repr__(self) -> str:
        return "NOT_DECODED"


NOT_DECODED: Any = _NotDecoded()


@dataclass(frozen=True, slots=True)
class Prepared:
    """A delivery ready for its handler: its input (or NOT_DECODED: decoded where the
    handler runs, off the worker's connection thread), context and idempotency key."""

    ctx: HandlerContext
    message: Any
    key: str | None  # None: no guard (consumer not idempotent, or no message_id)
    body: bytes
    content_type: str | None


def _takes_context(handler: Callable[..., Any], queue: str) -> bool:
    try:
        params = list(inspect.signature(handler).parameters.values())
    except (TypeError, ValueError):
        return True  # a builtin or C callable: assume (message, ctx)
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if any(p.kind is p.VAR_POSITIONAL for p in params) or len(positional) >= 2:
        return True
    if len(positional) == 1:
        return False
    raise ConfigError(
        f"consumer for {queue!r}: handler {_name(handler)} must take the message "
        "(and optionally the context): def handler(msg, ctx)"
    )


def _name(handler: Callable[..., Any]) -> str:
    module = getattr(handler, "__module__", None) or "?"
    return f"{module}.{getattr(handler, '__qualname__', repr(handler))}"


def is_async_callable(handler: Callable[..., Any]) -> bool:
    if inspect.iscoroutinefunction(handler):
        return True
    call = getattr(handler, "__call__", None)  # noqa: B004 - an async __call__ on an object
    return call is not None and inspect.iscoroutinefunction(call)


@dataclass(frozen=True, slots=True, eq=False)
class Consumer:
    """One registered handler for one business queue."""

    queue: str
    handler: Callable[..., Any]
    model: Any  # what the body is decoded into: model=, else the annotation (None: bytes)
    key: KeyFunction | None
    idempotent: bool
    is_async: bool
    takes_context: bool
    decode: Callable[[bytes], Any] = field(repr=False)
    policy: QueuePolicy = field(repr=False)
    # Idempotency keys are scoped to the queue: a message fanned out to several queues
    # (one binding key) is handled once per queue, not once in all.
    key_prefix: str = field(repr=False, default="")
    # The topology's [schedule], for a guarded consumer: its deliveries' rd-key /
    # rd-generation are checked at the claim and their results written to the record.
    schedule: Keeping | None = field(repr=False, default=None)

    @property
    def name(self) -> str:
        return _name(self.handler)

    def prepare(
        self,
        message_id: str | None,
        headers: Mapping[str, Any] | None,
        redelivered: bool,
        body: bytes,
        content_type: str | None,
        received_ms: int,
        *,
        lazy: bool = False,
    ) -> Prepared | Action:
        """Read one delivery. Returns what to run, or the Park action for a poison message.

        With `lazy`, a body that the idempotency key does not need is left undecoded
        (NOT_DECODED): `decoded()` decodes it where the handler runs.
        """
        try:
            env = self.policy.envelope(message_id, headers)
        except DecodeError as exc:
            env = Envelope(message_id, 1, None, None, None, headers or {})
            bad = Undecodable.from_exception(exc)
            return self._refuse(env, bad, body, content_type, received_ms)
        ctx = HandlerContext(self.queue, env, redelivered, received_ms, self.policy.max_attempts)
        key: str | None = None
        if lazy and (self.key is None or not self.idempotent):
            if self.idempotent and message_id:
                key = self.key_prefix + message_id
            return Prepared(ctx, NOT_DECODED, key, body, content_type)
        try:
            message = self.decode(body)
        except Exception as exc:  # ValidationError, or whatever a TypeAdapter raises
            bad = Undecodable.from_exception(exc)
            return self._refuse(env, bad, body, content_type, received_ms)
        if self.idempotent:
            if self.key is None:
                key = self.key_prefix + message_id if message_id else None
            else:
                try:
                    key = self.key_prefix + self.key(message)
                except Exception as exc:
                    return self._refuse(env, exc, body, content_type, received_ms)
        return Prepared(ctx, message, key, body, content_type)

    def decoded(self, prepared: Prepared) -> Any:
        """The handler's input; raises what the decoder raises for a bad body."""
        message = prepared.message
        return self.decode(prepared.body) if message is NOT_DECODED else message

    def _refuse(
        self, env: Envelope, result: Result, body: bytes, content_type: str | None, now_ms: int
    ) -> Action:
        """The action for a delivery refused before its handler (undecodable, no key)."""
        return decide(env, self.policy, result, body=body, content_type=content_type, now_ms=now_ms)

    def decide(
        self,
        prepared: Prepared,
        result: Result,
        now_ms: int,
        broker: BrokerInfo = UNKNOWN,
        crashes: int = 0,
        lease_ms: int = DEFAULT_LEASE_MS,
    ) -> Action:
        """The action once the handler (or the claim) produced `result`, under the
        version rules of `broker` (the worker's connection's); see `decide.decide`."""
        return decide(
            prepared.ctx.envelope,
            self.policy,
            result,
            body=prepared.body,
            content_type=prepared.content_type,
            now_ms=now_ms,
            broker=broker,
            crashes=crashes,
            lease_ms=lease_ms,
        )


class App:
    """A topology plus the handlers that consume its queues.

    `store` is the idempotency store (sync, or async for the async worker only); by
    default it is built, on first use, from the topology's `[idempotency]` table.
    `lease` and `retention` override that table's values.

    Raises TopologyError for a topology file that does not load, ConfigError for a
    lease or retention that is not a positive duration.
    """

    def __init__(
        self,
        topology: Topology | str | os.PathLike[str],
        *,
        store: IdempotencyStore | AsyncIdempotencyStore | None = None,
        lease: DurationLike | None = None,
        retention: DurationLike | None = None,
    ) -> None:
        self.topology = (
            topology if isinstance(topology, Topology) else load_topology(Path(topology))
        )
        cfg = self.topology.idempotency
        self.lease_ms = parse_positive_ms(lease) if lease is not None else cfg.lease
        self.retention_ms = parse_positive_ms(retention) if retention is not None else cfg.retention
        self.router = Router(self.topology)
        self.consumers: dict[str, Consumer] = {}
        self.reconcilers: dict[str, Reconciler] = {}
        self._explicit_store = store
        self._store = store
        self._async_store: AsyncIdempotencyStore | None = None
        self._guard: Guard | None = None
        self._async_guard: AsyncGuard | None = None
        self._installed = False  # a guard of rabbit_delay.testing is in place
        self._clock: Clock = clock_ms  # the guards' clock (rabbit_delay.testing's is virtual)
        if self.topology.schedule is not None:  # its sweeper: a reconciler of every app
            sweeper = make_reconciler(sweep_schedule, self.topology.schedule.sweep_every, SWEEPER)
            self.reconcilers[SWEEPER] = dataclasses.replace(sweeper, async_fn=asweep_schedule)

    # -- registration ------------------------------------------------------------------

    def consumer(
        self,
        queue: str,
        *,
        model: Any = None,
        key: KeyFunction | None = None,
        idempotent: bool = True,
    ) -> Callable[[F], F]:
        """Register the decorated function as the handler of `queue` (a logical name).

        The handler receives the message decoded into `model`, or without it into the
        annotation of its first parameter (docs/consumer.md): a pydantic
        model or any type pydantic validates JSON into (dict, list[int], a TypedDict...);
        `str` for the body as UTF-8 text; `bytes`, `Any`, `object` or no annotation for
        the raw body. If it takes a second argument, it also receives the HandlerContext.
        `key(message)` gives the idempotency key (default: the message_id);
        `idempotent=False` runs every copy.

        Raises ConfigError for a queue absent from the topology, a queue that already
        has a handler, a handler that takes no argument, a message annotation that does
        not resolve, or a type pydantic cannot validate.
        """

        def register(handler: F) -> F:
            self.add_consumer(queue, handler, model=model, key=key, idempotent=idempotent)
            return handler

        return register

    def add_consumer(
        self,
        queue: str,
        handler: Callable[..., Any],
        *,
        model: Any = None,
        key: KeyFunction | None = None,
        idempotent: bool = True,
    ) -> Consumer:
        """`consumer(...)` without the decorator. Raises like `consumer`."""
        if queue in self.consumers:
            raise ConfigError(
                f"queue {queue!r} already has a handler ({self.consumers[queue].name}); "
                "one queue, one handler"
            )
        policy = QueuePolicy(self.topology, queue, self.router)
        where = f"consumer for {queue!r}: handler {_name(handler)}"
        # What the handler receives: model=, else its first parameter's annotation.
        message_type = model if model is not None else annotated_input(handler, where)
        registered = Consumer(
            queue=queue,
            handler=handler,
            model=message_type,
            key=key,
            idempotent=idempotent,
            is_async=is_async_callable(handler),
            takes_context=_takes_context(handler, queue),
            decode=decoder_for(message_type, where),
            policy=policy,
            key_prefix=scoped_key(self.topology, queue, ""),
            schedule=keeping(self.topology) if idempotent else None,
        )
        self.consumers[queue] = registered
        return registered

    def reconcile(self, *, every: DurationLike, name: str | None = None) -> Callable[[F], F]:
        """Register the decorated function as a reconciler, run by the workers every
        `every` (one worker at a time, through the idempotency store) and by `rabbit-delay
        reconcile`. It takes a ReconcileContext (AsyncReconcileContext for an `async def`,
        which needs the async worker) and returns or yields `Resubmit`s to publish, or
        None; see docs/reconciliation.md. `name` defaults to the function's name.

        Raises ConfigError for an `every` that is not a positive duration, a name already
        registered or not made of letters, digits, '_', '.' and '-', or a function that
        takes no argument.
        """

        def register(fn: F) -> F:
            self.add_reconciler(fn, every=every, name=name)
            return fn

        return register

    def add_reconciler(
        self, fn: Callable[..., Any], *, every: DurationLike, name: str | None = None
    ) -> Reconciler:
        """`reconcile(...)` without the decorator. Raises like `reconcile`."""
        try:
            every_ms = parse_positive_ms(every)
        except ConfigError as exc:
            raise ConfigError(f"@app.reconcile(every={every!r}): {exc}") from None
        reconciler = make_reconciler(fn, every_ms, name)
        if reconciler.name in self.reconcilers:
            raise ConfigError(
                f"a reconciler named {reconciler.name!r} is already registered; give this one "
                "another name=..."
            )
        self.reconcilers[reconciler.name] = reconciler
        return reconciler

    def select_reconcilers(self, names: Sequence[str] | None = None) -> list[Reconciler]:
        """The reconcilers to run: all, or those named. Raises ConfigError for a name
        that is not registered."""
        if not names:
            return list(self.reconcilers.values())
        unknown = [n for n in names if n not in self.reconcilers]
        if unknown:
            known = ", ".join(sorted(self.reconcilers)) or "none"
            raise ConfigError(f"no reconciler named {unknown[0]!r}; registered: {known}")
        return [self.reconcilers[n] for n in names]

    def select(self, queues: Sequence[str] | None = None) -> list[Consumer]:
        """The consumers a worker runs: all of them, or those of `queues`.

        Raises ConfigError for none registered or a queue without a handler.
        """
        if not self.consumers:
            raise ConfigError(
                'the app has no consumers: register one with @app.consumer("queue", model=...)'
            )
        if not queues:
            return list(self.consumers.values())
        chosen = []
        for queue in queues:
            if queue not in self.consumers:
                known = ", ".join(sorted(self.consumers))
                where = "" if queue in self.topology.queues else " (nor is it in the topology)"
                raise ConfigError(f"no handler for queue {queue!r}{where}; handlers: {known}")
            chosen.append(self.consumers[queue])
        return chosen

    def check_runnable(self, consumers: Sequence[Consumer], transport: Transport) -> None:
        """Refuse, before connecting, what the chosen worker cannot run.

        Raises ConfigError for an async handler or reconciler, or an async-only store, in
        the sync worker.
        """
        if transport == Transport.SYNC:
            bad = [c for c in consumers if c.is_async]
            if bad:
                listed = ", ".join(f"{c.name} ({c.queue})" for c in bad)
                raise ConfigError(
                    f"the sync (pika) worker cannot run async handlers: {listed}; run the "
                    "async worker (`rabbit-delay worker --transport async`, or AsyncWorker)"
                )
            slow = [r.name for r in self.reconcilers.values() if r.is_async]
            if slow:
                raise ConfigError(
                    f"the sync (pika) worker cannot run async reconcilers: {', '.join(slow)}; "
                    "run the async worker (`rabbit-delay worker --transport async`, or "
                    "AsyncWorker), or make them plain `def`s"
                )
            uses_store = any(c.idempotent for c in consumers) or self.reconcilers
            if uses_store and _is_async_store(self._store):
                raise ConfigError(
                    f"the idempotency store {type(self._store).__name__} is asynchronous: "
                    "run the async worker, or give the app a synchronous store"
                )

    # -- idempotency -------------------------------------------------------------------

    @property
    def explicit_store(self) -> IdempotencyStore | AsyncIdempotencyStore | None:
        """The store given as `App(store=...)`; None when the app builds its store from
        the topology's `[idempotency]` table."""
        return self._explicit_store

    def _install_guard(self, store: IdempotencyStore, clock: Clock) -> Callable[[], None]:
        """Guard the app with `store` on `clock` (its workers' guard, the async one over the
        same store, and `cancel`) until the returned function puts back what the app had.

        For rabbit_delay.testing, whose in-memory worker and the test's `app.cancel()`
        must share one store on the virtual clock. Raises ConfigError while another
        installed guard is in place (they would be put back out of order).
        """
        if self._installed:
            raise ConfigError(
                "this app already runs on an in-memory broker (a TestBroker or MemoryWorker "
                "not closed yet): close that one first"
            )
        self._installed = True
        saved = (self._store, self._async_store, self._guard, self._async_guard, self._clock)
        self._store = store
        self._clock = clock
        self._async_store = SyncStoreAsAsync(store)
        lease, retention = self.lease_ms, self.retention_ms
        self._guard = Guard(store, lease_ms=lease, retention_ms=retention, clock=clock)
        self._async_guard = AsyncGuard(
            self._async_store, lease_ms=lease, retention_ms=retention, clock=clock
        )

        def restore() -> None:
            self._store, self._async_store, self._guard, self._async_guard, self._clock = saved
            self._installed = False

        return restore

    def store(self) -> IdempotencyStore:
        """The synchronous store (built from the topology on first use).

        Raises ConfigError if the app was given an async-only store.
        """
        if self._store is None:
            self._store = store_from_config(self.topology.idempotency)
        if _is_async_store(self._store):
            raise ConfigError(
                f"the idempotency store {type(self._store).__name__} is asynchronous; "
                "use App.acancel() and the async worker"
            )
        return cast(IdempotencyStore, self._store)

    def async_store(self) -> AsyncIdempotencyStore:
        """The store for the async worker: the app's own, wrapped if synchronous."""
        store = self._async_store
        if store is None:
            if self._store is None:
                store = async_store_from_config(self.topology.idempotency)
            elif _is_async_store(self._store):
                store = cast(AsyncIdempotencyStore, self._store)
            else:
                store = as_async(cast(IdempotencyStore, self._store))
            self._async_store = store
        return store

    def guard(self) -> Guard:
        if self._guard is None:
            self._guard = Guard(
                self.store(), lease_ms=self.lease_ms, retention_ms=self.retention_ms, clock=clock_ms
            )
        return self._guard

    def async_guard(self) -> AsyncGuard:
        if self._async_guard is None:
            self._async_guard = AsyncGuard(
                self.async_store(),
                lease_ms=self.lease_ms,
                retention_ms=self.retention_ms,
                clock=clock_ms,
            )
        return self._async_guard

    def cancel(
        self,
        key: str,
        *,
        queue: str | None = None,
        retention: DurationLike | None = None,
    ) -> ScheduleState | None:
        """Cancel the message with this key: it is acked and dropped when it comes due,
        however far away that is, and so are its retries.

        With a [schedule] table, `key` is its schedule key (by default the message_id)
        and the key's record is cancelled; returns what was found: SCHEDULED, HANDLED,
        PARKED, CANCELLED, or None for an unknown key (docs/schedule.md).

        Without one, `key` is the idempotency key (the message_id, unless the consumer
        has a `key` function) and a tombstone is written in every queue of the topology
        (or only in `queue`); returns None (nothing is known). The tombstone lives for
        the longest delay the topology can express plus its longest retries and a
        lease (at least the app's retention), so no cancel is lost; give `retention`
        to keep it for another time. A message without a message_id (published by
        another client) has no key, so no tombstone can reach it.

        Raises ValueError for an empty key; ConfigError for an unknown queue, a queue
        whose registered consumer has idempotent=False (its worker never reads
        tombstones), `queue`/`retention` with a schedule, or an async-only store (use
        `acancel`); StoreError when the schedule's store fails; the store's errors.
        """
        if self.topology.schedule is not None:
            core = self._schedule_core(queue, retention)
            return run(core.cancel(self._book(self.store()), key, self._clock()))
        keep = parse_positive_ms(retention) if retention is not None else self.tombstone_ms()
        guard = self.guard()
        for scoped in self._scoped_keys(key, queue):
            guard.cancel(scoped, retention_ms=keep)
        return None

    async def acancel(
        self,
        key: str,
        *,
        queue: str | None = None,
        retention: DurationLike | None = None,
    ) -> ScheduleState | None:
        """`cancel` through the async store."""
        if self.topology.schedule is not None:
            core = self._schedule_core(queue, retention)
            book = self._book(self.async_store())
            return await run_async(core.cancel(book, key, self._clock()))
        keep = parse_positive_ms(retention) if retention is not None else self.tombstone_ms()
        guard = self.async_guard()
        for scoped in self._scoped_keys(key, queue):
            await guard.cancel(scoped, retention_ms=keep)
        return None

    def tombstone_ms(self) -> int:
        """How long `cancel` keeps a tombstone: the longest delay the topology can
        express, plus its longest retries and a lease, and at least the retention."""
        topology = self.topology
        span = max(topology.retry_span_ms(q) for q in topology.queues)
        return max(self.retention_ms, topology.longest_delay_ms() + span + self.lease_ms)

    def _schedule_core(self, queue: str | None, retention: DurationLike | None) -> ScheduleCore:
        if queue is not None or retention is not None:
            raise ConfigError(
                "with a [schedule], cancel(key) cancels the key's record, which knows its "
                "queue and due time: drop queue= and retention="
            )
        return ScheduleCore(self.topology, lease_ms=self.lease_ms)

    @staticmethod
    def _book(store: object) -> Any:
        book = getattr(store, "schedule", None)
        if book is None:
            raise ConfigError(
                f"the store {type(store).__name__} keeps no schedule: use the SQLite, Redis, "
                "PostgreSQL or memory store"
            )
        return book

    def _scoped_keys(self, key: str, queue: str | None) -> list[str]:
        if not key:
            raise ValueError("an idempotency key must be a non-empty string")
        if queue is not None and queue not in self.topology.queues:
            known = ", ".join(sorted(self.topology.queues))
            raise ConfigError(f"unknown queue {queue!r}; the topology has: {known}")
        queues = [queue] if queue is not None else list(self.topology.queues)
        unguarded = [q for q in queues if q in self.consumers and not self.consumers[q].idempotent]
        if unguarded:
            # Its worker never looks at the store: a tombstone would be silently ignored.
            listed = ", ".join(repr(q) for q in unguarded)
            raise ConfigError(
                f"cannot cancel {key!r}: the consumer of {listed} runs with idempotent=False, so "
                "its worker never reads tombstones; register it with idempotent=True (the "
                "default), or cancel only in other queues with queue=..."
            )
        return [scoped_key(self.topology, q, key) for q in queues]

    def close(self) -> None:
        """Close the synchronous store, if one was opened."""
        if self._store is not None and not _is_async_store(self._store):
            cast(IdempotencyStore, self._store).close()

    async def aclose(self) -> None:
        """Close whichever stores were opened (the async one first)."""
        if self._async_store is not None:
            await self._async_store.close()
        elif self._store is not None and _is_async_store(self._store):
            await cast(AsyncIdempotencyStore, self._store).close()
        if self._store is not None and not _is_async_store(self._store):
            cast(IdempotencyStore, self._store).close()


def scoped_key(topology: Topology, queue: str, key: str) -> str:
    """The key the idempotency store sees: `<business queue name>:<key>`."""
    return f"{topology.names.business_queue(queue)}:{key}"


def _is_async_store(store: object) -> bool:
    claim = getattr(store, "claim", None)
    return claim is not None and inspect.iscoroutinefunction(claim)
