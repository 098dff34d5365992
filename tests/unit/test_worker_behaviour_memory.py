"""The behaviour suite of the real workers (tests/worker_behaviour.py) on
rabbit_delay.testing's in-memory worker and MemoryBroker: no RabbitMQ, virtual time.

The same cases, the same assertions: the in-memory worker drives the same delivery
program as the sync and async workers, so where this suite and the real one disagree,
the kit (or a worker) is wrong. Run with `def` handlers (inline, taking no virtual time)
and `async def` handlers (on the kit's virtual-time loop), emulating RabbitMQ 4.3 and
3.10, whose rules differ (what a nack counts, the retry backend "broker"). Every wait
advances the virtual clock up to its deadline.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from worker_behaviour import Calls, Step, Taken, WorkerBehaviour, handler

from rabbit_delay import App, HandlerContext, MissingObjectError, Topology, topology_from_dict
from rabbit_delay.testing import MemoryBroker, MemoryPublisher, MemoryWorker

VERSIONS = ("4.3.6", "3.10.8")


class MemoryRunning:
    """A started in-memory worker, with RunningWorker's face."""

    def __init__(self, worker: MemoryWorker, app: App, close_app: bool) -> None:
        self.worker = worker
        self.name = worker.name
        self._app = app
        self._close_app = close_app

    @property
    def stats(self) -> Any:
        return self.worker.stats

    @property
    def alive(self) -> bool:
        return self.worker.started.is_set()

    def stop(self) -> None:
        self.worker.stop()
        if self._close_app:
            self._app.close()


class MemoryBench:
    """The behaviour suite's driver (worker_behaviour.Bench) on a MemoryBroker."""

    def __init__(self, kind: str, version: str) -> None:
        self.kind = kind
        self.broker = MemoryBroker(version)
        self.broker_info = self.broker.info
        self.handlers_take_time = kind == "memory-async"
        self.running: list[MemoryRunning] = []
        self._workers: dict[int, MemoryWorker] = {}

    def topology(self, **overrides: Any) -> Topology:
        data: dict[str, Any] = {
            "namespace": "t" + uuid.uuid4().hex[:10],
            "tiers": {"1s": "1s", "3s": "3s"},
            "queues": {"orders.cancel": {}, "push": {"bindings": ["push.any"]}},
        }
        data.update(overrides)
        return topology_from_dict(data)

    def declared(self, **overrides: Any) -> Topology:
        topology = self.topology(**overrides)
        self.broker.declare(topology)
        return topology

    def declare(self, topology: Topology) -> object:
        return self.broker.declare(topology)

    def plan(self, topology: Topology) -> object:
        return self.broker.plan(topology)

    def calls(self) -> Calls:
        return Calls(self.wait_for, self.monotonic)

    def handler(
        self,
        calls: Calls,
        *,
        sleep: float | Callable[[Any, HandlerContext], float] = 0.0,
        then: Step | None = None,
        annotation: str | None = None,
    ) -> Callable[..., Any]:
        return handler(self.kind, calls, sleep=sleep, then=then, annotation=annotation)

    def run_worker(self, app: App, *, close_app: bool = False, **options: Any) -> MemoryRunning:
        # As the real workers do: the app's own store, else the one its topology names.
        store = app.explicit_store if app.explicit_store is not None else app.store()
        worker = MemoryWorker(app, self.broker, store=store, **options)  # type: ignore[arg-type]
        worker.start()
        self._workers[id(app)] = worker
        running = MemoryRunning(worker, app, close_app)
        self.running.append(running)
        return running

    @contextmanager
    def publisher(self, topology: Topology) -> Iterator[MemoryPublisher]:
        yield MemoryPublisher(topology, self.broker)

    def get_all(self, queue: str, expected: int, timeout: float = 15.0) -> list[Taken]:
        self.wait_for(
            lambda: self.broker.depth(queue) >= expected,
            timeout,
            f"{expected} message(s) in {queue}",
        )
        taken = [self.broker.get(queue) for _ in range(expected)]
        return [
            Taken(m.body, m.message_id, m.content_type, dict(m.headers))
            for m in taken
            if m is not None
        ]

    def message_count(self, queue: str) -> int:
        return self.broker.depth(queue)

    def message_count_or_none(self, queue: str) -> int | None:
        try:
            return self.broker.depth(queue)
        except MissingObjectError:
            return None

    def wait_for(self, predicate: Callable[[], Any], timeout: float, what: str = "") -> Any:
        if not self.broker.run_until(predicate, timeout):
            pytest.fail(f"timed out after {timeout}s of virtual time waiting for {what}")
        return predicate()

    def guard(self, app: App) -> Any:
        return self._workers[id(app)].guard

    def now_ms(self) -> int:
        return self.broker.now_ms()

    def monotonic(self) -> float:
        return self.broker.loop.time()

    def close(self) -> None:
        try:
            for running in self.running:
                if running.alive:
                    running.stop()
        finally:
            self.broker.close()


KINDS = [(kind, version) for version in VERSIONS for kind in ("memory", "memory-async")]


def _id(param: tuple[str, str]) -> str:
    kind, version = param
    return f"{kind}-{version}"


@pytest.fixture(params=KINDS, ids=_id)
def bench(request: pytest.FixtureRequest) -> Iterator[MemoryBench]:
    """The in-memory worker with `def` ("memory") or `async def` ("memory-async")
    handlers, on a MemoryBroker emulating RabbitMQ 4.3 or 3.10."""
    kind, version = request.param
    made = MemoryBench(kind, version)
    yield made
    made.close()


@pytest.fixture(params=VERSIONS)
def worker_bench(request: pytest.FixtureRequest) -> Iterator[MemoryBench]:
    """The in-memory worker, per emulated version, for what happens before any handler."""
    made = MemoryBench("memory", str(request.param))
    yield made
    made.close()


class TestMemoryWorker(WorkerBehaviour):
    """tests/worker_behaviour.py on rabbit_delay.testing."""
