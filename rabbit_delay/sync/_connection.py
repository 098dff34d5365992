"""pika connections: open with a redacted error, translate broker replies."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pika
import pika.exceptions

from rabbit_delay.broker import BrokerInfo
from rabbit_delay.errors import BrokerUnavailable
from rabbit_delay.urls import broker_url, redact


def connect(url: str | None = None, *, name: str = "rabbit-delay") -> pika.BlockingConnection:
    """Open a blocking connection. Raises BrokerUnavailable (password redacted)."""
    url = broker_url(url)
    try:
        params = pika.URLParameters(url)
        params.client_properties = {"connection_name": name}
        return pika.BlockingConnection(params)
    except (pika.exceptions.AMQPError, OSError, ValueError) as exc:
        raise BrokerUnavailable(f"cannot connect to {redact(url)}: {redact(repr(exc))}") from None


@contextmanager
def connected(
    url: str | None = None, *, name: str = "rabbit-delay"
) -> Iterator[pika.BlockingConnection]:
    """`connect`, closed on exit unless the broker already closed it (e.g. a 503)."""
    connection = connect(url, name=name)
    try:
        yield connection
    finally:
        if connection.is_open:
            connection.close()


def broker_info(connection: pika.BlockingConnection) -> BrokerInfo:
    """What the broker said about itself when the connection opened (version, cluster)."""
    return BrokerInfo.from_server_properties(connection._impl.server_properties)
