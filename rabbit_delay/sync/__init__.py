"""The synchronous (pika) transport."""

from rabbit_delay.sync._connection import broker_info, connect, connected
from rabbit_delay.sync.declarer import declare, plan
from rabbit_delay.sync.delete import delete_topology
from rabbit_delay.sync.publisher import Publisher
from rabbit_delay.sync.worker import Worker

__all__ = [
    "Publisher",
    "Worker",
    "broker_info",
    "connect",
    "connected",
    "declare",
    "delete_topology",
    "plan",
]
