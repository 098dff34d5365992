"""Counting for the fault tests, as RabbitMQ's Jepsen suite counts, and the figures table
of docs/reliability.md.

A `Tally` holds what one fault test saw: the ids it published, the ids the publisher
confirmed (every id of a call that its error did not name), every delivery per id, and
every handler effect per id. From those: `lost` (confirmed, never delivered: must be
empty), `duplicates` (deliveries beyond the first of an id) and, with a guarded worker,
`effects` (must be exactly 1 per delivered id).

With RABBIT_DELAY_FAULT_FIGURES=DIR set, each test writes its figures to
DIR/<name>.json; this file, run as a script, renders them into docs/reliability.md
between its `figures` markers:

    RABBIT_DELAY_FAULT_FIGURES=/tmp/figs .venv/bin/pytest tests/integration/test_faults.py
    .venv/bin/python tests/integration/_figures.py /tmp/figs [docs/reliability.md]

Imports nothing of the project: the script runs on its own.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FIGURES_ENV = "RABBIT_DELAY_FAULT_FIGURES"
BEGIN = "<!-- figures: begin (rendered by tests/integration/_figures.py) -->"
END = "<!-- figures: end -->"
DOC = Path(__file__).resolve().parents[2] / "docs" / "reliability.md"


@dataclass
class Tally:
    """What one fault test published, saw confirmed, delivered and run. Thread-safe
    where it is fed from consumers (`delivered`, `effect`)."""

    test: str
    transport: str
    published: list[str] = field(default_factory=list)
    confirmed: set[str] = field(default_factory=set)
    reported: set[str] = field(default_factory=set)  # named by an UnconfirmedError
    deliveries: Counter[str] = field(default_factory=Counter)
    effects: Counter[str] = field(default_factory=Counter)
    recovery_s: list[float] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def sent(self, ids: Iterable[str], *, unconfirmed: Iterable[str] = ()) -> None:
        """One publish call: `ids` attempted, all confirmed but `unconfirmed` (the ids
        its error named)."""
        ids = list(ids)
        named = set(unconfirmed)
        unknown = named - set(ids)
        assert not unknown, f"the error names ids that were not in the call: {sorted(unknown)[:5]}"
        self.published.extend(ids)
        self.confirmed.update(i for i in ids if i not in named)
        self.reported |= named

    def delivered(self, message_id: str) -> None:
        with self._lock:
            self.deliveries[message_id] += 1

    def effect(self, message_id: str) -> None:
        with self._lock:
            self.effects[message_id] += 1

    @property
    def lost(self) -> list[str]:
        """Confirmed, never delivered (Jepsen's "lost")."""
        with self._lock:
            return sorted(i for i in self.confirmed if self.deliveries[i] == 0)

    @property
    def duplicates(self) -> int:
        with self._lock:
            return sum(n - 1 for n in self.deliveries.values() if n > 1)

    @property
    def unique_delivered(self) -> int:
        with self._lock:
            return sum(1 for n in self.deliveries.values() if n > 0)

    def missing(self, ids: Iterable[str]) -> list[str]:
        """Of `ids`, those never delivered."""
        with self._lock:
            return [i for i in ids if self.deliveries[i] == 0]

    def unhandled(self, ids: Iterable[str]) -> list[str]:
        """Of `ids`, those whose handler never ran."""
        with self._lock:
            return [i for i in ids if self.effects[i] == 0]

    def figures(self, broker: str) -> dict[str, Any]:
        recovery = sorted(self.recovery_s)
        return {
            "test": self.test,
            "transport": self.transport,
            "broker": broker,
            "date": dt.date.today().isoformat(),
            "published": len(set(self.published)),
            "confirmed": len(self.confirmed),
            "reported_unconfirmed": len(self.reported),
            "delivered": self.unique_delivered,
            "lost": len(self.lost),
            "duplicates": self.duplicates,
            "effects_max": max(self.effects.values(), default=0),
            "recovery_s": [round(r, 3) for r in recovery],
            **self.extra,
        }


def record(tally: Tally, broker: str) -> dict[str, Any]:
    """The tally's figures; also written to $RABBIT_DELAY_FAULT_FIGURES/<test, transport,
    broker>.json when that is set. Printed either way (pytest -s shows them)."""
    figures = tally.figures(broker)
    print(f"\n[fault figures] {json.dumps(figures)}")
    directory = os.environ.get(FIGURES_ENV)
    if directory:
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        slug = re.sub(r"[^A-Za-z0-9.]+", "-", f"{tally.test}-{tally.transport}-{broker}")
        (path / f"{slug.strip('-')}.json").write_text(
            json.dumps(figures, indent=1) + "\n", encoding="utf-8"
        )
    return figures


def wait_until(predicate: Any, timeout: float, what: str) -> None:
    """Poll (every 20 ms) until `predicate()`; AssertionError naming `what` at the deadline."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


# -- rendering docs/reliability.md ------------------------------------------------------------


def _seconds(values: list[float]) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.2f} s"
    return f"median {statistics.median(values):.2f} s, max {max(values):.2f} s ({len(values)})"


def render(rows: Iterable[Mapping[str, Any]]) -> str:
    lines = [
        "| test | transport | broker | date | published | confirmed | named unconfirmed "
        "| delivered | lost | duplicates | recovery |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in sorted(rows, key=lambda r: (str(r["broker"]), str(r["test"]), str(r["transport"]))):
        recovery = _seconds(list(r.get("recovery_s", [])))
        if "worker_recovery_s" in r:
            recovery = f"publisher: {recovery}; worker: {_seconds(list(r['worker_recovery_s']))}"
        if "blocked_raised_after_s" in r:
            recovery = (
                f"BrokerBlocked after {r['blocked_raised_after_s']:.2f} s; "
                f"alarm cleared -> re-sent and confirmed in {recovery}"
            )
        if "outage_s" in r:
            recovery = f"node down {r['outage_s']:.1f} s, then {recovery}"
        lines.append(
            f"| {r['test']} | {r['transport']} | {r['broker']} | {r['date']} | {r['published']:,}"
            f" | {r['confirmed']:,} | {r['reported_unconfirmed']:,} | {r['delivered']:,}"
            f" | {r['lost']} | {r['duplicates']}"
            f" | {recovery} |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv or len(argv) > 2:
        print(__doc__)
        return 2
    rows = [json.loads(p.read_text(encoding="utf-8")) for p in sorted(Path(argv[0]).glob("*.json"))]
    if not rows:
        print(f"no figures in {argv[0]}: run the fault tests with {FIGURES_ENV}={argv[0]}")
        return 1
    doc = Path(argv[1]) if len(argv) > 1 else DOC
    text = doc.read_text(encoding="utf-8")
    pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.DOTALL)
    if not pattern.search(text):
        print(f"{doc} has no {BEGIN!r} ... {END!r} markers")
        return 1
    table = f"{BEGIN}\n{render(rows)}\n{END}"
    doc.write_text(pattern.sub(lambda _m: table, text), encoding="utf-8")
    print(f"{doc}: {len(rows)} row(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
