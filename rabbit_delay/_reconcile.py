"""Reconciliation: a function of yours, run now and then, that finds what should have
fired and did not, and re-submits it. Pure: registration, the schedule, the run's
protocol (a sans-I/O program, like the delivery program) and what a re-submission
becomes.

    @app.reconcile(every="10m")
    def overdue_orders(ctx: ReconcileContext) -> Iterable[Resubmit]:
        for order in db.unpaid_orders_past_their_deadline():
            yield Resubmit({"order_id": order.id}, queue="orders.cancel-unpaid",
                           message_id=f"order-{order.id}-timeout")

Re-submitted messages carry the message_id of the original: the consumer's idempotency
guard runs the handler once whichever copy comes first (a late original is then skipped
as a duplicate). A `Resubmit` without a tier or delay goes to its queue now, through the
due exchange.

Who runs it: every worker of the app looks at each reconciler every `check_ms`
(`every` / 10, between 0.2 s and 60 s); the first that finds it due runs it, one at a
time across processes, through two records in the app's idempotency store:

    key                                   record
    <prefix>.reconcile.<name>:running     a claim for the length of a run, renewed like a
                                          handler's lease: one run at a time (a worker
                                          that dies mid-run frees it after the lease)
    <prefix>.reconcile.<name>:period      a tombstone written when a run ends, living
                                          `every` from the run's start: workers skip the
                                          reconciler until it lapses

`rabbit-delay reconcile MODULE:APP` runs them once, now (not before a run elsewhere has
ended), and writes the same period record. With the memory store only the workers of
one process see each other's records.

Errors of the function, of a re-submission or of the store are logged and counted,
never raised into the worker; the next period tries again.
"""

from __future__ import annotations

import inspect
import logging
import re
import time
from collections.abc import AsyncIterable, Callable, Coroutine, Generator, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Literal

from rabbit_delay._durations import format_ms
from rabbit_delay._envelope import Body, Outgoing, outgoing
from rabbit_delay._errors import ConfigError, PublishError
from rabbit_delay._idempotency.guard import ClaimResult, run, run_async
from rabbit_delay._publishing.core import DelayLike, PublisherCore
from rabbit_delay._schedule.operations import ScheduleCore

if TYPE_CHECKING:
    from rabbit_delay._consumer.app import App
    from rabbit_delay._idempotency.guard import AsyncGuard, Guard
    from rabbit_delay._observe.metrics import Metrics
    from rabbit_delay._topology.model import Topology

log = logging.getLogger("rabbit_delay.reconcile")

# A reconciler's name goes into store keys, log lines and a metric label.
NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}$")
MIN_CHECK_MS = 200
MAX_CHECK_MS = 60_000
KIND = "reconcile"


def reconcile_key(topology: Topology, name: str, part: Literal["running", "period"]) -> str:
    """The idempotency-store key of reconciler `name`'s run claim or period record."""
    return f"{topology.names.prefix}.{KIND}.{name}:{part}"


@dataclass(frozen=True, slots=True)
class Resubmit:
    """A message to send again, under the original's `message_id` (required: it is what
    lets the guard run the handler once). Without `tier`, `delay` or `at` it goes to
    `queue` (or `routing_key`) now; with one, it is routed like `publish_delayed`."""

    body: Body
    message_id: str
    queue: str | None = None
    routing_key: str | None = None
    tier: str | None = None
    delay: DelayLike | None = None
    at: datetime | None = None
    headers: Mapping[str, object] | None = None


