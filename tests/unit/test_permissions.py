"""Least-privilege permissions per role: each regex matches exactly the objects the role
uses in its namespace, and nothing of another namespace or version."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from rabbit_delay import AccessRefused, Topology, load_topology, topology_from_dict
from rabbit_delay._errors import broker_refusal
from rabbit_delay._plan.desired import Kind, desired
from rabbit_delay._plan.permissions import (
    Permissions,
    Role,
    escape,
    name_regex,
    object_names,
    permissions,
    publish_targets,
)


def _topology(namespace: str = "shop", version: int = 1, **extra: Any) -> Topology:
    data: dict[str, Any] = {
        "namespace": namespace,
        "version": version,
        "tiers": {"5m": "5m", "30m": "30m"},
        "queues": {"orders.cancel": {}, "push": {"bindings": ["push.any"]}},
    }
    data.update(extra)
    return topology_from_dict(data)


TOPOLOGIES = {
    "tiers": _topology(),
    "cascade": _topology(cascade={"levels": 4, "resolution": "1s"}),
    "plugin": _topology(plugin={}),
    "classic": _topology(queue_type="classic"),
}


def _matches(regex: str, name: str) -> bool:
    """How RabbitMQ applies a permission: an unanchored search ("" means nothing)."""
    return bool(regex) and re.search(regex, name) is not None


def _all_names(topology: Topology) -> set[str]:
    names = object_names(topology)
    return set(names[Kind.EXCHANGE] | names[Kind.QUEUE])


def _neighbours(topology: Topology) -> set[str]:
    """Names of other namespaces and versions that share a prefix with this one, and
    near misses inside it."""
    others = set()
    for other in (
        _topology("shop", 2),
        _topology("shop", 10),
        _topology("shop", 11),
        _topology("shopx", 1),
        _topology("sho", 1),
        _topology("shop-v1", 1),
        _topology("shop_", 1),
    ):
        others |= _all_names(other)
    mine = _all_names(topology)
    # (no "\n" suffix: `$` also matches before a final newline, but the broker strips CR
    # and LF from the names it is given)
    others |= {name + suffix for name in mine for suffix in ("x", ".x", "-", ".in")}
    others |= {"x" + name for name in mine}
    others |= {"", "amq.default", "amq.direct", "amq.topic", "shop.v1", "shop.v1."}
    return others - mine


def _check_exact(granted: Permissions, topology: Topology) -> None:
    universe = _all_names(topology) | _neighbours(topology)
    for regex, names in (
        (granted.configure, granted.configure_names),
        (granted.write, granted.write_names),
        (granted.read, granted.read_names),
    ):
        assert names <= _all_names(topology)
        matched = {n for n in universe if _matches(regex, n)}
        server_named = {n for n in matched if n.startswith("amq.gen-")}
        assert matched - server_named == set(names), regex


@pytest.mark.parametrize("kind", sorted(TOPOLOGIES))
@pytest.mark.parametrize("role", list(Role))
def test_each_regex_matches_exactly_the_roles_objects(kind: str, role: Role) -> None:
    topology = TOPOLOGIES[kind]
    _check_exact(permissions(topology, role), topology)


def test_declarer_configures_every_object_and_reads_and_writes_what_declaring_checks() -> None:
    topology = TOPOLOGIES["tiers"]
    want = desired(topology)
    granted = permissions(topology, Role.DECLARER)
    assert granted.configure_names == _all_names(topology)
    # bindings: write on the destination, read on the source
    for b in want.bindings:
        assert b.destination in granted.write_names
        assert b.source in granted.read_names
    # a queue with a dead-letter exchange: read on the queue, write on the DLX
    n = topology.names
    assert n.tier_queue("5m") in granted.read_names
    assert n.due_exchange() in granted.write_names
    assert n.parking_exchange() in granted.write_names
    # an exchange with an alternate exchange: read on it, write on the AE
    assert n.unroutable_exchange() in granted.write_names
    # parking lots have no DLX and are no binding source: no read (the catch-all queue
    # is, by name, also the catch-all exchange, a binding source)
    assert n.parking_queue("push") not in granted.read_names


def test_publisher_only_writes_to_the_exchanges_it_publishes_to() -> None:
    topology = TOPOLOGIES["tiers"]
    n = topology.names
    granted = permissions(topology, "publisher")
    assert granted.configure == ""
    assert granted.read == ""
    assert granted.write_names == {n.tier_exchange("5m"), n.tier_exchange("30m")}
    assert not _matches(granted.write, n.parking_exchange())
    assert not _matches(granted.write, n.due_exchange())


def test_publisher_of_a_cascade_writes_to_its_entries_and_delivery_exchange() -> None:
    topology = TOPOLOGIES["cascade"]
    n = topology.names
    targets = publish_targets(topology)
    assert {n.cascade_entry_exchange(level) for level in range(4)} <= targets
    assert n.cascade_deliver_exchange() in targets
    # the levels' topic exchanges are reached by dead-lettering, never published to
    assert n.cascade_exchange(0) not in targets


def test_plugin_topology_publishes_to_the_plugin_exchange_and_lets_the_declarer_probe() -> None:
    topology = TOPOLOGIES["plugin"]
    n = topology.names
    assert permissions(topology, Role.PUBLISHER).write_names == {
        n.tier_exchange("5m"),
        n.tier_exchange("30m"),
        n.plugin_exchange(),
    }
    declarer = permissions(topology, Role.DECLARER)
    # the routing probe: a server-named exclusive queue, bound, published through, read
    for regex in (declarer.configure, declarer.write, declarer.read):
        assert _matches(regex, "amq.gen-JzTY20BRgKO-HjmUJj0wLg")
        assert not _matches(regex, "amq.default")
    assert n.plugin_exchange() in declarer.write_names
    # no other role ever gets server-named queues
    assert not _matches(permissions(topology, Role.WORKER).read, "amq.gen-x")


def test_worker_reads_its_queues_and_writes_retries_and_parking_without_configure() -> None:
    topology = TOPOLOGIES["tiers"]
    n = topology.names
    granted = permissions(topology, Role.WORKER)
    assert granted.configure == ""
    assert granted.read_names == {n.business_queue("orders.cancel"), n.business_queue("push")}
    assert granted.write_names == publish_targets(topology) | {n.parking_exchange()}
    assert not _matches(granted.read, n.parking_queue("push"))  # replay's, not the worker's
    assert not _matches(granted.read, n.tier_queue("5m"))  # a buffer must have no consumer


def test_regexes_escape_every_metacharacter() -> None:
    assert escape("a.b+c(d)[e]{f}|g^h$i?j*k\\l") == r"a\.b\+c\(d\)\[e\]\{f\}\|g\^h\$i\?j\*k\\l"
    regex = name_regex(["ns.v1.q.a+b", "ns.v1.q.a.b"], prefix="ns.v1")
    assert regex == r"^ns\.v1\.(?:q\.a\+b|q\.a\.b)$"
    assert _matches(regex, "ns.v1.q.a+b")
    assert not _matches(regex, "ns.v1.q.aab")
    assert name_regex([], prefix="ns.v1") == ""
    assert name_regex([], prefix="ns.v1", extra=[r"amq\.gen-.*"]) == r"^amq\.gen-.*$"


def test_rabbitmqctl_line_and_management_body() -> None:
    topology = TOPOLOGIES["tiers"]
    granted = permissions(topology, Role.PUBLISHER)
    line = granted.rabbitmqctl("pub user", "/shop")
    assert line == (
        "rabbitmqctl set_permissions -p /shop 'pub user' "
        r"'' '^shop\.v1\.(?:delay\.30m|delay\.5m)$' ''"
    )
    assert granted.as_json() == {
        "configure": "",
        "write": r"^shop\.v1\.(?:delay\.30m|delay\.5m)$",
        "read": "",
    }


def test_unknown_role_is_refused() -> None:
    with pytest.raises(ValueError, match="admin"):
        permissions(TOPOLOGIES["tiers"], "admin")


def test_the_lines_in_docs_security_md_are_what_the_command_prints() -> None:
    root = Path(__file__).resolve().parents[2]
    topology = load_topology(root / "topology" / "orders.toml")
    doc = (root / "docs" / "security.md").read_text()
    for role in Role:
        line = permissions(topology, role).rabbitmqctl(f"rd-{role.value}", "/")
        assert line in doc, f"docs/security.md is out of date for the {role.value}:\n{line}"


def test_a_refused_passive_check_names_the_permission_the_role_needs() -> None:
    # RabbitMQ 4.3 refuses a passive declare of an object the user has no permission on
    # as "configure access", though read (or write) is enough: a worker needs read.
    reply = "ACCESS_REFUSED - configure access to queue 'ns.v1.q.a' in vhost '/' refused"
    error = broker_refusal(403, reply, doing="checking queue 'ns.v1.q.a'", permission="read")
    assert isinstance(error, AccessRefused)
    assert error.permission == "read"
    assert "needs 'read' permission on queue 'ns.v1.q.a'" in str(error)
    # the broker's word wins otherwise: a bind refused on its source exchange
    reply = "ACCESS_REFUSED - read access to exchange 'ns.v1.due' in vhost '/' refused"
    assert broker_refusal(403, reply, doing="binding", permission="write").permission == "read"
    reply = "ACCESS_REFUSED - configure access to queue 'ns.v1.q.a' in vhost '/' refused"
    assert broker_refusal(403, reply, doing="declaring", permission="configure").permission == (
        "configure"
    )
