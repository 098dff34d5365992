"""The asynchronous transport (aio-pika): publisher, worker, schedule, connection, declarer.

    from rabbit_delay.aio import AsyncPublisher, AsyncSchedule, AsyncWorker, connect, declare

`AsyncPublisher` and `AsyncWorker` are also exported by `rabbit_delay` itself.
"""

from rabbit_delay._aio.connection import broker_info, connect
from rabbit_delay._aio.declarer import declare, plan
from rabbit_delay._aio.publisher import AsyncPublisher
from rabbit_delay._aio.worker import AsyncWorker
from rabbit_delay._schedule_api.aio import AsyncSchedule

__all__ = [
    "AsyncPublisher",
    "AsyncSchedule",
    "AsyncWorker",
    "broker_info",
    "connect",
    "declare",
    "plan",
]
