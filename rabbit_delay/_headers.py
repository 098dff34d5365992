"""Every message header rabbit-delay writes or reads, named here and only here.

Headers are the project's own (`rd-*`), never `x-*`: from RabbitMQ 3.13 the broker
treats `x-` headers as its own and 4.x ignores a client-published `x-death`. This module
is the wire contract's list of headers (docs: the headers reference); what each carries
is said beside it.
"""

from __future__ import annotations

# Headers written by the publisher and read by the consumer framework.
H_DUE_AT = "rd-due-at"  # scheduled delivery time, UTC epoch milliseconds
"""Integer, UTC epoch milliseconds: when the message is due (what the backend serves: the
cascade rounds up to its resolution). Written on every message sent through a delay."""
H_TIER = "rd-tier"  # tier name, or "cascade" / "plugin" for arbitrary delays
"""String: the tier name, `cascade` or `plugin` for an arbitrary delay, `now` for a message
sent straight to the due exchange (a replay, a message moved after its due time)."""
H_DELAY_MS = "rd-delay-ms"  # the delay requested, milliseconds
"""Integer, milliseconds: the delay of this copy's route (a relayed outbox row or a
moved message: the delay first asked for)."""
H_ATTEMPT = "rd-attempt"  # 1 for the first delivery attempt, +1 per retry
"""Integer: the delivery attempt, 1 for the first, +1 per retry (a replay starts at 1 again)."""
H_TARGET = "rd-target"  # the routing key the message was published for
"""String: the routing key the message was published for (a queue's own key, or a
binding key)."""
# The due time the publisher asked for (UTC ms): publish time + the delay asked, or `at=`.
# rd-due-at is that time rounded up to what the backend serves (the cascade's resolution),
# so rd-due-at - rd-asked-due-at is the schedule's own deviation, never negative.
H_ASKED_DUE_AT = "rd-asked-due-at"
"""Integer, UTC epoch milliseconds: the due time asked for, before the backend rounded it
up (`rd-due-at` - `rd-asked-due-at` >= 0 is the schedule's deviation)."""
# The schedule (a topology with [schedule]): the message's key and its generation; a
# worker drops a copy whose generation the key's record has moved past.
H_KEY = "rd-key"
"""String, on a message recorded in the schedule (a topology with [schedule]): its schedule
key (by default its message_id)."""
H_GENERATION = "rd-generation"
"""Integer, with `rd-key`: the key's generation this copy is (1, then +1 per replace or
reschedule); a worker drops a copy whose generation the key's record has moved past."""
# Parking-lot headers (consumer framework).
H_ERROR_TYPE = "rd-error-type"
"""String, on a retried or parked copy: the failure's exception type (`ValueError`,
`rabbit_delay.Reject`, `myapp.errors.PaymentDeclined`)."""
H_ERROR_MESSAGE = "rd-error-message"
"""String, on a retried or parked copy: the failure's message, at most 1,000 characters."""
H_ERROR_TRACEBACK = "rd-error-traceback"
"""String, on a message parked after its last attempt: the end of the traceback, at most
4,000 characters."""
H_ORIGINAL_QUEUE = "rd-original-queue"
"""String, on a parked message: the business queue (logical name) it failed in."""
H_FIRST_FAILURE = "rd-first-failure-at"
"""Integer, UTC epoch milliseconds, on a retried or parked copy: its first failure."""
H_LAST_FAILURE = "rd-last-failure-at"
"""Integer, UTC epoch milliseconds, on a retried or parked copy: its latest failure."""
H_PARK_REASON = "rd-park-reason"
"""String, on a parked message: `max_attempts`, `rejected`, `decode_error`,
`validation_error` or `crashed`."""
# Crash and defer accounting, carried by the copies the worker re-publishes.
H_CRASHES = "rd-crashes"  # deliveries of this message lost while its handler may have run
"""Integer, on a copy a worker re-published: deliveries of the message lost while its
handler may have run (absent: 0)."""
H_DEFERRALS = "rd-deferrals"  # times this copy was put off because another copy was running
"""Integer, on a copy a worker put off: how often, because another copy was running
(absent: 0)."""
# Broker-owned headers stripped before any re-publish (quorum queues count failed
# deliveries in x-delivery-count and, from 4.3, every hand-out in x-acquired-count).
DELIVERY_COUNT_HEADER = "x-delivery-count"
"""Integer, set by the broker on a quorum queue's redelivery: failed deliveries of this
copy. Read, never written."""
BROKER_HEADER_PREFIXES = (
    "x-death",
    "x-first-death-",
    "x-last-death-",
    DELIVERY_COUNT_HEADER,
    "x-acquired-count",
)
# The delayed-message plugin's delay header (milliseconds).
H_PLUGIN_DELAY = "x-delay"
"""Integer, milliseconds (1 .. 2^32-1): the delay, for the delayed-message plugin's
exchange only."""
# W3C trace context (https://www.w3.org/TR/trace-context/): carried unchanged through
# tiers, the cascade, retries and replays, so a handler continues the publisher's trace.
H_TRACEPARENT = "traceparent"
"""String, W3C trace context: carried unchanged through every delay, retry and replay."""
H_TRACESTATE = "tracestate"
"""String, W3C trace state: carried with `traceparent`."""
TRACE_HEADERS = (H_TRACEPARENT, H_TRACESTATE)
