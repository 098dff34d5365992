"""The declaration plan: what is wanted, how it compares, and the two-phase program."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest

from rabbit_delay import DeclarationConflict, Topology, topology_from_dict
from rabbit_delay._errors import ArgumentConflict
from rabbit_delay._plan.desired import BindingSpec, Desired, ExchangeSpec, Kind, QueueSpec, desired
from rabbit_delay._plan.diff import Change, ExistingObject, Observed, make_plan, plan_from_presence
from rabbit_delay._plan.program import (
    Bind,
    Declare,
    DeclareReport,
    Exists,
    Operation,
    declare_program,
    plan_program,
)
from rabbit_delay._plan.refusals import conflict_from_reply

# Every quorum queue is declared with a leader locator (`[scaling]`, default balanced).
PLACEMENT = {"x-queue-leader-locator": "balanced"}
QUORUM_DLX = {
    "x-queue-type": "quorum",
    "x-dead-letter-strategy": "at-least-once",
    "x-overflow": "reject-publish",
    **PLACEMENT,
}


def shop(queue_type: str = "quorum", **extra: Any) -> Topology:
    return topology_from_dict(
        {
            "namespace": "shop",
            "queue_type": queue_type,
            "tiers": {"1s": "1s", "3s": "3s"},
            "queues": {
                "orders.cancel": {"delivery_limit": 5},
                "push": {"bindings": ["push.any"]},
            },
            **extra,
        }
    )


EXPECTED_EXCHANGES = {
    "shop.v1.unroutable": ("fanout", {}),
    "shop.v1.due": ("direct", {"alternate-exchange": "shop.v1.unroutable"}),
    "shop.v1.parking": ("direct", {"alternate-exchange": "shop.v1.unroutable"}),
    "shop.v1.delay.1s": ("fanout", {}),
    "shop.v1.delay.3s": ("fanout", {}),
}

EXPECTED_BINDINGS = {
    ("shop.v1.unroutable", "shop.v1.unroutable", "queue", ""),
    ("shop.v1.delay.1s", "shop.v1.delay.1s", "queue", ""),
    ("shop.v1.delay.3s", "shop.v1.delay.3s", "queue", ""),
    ("shop.v1.due", "shop.v1.q.orders.cancel", "queue", "shop.v1.q.orders.cancel"),
    ("shop.v1.due", "shop.v1.q.push", "queue", "shop.v1.q.push"),
    ("shop.v1.due", "shop.v1.q.push", "queue", "push.any"),
    ("shop.v1.parking", "shop.v1.parking.orders.cancel", "queue", "shop.v1.q.orders.cancel"),
    ("shop.v1.parking", "shop.v1.parking.push", "queue", "shop.v1.q.push"),
}


# Queues read by people: an explicit, huge delivery limit (4.0 would drop after 20 requeues).
HUMAN = {"x-queue-type": "quorum", "x-delivery-limit": 1_000_000, **PLACEMENT}


def binding_keys(want: Desired) -> set[tuple[str, str, str, str]]:
    return {
        (b.source, b.destination, b.destination_type.value, b.routing_key) for b in want.bindings
    }


# -- desired --------------------------------------------------------------------------------


def test_desired_quorum_exactly() -> None:
    want = desired(shop())
    assert {e.name: (e.type, dict(e.arguments)) for e in want.exchanges} == EXPECTED_EXCHANGES
    assert all(e.durable for e in want.exchanges)
    assert {q.name: dict(q.arguments) for q in want.queues} == {
        "shop.v1.unroutable": HUMAN,
        "shop.v1.delay.1s": {
            **QUORUM_DLX,
            "x-dead-letter-exchange": "shop.v1.due",
            "x-message-ttl": 1000,
        },
        "shop.v1.delay.3s": {
            **QUORUM_DLX,
            "x-dead-letter-exchange": "shop.v1.due",
            "x-message-ttl": 3000,
        },
        "shop.v1.q.orders.cancel": {
            **QUORUM_DLX,
            "x-dead-letter-exchange": "shop.v1.parking",
            "x-dead-letter-routing-key": "shop.v1.q.orders.cancel",
            "x-delivery-limit": 5,
        },
        "shop.v1.q.push": {
            **QUORUM_DLX,
            "x-dead-letter-exchange": "shop.v1.parking",
            "x-dead-letter-routing-key": "shop.v1.q.push",
            "x-delivery-limit": 10,
        },
        "shop.v1.parking.orders.cancel": HUMAN,
        "shop.v1.parking.push": HUMAN,
    }
    assert all(q.durable for q in want.queues)
    assert binding_keys(want) == EXPECTED_BINDINGS
    assert len(want.bindings) == len(EXPECTED_BINDINGS)  # no duplicates


def test_desired_classic_exactly() -> None:
    want = desired(shop("classic"))
    assert {e.name: (e.type, dict(e.arguments)) for e in want.exchanges} == EXPECTED_EXCHANGES
    assert {q.name: dict(q.arguments) for q in want.queues} == {
        "shop.v1.unroutable": {},
        "shop.v1.delay.1s": {"x-dead-letter-exchange": "shop.v1.due", "x-message-ttl": 1000},
        "shop.v1.delay.3s": {"x-dead-letter-exchange": "shop.v1.due", "x-message-ttl": 3000},
        "shop.v1.q.orders.cancel": {
            "x-dead-letter-exchange": "shop.v1.parking",
            "x-dead-letter-routing-key": "shop.v1.q.orders.cancel",
        },
        "shop.v1.q.push": {
            "x-dead-letter-exchange": "shop.v1.parking",
            "x-dead-letter-routing-key": "shop.v1.q.push",
        },
        "shop.v1.parking.orders.cancel": {},
        "shop.v1.parking.push": {},
    }
    assert binding_keys(want) == EXPECTED_BINDINGS


def test_tier_buffers_are_the_only_queues_with_a_ttl() -> None:
    for queue in desired(shop()).queues:
        has_ttl = "x-message-ttl" in queue.arguments
        assert has_ttl == (".delay." in queue.name), queue.name


def test_exchanges_come_before_queues_and_the_dlx_exists_first() -> None:
    want = desired(shop())
    kinds = [spec.kind for spec in want.objects]
    assert kinds == sorted(kinds, key=lambda k: k is Kind.QUEUE)
    position = {spec.name + spec.kind: i for i, spec in enumerate(want.objects)}
    for queue in want.queues:
        dlx = queue.arguments.get("x-dead-letter-exchange")
        if dlx is not None:
            assert position[str(dlx) + Kind.EXCHANGE] < position[queue.name + Kind.QUEUE]


def test_desired_is_deterministic() -> None:
    assert desired(shop()) == desired(shop())


def test_binding_names_are_readable() -> None:
    b = BindingSpec("shop.v1.due", "shop.v1.q.push", "push.any")
    assert b.name == "shop.v1.due -> shop.v1.q.push [push.any]"
    e = BindingSpec("a", "b", "#", Kind.EXCHANGE)
    assert e.name == "a => b [#]"


# -- make_plan --------------------------------------------------------------------------------


def observed_from(
    want: Desired,
    *,
    bindings: bool = True,
    exchanges: Mapping[str, ExistingObject | None] | None = None,
    queues: Mapping[str, ExistingObject | None] | None = None,
) -> Observed:
    """An Observed where everything is as wanted, except the objects given (None: missing)."""
    have_exchanges = {
        e.name: ExistingObject(dict(e.arguments), e.durable, e.type) for e in want.exchanges
    }
    have_queues = {q.name: ExistingObject(dict(q.arguments), q.durable) for q in want.queues}
    for table, changes in ((have_exchanges, exchanges), (have_queues, queues)):
        for name, obj in (changes or {}).items():
            if obj is None:
                del table[name]
            else:
                table[name] = obj
    return Observed(
        have_exchanges, have_queues, frozenset(binding_keys(want)) if bindings else None
    )


def test_plan_everything_missing() -> None:
    want = desired(shop())
    plan = make_plan(want, Observed({}, {}, frozenset()))
    assert {i.action for i in plan.items} == {Change.CREATE}
    assert len(plan.items) == len(want.exchanges) + len(want.queues) + len(want.bindings)
    assert not plan.in_sync
    assert plan.pending == plan.items
    assert plan.conflicts == ()


def test_plan_everything_in_place() -> None:
    want = desired(shop())
    plan = make_plan(want, observed_from(want))
    assert {i.action for i in plan.items} == {Change.IN_PLACE}
    assert plan.in_sync


def test_plan_bindings_unknown_without_binding_list() -> None:
    want = desired(shop())
    plan = make_plan(want, observed_from(want, bindings=False))
    assert {i.action for i in plan.items if i.kind is Kind.BINDING} == {Change.ENSURE}
    assert plan.in_sync  # an ensure is not pending: binding is idempotent


def test_plan_create_in_place_and_conflict() -> None:
    want = desired(shop())
    observed = observed_from(
        want,
        queues={
            "shop.v1.delay.1s": ExistingObject(
                {**QUORUM_DLX, "x-dead-letter-exchange": "shop.v1.due", "x-message-ttl": 5000}
            ),
            "shop.v1.delay.3s": ExistingObject({"x-message-ttl": 3000}),  # classic, no DLX
            "shop.v1.parking.push": None,
            "shop.v1.unroutable": ExistingObject(HUMAN, durable=False),
        },
        exchanges={"shop.v1.due": ExistingObject({}, True, "topic")},
    )
    plan = make_plan(want, observed)
    by_name = {(i.kind, i.name): i for i in plan.items}
    assert by_name[(Kind.QUEUE, "shop.v1.parking.push")].action is Change.CREATE
    assert by_name[(Kind.QUEUE, "shop.v1.q.push")].action is Change.IN_PLACE
    assert by_name[(Kind.EXCHANGE, "shop.v1.unroutable")].action is Change.IN_PLACE

    ttl = by_name[(Kind.QUEUE, "shop.v1.delay.1s")]
    assert ttl.action is Change.CONFLICT
    assert ttl.conflicts == (
        ArgumentConflict("queue", "shop.v1.delay.1s", "x-message-ttl", 5000, 1000),
    )

    classic = by_name[(Kind.QUEUE, "shop.v1.delay.3s")]
    assert classic.action is Change.CONFLICT
    assert set(classic.conflicts) == {
        ArgumentConflict(
            "queue", "shop.v1.delay.3s", "x-dead-letter-exchange", None, "shop.v1.due"
        ),
        ArgumentConflict(
            "queue", "shop.v1.delay.3s", "x-dead-letter-strategy", None, "at-least-once"
        ),
        ArgumentConflict("queue", "shop.v1.delay.3s", "x-overflow", None, "reject-publish"),
        # no x-queue-type on the broker: a classic queue (4.x would say so explicitly)
        ArgumentConflict("queue", "shop.v1.delay.3s", "x-queue-type", "classic", "quorum"),
    }

    due = by_name[(Kind.EXCHANGE, "shop.v1.due")]
    assert due.conflicts == (
        ArgumentConflict("exchange", "shop.v1.due", "type", "topic", "direct"),
        ArgumentConflict(
            "exchange", "shop.v1.due", "alternate-exchange", None, "shop.v1.unroutable"
        ),
    )

    lot = by_name[(Kind.QUEUE, "shop.v1.unroutable")]
    assert lot.conflicts == (
        ArgumentConflict("queue", "shop.v1.unroutable", "durable", False, True),
    )

    assert set(plan.conflicts) == {
        *ttl.conflicts,
        *classic.conflicts,
        *due.conflicts,
        *lot.conflicts,
    }
    assert {i.name for i in plan.pending} == {
        "shop.v1.parking.push",
        "shop.v1.delay.1s",
        "shop.v1.delay.3s",
        "shop.v1.due",
        "shop.v1.unroutable",
    }
    assert not plan.in_sync


def test_extra_argument_on_the_broker_is_a_conflict() -> None:
    want = desired(shop())
    extra = ExistingObject({**HUMAN, "x-max-length": 10})
    plan = make_plan(want, observed_from(want, queues={"shop.v1.parking.push": extra}))
    assert plan.conflicts == (
        ArgumentConflict("queue", "shop.v1.parking.push", "x-max-length", 10, None),
    )


def test_conflict_describe_names_object_argument_and_both_values() -> None:
    text = ArgumentConflict("queue", "shop.v1.delay.1s", "x-message-ttl", 5000, 1000).describe()
    assert text == (
        "queue 'shop.v1.delay.1s': argument 'x-message-ttl' is 5000 on the broker "
        "but the topology wants 1000"
    )
    error = DeclarationConflict([ArgumentConflict("queue", "q", "x-message-ttl", 5000, 1000)])
    assert "queue 'q'" in str(error)
    assert "Nothing was changed" in str(error)
    assert error.conflicts[0].wanted == 1000


def test_plan_from_presence() -> None:
    want = desired(shop())
    # The 3s buffer queue is missing but its exchange (same name) is there.
    missing = (Kind.QUEUE, "shop.v1.delay.3s")
    present = {(spec.kind, spec.name): (spec.kind, spec.name) != missing for spec in want.objects}
    plan = plan_from_presence(want, present)
    actions = {(i.kind, i.name): i.action for i in plan.items}
    assert actions[missing] is Change.CREATE
    assert actions[(Kind.EXCHANGE, "shop.v1.delay.3s")] is Change.PRESENT
    assert {a for (k, _), a in actions.items() if k is Kind.BINDING} == {Change.ENSURE}
    assert [(i.kind, i.name) for i in plan.pending] == [missing]


# -- conflict_from_reply (texts as RabbitMQ 3.10 sends them) --------------------------------

QUEUE_1S = QueueSpec(
    "t.v1.delay.1s", {**QUORUM_DLX, "x-dead-letter-exchange": "t.v1.due", "x-message-ttl": 1000}
)


@pytest.mark.parametrize(
    ("spec", "reply", "argument", "on_broker", "wanted"),
    [
        (
            QUEUE_1S,
            "PRECONDITION_FAILED - inequivalent arg 'x-message-ttl' for queue 't.v1.delay.1s' "
            "in vhost '/': received '1000' but current is '5000'",
            "x-message-ttl",
            5000,
            1000,
        ),
        (
            QUEUE_1S,
            "PRECONDITION_FAILED - inequivalent arg 'x-queue-type' for queue 't.v1.delay.1s' "
            "in vhost '/': received the value 'quorum' of type 'longstr' but current is none",
            "x-queue-type",
            None,
            "quorum",
        ),
        (
            QueueSpec("c", {}),
            "PRECONDITION_FAILED - inequivalent arg 'x-queue-type' for queue 'c' in vhost '/': "
            "received none but current is the value 'quorum' of type 'longstr'",
            "x-queue-type",
            "quorum",
            None,
        ),
        (
            QUEUE_1S,
            "PRECONDITION_FAILED - inequivalent arg 'x-message-ttl' for queue 't.v1.delay.1s' "
            "in vhost '/': received the value '1000' of type 'signedint' but current is the "
            "value '5000' of type 'long'",
            "x-message-ttl",
            5000,
            1000,
        ),
        (
            ExchangeSpec("t.v1.due", "direct", {"alternate-exchange": "t.v1.unroutable"}),
            "PRECONDITION_FAILED - inequivalent arg 'type' for exchange 't.v1.due' in vhost '/': "
            "received 'direct' but current is 'fanout'",
            "type",
            "fanout",
            "direct",
        ),
        (
            ExchangeSpec("t.v1.due", "direct", {"alternate-exchange": "t.v1.unroutable"}),
            "PRECONDITION_FAILED - inequivalent arg 'alternate-exchange' for exchange "
            "'t.v1.due' in vhost '/': received 't.v1.unroutable' but current is 'zz'",
            "alternate-exchange",
            "zz",
            "t.v1.unroutable",
        ),
        (
            QueueSpec("d", {}),
            "PRECONDITION_FAILED - inequivalent arg 'durable' for queue 'd' in vhost '/': "
            "received 'true' but current is 'false'",
            "durable",
            False,
            True,
        ),
    ],
)
def test_conflict_from_reply(
    spec: QueueSpec | ExchangeSpec, reply: str, argument: str, on_broker: object, wanted: object
) -> None:
    assert conflict_from_reply(spec, reply) == ArgumentConflict(
        spec.kind.value, spec.name, argument, on_broker, wanted
    )


def test_conflict_from_an_unexpected_reply_keeps_the_text() -> None:
    conflict = conflict_from_reply(QueueSpec("q"), "PRECONDITION_FAILED - something new")
    assert conflict.argument == "?"
    assert conflict.on_broker == "PRECONDITION_FAILED - something new"


# -- declare_program driven by a fake executor ---------------------------------------------


@dataclass
class FakeBroker:
    """Executes a declaration program like a broker would, recording every operation."""

    objects: dict[tuple[Kind, str], Mapping[str, object]] = field(default_factory=dict)
    bindings: set[str] = field(default_factory=set)
    log: list[tuple[str, str]] = field(default_factory=list)
    # Arguments compared before the others (a broker's order is its own).
    first: tuple[str, ...] = ()

    def run(self, program: Any) -> DeclareReport:
        try:
            op: Operation = next(program)
            while True:
                op = program.send(self.execute(op))
        except StopIteration as stop:
            report: DeclareReport = stop.value
            return report

    def execute(self, op: Operation) -> object:
        if isinstance(op, Bind):
            self.log.append(("bind", op.spec.name))
            self.bindings.add(op.spec.name)
            return None
        key = (op.spec.kind, op.spec.name)
        if isinstance(op, Exists):
            self.log.append(("exists", op.spec.name))
            return key in self.objects
        assert isinstance(op, Declare)
        existing = self.objects.get(key)
        if existing is None:
            self.log.append(("create", op.spec.name))
            self.objects[key] = dict(op.spec.arguments)
            return None
        self.log.append(("redeclare", op.spec.name))
        args = sorted(set(existing) | set(op.spec.arguments))
        for arg in [a for a in self.first if a in args] + args:
            if existing.get(arg) != op.spec.arguments.get(arg):
                have, want = existing.get(arg), op.spec.arguments.get(arg)
                received = "none" if want is None else f"'{want}'"
                current = "none" if have is None else f"'{have}'"
                return (
                    f"PRECONDITION_FAILED - inequivalent arg '{arg}' for {op.spec.kind.value} "
                    f"'{op.spec.name}' in vhost '/': received {received} but current is {current}"
                )
        return None

    @property
    def created(self) -> list[str]:
        return [name for what, name in self.log if what == "create"]


def test_program_on_an_empty_broker_creates_everything() -> None:
    want = desired(shop())
    broker = FakeBroker()
    report = broker.run(declare_program(want))
    assert len(broker.created) == len(want.objects)
    assert broker.bindings == {b.name for b in want.bindings}
    assert report.changed
    assert {i.name for i in report.created} == {s.name for s in want.objects}
    # every object is probed before the first create
    first_create = next(i for i, (what, _) in enumerate(broker.log) if what == "create")
    assert sum(1 for what, _ in broker.log[:first_create] if what == "exists") == len(want.objects)


def test_program_twice_is_a_no_op() -> None:
    want = desired(shop())
    broker = FakeBroker()
    broker.run(declare_program(want))
    broker.log.clear()
    report = broker.run(declare_program(want))
    assert broker.created == []
    assert not report.changed
    assert {i.action for i in report.items if i.kind is not Kind.BINDING} == {Change.IN_PLACE}
    assert {i.action for i in report.items if i.kind is Kind.BINDING} == {Change.ENSURE}


def test_program_with_observed_needs_no_probe_and_skips_bindings_in_place() -> None:
    want = desired(shop())
    broker = FakeBroker()
    report = broker.run(declare_program(want, observed_from(want)))
    assert broker.log == []
    assert not report.changed
    assert {i.action for i in report.items} == {Change.IN_PLACE}


def test_program_with_observed_creates_only_what_is_missing() -> None:
    want = desired(shop())
    observed = observed_from(want, queues={"shop.v1.parking.push": None})
    broker = FakeBroker()
    report = broker.run(declare_program(want, observed))
    assert broker.created == ["shop.v1.parking.push"]
    assert [i.name for i in report.created] == ["shop.v1.parking.push"]


@pytest.mark.parametrize("use_observed", [False, True], ids=["passive", "management"])
def test_conflict_raises_before_any_create(use_observed: bool) -> None:
    want = desired(shop())
    broker = FakeBroker()
    # only the 1s buffer exists, with another TTL; everything else is missing
    broker.objects[(Kind.QUEUE, "shop.v1.delay.1s")] = {
        **QUORUM_DLX,
        "x-dead-letter-exchange": "shop.v1.due",
        "x-message-ttl": 5000,
    }
    observed = None
    if use_observed:
        observed = Observed(
            {},
            {"shop.v1.delay.1s": ExistingObject(broker.objects[(Kind.QUEUE, "shop.v1.delay.1s")])},
            frozenset(),
        )
    program = declare_program(want, observed)
    with pytest.raises(DeclarationConflict) as info:
        broker.run(program)
    assert broker.created == []
    assert broker.bindings == set()
    assert info.value.conflicts == (
        ArgumentConflict("queue", "shop.v1.delay.1s", "x-message-ttl", 5000, 1000),
    )
    message = str(info.value)
    assert "shop.v1.delay.1s" in message
    assert "x-message-ttl" in message
    assert "5000" in message
    assert "1000" in message


def test_conflicts_of_several_objects_are_all_reported() -> None:
    want = desired(shop())
    broker = FakeBroker()
    broker.objects[(Kind.QUEUE, "shop.v1.delay.3s")] = {"x-message-ttl": 3000}
    broker.objects[(Kind.EXCHANGE, "shop.v1.due")] = {}
    with pytest.raises(DeclarationConflict) as info:
        broker.run(declare_program(want))
    assert {c.name for c in info.value.conflicts} == {"shop.v1.delay.3s", "shop.v1.due"}
    assert broker.created == []


def test_concurrent_creation_with_other_arguments_is_a_conflict() -> None:
    """Missing at the check, created differently by someone else before our create."""
    want = desired(shop())
    broker = FakeBroker()
    program = declare_program(want, Observed({}, {}, frozenset()))
    broker.objects[(Kind.EXCHANGE, "shop.v1.unroutable")] = {"x-other": 1}
    with pytest.raises(DeclarationConflict, match=r"shop\.v1\.unroutable"):
        broker.run(program)


@pytest.mark.parametrize("use_observed", [False, True], ids=["passive", "management"])
@pytest.mark.parametrize("missing", [Kind.EXCHANGE, Kind.QUEUE])
def test_an_exchange_and_a_queue_of_the_same_name_are_told_apart(
    use_observed: bool, missing: Kind
) -> None:
    """A tier's exchange and buffer queue share a name: one missing is created, the other kept."""
    want = desired(shop())
    broker = FakeBroker()
    broker.run(declare_program(want))
    del broker.objects[(missing, "shop.v1.delay.1s")]
    broker.log.clear()
    observed = None
    if use_observed:
        gone: dict[str, ExistingObject | None] = {"shop.v1.delay.1s": None}
        observed = observed_from(
            want,
            exchanges=gone if missing is Kind.EXCHANGE else None,
            queues=gone if missing is Kind.QUEUE else None,
        )
    report = broker.run(declare_program(want, observed))
    assert (missing, "shop.v1.delay.1s") in broker.objects
    assert broker.created == ["shop.v1.delay.1s"]
    assert [(i.kind, i.name) for i in report.created] == [(missing, "shop.v1.delay.1s")]


