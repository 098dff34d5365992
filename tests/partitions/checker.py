"""The checker of a partition run, in the spirit of Jepsen's total-queue checker. Pure:
it reads what the workload recorded and says what went wrong (unit-tested in
tests/unit/test_partition_checker.py).

    lost          confirmed, but neither handled (its effect) nor parked       must be 0
    unexpected    handled or parked, but never published                       must be 0
    effects_twice an effect done more than once (the guard let a copy run)     must be 0
    early         a handler run before its copy was due (lateness < 0)         must be 0
    misparked     parked, but not one the workload meant to park                must be 0
    stuck         messages left in a buffer, business queue or the catch-all   must be 0
    duplicates    deliveries of a copy already handled: the guard's duplicates,
                  plus handler runs of a (message, attempt) beyond the first   counted
    lateness      of each message's first run (ms after due): p50 / p99 / max, over
                  all messages and over those due during a fault               reported
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True, slots=True)
class Published:
    message_id: str
    confirmed: bool  # the publish call returned (the broker confirmed it)
    due_ms: int  # epoch ms it falls due (publish time + delay, as the publisher asked)
    park: bool  # the workload means it to fail every attempt: parked in the end


@dataclass(frozen=True, slots=True)
class Run:
    """One handler run (the guard let it through)."""

    message_id: str
    attempt: int
    lateness_ms: int  # ctx.lateness_ms: how long after its copy was due it ran
    effect: bool  # the handler returned (its effect is done); False: it raised
    swept: bool = False  # the copy the schedule's sweeper republished (rd-tier "now")


@dataclass(frozen=True, slots=True)
class Window:
    """A fault, from its start to its heal (epoch ms)."""

    kind: str
    start_ms: int
    end_ms: int


@dataclass
class Verdict:
    published: int = 0
    confirmed: int = 0
    handled: int = 0  # distinct messages whose effect was done
    parked: int = 0
    lost: int = 0
    unexpected: int = 0
    effects_twice: int = 0
    early: int = 0
    misparked: int = 0
    stuck: int = 0
    duplicates: int = 0
    runs: int = 0
    lateness_p50_ms: int | None = None
    lateness_p99_ms: int | None = None
    lateness_max_ms: int | None = None
    fault_lateness_p50_ms: int | None = None
    fault_lateness_p99_ms: int | None = None
    fault_lateness_max_ms: int | None = None
    examples: dict[str, list[str]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not (
            self.lost
            or self.unexpected
            or self.effects_twice
            or self.early
            or self.misparked
            or self.stuck
        )

    def problems(self) -> list[str]:
        """One line per check that failed (with up to 5 message ids each)."""
        out = []
        for name in ("lost", "unexpected", "effects_twice", "early", "misparked", "stuck"):
            value = getattr(self, name)
            if value:
                out.append(f"{name} {value}: {self.examples.get(name, [])[:5]}")
        return out

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def quantile(values: Sequence[int], q: float) -> int | None:
    """The nearest-rank q-quantile (0 < q <= 1) of `values`; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, -(-int(q * 1000) * len(ordered) // 1000))  # ceil(q * n), in integers
    return ordered[min(rank, len(ordered)) - 1]


def check(
    published: Iterable[Published],
    runs: Iterable[Run],
    parked_ids: Iterable[str],
    *,
    guard_duplicates: int = 0,
    left: Mapping[str, int] | None = None,
    windows: Sequence[Window] = (),
) -> Verdict:
    """The verdict on one run.

    `parked_ids`: message ids found in the parking lots at the end (one per parked copy);
    `guard_duplicates`: deliveries the workers' guard acked without running (WorkerStats
    `duplicate`); `left`: messages still in each queue that must end empty (tier buffers,
    cascade levels, business queues, the catch-all) at the end; `windows`: the faults.
    """
    pubs = {p.message_id: p for p in published}
    all_runs = list(runs)
    parked = Counter(parked_ids)
    effects = Counter(r.message_id for r in all_runs if r.effect)
    per_attempt = Counter((r.message_id, r.attempt) for r in all_runs)
    v = Verdict(published=len(pubs), runs=len(all_runs))
    v.confirmed = sum(p.confirmed for p in pubs.values())
    v.handled = len(effects)
    v.parked = len(parked)

    lost = [m for m, p in pubs.items() if p.confirmed and m not in effects and m not in parked]
    unexpected = sorted({r.message_id for r in all_runs if r.message_id not in pubs})
    unexpected += sorted(m for m in parked if m not in pubs)
    twice = sorted(m for m, n in effects.items() if n > 1)
    early = sorted({r.message_id for r in all_runs if r.lateness_ms < 0})
    misparked = sorted(m for m in parked if m in pubs and not pubs[m].park)
    stuck = sorted(f"{q}={n}" for q, n in (left or {}).items() if n)
    v.lost, v.unexpected, v.effects_twice = len(lost), len(unexpected), len(twice)
    v.early, v.misparked = len(early), len(misparked)
    v.stuck = sum(n for n in (left or {}).values() if n > 0)
    v.duplicates = guard_duplicates + sum(n - 1 for n in per_attempt.values())
    v.duplicates += sum(n - 1 for n in parked.values())
    v.examples = {
        name: ids[:5]
        for name, ids in (
            ("lost", sorted(lost)),
            ("unexpected", unexpected),
            ("effects_twice", twice),
            ("early", early),
            ("misparked", misparked),
            ("stuck", stuck),
        )
        if ids
    }

    first: dict[str, int] = {}
    for r in all_runs:
        if r.attempt == 1 and r.message_id not in first:
            first[r.message_id] = r.lateness_ms
    late = list(first.values())
    v.lateness_p50_ms, v.lateness_p99_ms = quantile(late, 0.5), quantile(late, 0.99)
    v.lateness_max_ms = max(late) if late else None
    in_fault = [
        ms
        for m, ms in first.items()
        if m in pubs and any(w.start_ms <= pubs[m].due_ms <= w.end_ms for w in windows)
    ]
    v.fault_lateness_p50_ms = quantile(in_fault, 0.5)
    v.fault_lateness_p99_ms = quantile(in_fault, 0.99)
    v.fault_lateness_max_ms = max(in_fault) if in_fault else None
    return v
