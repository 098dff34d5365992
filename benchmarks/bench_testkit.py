"""rabbit_delay.testing: how long a user's test takes to publish N messages, let 30
minutes pass and have them handled. No broker: the figure is the kit's own cost.

    .venv/bin/python benchmarks/bench_testkit.py [--messages 1000] [--rounds 7] [--json]

Each round builds a TestBroker on topology/orders.toml (declared by the real declare
program), publishes N messages through its 30-minute tier with `publish_many`, advances
30 minutes, and checks every message was handled once; for a `def` and an `async def`
handler. Reports the median and best round (setup, publish, advance, total) and the
cost per message of the whole round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from rabbit_delay import App
from rabbit_delay.testing import TestBroker

TOPOLOGY = Path(__file__).resolve().parent.parent / "topology" / "orders.toml"
QUEUE = "orders.cancel-unpaid"


class CancelOrder(BaseModel):
    order_id: int


def make_app(asynchronous: bool, seen: list[int]) -> App:
    app = App(TOPOLOGY)
    if asynchronous:

        async def handle_async(msg: CancelOrder) -> None:
            seen.append(msg.order_id)

        app.add_consumer(QUEUE, handle_async, model=CancelOrder)
    else:

        def handle(msg: CancelOrder) -> None:
            seen.append(msg.order_id)

        app.add_consumer(QUEUE, handle, model=CancelOrder)
    return app


def one_round(messages: int, asynchronous: bool) -> dict[str, float]:
    seen: list[int] = []
    started = time.perf_counter()
    with TestBroker(make_app(asynchronous, seen)) as broker:
        ready = time.perf_counter()
        orders = [CancelOrder(order_id=n) for n in range(messages)]
        broker.publisher.publish_many(orders, "30m", queue=QUEUE)
        published = time.perf_counter()
        broker.advance("30m")
        advanced = time.perf_counter()
        if sorted(seen) != list(range(messages)) or broker.stats.acked != messages:
            raise SystemExit(f"not every message was handled once: {broker.stats}")
    return {
        "setup_s": ready - started,
        "publish_s": published - ready,
        "advance_s": advanced - published,
        "total_s": advanced - started,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=1_000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="1 round of 100 messages")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    messages, rounds = (100, 1) if args.quick else (args.messages, args.rounds)
    result: dict[str, Any] = {"config": {"messages": messages, "rounds": rounds}, "handlers": {}}
    for name, asynchronous in (("def", False), ("async def", True)):
        runs = [one_round(messages, asynchronous) for _ in range(rounds)]
        figures = {
            key: {
                "median": statistics.median(r[key] for r in runs),
                "best": min(r[key] for r in runs),
            }
            for key in runs[0]
        }
        figures["per_message_us"] = {
            "median": figures["total_s"]["median"] / messages * 1e6,
            "best": figures["total_s"]["best"] / messages * 1e6,
        }
        result["handlers"][name] = figures
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{messages} messages through a 30-minute tier, {rounds} round(s), median (best):")
    for name, figures in result["handlers"].items():
        parts = ", ".join(
            f"{key[:-2]} {figures[key]['median'] * 1000:.0f} ms ({figures[key]['best'] * 1000:.0f})"
            for key in ("setup_s", "publish_s", "advance_s", "total_s")
        )
        per = figures["per_message_us"]
        print(f"  {name:9} handler: {parts}; {per['median']:.0f} us/message ({per['best']:.0f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
