"""The publisher logic both transports share: validate, route, encode. No I/O."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from rabbit_delay import names as h
from rabbit_delay.delays import Route, Router
from rabbit_delay.durations import parse_ms
from rabbit_delay.errors import (
    DelayError,
    DurationError,
    NackError,
    PublishError,
    RabbitDelayError,
    UnroutableError,
)
from rabbit_delay.message import (
    Body,
    Outgoing,
    check_message_id,
    encode_body,
    new_message_id,
    now_ms,
)
from rabbit_delay.topology import Topology

if TYPE_CHECKING:
    from rabbit_delay.metrics import Metrics

DelayLike = timedelta | int | float


def confirm_failure(returned: Mapping[str, str], nacked: Sequence[str]) -> PublishError | None:
    """The one error for publishes the broker returned (message_id -> reply text) or
    nacked, or None. Returned ones win: they need the topology fixed, a nack only a retry.
    """
    if returned:
        reasons = ", ".join(sorted(set(returned.values())))
        return UnroutableError(
            f"{len(returned)} message(s) returned by the broker ({reasons}): no queue is bound "
            "for them; check the topology is declared (`rabbit-delay plan`)",
            message_ids=list(returned),
            replies=returned,
        )
    if nacked:
        return NackError(
            f"{len(nacked)} message(s) nacked by the broker; publish them again",
            message_ids=list(nacked),
        )
    return None


class PublisherCore:
    """Turns `publish_delayed` arguments into an `Outgoing` message, or refuses them.

    The sync and async publishers inherit this and only move bytes.
    """

    def __init__(self, topology: Topology, *, metrics: Metrics | None = None) -> None:
        self.topology = topology
        self.router = Router(topology)
        self.metrics = metrics

    def record(self, outs: Sequence[Outgoing], error: RabbitDelayError | None = None) -> None:
        """Count a batch in the metrics, by target and tier: the ids an error names (all
        of them when it names none: nothing is known to be confirmed) as failed, the rest
        as published. A no-op without metrics."""
        metrics = self.metrics
        if metrics is None:
            return
        failed: set[str] = set()
        if error is not None:
            named = getattr(error, "message_ids", ())
            failed = set(named) if named else {o.message_id for o in outs}
        sent: Counter[tuple[str, str]] = Counter()
        for out in outs:
            target = str(out.headers[h.H_TARGET])
            if out.message_id in failed and error is not None:
                metrics.publish_error(target, error)
            else:
                sent[(target, str(out.headers[h.H_TIER]))] += 1
        for (target, tier), count in sent.items():
            metrics.published(target, tier, count)

    def route(
        self,
        tier: str | None = None,
        *,
        queue: str | None = None,
        routing_key: str | None = None,
        delay: DelayLike | None = None,
        at: datetime | None = None,
        now: int | None = None,
    ) -> Route:
        key = self.router.target_key(queue, routing_key)
        delay_ms: int | None = None
        if at is not None:
            if delay is not None:
                raise DelayError("give either delay= or at=, not both")
            if at.tzinfo is None or at.utcoffset() is None:
                raise DelayError(
                    f"at={at!r} has no timezone; pass an aware datetime, "
                    "e.g. datetime.now(UTC) + ..."
                )
            delay_ms = int(at.timestamp() * 1000) - (now if now is not None else now_ms())
            if delay_ms <= 0:
                raise DelayError(
                    f"at={at.isoformat()} is in the past; a delayed message must be due later"
                )
        elif delay is not None:
            try:
                delay_ms = parse_ms(delay)
            except DurationError as exc:
                raise DelayError(str(exc)) from None
        return self.router.resolve(key, tier=tier, delay_ms=delay_ms)

    def prepare(
        self,
        msg: Body,
        tier: str | None = None,
        *,
        queue: str | None = None,
        routing_key: str | None = None,
        delay: DelayLike | None = None,
        at: datetime | None = None,
        message_id: str | None = None,
        headers: Mapping[str, object] | None = None,
        attempt: int = 1,
    ) -> Outgoing:
        """Validate and encode one message. Raises a PublishError subclass on bad input."""
        now = now_ms()
        route = self.route(tier, queue=queue, routing_key=routing_key, delay=delay, at=at, now=now)
        body, content_type = encode_body(msg)
        return self.outgoing(route, body, content_type, now, message_id, headers, attempt)

    @staticmethod
    def outgoing(
        route: Route,
        body: bytes,
        content_type: str,
        now: int,
        message_id: str | None = None,
        headers: Mapping[str, object] | None = None,
        attempt: int = 1,
    ) -> Outgoing:
        all_headers: dict[str, object] = dict(headers) if headers else {}
        all_headers.update(route.headers)
        all_headers[h.H_DUE_AT] = now + route.delay_ms
        all_headers[h.H_DELAY_MS] = route.delay_ms
        all_headers[h.H_TIER] = route.tier
        all_headers[h.H_ATTEMPT] = attempt
        all_headers[h.H_TARGET] = route.target
        return Outgoing(
            exchange=route.exchange,
            routing_key=route.routing_key,
            body=body,
            message_id=check_message_id(message_id) if message_id is not None else new_message_id(),
            content_type=content_type,
            headers=all_headers,
            mandatory=route.mandatory,
            timestamp=now // 1000,
        )