# -- sharded tiers ------------------------------------------------------------------------------


def sharded(**scaling: Any) -> Topology:
    return shop(scaling={"tier_shards": {"3s": 4}, **scaling})


def test_desired_lists_every_shard_with_the_tiers_arguments() -> None:
    want = desired(sharded())
    shards = ["shop.v1.delay.3s", "shop.v1.delay.3s.1", "shop.v1.delay.3s.2", "shop.v1.delay.3s.3"]
    queues = {q.name: dict(q.arguments) for q in want.queues}
    exchanges = {e.name: (e.type, dict(e.arguments)) for e in want.exchanges}
    buffer = {**QUORUM_DLX, "x-dead-letter-exchange": "shop.v1.due", "x-message-ttl": 3000}
    for name in shards:
        assert queues[name] == buffer, name  # same TTL, same due exchange
        assert exchanges[name] == ("fanout", {}), name
    assert binding_keys(want) == EXPECTED_BINDINGS | {(n, n, "queue", "") for n in shards}
    # The unsharded tier and everything else are exactly as without [scaling].
    plain = desired(shop())
    assert set(queues) - set(shards) == {q.name for q in plain.queues} - set(shards)
    assert (
        queues["shop.v1.delay.1s"]
        == {q.name: q for q in plain.queues}["shop.v1.delay.1s"].arguments
    )
    assert dict(want.tier_shards) == {"1s": 1, "3s": 4}


