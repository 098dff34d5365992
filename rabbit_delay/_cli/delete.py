"""`rabbit-delay delete FILE`: remove a drained topology version from the broker."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

import rabbit_delay._cli.options as opt
from rabbit_delay._ops.delete.rules import DeleteReport, Target


def _targets_table(title: str, rows: list[tuple[Target, str]]) -> Table:
    table = Table(title=escape(title), title_justify="left")
    table.add_column("kind")
    table.add_column("name", overflow="fold")
    table.add_column("status")
    for target, status in rows:
        extra = " (retired shard)" if target.extra else ""
        table.add_row(target.kind.value, escape(target.name), escape(status + extra))
    return table


def _print(report: DeleteReport) -> None:
    p = report.plan
    if p.refused:
        opt.out.print(
            escape(f"refused: {len(p.blocked)} queue(s) of {p.namespace} are not drained:"),
            style="bold red",
        )
        for b in p.blocked:
            opt.out.print(escape(f"  {b.name}: {b.reason}"))
        opt.out.print(
            "Nothing was deleted. Drain them (stop the publishers, wait for the buffers, "
            "handle or replay the parked messages), or pass --force to delete them with "
            "their messages."
        )
        return
    if report.dry_run:
        rows = [(t, "would delete") for t in p.delete] + [(t, "missing") for t in p.missing]
        opt.out.print(_targets_table(f"dry run: delete {p.namespace}", rows))
        lost = sum(b.state.held for b in p.blocked)
        forced = f", with {lost} message(s) (--force)" if p.blocked else ""
        opt.out.print(
            escape(f"would delete {len(p.delete)} object(s){forced}; nothing was changed")
        )
        return
    rows = [(t, "deleted") for t in report.deleted] + [(t, "missing") for t in p.missing]
    if rows:
        opt.out.print(_targets_table(f"delete {p.namespace}", rows))
    if not p.delete and not report.deleted:
        opt.out.print(escape(f"nothing to delete: no object of {p.namespace} is on the broker"))
    else:
        opt.out.print(escape(f"deleted {len(report.deleted)} object(s) of {p.namespace}"))


def delete(
    file: opt.TopologyArg = None,
    topology_file: opt.TopologyOpt = None,
    force: Annotated[
        bool,
        typer.Option(
            "--force", help="Delete queues that still hold messages or have consumers, too."
        ),
    ] = False,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="List what would be deleted; change nothing.")
    ] = False,
    url: opt.UrlOpt = None,
    management_url: opt.MgmtOpt = None,
    no_management: opt.NoMgmtOpt = False,
    as_json: opt.JsonOpt = False,
) -> None:
    """Delete a drained topology version: every queue and exchange the topology file
    declares (and shards past a lowered count), nothing of another namespace or version.

    Refused, deleting nothing, while any of its queues holds messages or has consumers
    (they are listed), unless --force. Exit code 0 when deleted or nothing to do (or,
    with --dry-run, when it would go ahead); 1 when refused or on an error.
    """
    from rabbit_delay._ops.delete.execute import delete as sync_delete
    from rabbit_delay._sync.connection import close_quietly, connect_first
    from rabbit_delay.sync import broker_info

    with opt.errors_to_exit():
        topology = opt.resolve_topology(file, topology_file)
        connection, broker = connect_first(opt.url_for(url), name="rabbit-delay delete")
        try:
            info = broker_info(connection)
            endpoint = opt.management_access(info, broker, management_url, no_management).endpoint
            report = sync_delete(
                connection, topology, force=force, dry_run=dry_run, endpoint=endpoint
            )
        finally:
            close_quietly(connection)
    opt.print_result(report, as_json, _print)
    opt.exit_on_failure(report.error, as_json=as_json)
    raise typer.Exit(opt.EXIT_ERROR if report.plan.refused else opt.EXIT_OK)


__all__ = ["delete"]