@dataclass(frozen=True, slots=True, eq=False)
class Reconciler:
    """One registered reconciliation function."""

    name: str
    fn: Callable[..., Any]
    every_ms: int
    is_async: bool  # async def (or an async generator function): the async worker's
    # An `async def` twin the async worker calls instead of `fn` (the schedule's sweeper,
    # whose store may be asynchronous): a `def` for the sync worker, a coroutine for this.
    async_fn: Callable[..., Any] | None = None

    @property
    def check_ms(self) -> int:
        """How often each worker looks whether it is due."""
        return min(max(self.every_ms // 10, MIN_CHECK_MS), MAX_CHECK_MS)


def make_reconciler(fn: Callable[..., Any], every_ms: int, name: str | None) -> Reconciler:
    """Raises ConfigError for a name outside NAME or a function that takes no argument."""
    chosen = name if name is not None else getattr(fn, "__name__", "")
    if not isinstance(chosen, str) or not NAME.match(chosen):
        raise ConfigError(
            f"reconciler name {chosen!r}: use letters, digits, '_', '.' and '-' (at most 100, "
            "not starting with '.' or '-'); pass name=... to @app.reconcile"
        )
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        params = None
    if params is not None and not any(
        p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in params
    ):
        raise ConfigError(f"reconciler {chosen!r} must take the context: def {chosen}(ctx)")
    is_async = inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn)
    return Reconciler(chosen, fn, every_ms, is_async)


# -- what a reconciler sees ----------------------------------------------------------------


@dataclass(slots=True)
class _Context:
    name: str
    app: App
    started_at: datetime  # UTC, when this run started

    @property
    def topology(self) -> Topology:
        return self.app.topology


@dataclass(slots=True)
class ReconcileContext(_Context):
    """The argument of a `def` reconciler. `publisher` publishes and waits for the
    broker's confirm (`publish_delayed`, `publish_many`, `publish_outgoing`), open for
    the run only; or return / yield `Resubmit`s and the run publishes them."""

    publisher: PublisherCore[str, list[str]] = field(repr=False)

    @property
    def guard(self) -> Guard:
        """The app's idempotency guard (e.g. `guard.cancel(key)`). Raises ConfigError for
        an async-only store."""
        return self.app.guard()


@dataclass(slots=True)
class AsyncReconcileContext(_Context):
    """The argument of an `async def` reconciler (the async worker's): `publisher` is
    the awaited face of the same calls."""

    publisher: PublisherCore[Coroutine[Any, Any, str], Coroutine[Any, Any, list[str]]] = field(
        repr=False
    )

    @property
    def guard(self) -> AsyncGuard:
        return self.app.async_guard()


@dataclass
class ReconcileResult:
    """What one look at a reconciler came to."""

    name: str
    ran: bool
    skipped: str | None = None  # why it did not run
    resubmitted: list[str] = field(default_factory=list)  # confirmed message_ids
    refused: list[str] = field(default_factory=list)  # returned items that are no message
    error: str | None = None  # the function raised, or re-submissions were not confirmed
    seconds: float = 0.0

    @property
    def failed(self) -> bool:
        """The function raised, a re-submission was refused or not confirmed, or the store
        failed (then it did not run)."""
        return self.error is not None or bool(self.refused)

    @property
    def ok(self) -> bool:
        return self.ran and not self.failed

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "ran": self.ran,
            "ok": self.ok,
            "failed": self.failed,
            "skipped": self.skipped,
            "resubmitted": list(self.resubmitted),
            "refused": list(self.refused),
            "error": self.error,
            "seconds": round(self.seconds, 3),
        }


# -- the run's program ---------------------------------------------------------------------


@dataclass(slots=True)
class StoreClaim:
    key: str
    owner: str
    lease_ms: int


@dataclass(slots=True)
class StoreRelease:
    key: str
    owner: str


@dataclass(slots=True)
class StoreMark:
    """A tombstone on `key` for `retention_ms` (the store's cancel: it overrides a
    claim, never shortens an earlier one)."""

    key: str
    retention_ms: int


@dataclass(slots=True)
class Open:
    """Open the run's publisher (a broker connection). Reply: None, or the
    RabbitDelayError that says why it could not (the run then fails)."""


@dataclass(slots=True)
class Call:
    """Call the function; renew `key`'s claim (a lease) while it runs. Reply: the items it
    returned or yielded (a list, None for none), or its exception."""

    reconciler: Reconciler
    key: str
    owner: str


@dataclass(frozen=True, slots=True)
class Called:
    """The reply to `Call`: what the function gave (or its exception), and when it was
    called (epoch ms), which is when the run started: the period counts from it."""

    items: object
    started_ms: int


@dataclass(slots=True)
class Send:
    """Publish `outs`, confirmed. Reply: None, or the PublishError / BrokerError."""

    outs: list[Outgoing]


ReconcileStep = StoreClaim | StoreRelease | StoreMark | Open | Call | Send
ReconcileProgram = Generator[ReconcileStep, object, ReconcileResult]