def test_default_shard_count_applies_to_every_tier_but_the_overridden() -> None:
    want = desired(shop(scaling={"shards": 2, "tier_shards": {"3s": 3}}))
    buffers = [q.name for q in want.queues if ".delay." in q.name]
    assert buffers == [
        "shop.v1.delay.1s",
        "shop.v1.delay.1s.1",
        "shop.v1.delay.3s",
        "shop.v1.delay.3s.1",
        "shop.v1.delay.3s.2",
    ]


def test_sharded_declare_is_idempotent() -> None:
    want = desired(sharded())
    broker = FakeBroker()
    broker.run(declare_program(want))
    assert len(broker.created) == len(want.objects)
    broker.log.clear()
    report = broker.run(declare_program(want))
    assert broker.created == []
    assert not report.changed
    assert {i.action for i in report.items if i.kind is not Kind.BINDING} == {Change.IN_PLACE}


def test_adding_shards_keeps_the_existing_buffer_and_creates_the_others() -> None:
    broker = FakeBroker()
    broker.run(declare_program(desired(shop())))
    broker.log.clear()
    report = broker.run(declare_program(desired(sharded())))
    assert sorted(broker.created) == [
        "shop.v1.delay.3s.1",
        "shop.v1.delay.3s.1",
        "shop.v1.delay.3s.2",
        "shop.v1.delay.3s.2",
        "shop.v1.delay.3s.3",
        "shop.v1.delay.3s.3",
    ]  # an exchange and a queue each
    assert (Kind.QUEUE, "shop.v1.delay.3s") not in {(i.kind, i.name) for i in report.created}


