"""The asynchronous (aio-pika) transport."""

from rabbit_delay.aio._connection import connect
from rabbit_delay.aio.declarer import declare, plan
from rabbit_delay.aio.publisher import AsyncPublisher

__all__ = ["AsyncPublisher", "connect", "declare", "plan"]
