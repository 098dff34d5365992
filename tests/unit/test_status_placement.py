"""`status` and where a quorum queue's replicas are: the management API's `leader`,
`members` and `online` read into rows, the columns of the table, the flags (pure; the
same on a real cluster: tests/integration/test_cluster.py)."""

from __future__ import annotations

from io import StringIO

from rich.console import Console

from rabbit_delay import Topology, topology_from_dict
from rabbit_delay._broker import QueueCounts
from rabbit_delay._cli.status import _status_table
from rabbit_delay._io.management import counts_from_api
from rabbit_delay._ops.status.rules import (
    QueueRole,
    QueueRow,
    placement_cells,
    shows_placement,
    status_rows,
)
from rabbit_delay._plan.desired import desired

A, B, C = "rabbit@a", "rabbit@b", "rabbit@c"


def topology() -> Topology:
    return topology_from_dict(
        {"namespace": "placement", "tiers": {"3s": "3s"}, "queues": {"orders": {}}}
    )


def stats(leader: str | None, members: tuple[str, ...], online: tuple[str, ...]) -> QueueCounts:
    return QueueCounts(0, 0, 0, leader, members, online)


def row(**placement: object) -> QueueRow:
    queue = QueueRow(QueueRole.BUSINESS, "placement.v1.q.orders", None, True, 0, 0, 1)
    for name, value in placement.items():
        setattr(queue, name, value)
    return queue


def test_a_quorum_queue_row_of_the_api_gives_its_placement() -> None:
    got = counts_from_api(
        {
            "name": "x",
            "type": "quorum",
            "messages_ready": 4,
            "messages_unacknowledged": 1,
            "consumers": 2,
            "leader": B,
            "members": [C, A, B],
            "online": [B, A],
            "messages_dlx": 32,
        }
    )
    assert got == QueueCounts(4, 1, 2, B, (A, B, C), (A, B), 32)


def test_a_classic_queue_or_an_older_answer_has_no_placement() -> None:
    classic = counts_from_api({"name": "x", "type": "classic", "node": A, "messages_ready": 1})
    assert (classic.leader, classic.members, classic.online) == (None, None, None)
    assert classic.ready == 1
    silent = counts_from_api({"name": "x", "type": "quorum", "leader": "", "members": "?"})
    assert (silent.leader, silent.members, silent.online) == (None, None, None)


def test_status_rows_carry_the_placement_and_json_shows_it() -> None:
    t = topology()
    everywhere = stats(A, (A, B, C), (A, B, C))
    api = {spec.name: everywhere for spec in desired(t).queues}
    rows = status_rows(t, None, api)
    assert all(r.leader == A and r.members == (A, B, C) for r in rows)
    assert not any(r.notes or r.attention for r in rows)
    as_json = rows[0].as_json()
    assert (as_json["leader"], as_json["members"], as_json["online"]) == (A, [A, B, C], [A, B, C])
    assert shows_placement(rows)

    without_api = status_rows(t, None, None)
    assert all(r.as_json()["leader"] is None for r in without_api)
    assert all(r.as_json()["members"] is None for r in without_api)


def test_one_member_offline_is_a_note_a_lost_majority_needs_attention() -> None:
    t = topology()
    names = [spec.name for spec in desired(t).queues]
    degraded, lost = names[0], names[1]
    api = {name: stats(A, (A, B, C), (A, B, C)) for name in names}
    api[degraded] = stats(B, (A, B, C), (A, B))
    api[lost] = stats(None, (A, B, C), (A,))
    rows = {r.name: r for r in status_rows(t, None, api)}
    assert rows[degraded].offline == (C,)
    assert not rows[degraded].attention
    assert rows[degraded].notes == [f"offline: {C}"]
    assert rows[lost].majority_lost
    assert rows[lost].attention
    assert rows[lost].notes == [f"no majority: 1 of 3 members online, offline: {B}, {C}"]
    assert placement_cells(rows[degraded]) == (B, "2/3 online")
    assert placement_cells(rows[lost]) == ("none", "1/3 online")


def test_messages_being_dead_lettered_are_noted() -> None:
    """A buffer's dead-lettered messages wait for their destination's confirm in neither
    ready nor unacked (`messages_dlx`): without the note such a buffer looks empty."""
    t = topology()
    buffer = t.names.tier_queue("3s")
    api = {spec.name: stats(A, (A, B, C), (A, B, C)) for spec in desired(t).queues}
    api[buffer] = QueueCounts(0, 0, 0, A, (A, B, C), (A, B, C), 370)
    rows = {r.name: r for r in status_rows(t, None, api)}
    assert rows[buffer].notes == ["370 dead-lettered, not yet confirmed by their destination"]
    assert rows[buffer].as_json()["dead_lettering"] == 370
    assert not rows[buffer].attention
    assert all(r.dead_lettering is None for r in status_rows(t, None, None))


