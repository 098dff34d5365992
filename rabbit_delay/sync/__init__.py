"""The synchronous (pika) transport."""

from rabbit_delay.sync._connection import connect, connected
from rabbit_delay.sync.declarer import declare, plan
from rabbit_delay.sync.publisher import Publisher

__all__ = ["Publisher", "connect", "connected", "declare", "plan"]
