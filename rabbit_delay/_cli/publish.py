"""`rabbit-delay publish`: one delayed JSON message, confirmed."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Annotated

import typer

import rabbit_delay._cli.options as opt
from rabbit_delay._durations import format_ms, iso_ms, parse_ms
from rabbit_delay._errors import DurationError
from rabbit_delay._headers import H_DELAY_MS, H_DUE_AT, H_TIER


def _parse_delay(delay: str | None) -> timedelta | None:
    if delay is None:
        return None
    try:
        return timedelta(milliseconds=parse_ms(delay))
    except DurationError as exc:
        opt.fail(f"--delay: {exc}", kind=type(exc).__name__)


def publish(
    message: Annotated[
        str, typer.Argument(help="JSON body, e.g. '{\"order_id\": 42}'; '-' reads stdin.")
    ],
    queue: Annotated[
        str | None, typer.Option("--queue", "-q", help="Target business queue (logical name).")
    ] = None,
    routing_key: Annotated[
        str | None, typer.Option("--routing-key", help="Target by a declared binding key.")
    ] = None,
    tier: Annotated[
        str | None, typer.Option("--tier", "-t", help="Delay tier name, e.g. 30m.")
    ] = None,
    delay: Annotated[
        str | None,
        typer.Option(
            "--delay",
            "-d",
            help=(
                "Delay such as 90s; must match a tier unless the topology has a cascade or plugin."
            ),
        ),
    ] = None,
    message_id: Annotated[
        str | None, typer.Option("--message-id", help="Idempotency key (default: generated).")
    ] = None,
    file: opt.TopologyOpt = None,
    url: opt.UrlOpt = None,
    as_json: opt.JsonOpt = False,
) -> None:
    """Publish one delayed JSON message (confirmed, persistent, mandatory)."""
    from rabbit_delay.sync import Publisher

    if message == "-":
        message = typer.get_text_stream("stdin").read()
    try:
        body = json.loads(message)
    except json.JSONDecodeError as exc:
        opt.fail(f"MESSAGE is not valid JSON ({exc}); quote it, e.g. '{{\"order_id\": 42}}'")
    if not isinstance(body, dict | list):
        opt.fail("MESSAGE must be a JSON object or array")
    with opt.errors_to_exit():
        topology = opt.resolve_topology(file)
        # several URLs travel as one comma-separated string (the connect helpers split it)
        with Publisher(topology, ",".join(opt.url_for(url))) as publisher:
            out_msg = publisher.prepare(
                body,
                tier,
                queue=queue,
                routing_key=routing_key,
                delay=_parse_delay(delay),
                message_id=message_id,
            )
            publisher.publish_outgoing((out_msg,))
    due_at_ms = int(str(out_msg.headers[H_DUE_AT]))
    delay_ms = int(str(out_msg.headers[H_DELAY_MS]))
    result = {
        "message_id": out_msg.message_id,
        "exchange": out_msg.exchange,
        "routing_key": out_msg.routing_key,
        "tier": out_msg.headers[H_TIER],
        "delay": format_ms(delay_ms),
        "due_at": iso_ms(due_at_ms),
        # the exact figures, for programs: the headers the message carries
        "delay_ms": delay_ms,
        "due_at_ms": due_at_ms,
    }
    if as_json:
        opt.print_json(result)
    else:
        opt.out.print(
            f"published {result['message_id']} via {result['exchange']} ({result['tier']}), "
            f"due at {result['due_at']} (in {result['delay']})",
            markup=False,
        )


__all__ = ["publish"]
