"""The one exception tree of rabbit-delay.

    RabbitDelayError
    ├── ConfigError (ValueError)            what the user wrote is wrong
    │   ├── DurationError                   "5x", "-3s", a delay too long
    │   └── TopologyError                   a topology file or model that does not validate
    ├── PublishError                        not (provably) confirmed; `message_ids` names them
    │   ├── DelayError (ValueError)         unknown tier, delay that matches no tier, bad `at=`
    │   ├── UnknownTargetError (ValueError) queue or routing key absent from the topology
    │   ├── EncodeError (ValueError)        a message that cannot be turned into bytes
    │   ├── DuplicateMessageError (ValueError)  outbox.add: that message_id is in the outbox already
    │   ├── UnroutableError                 returned by the broker under `mandatory`
    │   ├── NackError                       the broker refused responsibility (basic.nack)
    │   └── UnconfirmedError                connection lost / broker blocked past the deadline:
    │       └── BrokerBlocked               exactly the ids with no confirm; safe to re-send
    ├── BrokerError                         the broker said no, or is not there
    │   ├── BrokerUnavailable (ConnectionError)   cannot connect to any of the URLs
    │   │   └── ConnectionLost              an open connection or channel was lost
    │   ├── AccessRefused (PermissionError) 403 / 530: the user lacks a permission
    │   ├── DeclarationConflict             406: an object exists with other arguments
    │   ├── MissingObjectError              404: a queue or exchange the code relies on is absent
    │   ├── MissingPluginError              unknown exchange type 'x-delayed-message'
    │   ├── ManagementUnavailable           the management API cannot be used (callers fall back)
    │   └── IncompatibleBroker              the broker's version cannot do what is asked
    ├── OutboxError                         the outbox's database: no table, lost, locked
    ├── StoreError                          the schedule's store failed (nothing was sent)
    └── DecodeError (ValueError)            a delivered message that cannot be decoded

Handler control flow (`Retry`, `Reject`) lives in `rabbit_delay` (`Retry`, `Reject`): those are
signals, not failures of the library.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass


class RabbitDelayError(Exception):
    """Root of every error raised by rabbit-delay."""


class ConfigError(RabbitDelayError, ValueError):
    """Something the user wrote (a file, an argument) is invalid."""


class DurationError(ConfigError):
    """A duration that cannot be parsed or is out of range."""


class TopologyError(ConfigError):
    """A topology that does not validate; the message names the file and the field."""


class PublishError(RabbitDelayError):
    """A message was not (or not provably) handed over to the broker.

    `message_ids` names the messages concerned when known (empty for bad input refused
    before anything was sent: then nothing of the call was sent).
    """

    def __init__(self, message: str, *, message_ids: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.message_ids = tuple(message_ids)


class DelayError(PublishError, ValueError):
    """The requested tier or delay cannot be served by this topology."""


class UnknownTargetError(PublishError, ValueError):
    """The target queue or routing key is not part of the topology."""


class EncodeError(PublishError, ValueError):
    """The message body cannot be encoded."""


class DuplicateMessageError(PublishError, ValueError):
    """`outbox.add` with a message_id the outbox table already holds (pending, or sent
    and not yet past the retention): nothing was written, the transaction is intact."""


class UnroutableError(PublishError):
    """The broker returned the message: no queue was bound for it.

    `replies` maps each returned message_id to the broker's reply text (e.g. NO_ROUTE).
    """

    def __init__(
        self,
        message: str,
        *,
        message_ids: Sequence[str] = (),
        replies: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message, message_ids=message_ids)
        self.replies = dict(replies or {})


class NackError(PublishError):
    """The broker nacked the publish: it did not take responsibility for it."""


class UnconfirmedError(PublishError):
    """No confirm came for `message_ids` within the publisher's deadline (the connection
    or channel was lost and could not be recovered in time, or the broker blocked
    publishing). Each may or may not have reached the broker: publish them again with
    the same message_id (consumers' guards absorb the duplicate). Every id of the call
    that is not named here was confirmed."""


class BrokerBlocked(UnconfirmedError):
    """The broker blocked publishing (a memory or disk alarm) for longer than the
    publisher's `blocked_timeout`. `reason` is what the broker said (e.g. "low on
    memory")."""

    def __init__(self, message: str, *, message_ids: Sequence[str] = (), reason: str = "") -> None:
        super().__init__(message, message_ids=message_ids)
        self.reason = reason


class BrokerError(RabbitDelayError):
    """The broker refused an operation or cannot be reached."""


class BrokerUnavailable(BrokerError, ConnectionError):
    """No connection to the broker (the URL in the message is redacted)."""


class ConnectionLost(BrokerUnavailable):
    """A connection or channel that was open was lost (broker restart, network cut,
    connection forced closed): the operation did not complete; retrying it on a new
    connection is safe for idempotent operations."""


class AccessRefused(BrokerError, PermissionError):
    """The broker refused the user (AMQP 403 ACCESS_REFUSED, 530 NOT_ALLOWED).

    `permission` is the permission the operation needed ("configure", "write" or
    "read"; "" when not known) and `resource` the object refused ("" when not known).
    """

    def __init__(self, message: str, *, permission: str = "", resource: str = "") -> None:
        super().__init__(message)
        self.permission = permission
        self.resource = resource


@dataclass(frozen=True)
class ArgumentConflict:
    """One argument whose value on the broker differs from the one wanted."""

    kind: str  # "queue" or "exchange"
    name: str
    argument: str
    on_broker: object
    wanted: object

    def describe(self) -> str:
        return (
            f"{self.kind} '{self.name}': argument '{self.argument}' is {self.on_broker!r} "
            f"on the broker but the topology wants {self.wanted!r}"
        )


RESOLVE_HINT = (
    "Nothing was changed. To resolve: declare the new topology beside the old one by "
    "raising `version` in the topology file (names carry a version segment), or, once "
    "the object is drained, delete it yourself (e.g. `rabbitmqctl delete_queue NAME`) "
    "and run `rabbit-delay declare` again. Arguments that must change in place belong "
    "in a policy."
)


class DeclarationConflict(BrokerError):
    """Objects already exist on the broker with arguments other than the topology's."""

    def __init__(self, conflicts: Sequence[ArgumentConflict]) -> None:
        self.conflicts = tuple(conflicts)
        lines = "\n".join(f"  - {c.describe()}" for c in self.conflicts)
        super().__init__(f"existing objects conflict with the topology:\n{lines}\n{RESOLVE_HINT}")


class MissingObjectError(BrokerError):
    """A queue or exchange the operation needs does not exist on the broker."""


class MissingPluginError(BrokerError):
    """The broker lacks the rabbitmq_delayed_message_exchange plugin."""


class ManagementUnavailable(BrokerError):
    """The management HTTP API did not answer usefully, refused the user, or serves
    another broker than the AMQP connection; callers fall back to AMQP and say why."""


class IncompatibleBroker(BrokerError):
    """The broker's version cannot do what the topology or the call asks (e.g. the
    delayed-message plugin on RabbitMQ 4.3+); checked before anything is changed."""


class OutboxError(RabbitDelayError):
    """The outbox's database refused or lost a statement: its table is missing, the
    connection dropped, a lock was not obtained in time. The message names the table
    and what to do; the rows are untouched (a relay retries by itself)."""


class StoreError(RabbitDelayError):
    """The idempotency store (SQLite, Redis, PostgreSQL) failed an operation of the
    schedule: a record could not be written or read. Nothing was published on a failed
    write; the message names the operation and the store's error."""


class DecodeError(RabbitDelayError, ValueError):
    """A delivered message cannot be decoded or validated."""


# -- the one decision behind both transports' exception maps (_sync/errors.py,
#    _aio/errors.py): what a broker's close reply means. Pure. --------------------------

_RESOURCE = re.compile(r"(?:access to |no )(?P<what>(?:queue|exchange|vhost) '[^']*')")
# RabbitMQ names the permission it checked: "write access to queue 'q' in vhost ..."
_PERMISSION = re.compile(r"\b(?P<permission>configure|write|read) access to ")


def broker_refusal(
    code: int | None,
    text: str | None,
    *,
    doing: str,
    permission: str = "",
    connection: bool = False,
) -> BrokerError:
    """The error for a channel (or, with `connection=True`, a connection) the broker
    closed with `code`/`text` while `doing` (e.g. "publishing to exchange 'x'").

    `permission` is what `doing` needs ("configure", "write" or "read"): a 403 names it
    and how to grant it.
    """
    reply = f"{code} {text}" if code is not None else str(text or "closed")
    text = text or ""
    if code in (403, 530) or "ACCESS_REFUSED" in text or "NOT_ALLOWED" in text:
        found = _RESOURCE.search(text)
        resource = found["what"] if found else ""
        stated = _PERMISSION.search(text)
        # The broker's word wins (a bind needs write on one side, read on the other),
        # except "configure" for an operation that needs read (a consumer's queue
        # check): that is a passive declare, which RabbitMQ 4.3 refuses in those words
        # to a user with no permission at all on the object, though read passes it.
        if stated and not (stated["permission"] == "configure" and permission == "read"):
            permission = stated["permission"]
        need = f"; the user needs {permission!r} permission" if permission else ""
        on = f" on {resource}" if resource and permission else ""
        return AccessRefused(
            f"refused by the broker while {doing}: {reply}{need}{on} "
            "(see docs/security.md for each role's permissions)",
            permission=permission,
            resource=resource,
        )
    if code == 404:
        return MissingObjectError(
            f"{reply} (while {doing}); run `rabbit-delay declare` to create the topology"
        )
    if connection or code in (320, 541):
        # 320 CONNECTION_FORCED: closed by an operator or a node shutting down
        return ConnectionLost(f"connection closed by the broker while {doing}: {reply}")
    return BrokerError(f"closed by the broker while {doing}: {reply}")


def for_publishes(error: RabbitDelayError, message_ids: Sequence[str]) -> RabbitDelayError:
    """`error` as it concerns publishes still waiting for their confirms (`message_ids`):
    a lost connection leaves them unconfirmed (UnconfirmedError), a block names them."""
    if not message_ids:
        return error
    if isinstance(error, BrokerBlocked):
        return BrokerBlocked(str(error), message_ids=message_ids, reason=error.reason)
    if isinstance(error, ConnectionLost):
        return UnconfirmedError(
            f"{len(message_ids)} message(s) not confirmed: {error}; publish them again "
            "with the same message ids",
            message_ids=message_ids,
        )
    return error


# -- what both exception maps (_sync/errors.py, _aio/errors.py) build --------------------

Translate = Callable[..., RabbitDelayError]


class ExceptionMap:
    """A transport's exception map: every exception of its client library that a public
    call can meet (`client_errors`, and any that `also` accepts) becomes a class of this
    tree, by the transport's `rules`; ours pass as they are. With `message_ids` (a
    publish whose confirms were outstanding), a lost or blocked connection names them
    (`for_publishes`)."""

    def __init__(
        self,
        rules: Translate,
        client_errors: tuple[type[BaseException], ...],
        also: Callable[[BaseException], bool] = lambda exc: False,
    ) -> None:
        self._rules = rules
        self.client_errors = client_errors
        self._also = also

    def translate(
        self,
        exc: BaseException,
        *,
        doing: str,
        permission: str = "",
        message_ids: Sequence[str] = (),
    ) -> RabbitDelayError:
        """The project's error for `exc`, met while `doing` (e.g. "publishing")."""
        if isinstance(exc, RabbitDelayError):
            return exc
        error = self._rules(exc, doing=doing, permission=permission, message_ids=message_ids)
        return for_publishes(error, message_ids)

    @contextmanager
    def mapped(
        self, doing: str, *, permission: str = "", message_ids: Sequence[str] = ()
    ) -> Iterator[None]:
        """A block of client calls whose exceptions leave it as the project's error,
        chained nowhere: the client's traceback adds nothing for the user."""
        try:
            yield
        except RabbitDelayError:
            raise
        except Exception as exc:
            if not isinstance(exc, self.client_errors) and not self._also(exc):
                raise
            error = self.translate(exc, doing=doing, permission=permission, message_ids=message_ids)
            raise error from None


def login_refused(doing: str) -> BrokerUnavailable:
    return BrokerUnavailable(
        f"the broker refused the login while {doing}: check the user name and password of the URL"
    )


def vhost_refused(doing: str) -> BrokerUnavailable:
    return BrokerUnavailable(
        f"the broker refused the virtual host while {doing}: it does not exist, or the "
        "user has no permissions on it"
    )
