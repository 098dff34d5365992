"""The dashboard in a real browser: headless Chromium (Debian's /usr/bin/chromium) driven
by Playwright for Python, no `playwright install` (no browser download).

It opens the overview, finds the tiers and depths set up, follows the parking lot, opens
a message's traceback, replays it through the page and sees a consumer on the business
queue receive it, and saves a screenshot: into the test's tmp_path, or, with
RABBIT_DELAY_UPDATE_SCREENSHOT=1, over the one the README shows (docs/images/dashboard.png),
so a test run leaves the checkout as it was. For a topology with [schedule] it sees each
queue's timeline of what comes due (redrawn by the page's script as more is scheduled)
and finds a key's record through the search box.
Every request the page makes goes to the dashboard itself.

Chromium missing is a failure saying what to install, never a skip: `.ci/run` and
`.ci/test` install it (apt-get install chromium chromium-driver) when they can.
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pika
import pytest
from conftest import MakeTopology, wait_for
from prometheus_client import CollectorRegistry

from rabbit_delay._io.endpoints import serve as serve_metrics
from rabbit_delay.metrics import Metrics
from rabbit_delay.sync import Publisher

from .test_dashboard import Start, dashboards, park

# One xdist worker runs the module: one Chromium (the module's `browser`) for both tests.
pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("browser")]

CHROMIUM = "/usr/bin/chromium"
SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "images" / "dashboard.png"
# What the machine's closed network needs (docs/testing.md): no background fetches.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not Path(CHROMIUM).exists():
        pytest.fail(
            f"{CHROMIUM} is missing: install Debian's chromium and chromium-driver "
            "(apt-get install -y chromium chromium-driver; .ci/test does it as root)"
        )
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("playwright is missing: pip install -e '.[dev]' (it is a dev extra)")
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield launched
        launched.close()


@pytest.fixture
def dashboard(broker_url: str) -> Iterator[Start]:
    with dashboards(broker_url) as start:
        yield start


class Consumer:
    """A raw consumer on a business queue: what a worker would receive."""

    def __init__(self, url: str, queue: str) -> None:
        self.ids: list[str | None] = []
        self._stop = threading.Event()
        self._connection = pika.BlockingConnection(pika.URLParameters(url))
        channel = self._connection.channel()
        channel.basic_consume(queue, self._on_message, auto_ack=True)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _on_message(self, _ch: Any, _method: Any, props: Any, _body: bytes) -> None:
        self.ids.append(props.message_id)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._connection.process_data_events(time_limit=0.1)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._connection.close()


def test_the_page_shows_the_topology_and_replays_a_message(
    browser: Any, make_topology: MakeTopology, dashboard: Start, broker_url: str, tmp_path: Path
) -> None:
    shot = (
        SCREENSHOT
        if os.environ.get("RABBIT_DELAY_UPDATE_SCREENSHOT") == "1"
        else (tmp_path / "dashboard.png")
    )
    # Classic queues: their heads can be peeked on every version, so the ages show.
    topology = make_topology(tiers={"1m": "1m", "10m": "10m"}, queue_type="classic")
    n = topology.names
    # A worker's metrics, for the lateness histograms.
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    for late_ms in (12, 30, 40, 80, 120, 180, 260, 420, 700, 1300, 90, 60, 45):
        metrics.delivery_lateness_seconds.labels(queue="push", tier="1m").observe(late_ms / 1000)
    for late_ms in (20, 70, 150, 2600):
        metrics.delivery_lateness_seconds.labels(queue="orders.cancel", tier="10m").observe(
            late_ms / 1000
        )
    metrics_server, _ = serve_metrics(0, addr="127.0.0.1", registry=registry)
    metrics_url = f"http://127.0.0.1:{metrics_server.server_port}/metrics"
    run = dashboard(topology, allow_actions=True, refresh_s=1.0, metrics_urls=[metrics_url])
    with Publisher(topology, url=broker_url) as publisher:
        publisher.publish_many([{"i": i} for i in range(4)], "10m", queue="push")
        publisher.publish_many([{"i": i} for i in range(2)], "1m", queue="orders.cancel")
    ids = park(broker_url, topology, "push", 3)
    consumer = Consumer(broker_url, n.business_queue("push"))
    page = browser.new_page(viewport={"width": 1380, "height": 1000})
    requests: list[str] = []
    page.on("request", lambda request: requests.append(request.url))
    try:
        page.goto(run.base + "/")
        page.wait_for_selector("body[data-ready='1']")
        # The tiers and the depths that were set up.
        buffer_10m = page.locator(f'svg.topology g[data-q="{n.tier_queue("10m")}"]')
        assert "ready 4" in (buffer_10m.text_content() or "")
        buffer_1m = page.locator(f'svg.topology g[data-q="{n.tier_queue("1m")}"]')
        assert "ready 2" in (buffer_1m.text_content() or "")
        lot = page.locator(f'svg.topology g[data-q="{n.parking_queue("push")}"]')
        assert "ready 3" in (lot.text_content() or "")
        assert "attention" in (lot.get_attribute("class") or "")
        tiers = page.locator("#tiers").inner_text()
        assert n.tier_queue("10m") in tiers
        assert "3 message(s) need a human" in page.locator("#queues").inner_text()
        assert "push via 1m" in page.locator("#lateness").inner_text()
        # The script refreshes from /api/snapshot (string evaluation is refused by the
        # page's CSP, so selectors are waited on, not JavaScript).
        page.wait_for_selector("body[data-read-at]", timeout=10_000)
        shot.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(shot), full_page=True)
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert shot.stat().st_size > 10_000  # a page, not a blank
        # The parking lot: the list, a message's traceback on demand, then replay it.
        page.click('svg.topology a[href="/parked/push"]')
        page.wait_for_selector("table#parked")
        assert page.locator("table#parked tbody tr[data-id]").count() == 3
        page.click(f'button.show[data-id="{ids[1]}"]')
        traceback = page.locator(f'tr[data-detail="{ids[1]}"] pre.traceback')
        traceback.wait_for()
        assert "ValueError: boom 1" in traceback.inner_text()
        page.click(f'button.replay-one[data-id="{ids[1]}"]')
        page.wait_for_selector("#result.ok")
        assert "replayed 1 message(s)" in page.locator("#result").inner_text()
        wait_for(lambda: ids[1] in consumer.ids, 10, "the replayed message at the consumer")
        assert consumer.ids == [ids[1]]
        # The page reloads after the action: the lot holds the two others.
        page.wait_for_load_state()
        page.wait_for_selector(f'table#parked tr[data-id="{ids[2]}"]')
        wait_for(
            lambda: page.locator("table#parked tbody tr[data-id]").count() == 2,
            10,
            "the page to list the two messages left",
        )
    finally:
        page.close()
        consumer.close()
        metrics_server.shutdown()
        metrics_server.server_close()
    # Nothing from elsewhere: every request went to the dashboard.
    assert requests
    assert all(url.startswith(run.base + "/") for url in requests), requests
    assert shutil.which("chromium") or Path(CHROMIUM).exists()


def test_the_page_shows_the_schedule_and_finds_a_key(
    browser: Any, make_topology: MakeTopology, dashboard: Start, broker_url: str, tmp_path: Path
) -> None:
    topology = make_topology(
        tiers={"1m": "1m", "10m": "10m", "1h": "1h"},
        queue_type="classic",
        schedule={},
        idempotency={"path": str(tmp_path / "idem.sqlite3")},
    )
    run = dashboard(topology, refresh_s=1.0)
    with Publisher(topology, url=broker_url) as publisher:
        publisher.publish_many(
            [{"order": i} for i in range(3)], "10m", queue="push", keys=["o-1", "o-2", "o-3"]
        )
        publisher.publish_delayed({"order": 9}, "1h", queue="orders.cancel", key="order-9")
    page = browser.new_page(viewport={"width": 1380, "height": 1000})
    requests: list[str] = []
    page.on("request", lambda request: requests.append(request.url))
    try:
        page.goto(run.base + "/")
        page.wait_for_selector("body[data-ready='1']")
        push = page.locator('#schedule figure[data-tq="push"]')
        assert "3 due in the next 6h" in push.locator("figcaption").inner_text()
        assert push.locator("rect.bar").count() == 24
        tallest = push.locator('rect.bar[data-b="0"]')
        assert tallest.get_attribute("height") == "90"  # all three in the first 15 minutes
        cancel = page.locator('#schedule figure[data-tq="orders.cancel"]')
        assert "1 due in the next 6h" in cancel.locator("figcaption").inner_text()
        # The script draws the timelines again from /api/schedule: one more is seen.
        with Publisher(topology, url=broker_url) as publisher:
            publisher.publish_delayed({"order": 4}, "1h", queue="push", key="o-4")
        page.wait_for_selector("body[data-schedule-at]", timeout=10_000)
        wait_for(
            lambda: "4 due in the next 6h" in push.locator("figcaption").inner_text(),
            15,
            "the page to redraw the push timeline",
            interval=0.2,
        )
        assert push.locator('rect.bar[data-b="3"]').get_attribute("height") == "30"
        page.locator("#schedule").screenshot(path=str(tmp_path / "schedule.png"))
        # The search box: a key's record, then one the schedule does not know.
        page.fill('#schedule-search input[name="key"]', "order-9")
        page.click("#schedule-search button")
        page.wait_for_selector("#schedule-record")
        shown = page.locator("#schedule-record").inner_text()
        assert "order-9" in shown
        assert "scheduled" in shown
        assert "orders.cancel" in shown
        assert "(in 59m" in shown or "(in 1h)" in shown
        assert page.locator('#schedule-record dd[data-f="generation"]').inner_text() == "1"
        page.fill('#schedule-search input[name="key"]', "nope")
        page.click("#schedule-search button")
        page.wait_for_selector("#schedule-missing")
        assert "unknown key 'nope'" in page.locator("#schedule-missing").inner_text()
    finally:
        page.close()
    assert requests
    assert all(url.startswith(run.base + "/") for url in requests), requests
