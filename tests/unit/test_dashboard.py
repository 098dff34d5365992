"""The dashboard's pure decisions (rabbit_delay._ops.dashboard.rules): who may connect and act,
page bounds, lateness histograms from Prometheus text, the topology picture, and the
one poller every client shares."""

from __future__ import annotations

import base64
import math
import threading
import time
from dataclasses import dataclass

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from rabbit_delay import ConfigError, Topology, topology_from_dict
from rabbit_delay._ops.dashboard.rules import (
    MAX_PAGE,
    PAST_DUE_CAP,
    TIMELINE_BUCKET_MS,
    TIMELINE_SPAN_MS,
    Auth,
    Poller,
    Timeline,
    action_token_ok,
    check_binding,
    is_loopback,
    lateness_histograms,
    page_bounds,
    parse_auth,
    picture,
    schedule_json,
    schedule_key,
    snapshot_json,
    start_message,
    timeline_labels,
    timelines,
)
from rabbit_delay._ops.status.rules import PluginStore, QueueRole, Status, status_rows
from rabbit_delay._plan.desired import desired
from rabbit_delay._schedule.records import ScheduleRecord, ScheduleState
from rabbit_delay.metrics import Metrics

SECRET = "s3cret-pw"


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


# -- who may connect ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.0.0.2", True),
        ("localhost", True),
        ("::1", True),
        ("[::1]", True),
        ("0.0.0.0", False),
        ("::", False),
        ("192.168.1.10", False),
        ("dashboard.example", False),
    ],
)
def test_loopback_addresses(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_anything_but_loopback_needs_auth() -> None:
    check_binding("127.0.0.1", None)
    with pytest.raises(ConfigError, match=r"--host 0\.0\.0\.0 is not a loopback address"):
        check_binding("0.0.0.0", None)
    check_binding("0.0.0.0", Auth("ops", SECRET))


def test_auth_is_basic_or_a_token() -> None:
    assert parse_auth(None) is None
    basic_auth = parse_auth(f"ops:{SECRET}")
    assert basic_auth == Auth("ops", SECRET)
    assert basic_auth is not None
    assert basic_auth.kind == "HTTP Basic"
    token = parse_auth(SECRET)
    assert token == Auth(None, SECRET)
    assert token is not None
    assert token.kind == "bearer token"
    for bad in ("", ":pw", "user:"):
        with pytest.raises(ConfigError, match="--auth"):
            parse_auth(bad)
    assert SECRET not in repr(basic_auth) + repr(token)


def test_basic_auth_checks_user_and_password() -> None:
    auth = Auth("ops", SECRET)
    assert auth.allows(basic("ops", SECRET))
    assert not auth.allows(basic("ops", "wrong"))
    assert not auth.allows(basic("someone", SECRET))
    assert not auth.allows(f"Bearer {SECRET}")
    assert not auth.allows(None)
    assert not auth.allows("Basic !!!not-base64")
    assert not auth.allows("Basic " + base64.b64encode(b"no-colon").decode())


def test_a_token_is_a_bearer_or_the_basic_password() -> None:
    auth = Auth(None, SECRET)
    assert auth.allows(f"Bearer {SECRET}")
    assert auth.allows(f"bearer  {SECRET} ")
    assert auth.allows(basic("anyone", SECRET))  # what a browser's login box sends
    assert not auth.allows("Bearer nope")
    assert not auth.allows(f"Token {SECRET}")


def test_the_action_token_must_match() -> None:
    assert action_token_ok("abc", "abc")
    assert not action_token_ok(None, "abc")
    assert not action_token_ok("", "abc")
    assert not action_token_ok("abd", "abc")


def test_the_start_message_says_where_actions_and_auth() -> None:
    line = start_message(
        "127.0.0.1", 8765, actions=False, auth=None, broker="amqp://u:***@h/", refresh_s=5
    )
    assert line == (
        "rabbit-delay dashboard on http://127.0.0.1:8765/ (broker amqp://u:***@h/, refresh "
        "5s); actions: off (read-only); auth: off (loopback only)"
    )
    on = start_message(
        "0.0.0.0", 80, actions=True, auth=Auth("ops", SECRET), broker="b", refresh_s=2.5
    )
    assert "actions: ON (--allow-actions)" in on
    assert "auth: on (HTTP Basic)" in on
    assert SECRET not in on
    assert "http://[::1]:1/" in start_message(
        "::1", 1, actions=False, auth=None, broker="b", refresh_s=1
    )


# -- pages --------------------------------------------------------------------------------


def test_page_bounds() -> None:
    assert page_bounds(None, None) == (0, 50)
    assert page_bounds("", "") == (0, 50)
    assert page_bounds("100", "20") == (100, 20)
    assert page_bounds("0", "100000") == (0, MAX_PAGE)
    for offset, limit, words in (
        ("-1", None, "offset -1 is negative"),
        ("x", None, "offset 'x' is not a whole number"),
        (None, "0", "limit 0"),
        (None, "1.5", "limit '1.5'"),
    ):
        with pytest.raises(ConfigError, match=words):
            page_bounds(offset, limit)


# -- lateness ---------------------------------------------------------------------------


def worker_text(observations: dict[tuple[str, str], list[float]]) -> str:
    """What a worker's /metrics serves, from the project's own Metrics."""
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    for (queue, tier), values in observations.items():
        for late in values:
            metrics.delivery_lateness_seconds.labels(queue=queue, tier=tier).observe(
                int(late * 1000) / 1000
            )
    metrics.handled_total.labels(queue="push", outcome="acked").inc()  # other families: ignored
    return generate_latest(registry).decode()


def test_histograms_per_queue_and_tier_summed_over_workers() -> None:
    one = worker_text({("push", "1s"): [0.01, 0.2, 0.2, 3.0], ("orders", "now"): [0.07]})
    two = worker_text({("push", "1s"): [0.3, 7200.0]})
    found = lateness_histograms([one, two])
    assert [(h.queue, h.tier) for h in found] == [("orders", "now"), ("push", "1s")]
    push = found[1]
    assert math.isinf(push.bounds[-1])
    assert push.total == 6 == sum(push.counts)
    by_bound = dict(zip(push.bounds, push.counts, strict=True))
    assert by_bound[0.05] == 1  # 0.01
    assert by_bound[0.25] == 2  # 0.2 twice
    assert by_bound[0.5] == 1  # 0.3
    assert by_bound[5] == 1  # 3.0
    assert by_bound[math.inf] == 1  # two hours: past the last bound
    assert push.sum_s == pytest.approx(0.01 + 0.2 + 0.2 + 3.0 + 0.3 + 7200.0)
    assert push.quantile(0.5) == 0.25
    assert push.quantile(0.99) == math.inf
    data = push.as_json()
    assert data["p99_le_s"] == "+Inf"
    assert data["buckets"][-1] == {"le": "+Inf", "count": 1}
    assert data["count"] == 6


def test_histograms_keep_the_topology_queues_only() -> None:
    text = worker_text({("push", "1s"): [0.1], ("elsewhere", "1s"): [0.1]})
    assert [h.queue for h in lateness_histograms([text], ["push"])] == ["push"]
    assert lateness_histograms([]) == []
    empty = lateness_histograms([worker_text({})])
    assert empty == []


def test_histograms_refuse_what_is_not_prometheus_text() -> None:
    with pytest.raises(ValueError):  # noqa: PT011 (prometheus-client's own message)
        lateness_histograms(["rabbit_delay_delivery_lateness_seconds_bucket{le= 1"])


# -- the picture ------------------------------------------------------------------------


@dataclass(frozen=True)
class Counts:
    ready: int
    consumers: int = 0


def a_topology(**extra: object) -> Topology:
    data: dict[str, object] = {
        "namespace": "pic",
        "tiers": {"1s": "1s", "30m": "30m"},
        "queues": {"orders": {}, "push": {}},
    }
    data.update(extra)
    return topology_from_dict(data)


def a_status(t: Topology, **counts: Counts | None) -> Status:
    live: dict[str, Counts | None] = {spec.name: Counts(0) for spec in desired(t).queues}
    live.update(counts)
    rows = status_rows(t, live, None, now_ms=0)
    return Status(t.names.prefix, "amqp://u:***@h/", "3.10.8", None, 0, rows, (), None, {}, "ok")


def test_the_picture_follows_a_message() -> None:
    t = a_topology()
    n = t.names
    lot = n.parking_queue("push")
    pic = picture(a_status(t, **{lot: Counts(4), n.tier_queue("30m"): Counts(7)}), n)
    keys = [node.key for node in pic.nodes]
    assert keys[:2] == ["publish", "due"]
    columns = {node.key: node.column for node in pic.nodes}
    assert columns[n.tier_queue("1s")] == columns[n.tier_queue("30m")] == 1
    assert columns[n.business_queue("push")] == 3
    assert columns[lot] == 4
    assert columns[n.unroutable_queue()] == 2  # under the due exchange
    assert ("publish", n.tier_queue("1s")) in pic.edges
    assert (n.tier_queue("1s"), "due") in pic.edges
    assert ("due", n.business_queue("push")) in pic.edges
    assert (n.business_queue("push"), lot) in pic.edges
    assert ("due", n.unroutable_queue()) in pic.edges
    # A lot sits beside its business queue, and carries the status rules' flag.
    assert pic.node(lot).row == pic.node(n.business_queue("push")).row
    assert pic.node(lot).attention
    assert pic.node(lot).ready == 4
    assert pic.node(lot).queue == "push"
    assert pic.node(n.tier_queue("30m")).ready == 7
    assert not pic.node(n.tier_queue("30m")).attention
    assert pic.node(n.tier_queue("1s")).label == "delay.1s"
    assert pic.width > 0
    assert pic.height > 0


def test_the_picture_marks_a_consumer_on_a_buffer_and_a_missing_queue() -> None:
    t = a_topology()
    n = t.names
    status = a_status(
        t, **{n.tier_queue("1s"): Counts(0, consumers=1), n.business_queue("orders"): None}
    )
    pic = picture(status, n)
    assert pic.node(n.tier_queue("1s")).attention
    assert pic.node(n.business_queue("orders")).attention
    assert pic.node(n.business_queue("orders")).ready is None


def test_the_picture_shows_the_cascade_and_the_plugin() -> None:
    t = a_topology(
        cascade={"levels": 4},
    )
    status = a_status(t)
    roles = {node.role for node in picture(status, t.names).nodes}
    assert QueueRole.CASCADE.value in roles
    status.plugin = PluginStore("pic.v1.delayed", 12)
    plugin = picture(status, t.names).node("plugin")
    assert (plugin.ready, plugin.column) == (12, 1)


def test_the_snapshot_json() -> None:
    t = a_topology()
    status = a_status(t, **{t.names.tier_queue("30m"): Counts(3)})
    data = snapshot_json(
        status,
        [],
        ["metrics http://w:9464/metrics: refused"],
        read_at_ms=1,
        age=0.5,
        took_s=0.01,
        error=None,
        refresh_s=5,
        actions=False,
        names=t.names,
    )
    assert data["status"]["namespace"] == "pic.v1"
    assert [tier["name"] for tier in data["tiers"]] == [
        t.names.tier_queue("1s"),
        t.names.tier_queue("30m"),
    ]
    assert data["tiers"][1]["waiting"] == 3
    assert {node["key"] for node in data["picture"]} >= {"publish", "due"}
    assert data["metrics_errors"] == ["metrics http://w:9464/metrics: refused"]
    empty = snapshot_json(
        None,
        [],
        [],
        read_at_ms=None,
        age=None,
        took_s=0,
        error="down",
        refresh_s=5,
        actions=True,
        names=t.names,
    )
    assert (empty["status"], empty["picture"], empty["error"]) == (None, [], "down")


# -- the schedule -------------------------------------------------------------------------

T0 = 1_796_150_400_000  # 2026-12-01T18:40:00.000Z


def late(key: str, queue: str) -> ScheduleRecord:
    return ScheduleRecord("pic.v1", key, 1, ScheduleState.SCHEDULED, queue, T0 - 1_000, "m", T0, T0)


def test_a_timeline_per_queue_in_the_topology_order() -> None:
    buckets = TIMELINE_SPAN_MS // TIMELINE_BUCKET_MS
    assert buckets == 24  # the next 6h in 15m buckets
    counts = {"push": [3, 0, 1] + [0] * 21, "orders": [0] * 24}
    found = timelines(
        ["orders", "push"],
        counts,
        [late("a", "push"), late("b", "push"), late("c", "orders")],
        start_ms=T0,
        bucket_ms=TIMELINE_BUCKET_MS,
    )
    assert [t.queue for t in found] == ["orders", "push"]
    orders, push = found
    assert (push.total, push.past_due, push.past_due_more) == (4, 2, False)
    assert push.caption() == "4 due in the next 6h; 2 past due, not handled yet"
    assert orders.caption() == "nothing due in the next 6h; 1 past due, not handled yet"
    data = push.as_json()
    assert data["queue"] == "push"
    assert len(data["buckets"]) == 24
    assert data["buckets"][0] == {"start": "2026-12-01T18:40:00.000Z", "start_ms": T0, "count": 3}
    assert data["buckets"][2]["start"] == "2026-12-01T19:10:00.000Z"
    assert (data["total"], data["past_due"], data["caption"]) == (4, 2, push.caption())
    assert push.edges()[-1] == T0 + TIMELINE_SPAN_MS
    quiet = Timeline("push", T0, TIMELINE_BUCKET_MS, (0,) * 24)
    assert quiet.caption() == "nothing due in the next 6h"


def test_past_due_is_counted_up_to_a_page() -> None:
    many = [late(f"k{i}", "push") for i in range(PAST_DUE_CAP)]
    (push,) = timelines(["push"], {}, many, start_ms=T0, bucket_ms=TIMELINE_BUCKET_MS)
    assert (push.past_due, push.past_due_more) == (PAST_DUE_CAP, True)
    assert push.counts == ()  # a queue the read did not count
    assert push.caption().endswith(f"{PAST_DUE_CAP}+ past due, not handled yet")


def test_timeline_labels_every_hour() -> None:
    labels = timeline_labels(24, TIMELINE_BUCKET_MS)
    assert labels[0] == "now"
    assert [labels[i] for i in (4, 8, 20)] == ["+1h", "+2h", "+5h"]
    assert [x for x in labels if x] == ["now", "+1h", "+2h", "+3h", "+4h", "+5h"]
    assert timeline_labels(3, 30 * 60_000, 60 * 60_000) == ["now", "", "+1h"]


def test_the_schedule_json() -> None:
    t = Timeline("push", T0, TIMELINE_BUCKET_MS, (1,) + (0,) * 23)
    data = schedule_json((t,), read_at_ms=T0, age=0.25, error=None, refresh_s=5)
    assert (data["span_ms"], data["bucket_ms"], data["read_at_ms"]) == (
        TIMELINE_SPAN_MS,
        TIMELINE_BUCKET_MS,
        T0,
    )
    assert [q["queue"] for q in data["queues"]] == ["push"]
    failed = schedule_json(None, read_at_ms=None, age=None, error="store down", refresh_s=5)
    assert (failed["queues"], failed["error"]) == ([], "store down")


def test_a_searched_key_is_a_schedule_key() -> None:
    assert schedule_key("order-42") == "order-42"
    with pytest.raises(ConfigError, match=r"\?key=KEY"):
        schedule_key(None)
    with pytest.raises(ConfigError, match="key is empty"):
        schedule_key("")
    with pytest.raises(ConfigError, match="key is 256 bytes long"):
        schedule_key("k" * 256)


# -- one poller for every client --------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_poller_reads_once_per_interval() -> None:
    clock, reads = Clock(), []
    poller = Poller(lambda: reads.append(1) or len(reads), 5.0, clock=clock)
    assert poller.get().value == 1
    clock.now += 4.9
    assert poller.get().value == 1
    clock.now += 0.2
    assert poller.get().value == 2
    poller.invalidate()
    assert poller.get().value == 3
    assert poller.reads == 3


def test_a_failed_read_keeps_the_last_value_and_says_why() -> None:
    clock, results = Clock(), iter([1, RuntimeError("broker down"), 3])

    def read() -> int:
        value = next(results)
        if isinstance(value, Exception):
            raise value
        return value

    poller = Poller(read, 1.0, clock=clock, errors=(RuntimeError,))
    assert (poller.get().value, poller.get().error) == (1, None)
    clock.now += 2
    state = poller.get()
    assert (state.value, state.error) == (1, "broker down")
    clock.now += 2
    assert (poller.get().value, poller.get().error) == (3, None)


def test_concurrent_clients_share_one_read() -> None:
    reads = []

    def slow_read() -> int:
        reads.append(1)
        time.sleep(0.2)  # every client arrives while the first read runs
        return len(reads)

    poller = Poller(slow_read, 30.0)
    got: list[int | None] = []
    threads = [threading.Thread(target=lambda: got.append(poller.get().value)) for _ in range(50)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(reads) == 1
    assert got == [1] * 50
