"""The two exception maps (_sync/errors.py for pika, _aio/errors.py for aiormq and
aio-pika), fed the clients' real exception classes built the way the clients build
them: each becomes the right class of the error tree, with the permission and the ids
it should name, and nothing of the client escapes `mapped`."""

from __future__ import annotations

import ssl
from collections.abc import Callable

import aiormq.exceptions as aio_e
import pika.exceptions as pika_e
import pytest
from aiormq.abc import DeliveredMessage
from pamqp.commands import Basic
from pamqp.header import ContentHeader
from pika.adapters.utils.connection_workflow import (
    AMQPConnectionWorkflowFailed,
    AMQPConnectorSocketConnectError,
)

from rabbit_delay import (
    AccessRefused,
    BrokerBlocked,
    BrokerError,
    BrokerUnavailable,
    ConnectionLost,
    MissingObjectError,
    NackError,
    RabbitDelayError,
    UnconfirmedError,
    UnroutableError,
)
from rabbit_delay._aio import errors as aio_map
from rabbit_delay._sync import errors as pika_map

REFUSED_WRITE = "ACCESS_REFUSED - write access to queue 'ns.q' in vhost '/' refused for user 'app'"
REFUSED_CONFIGURE = (
    "ACCESS_REFUSED - configure access to exchange 'ns.x' in vhost '/' refused for user 'app'"
)
NOT_FOUND = "NOT_FOUND - no queue 'ns.q' in vhost '/'"
INEQUIVALENT = "PRECONDITION_FAILED - inequivalent arg 'x-message-ttl' for queue 'ns.q'"
FORCED = "CONNECTION_FORCED - broker forced connection closure with reason 'shutdown'"
VHOST_REFUSED = "NOT_ALLOWED - access to vhost 'shop' refused for user 'app'"


def _pika_refused() -> BaseException:
    connector = AMQPConnectorSocketConnectError(ConnectionRefusedError(111, "refused"))
    return pika_e.AMQPConnectionError(AMQPConnectionWorkflowFailed([connector]))


def _returned() -> BaseException:
    frame = Basic.Return(reply_code=312, reply_text="NO_ROUTE", exchange="x", routing_key="k")
    message = DeliveredMessage(delivery=frame, header=ContentHeader(), body=b"", channel=None)
    return aio_e.PublishError(message, frame)


PIKA_CASES: dict[str, tuple[BaseException, type[RabbitDelayError]]] = {
    "channel-403": (pika_e.ChannelClosedByBroker(403, REFUSED_WRITE), AccessRefused),
    "channel-404": (pika_e.ChannelClosedByBroker(404, NOT_FOUND), MissingObjectError),
    "channel-406": (pika_e.ChannelClosedByBroker(406, INEQUIVALENT), BrokerError),
    "connection-320": (pika_e.ConnectionClosedByBroker(320, FORCED), ConnectionLost),
    "connection-530": (pika_e.ConnectionClosedByBroker(530, VHOST_REFUSED), AccessRefused),
    "stream-lost": (
        pika_e.StreamLostError("Stream connection lost: ConnectionResetError(104, 'reset')"),
        ConnectionLost,
    ),
    "connect-refused": (_pika_refused(), BrokerUnavailable),
    "blocked-timeout": (pika_e.ConnectionBlockedTimeout(), BrokerBlocked),
    "login": (pika_e.ProbableAuthenticationError("403 ACCESS_REFUSED"), BrokerUnavailable),
    "vhost": (pika_e.ProbableAccessDeniedError("530 NOT_ALLOWED"), BrokerUnavailable),
    "heartbeat": (pika_e.AMQPHeartbeatTimeout("no heartbeat"), ConnectionLost),
    "connection-wrong-state": (pika_e.ConnectionWrongStateError("closed"), ConnectionLost),
    "channel-wrong-state": (pika_e.ChannelWrongStateError("Channel is closed."), ConnectionLost),
    "channel-closed-by-client": (pika_e.ChannelClosedByClient(200, "Normal"), ConnectionLost),
    "connection-closed-by-client": (pika_e.ConnectionClosedByClient(200, "Normal"), ConnectionLost),
    "reset": (ConnectionResetError(104, "Connection reset by peer"), ConnectionLost),
    "broken-pipe": (BrokenPipeError(32, "Broken pipe"), ConnectionLost),
    "socket-timeout": (TimeoutError("timed out"), ConnectionLost),
    "eof": (EOFError(), ConnectionLost),
    "tls": (ssl.SSLCertVerificationError(1, "certificate verify failed"), BrokerUnavailable),
    "nack": (pika_e.NackError([]), NackError),
    "unroutable": (pika_e.UnroutableError([]), UnroutableError),
    "consumer-cancelled": (pika_e.ConsumerCancelled("cancelled"), BrokerError),
}

