"""`rabbit-delay plan` and `rabbit-delay declare`: what the topology needs on the broker,
compared with what is there (the plan, read by the management API or passive declares),
and declaring it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import typer
from rich.markup import escape
from rich.table import Table

import rabbit_delay._cli.options as opt
from rabbit_delay._broker import BrokerInfo
from rabbit_delay._errors import DeclarationConflict
from rabbit_delay._io.management import observe
from rabbit_delay._plan.diff import Change, Plan, PlanItem
from rabbit_delay._plan.program import DeclareReport
from rabbit_delay._topology.model import Topology
from rabbit_delay._urls import redact

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


def _print_plan(topology: Topology, broker: str, info: BrokerInfo, plan: Plan, source: str) -> None:
    """The plan's table, titled with the broker it was read from, and how it was read."""
    title = f"plan for {topology.names.prefix} on {redact(broker)} ({info.describe()})"
    opt.out.print(_table(escape(title), plan.items))
    opt.out.print(escape(f"read via {source}"))


def _summary(plan: Plan) -> str:
    counts: dict[str, int] = {}
    for i in plan.items:
        counts[i.action.value] = counts.get(i.action.value, 0) + 1
    return ", ".join(f"{n} {a}" for a, n in counts.items())


@dataclass(frozen=True, slots=True)
class _Read:
    """What `plan` and `declare` read first, on one connection: the topology's plan on
    the broker, and how it was read."""

    topology: Topology
    broker: str
    info: BrokerInfo
    source: str
    plan: Plan
    declare: Callable[[], DeclareReport]  # declares the topology on that connection


def _command(name: str, act: Callable[[_Read, bool], int]) -> Callable[..., None]:
    """The command `name`: it takes the same options and reads the broker as `plan`
    and `declare` do, then `act(read, as_json)` (whose docstring is its help) decides
    the exit code, with the connection still open."""

    def command(
        file: opt.TopologyArg = None,
        topology_file: opt.TopologyOpt = None,
        url: opt.UrlOpt = None,
        management_url: opt.MgmtOpt = None,
        no_management: opt.NoMgmtOpt = False,
        as_json: opt.JsonOpt = False,
    ) -> None:
        from rabbit_delay._sync.connection import close_quietly, connect_first
        from rabbit_delay.sync import broker_info
        from rabbit_delay.sync import declare as sync_declare
        from rabbit_delay.sync import plan as sync_plan

        with opt.errors_to_exit():
            topology = opt.resolve_topology(file, topology_file)
            connection, broker = connect_first(opt.url_for(url), name=f"rabbit-delay {name}")
            try:
                info = broker_info(connection)
                access = opt.management_access(info, broker, management_url, no_management)
                observed, source = observe(access, topology)
                found = sync_plan(connection, topology, observed=observed)
                declare = partial(sync_declare, connection, topology, observed=observed)
                code = act(_Read(topology, broker, info, source, found, declare), as_json)
            finally:
                close_quietly(connection)
        raise typer.Exit(code)

    command.__name__ = name
    command.__doc__ = act.__doc__
    return command


def _plan(read: _Read, as_json: bool) -> int:
    """Show what `declare` would create, and any conflict, without changing anything.

    Exit code: 0 in sync, 2 changes pending, 1 error (conflicts count as pending).
    """
    result = read.plan
    if as_json:
        opt.print_json(
            {
                "in_sync": result.in_sync,
                "source": read.source,
                "broker": redact(read.broker),
                "broker_version": read.info.version_text,
                "items": _items_json(result.items),
            }
        )
    else:
        _print_plan(read.topology, read.broker, read.info, result, read.source)
        for conflict in result.conflicts:
            opt.out.print(f"[bold red]conflict:[/] {escape(conflict.describe())}")
        state = "in sync" if result.in_sync else "changes pending"
        opt.out.print(f"{_summary(result)} -> {state}")
    return opt.EXIT_OK if result.in_sync else opt.EXIT_PENDING


def _declare(read: _Read, as_json: bool) -> int:
    """Declare the topology: tier buffers, due/catch-all/parking exchanges, business queues.

    Idempotent. Shows the plan first; stops without changing anything when an object
    exists with other arguments.
    """
    if not as_json:
        _print_plan(read.topology, read.broker, read.info, read.plan, read.source)
    try:
        report = read.declare()
    except DeclarationConflict as exc:
        if as_json:
            opt.print_json(  # the error document, with the plan that found it
                {
                    "ok": False,
                    "error": str(exc),
                    "kind": type(exc).__name__,
                    "source": read.source,
                    "items": _items_json(read.plan.items),
                }
            )
        raise
    if as_json:
        opt.print_json(
            {
                "ok": True,
                "changed": report.changed,
                "source": read.source,
                "broker_version": read.info.version_text,
                "items": _items_json(report.items, _DONE_WORDS),
            }
        )
        return opt.EXIT_OK
    opt.out.print(_table("result", report.items, _DONE_WORDS))
    created = len(report.created)
    opt.out.print(
        f"{created} object(s) created"
        if report.changed
        else "nothing to do: everything was already in place"
    )
    return opt.EXIT_OK


plan = _command("plan", _plan)
declare = _command("declare", _declare)


__all__ = ["declare", "plan"]