def reconcile_program(
    reconciler: Reconciler,
    topology: Topology,
    owner: str,
    *,
    lease_ms: int,
    scheduled: bool,
    clock: Callable[[], int],
) -> ReconcileProgram:
    """One look at `reconciler` by `owner`: claim, run, publish, record. `scheduled`
    (a worker): skip it while its period record lives; otherwise (the CLI) run it now
    unless a run is going on elsewhere."""
    name = reconciler.name
    period = reconcile_key(topology, name, "period")
    running = reconcile_key(topology, name, "running")
    if scheduled:
        claimed = yield StoreClaim(period, owner, lease_ms)
        if isinstance(claimed, Exception):
            return _store_failed(name, claimed)
        if claimed is not ClaimResult.CLAIMED:
            return ReconcileResult(
                name,
                False,
                f"ran within the last {format_ms(reconciler.every_ms)}"
                if claimed is not ClaimResult.IN_PROGRESS
                else "running elsewhere",
            )
    locked = yield StoreClaim(running, owner, lease_ms)
    if locked is not ClaimResult.CLAIMED:
        if scheduled:
            yield StoreRelease(period, owner)
        if isinstance(locked, Exception):
            return _store_failed(name, locked)
        return ReconcileResult(name, False, "running elsewhere")
    result = ReconcileResult(name, True)
    # The run's start is the function's (`Called.started_ms`, taken as it is called): the
    # connection is opened before it and a thread may have to start, and neither may
    # bring the next run closer than `every` to this one.
    opened = yield Open()
    start = clock()
    started = time.monotonic()
    items = opened
    if not isinstance(opened, BaseException):
        called = yield Call(reconciler, running, owner)
        if isinstance(called, Called):
            items, start = called.items, called.started_ms
        else:
            items = called
    outs: list[Outgoing] = []
    if isinstance(items, BaseException):
        result.error = f"{type(items).__name__}: {items}"
        log.error("reconciler %s failed", name, exc_info=items)
    elif items is not None:
        outs, result.refused = _outgoing(topology, name, items, start)
    if outs:
        sent = yield Send(outs)
        failed: set[str] = set()
        if sent is not None:
            failed = set(getattr(sent, "message_ids", None) or [o.message_id for o in outs])
            result.error = f"{len(failed)} re-submission(s) not confirmed: {sent}"
            log.error("reconciler %s: %s", name, result.error)
        result.resubmitted = [o.message_id for o in outs if o.message_id not in failed]
    # Start to start: the next run is due `every` after this one began.
    keep = max(reconciler.every_ms - (clock() - start), 1)
    marked = yield StoreMark(period, keep)
    if marked is not None:
        log.warning("reconciler %s: could not record its run: %r", name, marked)
    released = yield StoreRelease(running, owner)
    if released is not None:  # its lease runs out by itself
        log.warning("reconciler %s: could not release its run claim: %r", name, released)
    result.seconds = time.monotonic() - started
    level = logging.INFO if result.resubmitted or not result.ok else logging.DEBUG
    log.log(
        level,
        "reconciler %s ran in %.2fs: %d message(s) re-submitted%s",
        name,
        result.seconds,
        len(result.resubmitted),
        "" if result.ok else " (with errors)",
    )
    return result


def _store_failed(name: str, exc: Exception) -> ReconcileResult:
    log.warning("reconciler %s not run: the idempotency store failed: %r", name, exc)
    why = f"the idempotency store failed: {exc!r}"
    return ReconcileResult(name, False, why, error=why)


def _outgoing(
    topology: Topology, name: str, items: object, now: int
) -> tuple[list[Outgoing], list[str]]:
    """The messages for what a reconciler returned; what is no message is refused (and
    logged), the rest still goes."""
    if not isinstance(items, Iterable) or isinstance(items, str | bytes | Mapping):
        why = f"returned a {type(items).__name__}: return or yield Resubmit(...) items, or None"
        log.error("reconciler %s %s", name, why)
        return [], [why]
    core: PublisherCore[Any, Any] = PublisherCore(topology, borrowed=True)
    outs: list[Outgoing] = []
    refused: list[str] = []
    for item in items:
        if isinstance(item, Outgoing):  # a message made by the schedule's sweeper
            outs.append(item)
            continue
        if not isinstance(item, Resubmit):
            why = f"item {item!r} is a {type(item).__name__}, not a Resubmit"
        else:
            try:
                outs.append(_resubmission(core, item, now))
                continue
            except (PublishError, ConfigError) as exc:
                why = f"Resubmit of {item.message_id!r}: {exc}"
        log.error("reconciler %s: %s; not re-submitted", name, why)
        refused.append(why)
    return outs, refused


def _resubmission(core: PublisherCore[Any, Any], item: Resubmit, now: int) -> Outgoing:
    """Raises EncodeError / DelayError / UnknownTargetError like publish_delayed."""
    if item.tier is not None or item.delay is not None or item.at is not None:
        return core.prepare(
            item.body,
            item.tier,
            queue=item.queue,
            routing_key=item.routing_key,
            delay=item.delay,
            at=item.at,
            message_id=item.message_id,
            headers=item.headers,
        )
    from rabbit_delay._envelope import encode_body

    route = core.router.immediate(core.router.target_key(item.queue, item.routing_key))
    body, content_type = encode_body(item.body)
    return outgoing(route, body, content_type, now, item.message_id, item.headers)


# -- the schedule's sweeper -------------------------------------------------------------

# The name of the reconciler every app of a topology with [schedule] runs.
SWEEPER = "schedule"


