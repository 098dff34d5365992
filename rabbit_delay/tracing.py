"""Where rabbit-delay's OpenTelemetry spans go.

The W3C trace context (`traceparent`, `tracestate`) always travels through the delay
in the message headers. Spans (publish, handle, retry, park) exist once the application
has imported OpenTelemetry (`pip install 'rabbit-delay[otel]'`); rabbit-delay never
imports it by itself. `configure(tracer_provider=..., enabled=...)` gives rabbit-delay
a provider of its own instead of the global one, or turns its spans off. See
docs/observability.md.
"""

from rabbit_delay._observe.tracing import configure

__all__ = ["configure"]
