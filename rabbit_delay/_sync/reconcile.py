"""Reconcilers on pika: the driver of the run program (_reconcile.py), for the
sync worker (a thread of its own beside the consumers) and `rabbit-delay reconcile`.

A run publishes on a connection of its own, opened once the run's claim is won and
closed when it ends: runs are rare, and the worker's connection belongs to its thread.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence

from rabbit_delay._consumer.app import App
from rabbit_delay._consumer.context import clock_ms
from rabbit_delay._consumer.leases import renew_every_ms
from rabbit_delay._errors import BrokerError, PublishError, RabbitDelayError
from rabbit_delay._idempotency.guard import Guard
from rabbit_delay._observe.metrics import Metrics
from rabbit_delay._reconcile import (
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
    call_def,
    count,
    reconcile_program,
    renewal_failed,
    run_claim_lost,
)
from rabbit_delay._sync.publisher import Publisher

log = logging.getLogger("rabbit_delay.reconcile")

Connect = Callable[[], Publisher]


def run_reconciler(
    app: App,
    reconciler: Reconciler,
    owner: str,
    connect: Connect,
    *,
    scheduled: bool,
    metrics: Metrics | None = None,
) -> ReconcileResult:
    """One look at a `def` reconciler (see reconcile_program); never raises for what the
    function, the broker or the store do: the result says. `connect` opens the run's
    publisher. Raises ConfigError for an app whose store is async-only."""
    guard = app.guard()
    program = reconcile_program(
        reconciler,
        app.topology,
        owner,
        lease_ms=guard.lease_ms,
        scheduled=scheduled,
        clock=clock_ms,
    )
    publisher: Publisher | None = None
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
                    publisher = connect()
                    reply = None
                except RabbitDelayError as exc:  # the run fails; the period record is kept
                    reply = exc
            elif isinstance(step, Call):
                assert publisher is not None
                reply = _call(app, guard, step, publisher)
            elif isinstance(step, Send):
                assert publisher is not None
                try:
                    publisher.publish_outgoing(step.outs)
                    reply = None
                except (PublishError, BrokerError) as exc:
                    reply = exc
            else:
                reply = _store(guard, step)
    finally:
        if publisher is not None:
            publisher.close()
    return count(result, metrics)


def _store(guard: Guard, step: StoreClaim | StoreRelease | StoreMark) -> object:
    store = guard.store
    try:
        if isinstance(step, StoreClaim):
            return store.claim(step.key, step.owner, now_ms=clock_ms(), lease_ms=step.lease_ms)
        if isinstance(step, StoreRelease):
            store.release(step.key, step.owner)
        else:
            store.cancel(step.key, now_ms=clock_ms(), retention_ms=step.retention_ms)
    except Exception as exc:
        return exc
    return None


def _call(app: App, guard: Guard, step: Call, publisher: Publisher) -> object:
    """`Called`: the function's items (its generator run to its end here) or its
    exception, and when it was called; the run's claim renewed meanwhile."""
    reconciler = step.reconciler
    renewing = _Renewer(guard, step.key, step.owner, reconciler.name)
    renewing.start()
    try:
        return call_def(
            reconciler, lambda at: ReconcileContext(reconciler.name, app, at, publisher)
        )
    finally:
        renewing.stop()


class _Renewer:
    """Keeps a run's claim alive while the function runs (renewed like a handler's)."""

    def __init__(self, guard: Guard, key: str, owner: str, name: str) -> None:
        self._guard, self._key, self._owner, self._name = guard, key, owner, name
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"rabbit-delay-reconcile-lease-{name}", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        every_s = renew_every_ms(self._guard.lease_ms) / 1000
        while not self._stop.wait(every_s):
            try:
                kept = self._guard.renew(self._key, self._owner)
            except Exception as exc:
                renewal_failed(self._name, exc)
                continue
            if not kept:
                run_claim_lost(self._name)
                return


class Reconciling:
    """The sync worker's reconcilers: a daemon thread looking at each one every
    `check_ms` (from the start), running those that are due. Nothing a reconciler does
    stops the thread or the worker."""

    def __init__(
        self,
        app: App,
        reconcilers: Sequence[Reconciler],
        identity: str,
        connect: Connect,
        metrics: Metrics | None = None,
    ) -> None:
        self.app = app
        self.reconcilers = list(reconcilers)
        self.identity = identity
        self.connect = connect
        self.metrics = metrics
        self.results: list[ReconcileResult] = []  # the runs of this worker, in order
        self._seq = itertools.count(1)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="rabbit-delay-reconcile", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop looking; a run in progress is waited for up to `timeout` (a daemon thread:
        the process may exit under it, and its claim then runs out after the lease)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        schedule = ReconcileSchedule(self.reconcilers, time.monotonic())
        while not self._stop.wait(schedule.wait_s(time.monotonic())):
            for reconciler in schedule.due(time.monotonic()):
                if self._stop.is_set():
                    return
                owner = f"{self.identity}:reconcile:{next(self._seq)}"
                try:
                    result = run_reconciler(
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


__all__ = ["Reconciling", "run_reconciler"]
