"""aio-pika connections: open with a redacted error."""

from __future__ import annotations

import aio_pika
import aiormq
from aio_pika.abc import AbstractRobustConnection

from rabbit_delay.errors import BrokerUnavailable
from rabbit_delay.urls import broker_url, redact


async def connect(url: str | None = None, *, name: str = "rabbit-delay") -> AbstractRobustConnection:
    """Open a robust connection (reconnects by itself). Raises BrokerUnavailable."""
    url = broker_url(url)
    try:
        return await aio_pika.connect_robust(url, client_properties={"connection_name": name})
    except (aiormq.exceptions.AMQPError, OSError, ValueError) as exc:
        raise BrokerUnavailable(f"cannot connect to {redact(url)}: {redact(repr(exc))}") from None
