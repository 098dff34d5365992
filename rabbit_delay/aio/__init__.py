"""The asynchronous (aio-pika) transport."""

from rabbit_delay.aio._connection import broker_info, connect
from rabbit_delay.aio.declarer import declare, plan
from rabbit_delay.aio.publisher import AsyncPublisher
from rabbit_delay.aio.worker import AsyncWorker

__all__ = ["AsyncPublisher", "AsyncWorker", "broker_info", "connect", "declare", "plan"]
