"""declare, plan, publish."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from rabbit_delay._cli.app import (
    EXIT_ERROR,
    EXIT_OK,
    EXIT_PENDING,
    JsonOpt,
    TopologyArg,
    TopologyOpt,
    UrlOpt,
    app,
    errors_to_exit,
    fail,
    out,
    print_json,
    resolve_topology,
    url_for,
)
from rabbit_delay._durations import format_ms, iso_ms, parse_ms
from rabbit_delay._errors import DeclarationConflict, DurationError
from rabbit_delay._headers import H_DELAY_MS, H_DUE_AT, H_TIER
from rabbit_delay._io.management import access_for, observe
from rabbit_delay._plan.diff import Change, Plan, PlanItem
from rabbit_delay._urls import redact

MgmtOpt = Annotated[
    str | None,
    typer.Option(
        "--management-url",
        help="Management API base URL (default: derived from --url; $RABBIT_DELAY_MANAGEMENT_URL).",
        show_default=False,
    ),
]
NoMgmtOpt = Annotated[
    bool,
    typer.Option(
        "--no-management", help="Do not use the management API; probe with passive declares."
    ),
]

_STYLE = {
    Change.CREATE: "yellow",
    Change.IN_PLACE: "green",
    Change.CONFLICT: "bold red",
    Change.PRESENT: "green",
    Change.ENSURE: "cyan",
    Change.EXTRA: "magenta",
}
_DONE_WORDS = {
    Change.CREATE: "created",
    Change.IN_PLACE: "in place",
    Change.ENSURE: "ensured",
    Change.PRESENT: "in place",
}


# The one rule of which management API a command may use (rabbit_delay._io.management).
management_access = access_for


def _items_json(
    items: tuple[PlanItem, ...], words: dict[Change, str] | None = None
) -> list[dict[str, Any]]:
    return [
        {
            "kind": i.kind.value,
            "name": i.name,
            "action": (words or {}).get(i.action, i.action.value),
            "conflicts": [
                {"argument": c.argument, "on_broker": c.on_broker, "wanted": c.wanted}
                for c in i.conflicts
            ],
            "notes": list(i.notes),
        }
        for i in items
    ]


def _table(
    title: str, items: tuple[PlanItem, ...], words: dict[Change, str] | None = None
) -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column("kind")
    table.add_column("name", overflow="fold")
    table.add_column("status")
    for i in items:
        word = (words or {}).get(i.action, i.action.value)
        detail = "; ".join(
            [f"{c.argument}: broker {c.on_broker!r}, wanted {c.wanted!r}" for c in i.conflicts]
            + list(i.notes)
        )
        table.add_row(
            i.kind.value,
            escape(i.name),
            f"[{_STYLE[i.action]}]{word}[/]" + (f" ({escape(detail)})" if detail else ""),
        )
    return table


def _summary(plan: Plan) -> str:
    counts: dict[str, int] = {}
    for i in plan.items:
        counts[i.action.value] = counts.get(i.action.value, 0) + 1
    return ", ".join(f"{n} {a}" for a, n in counts.items())


@app.command()
def plan(
    file: TopologyArg = None,
    topology_file: TopologyOpt = None,
    url: UrlOpt = None,
    management_url: MgmtOpt = None,
    no_management: NoMgmtOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Show what `declare` would create, and any conflict, without changing anything.

    Exit code: 0 in sync, 2 changes pending, 1 error (conflicts count as pending).
    """
    from rabbit_delay.sync import broker_info
    from rabbit_delay.sync import plan as sync_plan
    from rabbit_delay.sync._connection import close_quietly, connect_first

    with errors_to_exit():
        topology = resolve_topology(file, topology_file)
        connection, broker = connect_first(url_for(url), name="rabbit-delay plan")
        try:
            info = broker_info(connection)
            access = management_access(info, broker, management_url, no_management)
            observed, source = observe(access, topology)
            result = sync_plan(connection, topology, observed=observed)
        finally:
            close_quietly(connection)
    if as_json:
        print_json(
            {
                "in_sync": result.in_sync,
                "source": source,
                "broker": redact(broker),
                "broker_version": info.version_text,
                "items": _items_json(result.items),
            }
        )
    else:
        title = f"plan for {topology.names.prefix} on {redact(broker)} ({info.describe()})"
        out.print(_table(escape(title), result.items))
        out.print(escape(f"read via {source}"))
        for conflict in result.conflicts:
            out.print(f"[bold red]conflict:[/] {escape(conflict.describe())}")
        state = "in sync" if result.in_sync else "changes pending"
        out.print(f"{_summary(result)} -> {state}")
    raise typer.Exit(EXIT_OK if result.in_sync else EXIT_PENDING)