def test_dead_letters_pending_in_two_samples_are_stalled() -> None:
    """The RabbitMQ 3.10 stall (docs/reliability.md#network-partitions): a buffer's dead
    letters its destination never confirms stay in `messages_dlx`. One sample cannot
    tell them from dead letters in flight; a second sample a tick later, with as many
    or more, can: attention. Fewer the second time is a burst being confirmed."""
    t = topology()
    buffer = t.names.tier_queue("3s")
    api = {spec.name: stats(A, (A, B, C), (A, B, C)) for spec in desired(t).queues}
    api[buffer] = QueueCounts(0, 0, 0, A, (A, B, C), (A, B, C), 4)
    later = dict(api)
    rows = {r.name: r for r in status_rows(t, None, api, api_again=later)}
    stalled = rows[buffer]
    assert stalled.dead_letters_stalled
    assert stalled.attention
    assert stalled.notes == [
        "stalled: 4 dead-lettered and not confirmed by their destination, 12s apart"
    ]
    assert "move this buffer's leadership" in stalled.hints[0]
    assert stalled.as_json()["dead_letters_stalled"] is True
    assert not any(r.attention for name, r in rows.items() if name != buffer)
    # a burst being confirmed: fewer the second time
    later[buffer] = QueueCounts(0, 0, 0, A, (A, B, C), (A, B, C), 1)
    draining = {r.name: r for r in status_rows(t, None, api, api_again=later)}[buffer]
    assert not draining.dead_letters_stalled
    assert not draining.attention
    assert draining.notes == ["4 dead-lettered, not yet confirmed by their destination"]
    # not read again: one sample, a note only
    once = {r.name: r for r in status_rows(t, None, api)}[buffer]
    assert not once.attention
    assert once.dead_lettering_again is None
    # a business queue's own dead letters (to its parking lot) are not a buffer's stall
    business = t.names.business_queue("orders")
    api[business] = QueueCounts(0, 0, 0, A, (A, B, C), (A, B, C), 4)
    rows = {r.name: r for r in status_rows(t, None, api, api_again=dict(api))}
    assert not rows[business].attention


def test_a_quorum_queue_without_figures_is_noted() -> None:
    """RabbitMQ 3.10 after a partition: the API lists a queue (leader, members) with no
    message figures at all; its stalled dead letters cannot show."""
    t = topology()
    buffer = t.names.tier_queue("3s")
    api = {spec.name: stats(A, (A, B, C), (A, B, C)) for spec in desired(t).queues}
    api[buffer] = counts_from_api(
        {"name": buffer, "type": "quorum", "leader": C, "members": [A, B, C], "online": [A, B, C]}
    )
    rows = {r.name: r for r in status_rows(t, None, api)}
    assert rows[buffer].no_figures
    assert rows[buffer].notes == ["no message figures in the management API"]
    assert not rows[buffer].attention
    assert not any(r.no_figures for name, r in rows.items() if name != buffer)


def test_overdue_scheduled_messages_need_attention() -> None:
    """With [schedule]: records still scheduled past due + grace were not delivered
    (whatever the broker's figures say); the sweeper republishes them."""
    t = topology()
    business = t.names.business_queue("orders")
    api = {spec.name: stats(A, (A, B, C), (A, B, C)) for spec in desired(t).queues}
    rows = {
        r.name: r for r in status_rows(t, None, api, overdue={"orders": 3}, overdue_grace_ms=60_000)
    }
    row_ = rows[business]
    assert row_.overdue == 3
    assert row_.attention
    assert row_.notes == ["overdue: 3 scheduled message(s) not delivered 1m past their due time"]
    assert "--queue orders --state scheduled --due-before -1m" in row_.hints[0]
    assert row_.as_json()["overdue"] == 3
    assert not any(r.attention for name, r in rows.items() if name != business)
    none = {r.name: r for r in status_rows(t, None, api, overdue={}, overdue_grace_ms=60_000)}
    assert none[business].overdue == 0
    assert not none[business].attention
    unread = {r.name: r for r in status_rows(t, None, api)}
    assert unread[business].overdue is None


def test_majority_arithmetic() -> None:
    assert not row(members=(A,), online=(A,)).majority_lost
    assert row(members=(A,), online=()).majority_lost
    assert not row(members=(A, B, C), online=(A, C)).majority_lost
    assert row(members=(A, B), online=(A,)).majority_lost  # 2 members: both needed
    assert not row(members=(A, B, C), online=None).majority_lost  # the API did not say
    assert row(members=(A, B, C), online=None).offline == ()


def test_cells_say_what_is_unknown() -> None:
    assert placement_cells(row()) == ("?", "?")
    assert placement_cells(row(leader=A, members=(A, B), online=None)) == (A, "2")


def render(rows: list[QueueRow]) -> str:
    console = Console(file=StringIO(), width=250, color_system=None)
    console.print(_status_table("t", rows))
    output = console.file.getvalue()  # type: ignore[attr-defined]
    assert isinstance(output, str)
    return output


def test_the_columns_appear_only_for_a_cluster() -> None:
    single = [row(leader=A, members=(A,), online=(A,)), row(leader=A, members=(A,), online=(A,))]
    assert not shows_placement(single)
    assert "leader" not in render(single)
    assert "leader" not in render([row(), row()])  # no API: the table as it always was

    spread = [row(leader=A, members=(A,), online=(A,)), row(leader=B, members=(B,), online=(B,))]
    assert shows_placement(spread)  # one replica each, on two nodes: still a cluster
    text = render([*spread, row(leader=C, members=(A, B, C), online=(A, B, C))])
    header = next(line for line in text.splitlines() if "leader" in line)
    assert "members" in header
    assert "3/3 online" in text
    assert C in text