AIO_CASES: dict[str, tuple[BaseException, type[RabbitDelayError]]] = {
    "channel-403": (aio_e.ChannelAccessRefused(REFUSED_CONFIGURE), AccessRefused),
    "channel-404": (aio_e.ChannelNotFoundEntity(NOT_FOUND), MissingObjectError),
    "channel-406": (aio_e.ChannelPreconditionFailed(INEQUIVALENT), BrokerError),
    "channel-405": (aio_e.ChannelLockedResource("RESOURCE_LOCKED - exclusive"), BrokerError),
    "channel-unmapped-code": (aio_e.ChannelClosed(506, "RESOURCE_ERROR"), BrokerError),
    "channel-closed-by-client": (aio_e.ChannelClosed(None, None), ConnectionLost),
    "connection-320": (aio_e.ConnectionClosed(320, FORCED), ConnectionLost),
    "connection-normal": (aio_e.ConnectionClosed(0, "normal closed"), ConnectionLost),
    "connection-530": (aio_e.ConnectionNotAllowed(VHOST_REFUSED), AccessRefused),
    "connection-403": (aio_e.ConnectionClosed(403, "ACCESS_REFUSED - Login"), AccessRefused),
    "connection-541": (aio_e.ConnectionInternalError("INTERNAL_ERROR"), ConnectionLost),
    "connect-refused": (
        aio_e.AMQPConnectionError(111, "Connect call failed ('127.0.0.1', 1)"),
        ConnectionLost,
    ),
    "invalid-state": (aio_e.ChannelInvalidStateError("<Channel: 1> closed"), ConnectionLost),
    "timeout": (TimeoutError(), ConnectionLost),
    "login": (aio_e.ProbableAuthenticationError("ACCESS_REFUSED"), BrokerUnavailable),
    "vhost": (
        aio_e.InvalidFrameError("Expected one of ['Connection.OpenOk'], got <Connection.Close>"),
        BrokerUnavailable,
    ),
    "reset": (ConnectionResetError(104, "Connection reset by peer"), ConnectionLost),
    "eof": (EOFError(), ConnectionLost),
    "tls": (ssl.SSLCertVerificationError(1, "certificate verify failed"), BrokerUnavailable),
    "nack": (aio_e.DeliveryError(None, Basic.Nack(delivery_tag=1)), NackError),
    "returned": (_returned(), UnroutableError),
    "duplicate-consumer": (aio_e.DuplicateConsumerTag("ctag"), BrokerError),
}


def _exact(error: RabbitDelayError, expected: type[RabbitDelayError]) -> None:
    """`error` is `expected` itself, not only a subclass or a base of it (a 406 is no
    lost connection; a lost connection no mere BrokerError)."""
    assert type(error) is expected, f"{type(error).__name__}: {error}"


@pytest.mark.parametrize(("exc", "expected"), PIKA_CASES.values(), ids=PIKA_CASES.keys())
def test_pika_exceptions_become_the_error_tree(
    exc: BaseException, expected: type[RabbitDelayError]
) -> None:
    assert isinstance(exc, pika_map.CLIENT_ERRORS)
    error = pika_map.translate(exc, doing="declaring queue 'ns.q'", permission="configure")
    _exact(error, expected)
    assert "declaring queue 'ns.q'" in str(error)


@pytest.mark.parametrize(("exc", "expected"), AIO_CASES.values(), ids=AIO_CASES.keys())
def test_aiormq_exceptions_become_the_error_tree(
    exc: BaseException, expected: type[RabbitDelayError]
) -> None:
    assert isinstance(exc, aio_map.CLIENT_ERRORS)
    error = aio_map.translate(exc, doing="declaring queue 'ns.q'", permission="configure")
    _exact(error, expected)
    assert "declaring queue 'ns.q'" in str(error)


