"""status and replay: what is waiting where, and moving parked messages back."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from rabbit_delay.cli._app import (
    EXIT_ERROR,
    EXIT_OK,
    JsonOpt,
    TopologyArg,
    TopologyOpt,
    UrlOpt,
    app,
    err,
    errors_to_exit,
    fail,
    out,
    print_json,
    resolve_topology,
    url_for,
)
from rabbit_delay.cli._unreachable import describe_unavailable
from rabbit_delay.cli.commands import MgmtOpt, NoMgmtOpt, management_access
from rabbit_delay.durations import format_ms
from rabbit_delay.errors import BrokerUnavailable, ManagementUnavailable
from rabbit_delay.management import QueueStats, read_queue_stats
from rabbit_delay.plan import desired
from rabbit_delay.topology import Topology
from rabbit_delay.urls import ManagementEndpoint, management_endpoint, redact

if TYPE_CHECKING:
    from rabbit_delay.broker import BrokerInfo
    from rabbit_delay.sync.replay import PassiveCounts, Preview, ReplayReport

# A parking lot or the catch-all holds messages, or a delay buffer has consumers.
EXIT_ATTENTION = 3


class Role(StrEnum):
    BUFFER = "tier buffer"
    CASCADE = "cascade level"
    BUSINESS = "business"
    PARKING = "parking lot"
    CATCH_ALL = "catch-all"


_ROLE_OF_KIND = {
    "delay": Role.BUFFER,
    "cascade": Role.CASCADE,
    "q": Role.BUSINESS,
    "parking": Role.PARKING,
    "unroutable": Role.CATCH_ALL,
}
_ORDER = list(Role)
# Queues whose messages wait for a human.
_HUMAN = (Role.PARKING, Role.CATCH_ALL)
# Queues that must never have consumers: they hold messages until their TTL expires.
_BUFFERS = (Role.BUFFER, Role.CASCADE)


@dataclass
class QueueRow:
    role: Role
    name: str
    ttl_ms: int | None
    exists: bool
    ready: int | None
    unacked: int | None
    consumers: int | None
    # Where a quorum queue's replicas are, as the management API says (None: not told).
    leader: str | None = None
    members: tuple[str, ...] | None = None
    online: tuple[str, ...] | None = None
    # Dead-lettered by this quorum queue, not yet confirmed by the target (management API).
    dead_lettering: int | None = None
    notes: list[str] = field(default_factory=list)
    attention: bool = False

    @property
    def offline(self) -> tuple[str, ...]:
        """Members the API does not list as online (none when it does not say)."""
        if self.members is None or self.online is None:
            return ()
        return tuple(m for m in self.members if m not in self.online)

    @property
    def majority_lost(self) -> bool:
        """A quorum queue with fewer than a majority of its members online: it accepts,
        dead-letters and delivers nothing until enough of them are back."""
        if not self.members or self.online is None:
            return False
        return len(self.members) - len(self.offline) < len(self.members) // 2 + 1

    def as_json(self) -> dict[str, Any]:
        return {
            "role": self.role.value,
            "name": self.name,
            "ttl": format_ms(self.ttl_ms) if self.ttl_ms is not None else None,
            "ttl_ms": self.ttl_ms,
            "exists": self.exists,
            "ready": self.ready,
            "unacked": self.unacked,
            "consumers": self.consumers,
            "leader": self.leader,
            "members": list(self.members) if self.members is not None else None,
            "online": list(self.online) if self.online is not None else None,
            "dead_lettering": self.dead_lettering,
            "attention": self.attention,
            "notes": self.notes,
        }


def status_rows(
    topology: Topology,
    live: dict[str, PassiveCounts | None] | None,
    api: dict[str, QueueStats] | None,
) -> list[QueueRow]:
    """One row per queue of the topology, flagged. Pure: counts are passed in.

    `live` (passive declares) gives ready messages and consumers as they are now; `api`
    (management API, sampled) adds unacked messages and each quorum queue's leader,
    members and online members, and stands in when `live` is None.
    """
    rows: list[QueueRow] = []
    for spec in desired(topology).queues:
        kind, _ = topology.names.parse(spec.name)
        role = _ROLE_OF_KIND[kind]
        ttl = spec.arguments.get("x-message-ttl")
        stats = api.get(spec.name) if api is not None else None
        if live is not None:
            counts = live.get(spec.name)
            exists = counts is not None
            ready = counts.ready if counts is not None else None
            consumers = counts.consumers if counts is not None else None
        else:
            exists = stats is not None
            ready = stats.ready if stats is not None else None
            consumers = stats.consumers if stats is not None else None
        row = QueueRow(
            role,
            spec.name,
            ttl if isinstance(ttl, int) else None,
            exists,
            ready,
            stats.unacked if stats is not None else None,
            consumers,
            stats.leader if stats is not None else None,
            stats.members if stats is not None else None,
            stats.online if stats is not None else None,
            stats.dead_lettering if stats is not None else None,
        )
        _flag(row)
        rows.append(row)
    rows.sort(key=lambda r: _ORDER.index(r.role))  # stable: tiers keep the topology's order
    return rows


def _flag(row: QueueRow) -> None:
    if not row.exists:
        row.notes.append("missing: run `rabbit-delay declare`")
        return
    held = (row.ready or 0) + (row.unacked or 0)
    if row.role in _HUMAN and held:
        row.attention = True
        row.notes.append(f"{held} message(s) need a human")
    if row.role in _BUFFERS and row.consumers:
        row.attention = True
        row.notes.append(f"BUG: {row.consumers} consumer(s) on a delay buffer")
    if row.dead_lettering:
        row.notes.append(
            f"{row.dead_lettering} dead-lettered, not yet confirmed by their destination"
        )
    if row.majority_lost:
        row.attention = True
        online = len(row.members or ()) - len(row.offline)
        row.notes.append(
            f"no majority: {online} of {len(row.members or ())} members online, "
            f"offline: {', '.join(row.offline)}"
        )
    elif row.offline:
        row.notes.append(f"offline: {', '.join(row.offline)}")
    elif row.members and row.leader is None:
        row.notes.append("no leader reported")


def _hint(topology: Topology, row: QueueRow) -> str:
    if row.majority_lost:
        return (
            "a quorum queue needs a majority of its members online: start the stopped "
            "node(s) (`rabbitmqctl cluster_status` lists them); no message is lost meanwhile"
        )
    if row.role in _BUFFERS:
        return (
            "a consumer on a delay buffer takes messages before they are due; find it with "
            "`rabbitmqctl list_consumers` and stop it"
        )
    if row.role is Role.CATCH_ALL:
        return "due messages that matched no queue; see `rabbit-delay replay --unroutable`"
    _, queue = topology.names.parse(row.name)
    return f"parked messages; see `rabbit-delay replay {queue} --dry-run`"


def _cell(value: int | None) -> str:
    return "?" if value is None else str(value)


def shows_placement(rows: list[QueueRow]) -> bool:
    """Whether the table gets the leader and members columns: only when the management
    API names more than one node (a cluster), so a single node's table stays as it was."""
    nodes = {row.leader for row in rows if row.leader is not None}
    for row in rows:
        nodes.update(row.members or ())
    return len(nodes) > 1