def extra_items(plan: Any) -> list[tuple[Kind, str]]:
    return [(i.kind, i.name) for i in plan.items if i.action is Change.EXTRA]


def test_lowered_shard_count_reports_the_retired_buffers_as_extra_management() -> None:
    """Management API: every shard past the count is listed, none is pending."""
    before = desired(sharded())
    after = desired(shop(scaling={"tier_shards": {"3s": 2}}))
    observed = observed_from(before)
    plan = make_plan(after, observed)
    assert extra_items(plan) == [
        (Kind.EXCHANGE, "shop.v1.delay.3s.2"),
        (Kind.QUEUE, "shop.v1.delay.3s.2"),
        (Kind.EXCHANGE, "shop.v1.delay.3s.3"),
        (Kind.QUEUE, "shop.v1.delay.3s.3"),
    ]
    assert plan.in_sync  # nothing for declare to do: it never deletes
    note = next(i for i in plan.items if i.action is Change.EXTRA).notes[0]
    assert "tier '3s' now has 2 shard(s)" in note
    assert "delete it once empty" in note
    # the bindings of a retired shard are not the plan's business: no item for them
    assert all(".3s.2" not in i.name for i in plan.items if i.kind is Kind.BINDING)


def test_lowered_shard_count_reports_the_retired_buffers_as_extra_passive() -> None:
    """Passive declares: the run of shards past the count is probed, one probe per tier
    when there is none."""
    broker = FakeBroker()
    broker.run(declare_program(desired(sharded())))
    broker.log.clear()
    plan = broker.run(plan_program(desired(shop())))
    assert extra_items(plan) == [
        (kind, f"shop.v1.delay.3s.{i}") for i in (1, 2, 3) for kind in (Kind.EXCHANGE, Kind.QUEUE)
    ]
    assert plan.in_sync
    # Declared as sharded: one probe past the last shard of each tier, and no more.
    broker.log.clear()
    plan = broker.run(plan_program(desired(sharded())))
    assert extra_items(plan) == []
    probes = [name for what, name in broker.log if what == "exists"]
    assert probes.count("shop.v1.delay.3s.4") == 1
    assert probes.count("shop.v1.delay.1s.1") == 1
    assert len(probes) == len(desired(sharded()).objects) + 2


