"""AckTracker: coalesced acks never cover a delivery still running or meant to be refused."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from rabbit_delay._consumer.acks import AckTracker


def delivered(*tags: int) -> AckTracker:
    tracker = AckTracker()
    for tag in tags:
        tracker.delivered(tag)
    return tracker


def test_in_order_completions_become_one_multiple_ack() -> None:
    tracker = delivered(1, 2, 3, 4)
    for tag in (1, 2, 3):
        tracker.acked(tag)
    assert tracker.flush() == [(3, True)]
    assert len(tracker) == 1
    tracker.acked(4)
    assert tracker.flush() == [(4, False)]
    assert tracker.flush() == []
    assert len(tracker) == 0


def test_a_finished_delivery_behind_a_running_one_is_acked_alone_at_once() -> None:
    tracker = delivered(1, 2, 3)
    tracker.acked(2)
    tracker.acked(3)
    assert tracker.flush() == [(2, False), (3, False)]  # 1 still runs: no multiple-ack
    tracker.acked(1)
    assert tracker.flush() == [(1, False)]


def test_a_rejected_delivery_inside_a_run_is_not_acked_again() -> None:
    tracker = delivered(1, 2, 3)
    tracker.acked(1)
    tracker.settled(2)  # rejected on the wire already
    tracker.acked(3)
    assert tracker.flush() == [(3, True)]  # covers 1 and 3; 2 is no longer outstanding


def test_a_rejection_not_yet_written_blocks_the_run() -> None:
    tracker = delivered(1, 2, 3)
    tracker.acked(1)
    tracker.acked(3)
    assert tracker.flush() == [(1, False), (3, False)]


def test_a_gap_in_the_tags_switches_coalescing_off() -> None:
    tracker = delivered(1, 2, 4, 5)
    assert not tracker.coalescing
    for tag in (1, 2, 4, 5):
        tracker.acked(tag)
    assert tracker.flush() == [(1, False), (2, False), (4, False), (5, False)]


@pytest.mark.parametrize("seed", range(20))
def test_random_interleavings_are_exact(seed: int) -> None:
    """Simulate the broker: every frame must settle only deliveries meant to be acked."""
    rng = random.Random(seed)
    tracker = AckTracker()
    outstanding: dict[int, str | None] = {}  # tag -> None (running) / "ack"
    running: list[int] = []
    next_tag = 1

    def apply(frames: list[tuple[int, bool]]) -> None:
        for tag, multiple in frames:
            covered = [t for t in outstanding if (t <= tag if multiple else t == tag)]
            assert covered
            for t in covered:
                assert outstanding.pop(t) == "ack", (t, tag, multiple)

    for _ in range(400):
        roll = rng.random()
        if roll < 0.4:
            tracker.delivered(next_tag)
            outstanding[next_tag] = None
            running.append(next_tag)
            next_tag += 1
        elif roll < 0.85 and running:
            tag = running.pop(rng.randrange(len(running)))
            if rng.random() < 0.2:
                del outstanding[tag]  # rejected, written
                tracker.settled(tag)
            else:
                outstanding[tag] = "ack"
                tracker.acked(tag)
        else:
            apply(tracker.flush())
    for tag in running:
        outstanding[tag] = "ack"
        tracker.acked(tag)
    apply(tracker.flush())
    assert outstanding == {}
    assert len(tracker) == 0


class SlowChannel:
    """Records ack frames as the wire would see them; every write yields to the loop."""

    def __init__(self) -> None:
        self.wire: list[tuple[int, bool]] = []

    async def basic_ack(self, tag: int, multiple: bool = False) -> None:
        await asyncio.sleep(0.001)
        self.wire.append((tag, multiple))


async def test_the_async_worker_writes_ack_flushes_in_order() -> None:
    # A flush's multiple-ack assumes the single acks of earlier flushes are on the wire:
    # overtaking one would settle its tag first, and its own ack would then close the
    # channel (406 unknown delivery tag). Seen under load before the writes were ordered.
    from rabbit_delay import App, AsyncWorker, topology_from_dict
    from rabbit_delay.stores import MemoryStore

    topology = topology_from_dict({"namespace": "s", "tiers": {"1s": "1s"}, "queues": {"q": {}}})
    app = App(topology, store=MemoryStore())
    app.add_consumer("q", lambda message: None)
    worker = AsyncWorker(app, "amqp://guest:guest@127.0.0.1:5672/%2F")
    worker._loop = asyncio.get_running_loop()
    channel: Any = SlowChannel()
    tracker = delivered(1, 2, 3, 4)
    worker._ack(channel, tracker, 1)
    worker._ack(channel, tracker, 3)
    await asyncio.sleep(0)  # flush 1: (1), (3) one by one, 2 still runs
    worker._ack(channel, tracker, 2)
    worker._ack(channel, tracker, 4)
    await asyncio.sleep(0)  # flush 2: one multiple-ack up to 4
    await asyncio.wait(list(worker._ack_writes), timeout=5)
    assert channel.wire == [(1, False), (3, False), (4, True)]
