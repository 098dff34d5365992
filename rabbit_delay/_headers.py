"""Every message header rabbit-delay writes or reads, named here and only here.

Headers are the project's own (`rd-*`), never `x-*`: from RabbitMQ 3.13 the broker
treats `x-` headers as its own and 4.x ignores a client-published `x-death`. This module
is the wire contract's list of headers (docs: the headers reference); what each carries
is said beside it.
"""

from __future__ import annotations

# Headers written by the publisher and read by the consumer framework.
H_DUE_AT = "rd-due-at"  # scheduled delivery time, UTC epoch milliseconds
H_TIER = "rd-tier"  # tier name, or "cascade" / "plugin" for arbitrary delays
H_DELAY_MS = "rd-delay-ms"  # the delay requested, milliseconds
H_ATTEMPT = "rd-attempt"  # 1 for the first delivery attempt, +1 per retry
H_TARGET = "rd-target"  # the routing key the message was published for
# The due time the publisher asked for (UTC ms): publish time + the delay asked, or `at=`.
# rd-due-at is that time rounded up to what the backend serves (the cascade's resolution),
# so rd-due-at - rd-asked-due-at is the schedule's own deviation, never negative.
H_ASKED_DUE_AT = "rd-asked-due-at"
# The schedule (a topology with [schedule]): the message's key and its generation; a
# worker drops a copy whose generation the key's record has moved past.
H_KEY = "rd-key"
H_GENERATION = "rd-generation"
# Parking-lot headers (consumer framework).
H_ERROR_TYPE = "rd-error-type"
H_ERROR_MESSAGE = "rd-error-message"
H_ERROR_TRACEBACK = "rd-error-traceback"
H_ORIGINAL_QUEUE = "rd-original-queue"
H_FIRST_FAILURE = "rd-first-failure-at"
H_LAST_FAILURE = "rd-last-failure-at"
H_PARK_REASON = "rd-park-reason"
# Crash and defer accounting, carried by the copies the worker re-publishes.
H_CRASHES = "rd-crashes"  # deliveries of this message lost while its handler may have run
H_DEFERRALS = "rd-deferrals"  # times this copy was put off because another copy was running
# Broker-owned headers stripped before any re-publish (quorum queues count failed
# deliveries in x-delivery-count and, from 4.3, every hand-out in x-acquired-count).
DELIVERY_COUNT_HEADER = "x-delivery-count"
BROKER_HEADER_PREFIXES = (
    "x-death",
    "x-first-death-",
    "x-last-death-",
    DELIVERY_COUNT_HEADER,
    "x-acquired-count",
)
# The delayed-message plugin's delay header (milliseconds).
H_PLUGIN_DELAY = "x-delay"
# W3C trace context (https://www.w3.org/TR/trace-context/): carried unchanged through
# tiers, the cascade, retries and replays, so a handler continues the publisher's trace.
H_TRACEPARENT = "traceparent"
H_TRACESTATE = "tracestate"
TRACE_HEADERS = (H_TRACEPARENT, H_TRACESTATE)