# -- placement ----------------------------------------------------------------------------------


def queue_args(topology: Topology) -> dict[str, dict[str, object]]:
    return {q.name: dict(q.arguments) for q in desired(topology).queues}


def test_placement_arguments_go_on_every_quorum_queue() -> None:
    args = queue_args(shop(scaling={"leader_locator": "client-local", "replicas": 3}))
    for name, a in args.items():
        assert a["x-queue-leader-locator"] == "client-local", name
        assert a["x-quorum-initial-group-size"] == 3, name


def test_broker_locator_and_unset_replicas_set_no_argument() -> None:
    for a in queue_args(shop(scaling={"leader_locator": "broker"})).values():
        assert "x-queue-leader-locator" not in a
        assert "x-quorum-initial-group-size" not in a


def test_classic_queues_get_no_placement() -> None:
    for a in queue_args(shop("classic")).values():
        assert not {"x-queue-leader-locator", "x-quorum-initial-group-size"} & set(a)


def test_placement_is_never_a_conflict_but_a_note() -> None:
    """Queues created before placement was configured (or with another) are in place:
    the broker reads placement only at creation."""
    want = desired(shop(scaling={"replicas": 3}))
    old = desired(shop(scaling={"leader_locator": "client-local"}))
    observed = observed_from(old)  # every queue: client-local, no group size
    plan = make_plan(want, observed)
    assert plan.in_sync
    assert plan.conflicts == ()
    buffer = next(i for i in plan.items if i.name == "shop.v1.delay.1s" and i.kind is Kind.QUEUE)
    assert buffer.action is Change.IN_PLACE
    assert buffer.notes == (
        "x-queue-leader-locator 'client-local' on the broker, 'balanced' in the topology; "
        "x-quorum-initial-group-size unset on the broker, 3 in the topology "
        "(placement applies to new queues only: docs/scaling.md#placement)",
    )
    # a real difference is still a conflict beside the placement notes
    ttl = ExistingObject(
        {**QUORUM_DLX, "x-dead-letter-exchange": "shop.v1.due", "x-message-ttl": 9}
    )
    plan = make_plan(want, observed_from(want, queues={"shop.v1.delay.1s": ttl}))
    assert [c.argument for c in plan.conflicts] == ["x-message-ttl"]


