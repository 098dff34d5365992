"""Reconcilers on aio-pika: the driver of the run program (_reconcile.py), for
the async worker (a task beside the consumers) and `rabbit-delay reconcile`.

An `async def` reconciler runs on the loop with an AsyncPublisher; a plain `def` one runs
on a thread, with a blocking face of the same publisher (each call waits for its
confirms on the loop). A run publishes on a connection of its own, opened once its
claim is won and closed when it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence

from rabbit_delay._aio.publisher import AsyncPublisher
from rabbit_delay._consumer.app import App
from rabbit_delay._consumer.context import clock_ms
from rabbit_delay._consumer.leases import renew_every_ms
from rabbit_delay._envelope import Outgoing
from rabbit_delay._errors import BrokerError, PublishError, RabbitDelayError
from rabbit_delay._idempotency.guard import AsyncGuard
from rabbit_delay._observe.metrics import Metrics
from rabbit_delay._publishing.core import PublisherCore
from rabbit_delay._reconcile import (
    AsyncReconcileContext,
    Call,
    Open,
    ReconcileContext,
    Reconciler,
    ReconcileResult,
    ReconcileSchedule,
    ReconcileStep,
    Send,
    StoreClaim,
    StoreMark,
    StoreRelease,
    acall,
    call_def,
    count,
    reconcile_program,
    renewal_failed,
    run_claim_lost,
)

log = logging.getLogger("rabbit_delay.reconcile")

AsyncConnect = Callable[[], Awaitable[AsyncPublisher]]


async def arun_reconciler(
    app: App,
    reconciler: Reconciler,
    owner: str,
    connect: AsyncConnect,
    *,
    scheduled: bool,
    metrics: Metrics | None = None,
) -> ReconcileResult:
    """One look at a reconciler (see reconcile_program); never raises for what the
    function, the broker or the store do: the result says. `connect` opens the run's
    publisher."""
    guard = app.async_guard()
    program = reconcile_program(
        reconciler,
        app.topology,
        owner,
        lease_ms=guard.lease_ms,
        scheduled=scheduled,
        clock=clock_ms,
    )
    publisher: AsyncPublisher | None = None
    reply: object = None
    try:
        while True:
            try:
                step: ReconcileStep = program.send(reply)
            except StopIteration as stop:
                result: ReconcileResult = stop.value
                break
            if isinstance(step, Open):
                try:
                    publisher = await connect()
                    reply = None
                except RabbitDelayError as exc:  # the run fails; the period record is kept
                    reply = exc
            elif isinstance(step, Call):
                assert publisher is not None
                reply = await _call(app, guard, step, publisher)
            elif isinstance(step, Send):
                assert publisher is not None
                try:
                    await publisher.publish_outgoing(step.outs)
                    reply = None
                except (PublishError, BrokerError) as exc:
                    reply = exc
            else:
                reply = await _store(guard, step)
    finally:
        if publisher is not None:
            await publisher.close()
    return count(result, metrics)


async def _store(guard: AsyncGuard, step: StoreClaim | StoreRelease | StoreMark) -> object:
    store = guard.store
    try:
        if isinstance(step, StoreClaim):
            return await store.claim(
                step.key, step.owner, now_ms=clock_ms(), lease_ms=step.lease_ms
            )
        if isinstance(step, StoreRelease):
            await store.release(step.key, step.owner)
        else:
            await store.cancel(step.key, now_ms=clock_ms(), retention_ms=step.retention_ms)
    except Exception as exc:
        return exc
    return None


async def _call(app: App, guard: AsyncGuard, step: Call, publisher: AsyncPublisher) -> object:
    reconciler = step.reconciler
    renewing = asyncio.create_task(_renew(guard, step.key, step.owner, reconciler.name))
    try:
        if reconciler.async_fn is not None:  # its async twin (the schedule's sweeper)
            twin = dataclasses.replace(reconciler, fn=reconciler.async_fn, is_async=True)
            return await acall(
                twin, lambda at: AsyncReconcileContext(reconciler.name, app, at, publisher)
            )
        if reconciler.is_async:
            return await acall(
                reconciler,
                lambda at: AsyncReconcileContext(reconciler.name, app, at, publisher),
            )
        blocking = _BlockingPublisher(publisher, asyncio.get_running_loop())
        # on a thread of its own; the start is taken there, when the function is called
        return await asyncio.to_thread(
            call_def, reconciler, lambda at: ReconcileContext(reconciler.name, app, at, blocking)
        )
    except Exception as exc:
        return exc
    finally:
        renewing.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await renewing


async def _renew(guard: AsyncGuard, key: str, owner: str, name: str) -> None:
    every_s = renew_every_ms(guard.lease_ms) / 1000
    while True:
        await asyncio.sleep(every_s)
        try:
            kept = await guard.renew(key, owner)
        except Exception as exc:
            renewal_failed(name, exc)
            continue
        if not kept:
            run_claim_lost(name)
            return


class _BlockingPublisher(PublisherCore[str, list[str]]):
    """The async publisher of a run, for a `def` reconciler on a thread: each call is
    validated here and sent on the loop, and returns once confirmed. Raises like the
    async publisher."""

    def __init__(self, publisher: AsyncPublisher, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(publisher.topology, borrowed=True)
        self._publisher = publisher
        self._loop = loop

    def publish_outgoing(self, messages: Iterable[Outgoing]) -> list[str]:
        coroutine = self._publisher.publish_outgoing(list(messages))
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def _publish_one(self, out: Outgoing) -> str:
        return self.publish_outgoing((out,))[0]


class AsyncReconciling:
    """The async worker's reconcilers: a task looking at each one every `check_ms`
    (from the start), running those that are due. Nothing a reconciler does stops the
    task or the worker."""

    def __init__(
        self,
        app: App,
        reconcilers: Sequence[Reconciler],
        identity: str,
        connect: AsyncConnect,
        metrics: Metrics | None = None,
    ) -> None:
        self.app = app
        self.reconcilers = list(reconcilers)
        self.identity = identity
        self.connect = connect
        self.metrics = metrics
        self.results: list[ReconcileResult] = []  # the runs of this worker, in order
        self._seq = itertools.count(1)
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()

    def start(self) -> None:
        self._stopping = asyncio.Event()
        self._task = asyncio.create_task(self._run(), name="rabbit-delay-reconcile")

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stop looking; a run in progress gets `grace_s`, then is cancelled (a `def`
        reconciler's thread cannot be: it runs on, and its claim runs out after the
        lease)."""
        task, self._task = self._task, None
        if task is None:
            return
        self._stopping.set()
        try:
            await asyncio.wait_for(asyncio.shield(task), grace_s)
        except TimeoutError:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        schedule = ReconcileSchedule(self.reconcilers, time.monotonic())
        stopping = self._stopping
        while not stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), schedule.wait_s(time.monotonic()))
            for reconciler in schedule.due(time.monotonic()):
                if stopping.is_set():
                    return
                owner = f"{self.identity}:reconcile:{next(self._seq)}"
                try:
                    result = await arun_reconciler(
                        self.app,
                        reconciler,
                        owner,
                        self.connect,
                        scheduled=True,
                        metrics=self.metrics,
                    )
                except Exception:  # a bug of ours: logged, the worker goes on
                    log.exception("reconciler %s: unexpected error", reconciler.name)
                else:
                    if result.ran:
                        self.results.append(result)
                schedule.looked(reconciler, time.monotonic())


__all__ = ["AsyncReconciling", "arun_reconciler"]
