"""The synchronous transport (pika): publisher, worker, schedule, connection, declarer.

    from rabbit_delay.sync import Publisher, Schedule, Worker, connected, declare

`Publisher` and `Worker` are also exported by `rabbit_delay` itself. `delete_topology`
removes a drained topology version (what `rabbit-delay delete` does).
"""

from rabbit_delay._ops.delete.execute import delete_topology
from rabbit_delay._schedule_api.sync import Schedule
from rabbit_delay._sync.connection import broker_info, connect, connected
from rabbit_delay._sync.declarer import declare, plan
from rabbit_delay._sync.publisher import Publisher
from rabbit_delay._sync.worker import Worker

__all__ = [
    "Publisher",
    "Schedule",
    "Worker",
    "broker_info",
    "connect",
    "connected",
    "declare",
    "delete_topology",
    "plan",
]
