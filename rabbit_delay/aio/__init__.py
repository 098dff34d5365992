"""The asynchronous (aio-pika) transport."""

from rabbit_delay.aio._connection import connect
from rabbit_delay.aio.declarer import declare, plan
from rabbit_delay.aio.publisher import AsyncPublisher
from rabbit_delay.aio.worker import AsyncWorker

__all__ = ["AsyncPublisher", "AsyncWorker", "connect", "declare", "plan"]
