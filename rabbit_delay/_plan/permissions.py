"""The exact RabbitMQ permissions of each role for one topology. Pure.

RabbitMQ grants a user, per vhost, three regular expressions matched against the name
of the queue or exchange an operation touches (docs/security.md has the table):

    configure   declare (also re-declare an existing object) or delete it
    write       publish to an exchange; be the destination of a binding (queue or
                exchange); be the dead-letter exchange of a queue declared, or the
                alternate exchange of an exchange declared
    read        consume / get from a queue; be the source exchange of a binding; a
                queue declared with a dead-letter exchange; an exchange declared with an
                alternate exchange

Passive declares need no permission, so a publisher or a worker runs without any
configure permission once the topology exists. Each regex here matches exactly the
objects of the topology's namespace that the role uses (anchored, names escaped), not
another namespace's or another version's: a topology change (a tier, a queue, a version)
needs the permissions printed again (`rabbit-delay permissions ROLE`).

Roles:
    declarer   `rabbit-delay declare` (or a worker started with --declare)
    publisher  `Publisher` / `AsyncPublisher` / `rabbit-delay publish`
    worker     consumes the business queues, re-publishes retries and deferrals through
               the delays, parks through the parking exchange
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

from rabbit_delay._plan.desired import PLUGIN_EXCHANGE_TYPE, Desired, Kind, desired
from rabbit_delay._topology.model import Topology

# The server-named exclusive queue of the declarer's routing probe (program.RoutesEveryKey),
# made only for a [plugin] topology whose arguments cannot be read through the
# management API. Exclusive: no other connection can touch one of these.
SERVER_NAMED_QUEUES = r"amq\.gen-.*"
_META = re.compile(r"([\\^$.|?*+()\[\]{}])")


class Role(StrEnum):
    DECLARER = "declarer"
    PUBLISHER = "publisher"
    WORKER = "worker"


def escape(name: str) -> str:
    """`name` as a literal in a PCRE (RabbitMQ's regex flavour) or Python regex."""
    return _META.sub(r"\\\1", name)


def name_regex(names: Iterable[str], *, prefix: str, extra: Iterable[str] = ()) -> str:
    """An anchored regex matching exactly `names` (each starting with `prefix`), plus the
    `extra` regexes; "" (RabbitMQ: nothing at all) when both are empty."""
    names = sorted(set(names))
    alternatives = list(extra)
    if names:
        head = prefix + "."
        assert all(n.startswith(head) for n in names), "names outside the namespace"
        rest = "|".join(escape(n[len(head) :]) for n in names)
        alternatives.insert(0, f"{escape(head)}(?:{rest})")
    if not alternatives:
        return ""
    if len(alternatives) == 1:
        return f"^{alternatives[0]}$"
    return "^(?:" + "|".join(alternatives) + ")$"


@dataclass(frozen=True, slots=True)
class Permissions:
    """One role's permissions on one topology: the object names behind each of the three
    regexes, and the regexes (RabbitMQ's `configure`, `write`, `read`)."""

    role: Role
    prefix: str  # the namespace's name prefix, e.g. "shop.v1"
    configure_names: frozenset[str]
    write_names: frozenset[str]
    read_names: frozenset[str]
    server_named_queues: bool = False  # the declarer's plugin routing probe

    def _regex(self, names: frozenset[str]) -> str:
        extra = [SERVER_NAMED_QUEUES] if self.server_named_queues else []
        return name_regex(names, prefix=self.prefix, extra=extra)

    @property
    def configure(self) -> str:
        return self._regex(self.configure_names)

    @property
    def write(self) -> str:
        return self._regex(self.write_names)

    @property
    def read(self) -> str:
        return self._regex(self.read_names)

    def as_json(self) -> dict[str, str]:
        """The body of the management API's `PUT /api/permissions/VHOST/USER`."""
        return {"configure": self.configure, "write": self.write, "read": self.read}

    def rabbitmqctl(self, user: str, vhost: str = "/") -> str:
        """The `rabbitmqctl set_permissions` command line granting these permissions
        (shell-quoted; an empty regex grants nothing)."""
        words = ["rabbitmqctl", "set_permissions", "-p", vhost, user]
        quoted = " ".join(shlex.quote(w) for w in words)
        regexes = " ".join(_quote(r) for r in (self.configure, self.write, self.read))
        return f"{quoted} {regexes}"


def _quote(regex: str) -> str:
    """Single quotes always (an empty regex must stay an argument)."""
    return "'" + regex.replace("'", "'\"'\"'") + "'"


def publish_targets(topology: Topology) -> frozenset[str]:
    """Every exchange a publisher may publish to (delays.Router): the tier exchanges (of
    every shard), the cascade's entry exchanges and its delivery exchange (a delay of 0),
    the plugin's, the holding queue's."""
    n = topology.names
    targets = {x for t in topology.tiers for x in topology.tier_exchanges(t)}
    if topology.cascade is not None:
        targets |= {n.cascade_entry_exchange(level) for level in range(topology.cascade.levels)}
        targets.add(n.cascade_deliver_exchange())
    if topology.plugin is not None:
        targets.add(n.plugin_exchange())
    if topology.held is not None:
        targets.add(n.held_exchange())
    return frozenset(targets)


def _declarer(topology: Topology, want: Desired) -> Permissions:
    configure = {spec.name for spec in want.objects}
    write: set[str] = set()
    read: set[str] = set()
    for binding in want.bindings:
        write.add(binding.destination)  # queue or exchange
        read.add(binding.source)
    for queue in want.queues:
        dlx = queue.arguments.get("x-dead-letter-exchange")
        if isinstance(dlx, str):
            read.add(queue.name)
            write.add(dlx)
    for exchange in want.exchanges:
        alternate = exchange.arguments.get("alternate-exchange")
        if isinstance(alternate, str):
            read.add(exchange.name)
            write.add(alternate)
    plugin = any(e.type == PLUGIN_EXCHANGE_TYPE for e in want.exchanges)
    if plugin:  # the routing probe publishes through the plugin exchange
        write |= {e.name for e in want.exchanges if e.type == PLUGIN_EXCHANGE_TYPE}
    return Permissions(
        Role.DECLARER,
        topology.names.prefix,
        frozenset(configure),
        frozenset(write),
        frozenset(read),
        server_named_queues=plugin,
    )


def permissions(topology: Topology, role: Role | str) -> Permissions:
    """What `role` needs on the broker for `topology`, and nothing more.

    Raises ValueError for an unknown role.
    """
    role = Role(role)
    n = topology.names
    want = desired(topology)
    if role is Role.DECLARER:
        return _declarer(topology, want)
    targets = publish_targets(topology)
    nothing: frozenset[str] = frozenset()
    if role is Role.PUBLISHER:
        return Permissions(role, n.prefix, nothing, targets, nothing)
    # A worker consumes its business queues (read; the passive declare that checks them
    # needs none), re-publishes retries and deferrals through the delays (write, like a
    # publisher), and parks through the parking exchange (write). A rejected message is
    # dead-lettered by the broker itself, which checks no permission of the worker.
    consumed = frozenset(n.business_queue(q) for q in topology.queues)
    return Permissions(role, n.prefix, nothing, targets | {n.parking_exchange()}, consumed)


def object_names(topology: Topology) -> dict[Kind, frozenset[str]]:
    """Every exchange and queue name the topology declares (for checking the regexes)."""
    want = desired(topology)
    return {
        Kind.EXCHANGE: frozenset(e.name for e in want.exchanges),
        Kind.QUEUE: frozenset(q.name for q in want.queues),
    }


__all__ = [
    "SERVER_NAMED_QUEUES",
    "Permissions",
    "Role",
    "escape",
    "name_regex",
    "object_names",
    "permissions",
    "publish_targets",
]
