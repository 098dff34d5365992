"""The Metrics class: each call moves the sample it should, in its own registry."""

from __future__ import annotations

import subprocess
import sys
import urllib.request

import pytest
from prometheus_client import REGISTRY, CollectorRegistry

from rabbit_delay import (
    BrokerUnavailable,
    DelayError,
    MissingObjectError,
    NackError,
    UnroutableError,
)
from rabbit_delay import _headers as h
from rabbit_delay._consumer.outcome import OUTCOMES, Outcome
from rabbit_delay._observe.metrics import (
    NO_TIER,
    OTHER_TIER,
    PublishErrorReason,
    deviation_s,
    error_reason,
    late_s,
    tier_label,
)
from rabbit_delay.metrics import Metrics, default_metrics, start_metrics_server


@pytest.fixture
def metrics() -> Metrics:
    return Metrics(CollectorRegistry())


def sample(m: Metrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, labels)


def test_published_counts_per_queue_and_tier(metrics: Metrics) -> None:
    assert sample(metrics, "rabbit_delay_published_total", queue="orders", tier="5m") is None
    metrics.published("orders", "5m")
    metrics.published("orders", "5m", count=3)
    metrics.published("orders", "cascade")
    assert sample(metrics, "rabbit_delay_published_total", queue="orders", tier="5m") == 4
    assert sample(metrics, "rabbit_delay_published_total", queue="orders", tier="cascade") == 1


@pytest.mark.parametrize(
    ("exc", "reason"),
    [
        (UnroutableError("x"), PublishErrorReason.UNROUTABLE),
        (NackError("x"), PublishErrorReason.NACK),
        (MissingObjectError("x"), PublishErrorReason.MISSING_OBJECT),
        (DelayError("x"), PublishErrorReason.INVALID),
        (BrokerUnavailable("x"), PublishErrorReason.BROKER),
        (RuntimeError("x"), PublishErrorReason.OTHER),
    ],
)
def test_publish_error_reason_from_exception(
    metrics: Metrics, exc: Exception, reason: PublishErrorReason
) -> None:
    assert error_reason(exc) is reason
    metrics.publish_error("orders", exc)
    metrics.publish_error("orders", reason)
    got = sample(metrics, "rabbit_delay_publish_errors_total", queue="orders", reason=reason.value)
    assert got == 2


def test_handled_by_outcome(metrics: Metrics) -> None:
    from rabbit_delay._observe.report import WorkerMetrics

    worker = WorkerMetrics(metrics, ["push"])
    for outcome in Outcome:
        worker.handled("push", outcome)
    worker.handled("push", Outcome.RETRIED)
    for outcome in Outcome:
        # label values are a closed set: the outcomes that end a delivery's handling
        expected = (2 if outcome is Outcome.RETRIED else 1) if outcome in OUTCOMES else None
        got = sample(metrics, "rabbit_delay_handled_total", queue="push", outcome=outcome.value)
        assert got == expected, outcome


def test_lateness(metrics: Metrics) -> None:
    from rabbit_delay._observe.report import WorkerMetrics

    worker = WorkerMetrics(metrics, ["push"], tiers=["1s"])
    worker.delivered("push", {h.H_TIER: "1s"}, 5_000)  # no rd-due-at: nothing recorded
    name = "rabbit_delay_delivery_lateness_seconds"
    assert sample(metrics, f"{name}_count", queue="push", tier="1s") is None
    worker.delivered("push", {h.H_DUE_AT: 1_000, h.H_TIER: "1s"}, 1_300)  # 0.3 s late
    worker.delivered("push", {h.H_DUE_AT: 2_000, h.H_TIER: "1s"}, 1_000)  # early: 0
    worker.delivered("push", {h.H_DUE_AT: 1_000, h.H_TIER: "cascade"}, 3_000)
    assert sample(metrics, f"{name}_count", queue="push", tier="1s") == 2
    assert sample(metrics, f"{name}_sum", queue="push", tier="1s") == pytest.approx(0.3)
    assert sample(metrics, f"{name}_bucket", queue="push", tier="1s", le="0.05") == 1
    assert sample(metrics, f"{name}_bucket", queue="push", tier="1s", le="0.5") == 2
    assert sample(metrics, f"{name}_sum", queue="push", tier="cascade") == pytest.approx(2.0)
    assert late_s(2_000, 1_000) == 0.0  # the one rule (clock skew is no negative lateness)


def test_schedule_deviation(metrics: Metrics) -> None:
    from rabbit_delay._observe.report import WorkerMetrics

    worker = WorkerMetrics(metrics, ["push"], tiers=["5s"])
    name = "rabbit_delay_schedule_deviation_seconds"
    worker.delivered("push", {h.H_DUE_AT: 62_000, h.H_TIER: "cascade"}, 62_000)  # no asked
    assert not sample(metrics, f"{name}_count", queue="push", tier="cascade")
    cascade = {h.H_DUE_AT: 62_000, h.H_ASKED_DUE_AT: 61_500, h.H_TIER: "cascade"}
    worker.delivered("push", cascade, 62_000)  # rounded up by 0.5 s
    worker.delivered("push", {h.H_DUE_AT: 5_000, h.H_ASKED_DUE_AT: 5_000, h.H_TIER: "5s"}, 5_000)
    assert sample(metrics, f"{name}_sum", queue="push", tier="cascade") == pytest.approx(0.5)
    assert sample(metrics, f"{name}_bucket", queue="push", tier="cascade", le="0.1") == 0
    assert sample(metrics, f"{name}_bucket", queue="push", tier="cascade", le="0.5") == 1
    assert sample(metrics, f"{name}_bucket", queue="push", tier="5s", le="0.001") == 1
    assert deviation_s(5_000, 6_000) == 0.0  # never negative


