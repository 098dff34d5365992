"""What the broker refuses, and why: a topology its version cannot hold (checked before
anything is declared), and the broker's refusal replies read back (a 406 inequivalent
argument as a structured conflict; an unknown exchange type as the missing plugin). Pure.
"""

from __future__ import annotations

import re

from rabbit_delay._broker import BrokerInfo
from rabbit_delay._errors import ArgumentConflict, IncompatibleBroker, MissingPluginError
from rabbit_delay._plan.desired import (
    DELAYED_RETRY_TYPE,
    PLUGIN_EXCHANGE_TYPE,
    Desired,
    ExchangeSpec,
    ObjectSpec,
)

# -- what the broker's version can do ---------------------------------------------------


def broker_requirements(want: Desired, broker: BrokerInfo) -> list[str]:
    """Why this broker cannot hold `want`, one reason per line; empty when it can.

    Checked before anything is declared (and by workers at start), so a topology the
    broker cannot serve never half-exists on it.
    """
    reasons: list[str] = []
    if not broker.supports_plugin and any(e.type == PLUGIN_EXCHANGE_TYPE for e in want.exchanges):
        reasons.append(
            f"the [plugin] backend needs rabbitmq_delayed_message_exchange, which cannot run on "
            f"{broker.describe()}: RabbitMQ 4.3 removed Mnesia, which the plugin stores its "
            "messages in (the plugin was archived in January 2026). Replace the [plugin] table "
            "with [cascade] (plugin-free, replicated) and declare it as a new topology `version`"
        )
    native = [q.name for q in want.queues if DELAYED_RETRY_TYPE in q.arguments]
    if native and not broker.supports_delayed_retry:
        reasons.append(
            f'retry backend = "broker" (queue {", ".join(native)}) needs quorum queue delayed '
            f"retry (x-delayed-retry-*), which RabbitMQ added in 4.3; {broker.describe()} does "
            'not have it. Retry through the tiers (backend = "tiers", the default) on this '
            "broker, or upgrade it to 4.3+"
        )
    if want.held_queue is not None and not broker.supports_held:
        reasons.append(
            f"the [held] backend (queue {want.held_queue}) needs a quorum queue that holds a "
            "message until the time an AMQP 1.0 consumer gives it (`modified` with "
            f"x-opt-delivery-time), which RabbitMQ added in 4.3; {broker.describe()} does not "
            "have it. Use [cascade] on this broker, or upgrade it to 4.3+"
        )
    return reasons


def check_broker(want: Desired, broker: BrokerInfo) -> None:
    """Raise IncompatibleBroker when `broker_requirements` finds a reason."""
    reasons = broker_requirements(want, broker)
    if reasons:
        raise IncompatibleBroker("; ".join(reasons))


# -- refusals read back ----------------------------------------------------------------


_INEQUIVALENT = re.compile(
    r"inequivalent arg '(?P<arg>[^']+)' for (?P<kind>queue|exchange) '(?P<name>[^']*)'.*?"
    r"received (?:the value '(?P<recv>[^']*)'|'(?P<recv2>[^']*)'|none).*?"
    r"current is (?:the value '(?P<cur>[^']*)'|'(?P<cur2>[^']*)'|none)",
    re.S,
)


def conflict_from_reply(spec: ObjectSpec, reply: str) -> ArgumentConflict:
    """Turn the broker's 406 text into a structured conflict (best effort)."""
    m = _INEQUIVALENT.search(reply)
    if m is None:
        return ArgumentConflict(spec.kind.value, spec.name, "?", reply, "see topology")
    arg = m["arg"]
    current = m["cur"] if m["cur"] is not None else m["cur2"]
    wanted: object = spec.arguments.get(arg)
    if arg == "type" and isinstance(spec, ExchangeSpec):
        wanted = spec.type
    elif arg == "durable":
        wanted = spec.durable
    on_broker = _as_wanted_type(current, wanted)
    return ArgumentConflict(spec.kind.value, spec.name, arg, on_broker, wanted)


def _as_wanted_type(text: str | None, wanted: object) -> object:
    """The reply spells every value as text ('5000', 'true'): give it the wanted value's
    type, so a conflict reads the same whether it came from a 406 or the management API."""
    if text is None:
        return None
    if isinstance(wanted, bool):
        return {"true": True, "false": False}.get(text, text)
    if isinstance(wanted, int):
        try:
            return int(text)
        except ValueError:
            return text
    return text


# A broker without the delayed-message plugin refuses the exchange type: 3.x closes the
# whole connection (503 COMMAND_INVALID), 4.x only the channel (406 PRECONDITION_FAILED);
# the text says "unknown exchange type" on a clean node and "invalid exchange type" after
# the plugin was disabled.
UNKNOWN_EXCHANGE_TYPE = re.compile(r"(unknown|invalid) exchange type", re.I)
PLUGIN_HINT = (
    "the broker has no 'x-delayed-message' exchange type: enable the plugin with "
    "`rabbitmq-plugins enable rabbitmq_delayed_message_exchange` (docker-compose.yml "
    "builds a broker that has it), or replace the [plugin] table with [cascade]"
)


def missing_plugin(reply: str) -> MissingPluginError | None:
    """The error a refusal's `reply` text means when it names an exchange type the broker
    does not know (whichever of the connection or the channel it closed), else None."""
    if UNKNOWN_EXCHANGE_TYPE.search(reply):
        return MissingPluginError(f"{reply}: {PLUGIN_HINT}")
    return None
