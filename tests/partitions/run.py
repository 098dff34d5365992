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

With `schedule=True` the workload runs with a `[schedule]` table and nothing moves a
leadership: the workers' sweeper (docs/schedule.md#the-sweeper) republishes what is still
scheduled past its due time plus the grace, straight to the business queue. The drain
then waits up to `sweep_timeout_s` more; `unstalled` counts the messages missing at the
drain deadline that arrived then, `swept` the records the sweeper republished (some only
late: their copies are duplicates the guard absorbs) and `swept_stalled` those of them
that were missing.
"""

from __future__ import annotations

import json
import random
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rabbit_delay import RabbitDelayError
from rabbit_delay._envelope import now_ms
from rabbit_delay._ops.status.execute import overdue_records, read_status
from rabbit_delay._ops.status.rules import BUFFER_ROLES

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
    unstalled: int  # missing at the drain deadline, then handled or parked
    stalled_dlx: dict[str, int]  # what the management API showed in messages_dlx then
    other_errors: list[str]
    schedule: bool = False  # the run's recovery: the sweeper (else: moving leaderships)
    swept: int = 0  # records the sweeper republished (schedule runs)
    swept_stalled: int = 0  # ... of them missing at the drain deadline
    settled_by_sweeper: int = 0  # messages whose first run to the end was a sweeper copy
    held_dead_letters: dict[str, int] = field(default_factory=dict)  # by the leaders, at the end
    # `rabbit-delay status` read at the end: the buffers it flagged stalled, the dead
    # letters it saw (messages_dlx), the queues the management API gave no figures for
    status_stalled: list[str] = field(default_factory=list)
    status_dead_letters: int = 0
    status_no_figures: list[str] = field(default_factory=list)
    # schedule runs: the most records `status` would have called overdue, polled every 2 s
    max_overdue: int = 0
    partitioned_after_heal: int = 0  # 3.x: Mnesia still split after the network healed
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
            f"{self.publish_errors}, stalled dead letters sent again by "
            + (
                f"the sweeper {self.unstalled} (republished {self.swept}, "
                f"{self.swept_stalled} of them missing at the drain deadline, "
                f"{self.settled_by_sweeper} settled by a sweeper copy first)"
                if self.schedule
                else f"a new buffer leader {self.unstalled}"
            )
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


class OverduePoll:
    """What `status` would call overdue (records scheduled past due + grace), read from
    the schedule's store every 2 s while the run lasts: the most seen."""

    def __init__(self, wl: Workload) -> None:
        self.max = 0
        self._wl = wl
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="overdue poll", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(2.0):
            found, _note = overdue_records(self._wl.topology, now_ms())
            if found:
                self.max = max(self.max, sum(found.values()))

    def stop(self) -> None:
        self._done.set()
        self._thread.join(30)


def status_at_the_end(wl: Workload, cluster: PartitionCluster, log: Any) -> dict[str, Any]:
    """`rabbit-delay status` as an operator would read it after the run (the management
    API read twice when dead letters are pending)."""
    try:
        st = read_status(wl.topology, cluster.urls)
    except RabbitDelayError as exc:
        log(f"status failed: {exc}")
        return {"stalled": [], "dead_letters": 0, "no_figures": []}
    short = wl.topology.names.prefix + "."
    seen = {
        "stalled": [r.name.removeprefix(short) for r in st.rows if r.dead_letters_stalled],
        "dead_letters": sum(r.dead_lettering or 0 for r in st.rows if r.role in BUFFER_ROLES),
        "no_figures": [r.name.removeprefix(short) for r in st.rows if r.no_figures],
    }
    log(f"status at the end: {seen}")
    return seen


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
    schedule: bool = False,
    sweep_timeout_s: float = 240.0,
    log: Any = print,
) -> Outcome:
    """The workload under faults of kind `fault` for `duration_s`; the checker's verdict."""
    wl = Workload(cluster.urls, workdir / "guard.sqlite", rate=rate, schedule=schedule)
    # the cluster counts for its life; the outcome counts this run's
    restarts_before, split_before = cluster.restarts_after_heal, cluster.partitioned_after_heal
    wl.declare()
    windows: list[Window] = []
    poll: OverduePoll | None = None
    try:
        wl.start()
        poll = OverduePoll(wl) if schedule else None
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
        log(
            f"one cluster again after {recover_s:.1f}s (restarts "
            f"{cluster.restarts_after_heal - restarts_before})"
        )
        wl.stop_publishing()
        settling = time.monotonic()
        settled = wl.wait_settled(settle_timeout_s)
        settle_s = time.monotonic() - settling
        unstalled, stalled_dlx = 0, {}
        stalled_ids: set[str] = set()
        if not settled and schedule:
            # no leadership moves: the workers' sweeper republishes what stays scheduled
            stalled_dlx = wl.stalled()
            stalled_ids = wl.rec.confirmed() - wl.rec.settled()
            log(
                f"not settled after {settle_s:.0f}s: {len(stalled_ids)} missing "
                f"{sorted(stalled_ids)[:10]}; messages_dlx {stalled_dlx}; waiting for the "
                "sweeper"
            )
            settled = wl.wait_settled(sweep_timeout_s)
            settle_s = time.monotonic() - settling
            unstalled = len(stalled_ids - (wl.rec.confirmed() - wl.rec.settled()))
        elif not settled and unstall:
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
        if poll is not None:
            poll.stop()
        wl.stop()
    swept = wl.swept()
    # what the buffers' leaders still hold, dead-lettered and unconfirmed (the management
    # API's messages_dlx misses the queues of a node on 3.10 after a partition)
    held = cluster.dead_letters_held(wl.dead_lettering_queues())
    log(f"dead letters the buffers' leaders hold: { ({q: n for q, n in held.items() if n}) }")
    seen = status_at_the_end(wl, cluster, log)
    left, parked = wl.queues(held)
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
        restarts_after_heal=cluster.restarts_after_heal - restarts_before,
        recover_s=recover_s,
        settle_s=settle_s,
        settled=settled,
        publish_errors=publish_errors,
        unstalled=unstalled,
        stalled_dlx=stalled_dlx,
        other_errors=[e for e in errors if "publish:" not in e][:20],
        worker_stats=wl.worker_stats,
        schedule=schedule,
        swept=len(swept),
        swept_stalled=len(stalled_ids & set(swept)),
        settled_by_sweeper=len(wl.rec.settled_by_sweeper()),
        held_dead_letters={q: n for q, n in held.items() if n},
        status_stalled=seen["stalled"],
        status_dead_letters=seen["dead_letters"],
        status_no_figures=seen["no_figures"],
        max_overdue=poll.max if poll is not None else 0,
        partitioned_after_heal=cluster.partitioned_after_heal - split_before,
    )


def dump(outcome: Outcome) -> str:
    return json.dumps(outcome.as_dict(), default=str)
