"""One partition run: the workload on a cluster, faults of one kind, heal, the verdict.

Fault kinds (3 nodes; a "minority" is one node, the majority the two others):

    isolate-buffer-leader  the node leading the 2 s tier's first buffer, cut from the others
    isolate-queue-leader   the node leading the business queue, cut from the others
    minority               a random node cut from the others (a new one each window)
    bridge                 a random node sees both others, which do not see each other
    random                 every few seconds one of: a minority, a bridge, heal

A fault lasts `fault_s` (long enough for the nodes to notice: the harness sets
net_ticktime to 10 s), then everything heals for `heal_s`, until `duration_s` is over;
then the last heal, the cluster waits until all members run together again (restarting
a member that does not come back: cluster.recover), publishing stops, and the workers
drain until every confirmed message ran to its end. When they do not within
`settle_timeout_s` (the RabbitMQ 3.10 stall: dead letters their target never confirmed,
docs/reliability.md), `unstall` moves the leadership of every buffer and cascade level
to another node (what the docs tell an operator to do) and the drain goes on: the
outcome counts the messages that arrived only then (`unstalled`).
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rabbit_delay._envelope import now_ms

from .checker import Verdict, Window, check
from .cluster import Member, PartitionCluster
from .workload import QUEUE, Workload

KINDS = ("isolate-buffer-leader", "isolate-queue-leader", "minority", "bridge", "random")


@dataclass
class Outcome:
    kind: str
    version: str
    fault: str
    duration_s: float
    verdict: Verdict
    windows: list[Window]
    restarts_after_heal: int
    recover_s: float
    settle_s: float
    settled: bool
    publish_errors: int
    unstalled: int  # missing until the buffers' leadership moved, then handled or parked
    stalled_dlx: dict[str, int]  # what the management API showed in messages_dlx then
    other_errors: list[str]
    worker_stats: dict[str, dict[str, int]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["verdict"] = self.verdict.as_dict()
        return d

    def summary(self) -> str:
        v = self.verdict
        return (
            f"{self.version} {self.fault}: published {v.published} confirmed {v.confirmed} "
            f"handled {v.handled} parked {v.parked} lost {v.lost} duplicates {v.duplicates} "
            f"unexpected {v.unexpected} effects_twice {v.effects_twice} early {v.early} "
            f"stuck {v.stuck} lateness p50/p99/max {v.lateness_p50_ms}/{v.lateness_p99_ms}/"
            f"{v.lateness_max_ms} ms, due in a fault {v.fault_lateness_p50_ms}/"
            f"{v.fault_lateness_p99_ms}/{v.fault_lateness_max_ms} ms; windows "
            f"{len(self.windows)}, recover {self.recover_s:.1f}s (restarts "
            f"{self.restarts_after_heal}), settle {self.settle_s:.1f}s, publish errors "
            f"{self.publish_errors}, stalled dead letters sent again by a new buffer "
            f"leader {self.unstalled}"
        )


def _leader_of(cluster: PartitionCluster, queue: str) -> Member:
    """The member leading `queue` (rabbitmqctl can time out on a loaded machine: asked
    again for up to 60 s)."""
    deadline = time.monotonic() + 60
    while True:
        name = cluster.leaders().get(queue, "")
        if name:
            return cluster.member(name)
        if time.monotonic() > deadline:
            raise RuntimeError(f"no member says which node leads {queue}")
        time.sleep(1)


def apply_fault(cluster: PartitionCluster, fault: str, wl: Workload, log: Any = print) -> str:
    """Start one fault of kind `fault`; what it cut, for the log."""
    names = wl.topology.names
    if fault.startswith("isolate-"):
        leaders = {q.split(".v1.")[-1]: n.split("@")[-1] for q, n in cluster.leaders().items()}
        log(f"leaders: {leaders}")
    if fault == "isolate-buffer-leader":
        m = _leader_of(cluster, names.tier_queue("2s"))
        cluster.isolate(m)
    elif fault == "isolate-queue-leader":
        m = _leader_of(cluster, names.business_queue(QUEUE))
        cluster.isolate(m)
    elif fault == "minority":
        cluster.isolate(random.choice(cluster.members))
    elif fault == "bridge":
        cluster.bridge_through(random.choice(cluster.members))
    else:
        raise ValueError(f"unknown fault {fault!r}; the kinds are {KINDS}")
    return cluster.describe_cut()


def run_partitions(
    cluster: PartitionCluster,
    fault: str,
    workdir: Path,
    *,
    duration_s: float = 60.0,
    fault_s: float = 25.0,
    heal_s: float = 10.0,
    rate: float = 40.0,
    settle_timeout_s: float = 60.0,
    unstall: bool = True,
    log: Any = print,
) -> Outcome:
    """The workload under faults of kind `fault` for `duration_s`; the checker's verdict."""
    wl = Workload(cluster.urls, workdir / "guard.sqlite", rate=rate)
    wl.declare()
    windows: list[Window] = []
    try:
        wl.start()
        time.sleep(5)  # a steady state before the first fault
        began = time.monotonic()
        while time.monotonic() - began < duration_s:
            start = now_ms()
            if fault == "random":
                until = time.monotonic() + fault_s
                while time.monotonic() < until:
                    pick = random.choice(("minority", "bridge", "heal"))
                    if pick == "heal":
                        cluster.heal()
                    else:
                        apply_fault(cluster, pick, wl, log)
                    log(f"random: {pick} (cut {cluster.describe_cut()})")
                    time.sleep(random.uniform(3, 8))
            else:
                log(f"{fault}: cut {apply_fault(cluster, fault, wl, log)}")
                time.sleep(fault_s)
            cluster.heal()
            windows.append(Window(fault, start, now_ms()))
            log(f"healed after {(windows[-1].end_ms - start) / 1000:.1f}s")
            if time.monotonic() - began < duration_s:
                time.sleep(heal_s)
        healing = time.monotonic()
        cluster.recover()
        recover_s = time.monotonic() - healing
        log(f"one cluster again after {recover_s:.1f}s (restarts {cluster.restarts_after_heal})")
        wl.stop_publishing()
        settling = time.monotonic()
        settled = wl.wait_settled(settle_timeout_s)
        settle_s = time.monotonic() - settling
        unstalled, stalled_dlx = 0, {}
        if not settled and unstall:
            # RabbitMQ 3.10: dead letters of a buffer sent while a node was being cut off
            # stay unconfirmed for good (the management API does not always count them in
            # messages_dlx); a new leader of each buffer sends them again
            stalled_dlx = wl.stalled()
            missing = wl.rec.confirmed() - wl.rec.settled()
            log(
                f"not settled after {settle_s:.0f}s: {len(missing)} missing "
                f"{sorted(missing)[:10]}; messages_dlx {stalled_dlx}"
            )
            moved = cluster.transfer_leaderships(wl.dead_lettering_queues())
            log(f"buffers' leadership moved: {moved}")
            settled = wl.wait_settled(settle_timeout_s)
            settle_s = time.monotonic() - settling
            unstalled = len(missing - (wl.rec.confirmed() - wl.rec.settled()))
    finally:
        wl.stop()
    left, parked = wl.queues()
    verdict = check(
        wl.rec.published,
        wl.rec.runs,
        parked,
        guard_duplicates=wl.guard_duplicates,
        left=left,
        windows=windows,
    )
    (workdir / "outcome.json").write_text(
        json.dumps(
            {"verdict": verdict.as_dict(), "left": left, "stats": wl.worker_stats,
             "errors": wl.rec.errors[:50], "windows": [asdict(w) for w in windows]},
            default=str, indent=1,
        ),
        encoding="utf-8",
    )  # fmt: skip
    errors = wl.rec.errors
    publish_errors = sum(1 for e in errors if "publish:" in e)
    return Outcome(
        kind=cluster.kind,
        version=cluster.version,
        fault=fault,
        duration_s=duration_s,
        verdict=verdict,
        windows=windows,
        restarts_after_heal=cluster.restarts_after_heal,
        recover_s=recover_s,
        settle_s=settle_s,
        settled=settled,
        publish_errors=publish_errors,
        unstalled=unstalled,
        stalled_dlx=stalled_dlx,
        other_errors=[e for e in errors if "publish:" not in e][:20],
        worker_stats=wl.worker_stats,
    )


def dump(outcome: Outcome) -> str:
    return json.dumps(outcome.as_dict(), default=str)
