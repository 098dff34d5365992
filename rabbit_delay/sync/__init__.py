"""The synchronous transport (pika): publisher, worker, connection and declarer.

    from rabbit_delay.sync import Publisher, Worker, connect, declare

`Publisher` and `Worker` are also exported by `rabbit_delay` itself.
"""

from rabbit_delay.sync._connection import broker_info, connect, connected
from rabbit_delay.sync._declarer import declare, plan
from rabbit_delay.sync._publisher import Publisher
from rabbit_delay.sync._worker import Worker

__all__ = ["Publisher", "Worker", "broker_info", "connect", "connected", "declare", "plan"]