def test_tier_label_is_a_closed_set() -> None:
    known = {"1s", "cascade", "now"}
    assert tier_label("1s", known) == "1s"
    assert tier_label(b"cascade", known) == "cascade"
    assert tier_label("7s", known) == OTHER_TIER
    assert tier_label(7, known) == OTHER_TIER
    assert tier_label(None, known) == NO_TIER


def test_reconciled(metrics: Metrics) -> None:
    metrics.reconciled("overdue", True, 3)
    metrics.reconciled("overdue", False, 0)
    metrics.reconciled("overdue", True, 0)
    get = metrics.registry.get_sample_value  # the label `name` would clash with sample()
    runs = "rabbit_delay_reconcile_runs_total"
    assert get(runs, {"name": "overdue", "result": "ok"}) == 2
    assert get(runs, {"name": "overdue", "result": "failed"}) == 1
    assert get("rabbit_delay_reconcile_resubmitted_total", {"name": "overdue"}) == 3


def test_worker_metrics_time_each_delivery_by_queue_and_tier(metrics: Metrics) -> None:
    from rabbit_delay._observe.report import WorkerMetrics

    worker = WorkerMetrics(metrics, ["push"], tiers=["1s", "3s"])
    late = "rabbit_delay_delivery_lateness_seconds"
    deviation = "rabbit_delay_schedule_deviation_seconds"
    due = {h.H_DUE_AT: 10_000, h.H_ASKED_DUE_AT: 10_000}
    worker.delivered("push", {**due, h.H_TIER: "1s"}, 10_200)
    worker.delivered("push", {**due, h.H_TIER: "cascade", h.H_ASKED_DUE_AT: 9_400}, 10_000)
    worker.delivered("push", {**due, h.H_TIER: b"3s"}, 10_000)  # aiormq may give bytes
    worker.delivered("push", {**due, h.H_TIER: "9h"}, 10_000)  # not the topology's
    worker.delivered("push", {h.H_DUE_AT: 10_000}, 11_000)  # no rd-tier nor rd-asked-due-at
    worker.delivered("push", {h.H_TIER: "1s"}, 10_000)  # no rd-due-at: not a delayed message
    worker.delivered("push", None, 10_000)

    class Long(int):  # what pika decodes a 64-bit header integer into
        pass

    worker.delivered("push", {h.H_DUE_AT: Long(10_000), h.H_TIER: "3s"}, 10_500)
    assert sample(metrics, f"{late}_sum", queue="push", tier="1s") == pytest.approx(0.2)
    assert sample(metrics, f"{late}_count", queue="push", tier="1s") == 1
    assert sample(metrics, f"{late}_count", queue="push", tier="3s") == 2
    assert sample(metrics, f"{late}_sum", queue="push", tier="3s") == pytest.approx(0.5)
    assert sample(metrics, f"{late}_count", queue="push", tier="other") == 1
    assert sample(metrics, f"{late}_sum", queue="push", tier="none") == pytest.approx(1.0)
    assert sample(metrics, f"{deviation}_sum", queue="push", tier="cascade") == pytest.approx(0.6)
    assert sample(metrics, f"{deviation}_sum", queue="push", tier="1s") == 0
    assert not sample(metrics, f"{deviation}_count", queue="push", tier="none")


def test_one_instance_per_registry() -> None:
    registry = CollectorRegistry()
    Metrics(registry)
    with pytest.raises(ValueError, match="Duplicated"):
        Metrics(registry)


def test_instances_are_independent() -> None:
    a, b = Metrics(), Metrics()
    a.published("q", "1s")
    assert sample(a, "rabbit_delay_published_total", queue="q", tier="1s") == 1
    assert sample(b, "rabbit_delay_published_total", queue="q", tier="1s") is None


def test_import_registers_nothing() -> None:
    code = (
        "import rabbit_delay._observe.metrics\n"
        "from prometheus_client import REGISTRY\n"
        "print(any(m.name.startswith('rabbit_delay') for m in REGISTRY.collect()))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=True
    )
    assert done.stdout.strip() == "False"


def test_default_metrics_is_one_lazy_instance_in_the_global_registry() -> None:
    first = default_metrics()
    assert default_metrics() is first
    assert first.registry is REGISTRY


def test_metrics_server_serves_the_registry(metrics: Metrics) -> None:
    metrics.published("orders", "5m")
    server, thread = start_metrics_server(0, addr="127.0.0.1", registry=metrics.registry)
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
    assert 'rabbit_delay_published_total{queue="orders",tier="5m"} 1.0' in text
