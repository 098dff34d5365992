"""`rabbit-delay permissions ROLE`: the exact permissions a role needs on a topology, as a
`rabbitmqctl set_permissions` line (the rules: rabbit_delay._plan.permissions)."""

from __future__ import annotations

from typing import Annotated

import typer

from rabbit_delay._cli.options import (
    JsonOpt,
    TopologyOpt,
    UrlOpt,
    errors_to_exit,
    fail,
    out,
    print_json,
    resolve_topology,
    url_for,
)


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


__all__ = ["permissions_command"]
