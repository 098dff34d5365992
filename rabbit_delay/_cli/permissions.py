"""`rabbit-delay permissions ROLE`: the exact permissions a role needs on a topology, as a
`rabbitmqctl set_permissions` line (the rules: rabbit_delay._plan.permissions)."""

from __future__ import annotations

from typing import Annotated

import typer

import rabbit_delay._cli.options as opt


def permissions_command(
    role: Annotated[
        str, typer.Argument(help="declarer, publisher or worker (see docs/security.md).")
    ],
    file: opt.TopologyOpt = None,
    user: Annotated[str, typer.Option("--user", help="User name in the command.")] = "USER",
    vhost: Annotated[
        str | None,
        typer.Option("--vhost", help="Vhost (default: the vhost of --url).", show_default=False),
    ] = None,
    url: opt.UrlOpt = None,
    as_json: opt.JsonOpt = False,
) -> None:
    """Print the exact permissions ROLE needs on this topology, as a `rabbitmqctl
    set_permissions` line (configure, write, read regexes). Connects to nothing."""
    from rabbit_delay._plan.permissions import Role
    from rabbit_delay._plan.permissions import permissions as role_permissions
    from rabbit_delay._urls import vhost_of

    with opt.errors_to_exit():
        try:
            chosen = Role(role)
        except ValueError:
            opt.fail(f"unknown role {role!r}: choose one of {', '.join(r.value for r in Role)}")
        topology = opt.resolve_topology(file)
        granted = role_permissions(topology, chosen)
        vhost = vhost if vhost is not None else vhost_of(opt.url_for(url)[0])
    command = granted.rabbitmqctl(user, vhost)
    if as_json:
        opt.print_json(
            {
                "role": chosen.value,
                "namespace": topology.names.prefix,
                "vhost": vhost,
                **granted.as_json(),
                "rabbitmqctl": command,
            }
        )
        return
    opt.out.print(f"# {chosen.value} of {topology.names.prefix} (docs/security.md)", markup=False)
    opt.out.print(command, markup=False)


__all__ = ["permissions_command"]
