"""A network partition under the delay path (issue 23): the short run of CI.

A 3-node cluster of the broker-under-test's version, each node in a network namespace of
its own (tests/partitions/cluster.py: the machine's rabbitmq-server for 3.10, with
cluster_partition_handling = pause_minority; the Debian root for 4.3). The workload
(tests/partitions/workload.py: sync and async publishers and workers, each given every
node, a sharded 2 s tier, a 5 s tier, the cascade, retries through the tier, parking,
the guard on a shared SQLite file) runs while the node leading the 2 s tier's first
buffer is cut from the other two for 25 s; then the partition heals, the cluster is one
again, and the checker (tests/partitions/checker.py) finds: lost 0, unexpected 0, no
effect twice, none early, none misparked, nothing left in a buffer, the business queue
or the catch-all. Duplicates and lateness are printed (`pytest -s`).

Needs root (namespaces, nftables; .ci/services.sh installs nftables): skips without it.
benchmarks/bench_partitions.py runs every fault kind, longer; docs/reliability.md has
its table.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from partitions.cluster import HarnessError, PartitionCluster, leftovers, unavailable_reason
from partitions.run import run_partitions

from ._scratch_node import _skip_or_fail, installed_version, scratch_kind

pytestmark = [
    pytest.mark.integration,
    pytest.mark.cluster,
    pytest.mark.partition,
    # a group of its own: its cluster boots beside test_cluster's, on another CI worker
    pytest.mark.xdist_group("partition"),
]

NETS = {"host": 1, "4.0": 2, "4.3": 3}  # 10.23.N.0/24: one per version, never the bench's


@pytest.fixture
def cluster(broker_url: str) -> Iterator[PartitionCluster]:
    kind = scratch_kind(broker_url)
    reason = unavailable_reason()
    if reason is not None:
        if os.geteuid() != 0:
            pytest.skip(f"partitions: {reason}")
        _skip_or_fail(f"partitions: {reason}")
    conf = []
    if (installed_version(kind) or ()) >= (4, 3):
        # held for a consumer on a node cut off, then delivered again (default 60 s)
        conf.append("consumer_disconnected_timeout = 5000")
    cluster = PartitionCluster(kind, net=NETS[kind], conf=conf)
    try:
        try:
            cluster.start()
        except HarnessError as exc:
            _skip_or_fail(f"cannot start a partitionable cluster of {kind}: {exc}")
        yield cluster
    finally:
        cluster.cleanup()
        assert not [
            x for x in leftovers() if f"-{cluster.net}-" in x or x.endswith(f"br{cluster.net}")
        ]


@pytest.mark.timeout(600)
def test_the_leader_of_the_business_queue_cut_off_loses_nothing(
    cluster: PartitionCluster, tmp_path: Path
) -> None:
    outcome = run_partitions(
        cluster,
        "isolate-queue-leader",
        tmp_path,
        duration_s=15,
        fault_s=20,
        rate=30,
        settle_timeout_s=25,
    )
    print(outcome.summary())
    v = outcome.verdict
    assert outcome.settled, (outcome.summary(), v.problems())
    assert v.ok, (v.problems(), outcome.other_errors)
    assert v.lost == 0
    assert v.confirmed > 0
    assert v.handled > 0
    assert v.parked > 0
    assert not outcome.other_errors
    if cluster.major >= 4:
        # the 3.10 stall (dead letters never confirmed by a target whose leader was cut
        # off: docs/reliability.md) is gone from 4.x: nothing waited for a new buffer leader
        assert outcome.unstalled == 0