@pytest.mark.parametrize(
    "created_with",
    [
        {},  # before placement existed
        {"x-queue-leader-locator": "client-local", "x-quorum-initial-group-size": 5},
        {"x-quorum-initial-group-size": 5},
    ],
    ids=["none", "other-both", "group-size-only"],
)
def test_redeclare_of_a_queue_placed_otherwise_is_in_place_without_management(
    created_with: dict[str, object],
) -> None:
    """Without the management API, existing queues are checked by re-declaring them: a
    406 on a placement argument is retried with the broker's value, never a conflict."""
    broker = FakeBroker()
    broker.run(declare_program(desired(shop(scaling={"leader_locator": "broker"}))))
    for (kind, name), args in list(broker.objects.items()):
        if kind is Kind.QUEUE:
            broker.objects[(kind, name)] = {**args, **created_with}
    broker.log.clear()
    broker.first = ("x-quorum-initial-group-size", "x-queue-leader-locator")
    report = broker.run(declare_program(desired(shop(scaling={"replicas": 3}))))
    assert broker.created == []
    queues = [i for i in report.items if i.kind is Kind.QUEUE]
    assert {i.action for i in queues} == {Change.IN_PLACE}
    assert all(any("placement applies to new queues only" in n for n in i.notes) for i in queues)