def test_an_access_refusal_names_the_permission_the_broker_checked() -> None:
    # the broker's own words win over the caller's guess (a bind: write on the queue)
    error = pika_map.translate(
        pika_e.ChannelClosedByBroker(403, REFUSED_WRITE), doing="binding", permission="read"
    )
    assert isinstance(error, AccessRefused)
    assert (error.permission, error.resource) == ("write", "queue 'ns.q'")
    assert "needs 'write' permission on queue 'ns.q'" in str(error)
    aio_error = aio_map.translate(
        aio_e.ChannelAccessRefused(REFUSED_CONFIGURE), doing="declaring", permission="write"
    )
    assert isinstance(aio_error, AccessRefused)
    assert (aio_error.permission, aio_error.resource) == ("configure", "exchange 'ns.x'")
    # a reply that names no permission: the caller's
    bare = aio_map.translate(
        aio_e.ChannelAccessRefused("ACCESS_REFUSED"), doing="consuming", permission="read"
    )
    assert isinstance(bare, AccessRefused)
    assert bare.permission == "read"


def test_the_reply_code_and_text_are_kept() -> None:
    assert "406 PRECONDITION_FAILED" in str(
        aio_map.translate(aio_e.ChannelPreconditionFailed(INEQUIVALENT), doing="x")
    )
    assert "320 CONNECTION_FORCED" in str(
        pika_map.translate(pika_e.ConnectionClosedByBroker(320, FORCED), doing="x")
    )
    assert aio_map.reply_of(aio_e.ChannelClosed(None, None), aio_map.CHANNEL_CODES) == (None, "")
    assert aio_map.reply_of(aio_e.ChannelNotFoundEntity(NOT_FOUND), aio_map.CHANNEL_CODES) == (
        404,
        NOT_FOUND,
    )


@pytest.mark.parametrize(
    ("translate", "lost", "blocked"),
    [
        (pika_map.translate, pika_e.StreamLostError("lost"), pika_e.ConnectionBlockedTimeout()),
        (aio_map.translate, aio_e.ConnectionClosed(320, FORCED), None),
    ],
    ids=["pika", "aiormq"],
)
def test_with_message_ids_a_loss_names_the_unconfirmed(
    translate: Callable[..., RabbitDelayError], lost: BaseException, blocked: BaseException | None
) -> None:
    error = translate(lost, doing="publishing", permission="write", message_ids=["m1", "m2"])
    assert type(error) is UnconfirmedError
    assert error.message_ids == ("m1", "m2")
    if blocked is not None:
        b = translate(blocked, doing="publishing", message_ids=["m3"])
        assert type(b) is BrokerBlocked
        assert b.message_ids == ("m3",)


def test_pika_mapped_translates_and_lets_everything_else_through() -> None:
    with pytest.raises(ConnectionLost) as caught, pika_map.mapped("consuming"):
        raise pika_e.StreamLostError("lost")
    assert caught.value.__suppress_context__  # no client traceback under ours
    with pytest.raises(MissingObjectError), pika_map.mapped("x"):
        raise MissingObjectError("ours, unchanged")
    with pytest.raises(KeyError), pika_map.mapped("x"):
        raise KeyError("a bug is not a broker error")


def test_aio_mapped_translates_a_closed_connection_runtime_error_only() -> None:
    with pytest.raises(ConnectionLost), aio_map.mapped("consuming"):
        raise RuntimeError("<Connection: amqp://app:******@h> closed")
    with pytest.raises(ConnectionLost), aio_map.mapped("consuming"):
        raise aio_e.ChannelInvalidStateError("writer is None")
    with pytest.raises(RuntimeError, match="unrelated"), aio_map.mapped("x"):
        raise RuntimeError("unrelated")


def test_no_password_in_a_translated_error() -> None:
    exc = pika_e.StreamLostError("lost amqp://app:s3cret@h:5672/")
    assert "s3cret" not in str(pika_map.translate(exc, doing="x"))
    aexc = aio_e.AMQPConnectionError("lost amqp://app:s3cret@h:5672/")
    assert "s3cret" not in str(aio_map.translate(aexc, doing="x"))
