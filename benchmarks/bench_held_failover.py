#!/usr/bin/env python3
"""The [held] backend when the holding queue's leader node dies (RabbitMQ 4.3+).

Starts a 3-node 4.3 cluster with `.ci/brokers.sh cluster-start` (its own name and ports),
declares a [held] topology (3 replicas), runs a holder connected to the node that leads
the holding queue (the worst case: the holder loses its connection too), publishes N
messages with random delays (confirmed, through another node), SIGKILLs the leader a few
seconds later, and counts what reaches the business queue (a consumer on a surviving
node): lost, early, duplicates, lateness. Removes the cluster at the end.

    .venv/bin/python benchmarks/bench_held_failover.py                 # 2,000 messages, ~2 min
    .venv/bin/python benchmarks/bench_held_failover.py --port 5970 --json

Exit 0; 1 when a message was lost or early.
"""

from __future__ import annotations

import argparse
import base64
import json
import random
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pika

from rabbit_delay import topology_from_dict
from rabbit_delay._amqp10.holder import Holder
from rabbit_delay._envelope import now_ms
from rabbit_delay.sync import Publisher, connect, declare

BROKERS_SH = Path(__file__).resolve().parents[1] / ".ci" / "brokers.sh"


def brokers(*args: str) -> str:
    done = subprocess.run(["bash", str(BROKERS_SH), *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"brokers.sh {' '.join(args)}: {done.stderr[-2000:]}")
    return done.stdout.strip()


def api(port: int, path: str) -> Any:
    request = urllib.request.Request(f"http://127.0.0.1:{port + 10000}/api/{path}")
    request.add_header("Authorization", "Basic " + base64.b64encode(b"guest:guest").decode())
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.load(response)


class Sink(threading.Thread):
    """Consumes the business queue on one node: first arrival and due time per id."""

    def __init__(self, url: str, queue: str) -> None:
        super().__init__(daemon=True)
        self.url, self.queue = url, queue
        self.first: dict[str, tuple[int, int]] = {}
        self.duplicates = 0
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            try:
                conn = pika.BlockingConnection(pika.URLParameters(self.url))
                ch = conn.channel()
                ch.basic_qos(prefetch_count=500)

                def on(ch_: Any, method: Any, props: Any, _body: bytes) -> None:
                    arrived = now_ms()
                    if props.message_id in self.first:
                        self.duplicates += 1
                    else:
                        self.first[props.message_id] = (arrived, int(props.headers["rd-due-at"]))
                    ch_.basic_ack(method.delivery_tag)

                ch.basic_consume(self.queue, on)
                while not self.halt.is_set():
                    conn.process_data_events(time_limit=0.05)
                conn.close()
            except Exception:  # a node going away: consume again
                time.sleep(1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=2_000)
    parser.add_argument("--port", type=int, default=5970, help="first member's AMQP port")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    name = "hf" + uuid.uuid4().hex[:6]
    log = (lambda line: print(line, file=sys.stderr)) if args.json else print
    log(f"starting cluster {name} on ports {args.port}, +10, +20")
    brokers("cluster-start", "4.3", name, "--port", str(args.port))
    members = [f"{name}-{i}" for i in (1, 2, 3)]
    ports = {m: args.port + 10 * i for i, m in enumerate(members)}
    urls = {m: f"amqp://guest:guest@127.0.0.1:{p}/%2F" for m, p in ports.items()}
    result: dict[str, Any] = {"messages": args.messages}
    try:
        topology = topology_from_dict(
            {
                "namespace": name,
                "tiers": {"1h": "1h"},
                "queues": {"a": {}},
                "held": {},
                "scaling": {"replicas": 3},
            }
        )
        conn = connect(urls[members[0]])
        declare(conn, topology)
        conn.close()
        held_queue = quote(topology.names.held_queue(), safe="")
        leader = ""
        for _ in range(30):
            leader = api(args.port, f"queues/%2F/{held_queue}").get("leader") or ""
            if leader:
                break
            time.sleep(1)
        victim = next(m for m in members if leader.startswith(f"rd-43-{m}@"))
        others = [m for m in members if m != victim]
        sink = Sink(urls[others[0]], topology.names.business_queue("a"))
        sink.start()
        holder = Holder(topology, [urls[victim], *(urls[m] for m in others)])
        holder.start()
        holder.ready.wait(15)
        rng = random.Random(5)
        with Publisher(topology, urls[others[1]]) as publisher:
            ids = [
                publisher.publish_delayed({"i": i}, queue="a", delay=rng.uniform(2, 25))
                for i in range(args.messages)
            ]
        time.sleep(4)
        killed_at = now_ms()
        brokers("kill", "4.3", victim)
        log(f"killed {victim}, the holding queue's leader and the holder's node")
        deadline = time.monotonic() + 120
        while len(sink.first) < len(ids) and time.monotonic() < deadline:
            time.sleep(0.5)
        sink.halt.set()
        holder.stop()
        late = sorted(a - d for a, d in sink.first.values())
        after = sorted(a - d for a, d in sink.first.values() if d > killed_at + 15_000)
        result.update(
            {
                "received": len(sink.first),
                "lost": len(set(ids) - set(sink.first)),
                "duplicates": sink.duplicates,
                "early": sum(1 for x in late if x < 0),
                "late_p50_ms": late[len(late) // 2] if late else None,
                "late_p99_ms": late[int(len(late) * 0.99)] if late else None,
                "late_max_ms": late[-1] if late else None,
                "late_over_1s": sum(1 for x in late if x > 1000),
                "due_15s_after_kill_p99_ms": after[int(len(after) * 0.99)] if after else None,
                "holder_connects": holder.stats.connects,
                "new_leader": api(ports[others[0]], f"queues/%2F/{held_queue}").get("leader"),
            }
        )
    finally:
        brokers("cluster-rm", "4.3", name)
    print(json.dumps(result, indent=2) if args.json else result)
    return 1 if result.get("lost") or result.get("early") else 0


if __name__ == "__main__":
    sys.exit(main())
