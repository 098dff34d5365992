"""The worker command's logging set-up and the one-line cause of a failed connection.

Connection failures are built from the clients' real exception classes, nested the way
pika and aiormq nest them; the subprocess runs against a broker live in
tests/integration/test_cli.py.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator

import aiormq.exceptions
import pika.exceptions
import pytest
from pika.adapters.utils.connection_workflow import (
    AMQPConnectionWorkflowFailed,
    AMQPConnectorSocketConnectError,
)

from rabbit_delay import BrokerUnavailable
from rabbit_delay._cli.options import CLIENT_LOGGERS, LogLevel, configure_logging
from rabbit_delay._cli.unreachable import Cause, cause_of, describe_unavailable
from rabbit_delay._urls import redact

URL = "amqp://app:s3cret@rabbit.example:5999/orders"


def unavailable(client_error: BaseException, url: str = URL) -> BrokerUnavailable:
    """What the connect helpers raise: the client's error as hidden context."""
    try:
        raise client_error
    except BaseException as exc:
        try:
            raise BrokerUnavailable(f"cannot connect to {redact(url)}: {exc!r}") from None
        except BrokerUnavailable as wrapped:
            return wrapped
    raise AssertionError("unreachable")


def _pika_refused() -> BaseException:
    connector = AMQPConnectorSocketConnectError(ConnectionRefusedError(111, "refused"))
    return pika.exceptions.AMQPConnectionError(AMQPConnectionWorkflowFailed([connector]))


CASES = {
    "pika-login": (pika.exceptions.ProbableAuthenticationError("403 ACCESS_REFUSED"), Cause.LOGIN),
    "aiormq-login": (aiormq.exceptions.ProbableAuthenticationError("ACCESS_REFUSED"), Cause.LOGIN),
    "pika-vhost": (pika.exceptions.ProbableAccessDeniedError("530 NOT_ALLOWED"), Cause.VHOST),
    "pika-refused": (_pika_refused(), Cause.REFUSED),
    "aiormq-refused": (aiormq.exceptions.AMQPConnectionError(111, "Connect failed"), Cause.REFUSED),
    "pika-dns": (socket.gaierror(-2, "Name or service not known"), Cause.DNS),
    "timeout": (TimeoutError("timed out"), Cause.TIMEOUT),
}


@pytest.mark.parametrize(("client_error", "cause"), CASES.values(), ids=CASES.keys())
def test_each_cause_is_recognised_and_named(client_error: BaseException, cause: Cause) -> None:
    exc = unavailable(client_error)
    assert cause_of(exc) is cause
    line = describe_unavailable(exc)
    assert line.startswith("cannot connect to amqp://app:***@rabbit.example:5999/orders: ")
    assert "\n" not in line
    assert "s3cret" not in line
    assert type(client_error).__name__ not in line  # words, not the client's class names


def test_each_cause_says_what_to_fix() -> None:
    def line(error: BaseException) -> str:
        return describe_unavailable(unavailable(error))

    assert "refused the login of user 'app'" in line(CASES["pika-login"][0])
    assert "virtual host 'orders'" in line(CASES["pika-vhost"][0])
    assert "nothing is listening on rabbit.example:5999" in line(CASES["aiormq-refused"][0])
    assert "cannot resolve the host name 'rabbit.example'" in line(CASES["pika-dns"][0])
    default_port = unavailable(CASES["pika-refused"][0], "amqps://app:s3cret@rabbit.example/")
    assert "rabbit.example:5671" in describe_unavailable(default_port)


def test_an_unknown_cause_keeps_the_original_text() -> None:
    exc = unavailable(ValueError("odd"))
    assert cause_of(exc) is None
    assert describe_unavailable(exc) == str(exc)
    other = BrokerUnavailable("the broker went away")
    assert describe_unavailable(other) == "the broker went away"


@pytest.fixture
def restore_logging() -> Iterator[None]:
    names = ["rabbit_delay", *CLIENT_LOGGERS]
    levels = {name: logging.getLogger(name).level for name in names}
    root = logging.getLogger()
    handlers, root_level = list(root.handlers), root.level
    yield
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)
    root.handlers[:] = handlers
    root.setLevel(root_level)


@pytest.mark.usefixtures("restore_logging")
@pytest.mark.parametrize("level", list(LogLevel))
def test_client_loggers_speak_only_at_debug(level: LogLevel) -> None:
    configure_logging(level)
    assert logging.getLogger("rabbit_delay").level == logging.getLevelName(level.upper())
    for name in CLIENT_LOGGERS:
        client = logging.getLogger(name)
        assert client.isEnabledFor(logging.ERROR) is (level is LogLevel.DEBUG), name
        assert client.isEnabledFor(logging.INFO) is (level is LogLevel.DEBUG), name


def _record(level: int) -> logging.LogRecord:
    return logging.LogRecord("rabbit_delay.worker", level, __file__, 1, "m", None, None)
