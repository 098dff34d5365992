"""The operations on a running topology: status, parked, replay, transfer, delete and the
dashboard, one folder each.

Each folder holds its `rules.py` (pure: what the operation shows and decides) and its
`execute.py` (pika: reads the broker and carries the decision out). What they share:
`queues.py` (pika: count, peek, hold all, requeue in order) and `stored.py` (pure: a
message read back). Queue counts are `rabbit_delay._broker.QueueCounts`; the management
HTTP API is `rabbit_delay._io.management`. The CLI (`rabbit_delay._cli`) only renders.
"""