@pytest.mark.parametrize("first", [(), ("x-quorum-initial-group-size", "x-queue-leader-locator")])
def test_redeclare_still_finds_a_real_conflict_behind_a_placement_difference(
    first: tuple[str, ...],
) -> None:
    broker = FakeBroker(first=first)
    broker.objects[(Kind.QUEUE, "shop.v1.delay.1s")] = {
        **QUORUM_DLX,
        "x-dead-letter-exchange": "shop.v1.due",
        "x-message-ttl": 5000,
        "x-queue-leader-locator": "client-local",
        "x-quorum-initial-group-size": 1,
    }
    with pytest.raises(DeclarationConflict) as info:
        broker.run(declare_program(desired(shop(scaling={"replicas": 3}))))
    assert info.value.conflicts == (
        ArgumentConflict("queue", "shop.v1.delay.1s", "x-message-ttl", 5000, 1000),
    )
    assert broker.created == []


def test_a_refused_probe_of_a_retired_shard_answers_absent_and_other_refusals_are_errors() -> None:
    from rabbit_delay._plan.desired import QueueSpec
    from rabbit_delay._plan.program import NOT_ANSWERED, Declare, Exists, refusal_answer

    spec = QueueSpec("ns.v1.delay.1s.1")
    assert refusal_answer(Exists(spec, optional=True), 403, "ACCESS_REFUSED") is False
    assert refusal_answer(Exists(spec), 403, "ACCESS_REFUSED") is NOT_ANSWERED
    assert refusal_answer(Exists(spec), 404, "NOT_FOUND") is False
    assert (
        refusal_answer(Declare(spec), 406, "PRECONDITION_FAILED - x") == "PRECONDITION_FAILED - x"
    )
    assert refusal_answer(Declare(spec), 403, "ACCESS_REFUSED") is NOT_ANSWERED