def placement_cells(row: QueueRow) -> tuple[str, str]:
    """The leader and members cells of a row: `rabbit@b`, `2/3 online`; `?` where the
    API did not say (a classic queue, or no API), `none` for a queue without a leader."""
    if row.members is None:
        return ("?" if row.leader is None else row.leader), "?"
    leader = row.leader if row.leader is not None else "none"
    if row.online is None:
        return leader, str(len(row.members))
    return leader, f"{len(row.members) - len(row.offline)}/{len(row.members)} online"


def _status_table(title: str, rows: list[QueueRow]) -> Table:
    table = Table(title=title, title_justify="left")
    placement = shows_placement(rows)
    table.add_column("role")
    table.add_column("queue", overflow="fold")
    table.add_column("ttl", justify="right")
    table.add_column("ready", justify="right")
    table.add_column("unacked", justify="right")
    table.add_column("consumers", justify="right")
    if placement:
        table.add_column("leader", overflow="fold")
        table.add_column("members", justify="right")
    table.add_column("notes", overflow="fold")
    for row in rows:
        style = "bold red" if row.attention else ("yellow" if not row.exists else "")
        notes = escape("; ".join(row.notes))
        cells = [
            row.role.value,
            escape(row.name),
            format_ms(row.ttl_ms) if row.ttl_ms is not None else "",
            _cell(row.ready),
            _cell(row.unacked),
            _cell(row.consumers),
        ]
        if placement:
            cells += [escape(cell) for cell in placement_cells(row)]
        cells.append(f"[{style}]{notes}[/]" if style and notes else notes)
        table.add_row(*cells, style=None)
    return table