def sweep_schedule(ctx: ReconcileContext) -> list[Outgoing]:
    """The schedule's sweeper, run as a reconciler by the workers (one at a time,
    every `[schedule] sweep_every`) and by `rabbit-delay reconcile`: the records still
    scheduled past their due time and the grace, marked swept and returned as messages
    to their queues now (`ScheduleCore.sweep`); the run publishes them, confirmed."""
    app = ctx.app
    book = getattr(app.store(), "schedule", None)
    if book is None:
        raise ConfigError(f"the store {type(app.store()).__name__} keeps no schedule")
    core = ScheduleCore(app.topology, lease_ms=app.lease_ms)
    outs, result = run(core.sweep(book, int(ctx.started_at.timestamp() * 1000)))
    _log_sweep(outs, result)
    return outs


async def asweep_schedule(ctx: AsyncReconcileContext) -> list[Outgoing]:
    """`sweep_schedule` for the async worker, through the app's async store."""
    app = ctx.app
    store = app.async_store()
    book = getattr(store, "schedule", None)
    if book is None:
        raise ConfigError(f"the store {type(store).__name__} keeps no schedule")
    core = ScheduleCore(app.topology, lease_ms=app.lease_ms)
    outs, result = await run_async(core.sweep(book, int(ctx.started_at.timestamp() * 1000)))
    _log_sweep(outs, result)
    return outs


def _log_sweep(outs: list[Outgoing], result: Any) -> None:
    if outs:
        log.warning(
            "schedule sweep: %d overdue message(s) republished (grace %s, workers' lateness "
            "%s): %s",
            len(outs),
            format_ms(result.grace_ms),
            "unknown" if result.lateness_ms is None else format_ms(result.lateness_ms),
            ", ".join(result.republished[:10]) + (" ..." if len(outs) > 10 else ""),
        )


def count(result: ReconcileResult, metrics: Metrics | None) -> ReconcileResult:
    """The end of one look, for both drivers: a run is counted in the metrics."""
    if metrics is not None and result.ran:
        metrics.reconciled(result.name, result.ok, len(result.resubmitted))
    return result


def renewal_failed(name: str, exc: BaseException) -> None:
    log.warning("reconciler %s: renewing its run claim failed: %r", name, exc)


def run_claim_lost(name: str) -> None:
    log.warning(
        "reconciler %s: its run claim was lost (the store could not renew it in time); "
        "another worker may run it beside this one",
        name,
    )


def call_def(reconciler: Reconciler, context: Callable[[datetime], ReconcileContext]) -> Called:
    """Call a `def` reconciler with the context made for this instant (its generator run
    to its end here): the reply to `Call`, the function's exception included."""
    started = now_utc()
    try:
        items = collect(reconciler.fn(context(started)))
    except Exception as exc:
        items = exc
    return Called(items, _epoch_ms(started))


async def acall(
    reconciler: Reconciler, context: Callable[[datetime], AsyncReconcileContext]
) -> Called:
    """`call_def` for an `async def` reconciler (or an async generator function)."""
    started = now_utc()
    try:
        items = await acollect(reconciler.fn(context(started)))
    except Exception as exc:
        items = exc
    return Called(items, _epoch_ms(started))


def _epoch_ms(at: datetime) -> int:
    return int(at.timestamp() * 1000)


def collect(items: object) -> object:
    """What a `def` reconciler returned, an iterable (a generator too) run to its end
    into a list; None stays None, anything else stays as it is (the run refuses it)."""
    if items is None:
        return None
    if isinstance(items, Iterable) and not isinstance(items, str | bytes | Mapping):
        return list(items)
    return items


async def acollect(items: object) -> object:
    """`collect` for what an `async def` reconciler gives: an awaitable's result, or an
    async generator's items."""
    if isinstance(items, AsyncIterable):
        return [item async for item in items]
    if inspect.isawaitable(items):
        items = await items
    return collect(items)


def now_utc() -> datetime:
    return datetime.now(UTC)


# -- the schedule of one worker ------------------------------------------------------------


class ReconcileSchedule:
    """When a worker next looks at each reconciler: at start, then every `check_ms`."""

    def __init__(self, reconcilers: Iterable[Reconciler], now_s: float) -> None:
        self._by_name = {r.name: r for r in reconcilers}
        self._next = dict.fromkeys(self._by_name, now_s)

    def due(self, now_s: float) -> list[Reconciler]:
        return [self._by_name[n] for n, at in self._next.items() if at <= now_s]

    def looked(self, reconciler: Reconciler, now_s: float) -> None:
        self._next[reconciler.name] = now_s + reconciler.check_ms / 1000

    def wait_s(self, now_s: float) -> float:
        """Seconds until the next look (0 when one is due)."""
        if not self._next:
            return 3600.0
        return max(min(self._next.values()) - now_s, 0.0)


__all__ = [
    "SWEEPER",
    "AsyncReconcileContext",
    "ReconcileContext",
    "ReconcileResult",
    "ReconcileSchedule",
    "Reconciler",
    "Resubmit",
    "acollect",
    "asweep_schedule",
    "collect",
    "now_utc",
    "reconcile_key",
    "reconcile_program",
    "sweep_schedule",
]
