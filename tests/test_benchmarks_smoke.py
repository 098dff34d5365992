"""benchmarks/bench_{publish,retry,outbox,held}.py --quick --json run and report every figure.

Only the structure is checked: ratios on a shared 2-core machine are the benchmark's
business, never a test's (STYLE: no tight timing in tests).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rabbit_delay._broker import BrokerInfo

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks" / "bench_publish.py"
CONTENDERS = {
    "raw-aio-pipelined",
    "raw-aio-single",
    "raw-pika-single",
    "async-batched",
    "async-single",
    "sync-single",
    "sync-batched",
}

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def run_quick(bench: Path, url: str) -> tuple[subprocess.CompletedProcess[str], Any]:
    """Run a benchmark's --quick --json smoke run; it must exit 0. Its output, parsed."""
    proc = subprocess.run(
        [sys.executable, str(bench), "--quick", "--json", "--url", url],
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    )
    return proc, json.loads(proc.stdout)


@pytest.mark.timeout(150)
def test_bench_publish_quick_json(broker_url: str) -> None:
    proc, result = run_quick(BENCH, broker_url)

    assert set(result["throughput"]) == CONTENDERS
    for name, figures in result["throughput"].items():
        assert figures["median_msg_s"] > 0, name
        assert len(figures["rates"]) == result["config"]["rounds"], name
    pairs = {(r["ours"], r["baseline"]) for r in result["ratios"]}
    assert pairs == {
        ("async-batched", "raw-aio-pipelined"),
        ("sync-single", "raw-pika-single"),
        ("sync-batched", "raw-pika-single"),
        ("async-single", "raw-aio-single"),
    }
    for r in result["ratios"]:
        assert r["ratio"] > 0
        assert (r["met"] is None) == (r["target"] is None)

    lateness = result["lateness"]
    assert lateness["received"] == lateness["sent"] > 0
    assert lateness["early"] == 0, "a message arrived before its rd-due-at"
    assert 0 <= lateness["p50_ms"] <= lateness["p99_ms"] <= lateness["max_ms"]
    assert "guest:guest@" not in proc.stdout + proc.stderr, "the broker password must be redacted"


RETRY_BENCH = ROOT / "benchmarks" / "bench_retry.py"


@pytest.mark.timeout(150)
def test_bench_retry_quick_json(broker_url: str, broker_info: BrokerInfo) -> None:
    proc, result = run_quick(RETRY_BENCH, broker_url)
    assert result["errors"] == []  # every message attempted max_attempts times, then parked
    native = broker_info.supports_delayed_retry
    assert set(result["results"]) == ({"tiers", "broker"} if native else {"tiers"})
    assert result["not_measured"] == ([] if native else ["broker"])
    tiers = result["results"]["tiers"]
    # Exact counts, not timings: a tier retry is a publish and an ack of the original.
    assert tiers["ops_per_retry"] == 2
    assert tiers["ops_per_message"]["publish (retry)"] == result["max_attempts"] - 1
    if native:
        broker = result["results"]["broker"]
        assert broker["ops_per_retry"] == 1  # one basic.reject, the queue does the rest
        assert broker["ops_per_message"]["reject (requeue)"] == result["max_attempts"] - 1
        assert "publish (retry)" not in broker["ops_per_message"]
    for row in result["results"].values():
        assert row["retries_per_s"] > 0
        assert len(row["samples_retries_per_s"]) == result["rounds"]
    assert "guest:guest@" not in proc.stdout + proc.stderr, "the broker password must be redacted"


OUTBOX_BENCH = ROOT / "benchmarks" / "bench_outbox.py"


@pytest.mark.timeout(150)
def test_bench_outbox_quick_json(broker_url: str) -> None:
    proc, result = run_quick(OUTBOX_BENCH, broker_url)
    assert result["errors"] == []  # every row relayed once, nothing lost or doubled
    measured = {"sqlite", "postgresql"} - set(result["not_measured"])
    assert "sqlite" in measured
    if os.environ.get("CI"):
        assert measured == {"sqlite", "postgresql"}, "CI runs PostgreSQL (.ci/services.sh)"
    assert set(result["throughput"]) == {"direct", *(f"relay-{m}" for m in measured)}
    for figures in result["throughput"].values():
        assert figures["median_rows_s"] > 0
        assert len(figures["rates"]) == result["config"]["rounds"]
    assert {r["ours"] for r in result["ratios"]} == {f"relay-{m}" for m in measured}
    for r in result["ratios"]:
        assert r["baseline"] == "direct"
        assert r["ratio"] > 0
        assert r["target"] == 0.8
    assert set(result["lag"]) == measured
    for lag in result["lag"].values():
        assert lag["relayed"] == lag["rows"] > 0
        assert 0 <= lag["p50_ms"] <= lag["p99_ms"] <= lag["max_ms"]
    assert "guest:guest@" not in proc.stdout + proc.stderr, "the broker password must be redacted"


HELD_BENCH = ROOT / "benchmarks" / "bench_held.py"


@pytest.mark.timeout(150)
def test_bench_held_quick_json(broker_url: str, broker_info: BrokerInfo) -> None:
    if not broker_info.supports_held:
        pytest.skip(f"the [held] backend needs RabbitMQ 4.3+, not {broker_info.describe()}")
    proc, result = run_quick(HELD_BENCH, broker_url)
    for name in ("held", "cascade", "tier"):
        row = result["lateness"][name]
        assert (row["received"], row["early"]) == (row["sent"], 0)
        assert result["publish"][name]["msg_s"] > 0
    for name in ("held", "tier"):
        assert result["burst"][name]["received"] == result["burst"][name]["sent"]
    assert result["holder"]["released"] >= result["lateness"]["held"]["sent"]
    assert set(result["targets"]) == {"held_p99_ms", "burst_ratio"}
    assert "guest:guest@" not in proc.stdout + proc.stderr, "the broker password must be redacted"