@app.command()
def status(
    file: TopologyArg = None,
    topology_file: TopologyOpt = None,
    url: UrlOpt = None,
    management_url: MgmtOpt = None,
    no_management: NoMgmtOpt = False,
    check: Annotated[
        bool,
        typer.Option(
            "--check",
            help=f"Exit {EXIT_ATTENTION} when a parking lot or the catch-all holds messages, "
            "a delay buffer has consumers, or a quorum queue has lost the majority of its "
            "members (for monitoring scripts).",
        ),
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Every queue of the topology with its messages (ready / unacked) and consumers.

    Ready messages and consumers: live, from passive declares.
    Unacked messages: from the management API, sampled every few seconds ('?' without it).
    In a cluster, each quorum queue's leader and members online (management API).
    Exit code 0; 3 with --check when something needs a human; 1 on error.
    """
    from rabbit_delay.sync import broker_info
    from rabbit_delay.sync._connection import close_quietly, connect_first
    from rabbit_delay.sync.replay import passive_counts

    with errors_to_exit():
        topology = resolve_topology(file, topology_file)
        urls = url_for(url)
        broker = urls[0]  # the node shown until one answers
        names = [spec.name for spec in desired(topology).queues]
        live: dict[str, PassiveCounts | None] | None = None
        amqp_error: BrokerUnavailable | None = None
        info: BrokerInfo | None = None
        endpoint: ManagementEndpoint | None = None
        try:
            connection, broker = connect_first(urls, name="rabbit-delay status")
        except BrokerUnavailable as exc:
            amqp_error = exc
            # Nothing to compare the API with: use it, and say it is unverified.
            if not no_management:
                endpoint = management_endpoint(broker, management_url)
            api_note = f"{endpoint.base} (not verified: no AMQP connection)" if endpoint else ""
        else:
            try:
                info = broker_info(connection)
                live = passive_counts(connection, names)
            finally:
                close_quietly(connection)
            access = management_access(info, broker, management_url, no_management)
            endpoint, api_note = access.endpoint, access.note
        api: dict[str, QueueStats] | None = None
        api_error = api_note or "not used (--no-management)"
        if endpoint is not None:
            try:
                api = read_queue_stats(endpoint, topology.names.prefix + ".")
            except ManagementUnavailable as exc:
                api_error = f"not reachable ({exc})"
        if live is None and api is None:
            assert amqp_error is not None
            fail(
                f"{describe_unavailable(amqp_error)}; management API {api_error}",
                kind=type(amqp_error).__name__,
            )
    rows = status_rows(topology, live, api)
    attention = any(r.attention for r in rows)
    sources = {
        "ready_and_consumers": "amqp passive declare" if live is not None else "management API",
        "unacked": "management API" if api is not None else None,
        "placement": "management API" if api is not None else None,
    }
    if as_json:
        print_json(
            {
                "namespace": topology.names.prefix,
                "broker": redact(broker),
                "broker_version": info.version_text if info is not None else None,
                "sources": sources,
                "management_api": "ok" if api is not None else api_error,
                "attention": attention,
                "queues": [r.as_json() for r in rows],
            }
        )
    else:
        described = f" ({info.describe()})" if info is not None else ""
        title = f"status of {topology.names.prefix} on {redact(broker)}{described}"
        out.print(_status_table(escape(title), rows))
        if api is None:
            out.print(escape(f"management API {api_error}: unacked messages unknown ('?')"))
        if live is None:
            out.print(escape(f"no AMQP connection ({amqp_error}): counts from the management API"))
        for row in rows:
            if row.attention:
                hint = escape(f"{row.name}: {_hint(topology, row)}")
                out.print(f"[bold red]needs attention:[/] {hint}")
        if not attention:
            out.print("[green]nothing needs attention[/]")
    raise typer.Exit(EXIT_ATTENTION if check and attention else EXIT_OK)


# -- replay -----------------------------------------------------------------------------


def _looks_like_file(text: str) -> bool:
    return text.endswith(".toml") or Path(text).exists()


def _preview_json(preview: Preview) -> dict[str, Any]:
    return {
        "dry_run": True,
        "source": preview.source,
        "destination": preview.destination,
        "held": preview.held,
        "via": preview.via,
        "would_move": sum(1 for p in preview.messages if p.moves),
        "messages": [p.message.summary() | {"action": p.action} for p in preview.messages],
    }


def _preview_table(preview: Preview) -> Table:
    title = f"dry run: {preview.source} -> {preview.destination} (read via {preview.via})"
    table = Table(title=escape(title), title_justify="left")
    for column in ("message_id", "error", "attempts", "reason", "parked at", "would go to"):
        table.add_column(column, overflow="fold")
    for p in preview.messages:
        s = p.message.summary()
        error = ": ".join(str(s[k]) for k in ("error_type", "error_message") if s[k] is not None)
        action = escape(p.action) if p.moves else f"[yellow]{escape(p.action)}[/]"
        table.add_row(
            escape(str(s["message_id"])),
            escape(error[:200]),
            _cell(s["attempts"] if isinstance(s["attempts"], int) else None),
            escape(str(s["park_reason"] or "")),
            escape(str(s["parked_at"] or "")),
            action,
        )
    return table


def _report_json(report: ReplayReport) -> dict[str, Any]:
    return {
        "dry_run": False,
        "ok": report.ok,
        "source": report.source,
        "destination": report.destination,
        "moved": len(report.moved),
        "message_ids": [m.message_id for m in report.moved],
        "left": [{"message_id": mid, "reason": why} for mid, why in report.left],
        "error": report.error,
    }


@app.command()
def replay(
    queue: Annotated[
        str | None,
        typer.Argument(
            help="Business queue (logical name) whose parking lot to replay; with "
            "--unroutable, only catch-all messages for this queue.",
            show_default=False,
        ),
    ] = None,
    file: TopologyArg = None,
    topology_file: TopologyOpt = None,
    limit: Annotated[
        int | None,
        typer.Option("--limit", "-n", min=1, help="Move at most N messages.", show_default=False),
    ] = None,
    tier: Annotated[
        str | None,
        typer.Option("--tier", "-t", help="Replay after this delay tier instead of at once."),
    ] = None,
    now: Annotated[
        bool, typer.Option("--now", help="Replay at once, through the due exchange (default).")
    ] = False,
    dry_run: Annotated[
        bool,
        typer.Option("--dry-run", help="List what would be replayed; every message stays put."),
    ] = False,
    unroutable: Annotated[
        bool,
        typer.Option(
            "--unroutable",
            help="Re-route the catch-all's messages to their original target instead.",
        ),
    ] = False,
    url: UrlOpt = None,
    management_url: MgmtOpt = None,
    no_management: NoMgmtOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Move parked messages back to their business queue as first attempts (rd-attempt 1).

    Each copy is confirmed by the broker before the parked message is acked.
    On a failure the message stays parked and the command stops with exit code 1.
    """
    from rabbit_delay.sync import broker_info
    from rabbit_delay.sync._connection import close_quietly, connect_first
    from rabbit_delay.sync.replay import (
        preview_parked,
        preview_unroutable,
        replay_parked,
        replay_unroutable,
    )

    if tier is not None and now:
        fail("give either --tier or --now, not both")
    if unroutable:
        if tier is not None:
            fail("--tier does not apply to --unroutable: catch-all messages are already due")
        if queue is not None and file is None and topology_file is None and _looks_like_file(queue):
            file, queue = Path(queue), None
    elif queue is None or (file is None and topology_file is None and _looks_like_file(queue)):
        fail("name the QUEUE whose parking lot to replay, or pass --unroutable for the catch-all")

    with errors_to_exit():
        topology = resolve_topology(file, topology_file)
        connection, broker = connect_first(url_for(url), name="rabbit-delay replay")
        try:
            if dry_run:
                info = broker_info(connection)
                endpoint = management_access(info, broker, management_url, no_management).endpoint
                if unroutable:
                    preview = preview_unroutable(
                        connection, topology, queue=queue, limit=limit, endpoint=endpoint
                    )
                else:
                    assert queue is not None
                    preview = preview_parked(
                        connection, topology, queue, tier=tier, limit=limit, endpoint=endpoint
                    )
            elif unroutable:
                report = replay_unroutable(connection, topology, queue=queue, limit=limit)
            else:
                assert queue is not None
                report = replay_parked(connection, topology, queue, tier=tier, limit=limit)
        finally:
            close_quietly(connection)

    if dry_run:
        if as_json:
            print_json(_preview_json(preview))
        else:
            out.print(_preview_table(preview))
            moving = sum(1 for p in preview.messages if p.moves)
            shown = len(preview.messages)
            more = f" (showing {shown} of {preview.held})" if shown < preview.held else ""
            out.print(f"would move {moving} message(s){escape(more)}; nothing was changed")
        raise typer.Exit(EXIT_OK)

    if as_json:
        print_json(_report_json(report))
    else:
        moved = f"moved {len(report.moved)} message(s) from {report.source} to {report.destination}"
        out.print(escape(moved))
        for message_id, why in report.left:
            err.print("[yellow]left in place:[/] ", end="")
            err.print(redact(f"{message_id}: {why}"), markup=False)
    if report.error is not None:
        if as_json:
            raise typer.Exit(EXIT_ERROR)
        fail(report.error)
    raise typer.Exit(EXIT_OK)


__all__ = [
    "EXIT_ATTENTION",
    "QueueRow",
    "Role",
    "placement_cells",
    "replay",
    "shows_placement",
    "status",
    "status_rows",
]