@app.command()
def declare(
    file: TopologyArg = None,
    topology_file: TopologyOpt = None,
    url: UrlOpt = None,
    management_url: MgmtOpt = None,
    no_management: NoMgmtOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Declare the topology: tier buffers, due/catch-all/parking exchanges, business queues.

    Idempotent. Shows the plan first; stops without changing anything when an object
    exists with other arguments.
    """
    from rabbit_delay.sync import broker_info
    from rabbit_delay.sync import declare as sync_declare
    from rabbit_delay.sync import plan as sync_plan
    from rabbit_delay.sync._connection import close_quietly, connect_first

    with errors_to_exit():
        topology = resolve_topology(file, topology_file)
        connection, broker = connect_first(url_for(url), name="rabbit-delay declare")
        try:
            info = broker_info(connection)
            access = management_access(info, broker, management_url, no_management)
            observed, source = observe(access, topology)
            before = sync_plan(connection, topology, observed=observed)
            if not as_json:
                title = f"plan for {topology.names.prefix} on {redact(broker)} ({info.describe()})"
                out.print(_table(escape(title), before.items))
                out.print(escape(f"read via {source}"))
            try:
                report = sync_declare(connection, topology, observed=observed)
            except DeclarationConflict as exc:
                if as_json:
                    print_json(  # the error document, with the plan that found it
                        {
                            "ok": False,
                            "error": str(exc),
                            "kind": type(exc).__name__,
                            "source": source,
                            "items": _items_json(before.items),
                        }
                    )
                raise
        finally:
            close_quietly(connection)
    if as_json:
        print_json(
            {
                "ok": True,
                "changed": report.changed,
                "source": source,
                "broker_version": info.version_text,
                "items": _items_json(report.items, _DONE_WORDS),
            }
        )
        return
    out.print(_table("result", report.items, _DONE_WORDS))
    created = len(report.created)
    out.print(
        f"{created} object(s) created"
        if report.changed
        else "nothing to do: everything was already in place"
    )


def _parse_delay(delay: str | None) -> timedelta | None:
    if delay is None:
        return None
    try:
        return timedelta(milliseconds=parse_ms(delay))
    except DurationError as exc:
        fail(f"--delay: {exc}", kind=type(exc).__name__)


@app.command()
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
    file: TopologyOpt = None,
    url: UrlOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Publish one delayed JSON message (confirmed, persistent, mandatory)."""
    from rabbit_delay.sync import Publisher

    if message == "-":
        message = typer.get_text_stream("stdin").read()
    try:
        body = json.loads(message)
    except json.JSONDecodeError as exc:
        fail(f"MESSAGE is not valid JSON ({exc}); quote it, e.g. '{{\"order_id\": 42}}'")
    if not isinstance(body, dict | list):
        fail("MESSAGE must be a JSON object or array")
    with errors_to_exit():
        topology = resolve_topology(file)
        # several URLs travel as one comma-separated string (the connect helpers split it)
        with Publisher(topology, ",".join(url_for(url))) as publisher:
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
        print_json(result)
    else:
        out.print(
            f"published {result['message_id']} via {result['exchange']} ({result['tier']}), "
            f"due at {result['due_at']} (in {result['delay']})",
            markup=False,
        )


@app.command("permissions")
def permissions_command(
    role: Annotated[
        str, typer.Argument(help="declarer, publisher or worker (see docs/security.md).")
    ],
    file: TopologyOpt = None,
    user: Annotated[str, typer.Option("--user", help="User name in the command.")] = "USER",
    vhost: Annotated[
        str | None,
        typer.Option("--vhost", help="Vhost (default: the vhost of --url).", show_default=False),
    ] = None,
    url: UrlOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Print the exact permissions ROLE needs on this topology, as a `rabbitmqctl
    set_permissions` line (configure, write, read regexes). Connects to nothing."""
    from rabbit_delay._plan.permissions import Role
    from rabbit_delay._plan.permissions import permissions as role_permissions
    from rabbit_delay._urls import vhost_of

    with errors_to_exit():
        try:
            chosen = Role(role)
        except ValueError:
            fail(f"unknown role {role!r}: choose one of {', '.join(r.value for r in Role)}")
        topology = resolve_topology(file)
        granted = role_permissions(topology, chosen)
        vhost = vhost if vhost is not None else vhost_of(url_for(url)[0])
    command = granted.rabbitmqctl(user, vhost)
    if as_json:
        print_json(
            {
                "role": chosen.value,
                "namespace": topology.names.prefix,
                "vhost": vhost,
                **granted.as_json(),
                "rabbitmqctl": command,
            }
        )
        return
    out.print(f"# {chosen.value} of {topology.names.prefix} (docs/security.md)", markup=False)
    out.print(command, markup=False)


__all__ = ["EXIT_ERROR", "declare", "plan", "publish"]