def test_what_a_driver_makes_of_a_refusal() -> None:
    """`refused` / `failure`: what every declarer does with a channel or connection the
    broker closed; the plugin's missing exchange type wins over the 406 it comes with."""
    from rabbit_delay._errors import MissingPluginError
    from rabbit_delay._plan.desired import ExchangeSpec, QueueSpec
    from rabbit_delay._plan.program import Declare, Exists, SupportsType, failure, refused

    class Translated(Exception):
        pass

    def translate(exc: BaseException, *, doing: str, permission: str) -> Exception:
        return Translated(f"{exc} while {doing} [{permission}]")

    cause = RuntimeError("closed")
    queue = Declare(QueueSpec("ns.v1.delay.1s"))
    plugin = Declare(ExchangeSpec("ns.v1.delayed", "x-delayed-message"))
    assert refused(Exists(queue.spec), cause, translate, 404, "NOT_FOUND") is False
    assert refused(queue, cause, translate, 406, "PRECONDITION_FAILED - x") == (
        "PRECONDITION_FAILED - x"
    )
    assert refused(SupportsType("x-delayed-message"), cause, translate, 403, "") is True
    with pytest.raises(Translated, match=r"declare queue 'ns.v1.delay.1s' \[configure\]"):
        refused(queue, cause, translate, 403, "ACCESS_REFUSED")
    unknown = "PRECONDITION_FAILED - unknown exchange type 'x-delayed-message'"
    with pytest.raises(MissingPluginError, match="rabbitmq-plugins enable"):
        refused(plugin, cause, translate, 406, unknown)  # 4.x: the channel
    assert isinstance(failure(plugin, cause, translate, unknown), MissingPluginError)  # 3.x
    assert isinstance(failure(plugin, cause, translate), Translated)
