"""The one exception tree of rabbit-delay.

    RabbitDelayError
    ├── ConfigError (ValueError)            what the user wrote is wrong
    │   ├── DurationError                   "5x", "-3s", a delay too long
    │   └── TopologyError                   a topology file or model that does not validate
    ├── PublishError                        nothing was confirmed as sent
    │   ├── DelayError (ValueError)         unknown tier, delay that matches no tier, bad `at=`
    │   ├── UnknownTargetError (ValueError) queue or routing key absent from the topology
    │   ├── EncodeError (ValueError)        a message that cannot be turned into bytes
    │   ├── UnroutableError                 returned by the broker under `mandatory`
    │   └── NackError                       the broker refused responsibility (basic.nack)
    ├── BrokerError                         the broker said no, or is not there
    │   ├── BrokerUnavailable (ConnectionError)
    │   ├── DeclarationConflict             406: an object exists with other arguments
    │   ├── MissingObjectError              404: a queue or exchange the code relies on is absent
    │   ├── MissingPluginError              unknown exchange type 'x-delayed-message'
    │   ├── ManagementUnavailable           the management API cannot be used (callers fall back)
    │   └── IncompatibleBroker              the broker's version cannot do what is asked
    └── DecodeError (ValueError)            a delivered message that cannot be decoded

Handler control flow (`Retry`, `Reject`) lives in `rabbit_delay.consumer`: those are
signals, not failures of the library.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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
    """A message was not (or not provably) handed over to the broker."""


class DelayError(PublishError, ValueError):
    """The requested tier or delay cannot be served by this topology."""


class UnknownTargetError(PublishError, ValueError):
    """The target queue or routing key is not part of the topology."""


class EncodeError(PublishError, ValueError):
    """The message body cannot be encoded."""


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
        super().__init__(message)
        self.message_ids = tuple(message_ids)
        self.replies = dict(replies or {})


class NackError(PublishError):
    """The broker nacked the publish: it did not take responsibility for it."""

    def __init__(self, message: str, *, message_ids: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.message_ids = tuple(message_ids)


class BrokerError(RabbitDelayError):
    """The broker refused an operation or cannot be reached."""


class BrokerUnavailable(BrokerError, ConnectionError):
    """No connection to the broker (the URL in the message is redacted)."""


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


class DecodeError(RabbitDelayError, ValueError):
    """A delivered message cannot be decoded or validated."""
