"""Partitions (issue 23): a RabbitMQ cluster in network namespaces (`cluster`), a
workload through the real delay path (`workload`) and a Jepsen-style checker (`checker`).

Used by tests/integration/test_partitions.py and benchmarks/bench_partitions.py;
`python -m partitions cleanup` (from tests/) removes whatever a killed run left.
"""
