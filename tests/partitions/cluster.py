"""A RabbitMQ cluster whose members can be partitioned: one network namespace per node.

Layout (net N, default 0; members 1..size):

    root namespace (the clients)          bridge p23brN, 10.23.N.1/24
      |-- veth p23vN-i <-> eth0 in namespace p23-N-i, 10.23.N.(10+i)/24: member i

Every member runs in a namespace of its own, on the standard ports (AMQP 5672,
distribution 25672, epmd 4369: namespaces do not share ports, so nothing here can meet
the machine's broker or the nodes of `.ci/brokers.sh`), with the long node name
`rd@10.23.N.(10+i)`. The clients (publishers, workers, rabbitmqctl for checks) run in the
root namespace and reach every member through the bridge: a partition cuts members from
members, never a client from a member (as in RabbitMQ's own Jepsen suite, whose clients
may talk to any node).

Faults are nftables rules in a table `inet p23` inside the namespaces (drop both ways
between the two sides); `heal()` flushes them. `tc netem` (latency, loss) needs the
sch_netem kernel module, which the machines here lack: `netem_available()` says so.

Node kinds are `.ci/brokers.sh`'s VERSIONs: `host` (the machine's rabbitmq-server, 3.10
here, data under $RD_BROKERS_DIR/partitions/) and `4.0` / `4.3` (their Debian roots,
provisioned by `brokers.sh setup`, data under the root's /var/lib/rd-nodes/p23-*, run as
the root's node user, chrooted, inside the namespace). Members join through classic
peer discovery (3.x: member 1 boots first and the others find it; 4.x: all at once,
its discovery elects the seed).

Cleanup is certain: `cleanup()` (the fixture's finalizer, an atexit hook, and
`python -m partitions cleanup` for a run that was killed) kills every process inside
the namespaces (`ip netns pids`), deletes the namespaces (their veths and nft tables go
with them) and the bridge, and the nodes' data. Needs root (namespaces, nftables).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "p23"
BROKERS_DIR = Path(
    os.environ.get("RD_BROKERS_DIR")
    or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rabbit-delay/brokers"
)
ROOT_UIDS = {"4.0": 2940, "4.3": 2943}
AMQP_PORT = 5672
NET_TICKTIME_S = 10  # Erlang's default is 60 s: a partition would go unseen for a minute
BOOT_TIMEOUT_S = 150.0


class HarnessError(RuntimeError):
    """The partition harness could not do what it was asked (names what and why)."""


def run(args: Sequence[str], *, check: bool = True, timeout: float = 60) -> str:
    done = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, check=False)
    if check and done.returncode != 0:
        raise HarnessError(f"{' '.join(args)}: exit {done.returncode}: {done.stderr[-2000:]}")
    return done.stdout


def unavailable_reason() -> str | None:
    """Why partitions cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces and nftables need root"
    for tool in ("ip", "nft"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (apt-get install -y iproute2 nftables)"
    return None


def netem_available() -> bool:
    """Whether `tc qdisc ... netem` works here (it needs the sch_netem kernel module)."""
    ns = f"{PREFIX}-netem-probe"
    run(["ip", "netns", "add", ns], check=False)
    try:
        run(["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"], check=False)
        done = subprocess.run(
            ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", "netem",
             "delay", "1ms"],
            capture_output=True, check=False, timeout=10,
        )  # fmt: skip
        return done.returncode == 0
    finally:
        run(["ip", "netns", "del", ns], check=False)


def _cmdline(pid: int) -> bytes:
    """The command line of process `pid` (b"" once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def host_server() -> str:
    # Debian's /usr/sbin/rabbitmq-server re-runs itself through su (losing our HOME)
    path = "/usr/lib/rabbitmq/bin/rabbitmq-server"
    return path if os.path.exists(path) else (shutil.which("rabbitmq-server") or path)


@dataclass
class Member:
    """One node of the cluster, in its namespace."""

    cluster: PartitionCluster
    index: int  # 1..size

    @property
    def ns(self) -> str:
        return f"{PREFIX}-{self.cluster.net}-{self.index}"

    @property
    def address(self) -> str:
        return f"10.23.{self.cluster.net}.{10 + self.index}"

    @property
    def node_name(self) -> str:
        return f"rd@{self.address}"

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@{self.address}:{AMQP_PORT}/%2F"

    @property
    def host_dir(self) -> Path:
        """Its state as the root namespace sees it."""
        return self.cluster.base_dir / self.ns

    @property
    def node_dir(self) -> str:
        """Its state as the node sees it (inside its Debian root for 4.x)."""
        if self.cluster.root is None:
            return str(self.host_dir)
        return f"/var/lib/rd-nodes/{self.ns}"

    def env(self) -> list[str]:
        d = self.node_dir
        dist_if = "{" + self.address.replace(".", ",") + "}"
        return [
            f"HOME={d}/home",
            "PATH=/usr/lib/rabbitmq/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "LANG=C.UTF-8",
            "LC_ALL=C.UTF-8",
            f"RABBITMQ_NODENAME={self.node_name}",
            "RABBITMQ_USE_LONGNAME=true",
            f"RABBITMQ_NODE_PORT={AMQP_PORT}",
            "RABBITMQ_DIST_PORT=25672",
            f"RABBITMQ_MNESIA_BASE={d}/data",
            f"RABBITMQ_LOG_BASE={d}/log",
            f"RABBITMQ_ENABLED_PLUGINS_FILE={d}/enabled_plugins",
            f"RABBITMQ_CONFIG_FILE={d}/rabbitmq.conf",
            f"RABBITMQ_ADVANCED_CONFIG_FILE={d}/advanced.config",
            f"RABBITMQ_CONF_ENV_FILE={d}/rabbitmq-env.conf",
            f"RABBITMQ_PID_FILE={d}/node.pid",
            "ERL_EPMD_PORT=4369",
            f"RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS=-kernel inet_dist_use_interface {dist_if}",
        ]

    def in_ns(self, *cmd: str) -> list[str]:
        """`cmd` as this node's user, in its namespace (and root), with its environment."""
        prefix = ["ip", "netns", "exec", self.ns]
        if self.cluster.root is None:
            return [*prefix, "env", "-i", *self.env(), *cmd]
        uid = ROOT_UIDS[self.cluster.kind]
        return [
            *prefix, "chroot", f"--userspec={uid}:{uid}", str(self.cluster.root),
            "/usr/bin/env", "-i", "-C", self.node_dir, *self.env(), *cmd,
        ]  # fmt: skip

    def ctl(self, *args: str, timeout: float = 60) -> str:
        return run(self.in_ns("rabbitmqctl", "-q", *args), timeout=timeout)

    def write_config(self) -> None:
        c = self.cluster
        d = self.host_dir
        for sub in ("home", "data", "log"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        cookie = d / "home" / ".erlang.cookie"
        cookie.write_text(c.cookie, encoding="ascii")
        cookie.chmod(0o400)
        # the management API: `rabbit-delay status` and the checker read `messages_dlx`
        (d / "enabled_plugins").write_text("[rabbitmq_management].\n", encoding="ascii")
        lines = [
            f"listeners.tcp.1 = {self.address}:{AMQP_PORT}",
            "loopback_users = none",  # guest from the root namespace (not loopback here)
            f"management.tcp.ip = {self.address}",
            "management.tcp.port = 15672",
            "disk_free_limit.absolute = 50MB",
            "log.file.level = info",
            "cluster_formation.peer_discovery_backend = classic_config",
        ]
        lines += [
            f"cluster_formation.classic_config.nodes.{m.index} = {m.node_name}" for m in c.members
        ]
        if c.major < 4:
            lines += [
                f"cluster_partition_handling = {c.partition_handling}",
                "cluster_formation.randomized_startup_delay_range.min = 0",
                "cluster_formation.randomized_startup_delay_range.max = 1",
            ]
        lines += list(c.conf)
        (d / "rabbitmq.conf").write_text("\n".join(lines) + "\n", encoding="utf-8")
        (d / "rabbitmq-env.conf").write_text("", encoding="utf-8")
        (d / "advanced.config").write_text(
            f"[{{kernel, [{{net_ticktime, {NET_TICKTIME_S}}}]}}].\n", encoding="utf-8"
        )
        if c.root is not None:
            uid = ROOT_UIDS[c.kind]
            run(["chown", "-R", f"{uid}:{uid}", str(d)])

    def start(self) -> None:
        """Start the node (returns at once; `wait_answers` waits for its boot)."""
        log = open(self.host_dir / f"stdout.{int(time.time())}.log", "ab")  # noqa: SIM115
        server = (
            host_server() if self.cluster.root is None else "/usr/lib/rabbitmq/bin/rabbitmq-server"
        )
        self.cluster.procs.append(subprocess.Popen(
            self.in_ns(server), stdin=subprocess.DEVNULL, stdout=log, stderr=log,
            start_new_session=True,
        ))  # fmt: skip
        log.close()

    def kill(self) -> None:
        """SIGKILL every process in its namespace but epmd (a crash of the node)."""
        for pid in self.pids():
            if b"epmd" not in _cmdline(pid):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)

    def pids(self) -> list[int]:
        out = run(["ip", "netns", "pids", self.ns], check=False)
        return [int(p) for p in out.split()]

    def answers(self) -> bool:
        """It accepts TCP connections on its AMQP port (from the root namespace)."""
        try:
            with socket.create_connection((self.address, AMQP_PORT), timeout=2):
                return True
        except OSError:
            return False

    def running_nodes(self) -> list[str]:
        """The cluster's running nodes as this member sees them ([] if it cannot say)."""
        try:
            out = self.ctl("cluster_status", "--formatter", "json", timeout=30)
            data = json.loads(out)
        except (HarnessError, ValueError, subprocess.TimeoutExpired):
            return []
        return sorted(str(n) for n in data.get("running_nodes", []))

    def log_tail(self, lines: int = 20) -> str:
        out = []
        for f in sorted((self.host_dir / "log").glob("*.log")):
            text = f.read_text(encoding="utf-8", errors="replace").splitlines()
            out.append(f"--- {f}\n" + "\n".join(text[-lines:]))
        return "\n".join(out)


@dataclass
class PartitionCluster:
    """`size` nodes of `kind` (brokers.sh VERSION) clustered, each in its namespace."""

    kind: str
    size: int = 3
    net: int = 0
    partition_handling: str = "pause_minority"  # 3.x only: ignore, pause_minority, autoheal
    conf: Sequence[str] = ()
    members: list[Member] = field(init=False)
    cookie: str = field(init=False)
    cut_pairs: set[frozenset[int]] = field(init=False, default_factory=set)
    restarts_after_heal: int = 0
    partitioned_after_heal: int = 0  # times Mnesia still reported a partition (3.x)
    procs: list[subprocess.Popen[bytes]] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        if not 0 <= self.net <= 255:
            raise ValueError("net is the third octet of 10.23.N.0/24")
        self.members = [Member(self, i) for i in range(1, self.size + 1)]
        self.cookie = os.urandom(10).hex().upper()

    # -- where things are ------------------------------------------------------------------

    @property
    def bridge(self) -> str:
        return f"{PREFIX}br{self.net}"

    @property
    def root(self) -> Path | None:
        return None if self.kind == "host" else BROKERS_DIR / f"rabbitmq-{self.kind}" / "root"

    @property
    def base_dir(self) -> Path:
        if self.root is None:
            return BROKERS_DIR / "partitions"
        return self.root / "var/lib/rd-nodes"

    @property
    def version(self) -> str:
        if self.root is None:
            dirs = sorted(Path("/usr/lib/rabbitmq/lib").glob("rabbitmq_server-*"))
            return dirs[-1].name.rsplit("-", 1)[1] if dirs else "?"
        out = run(["chroot", str(self.root), "dpkg-query", "-W", "-f", "${Version}",
                   "rabbitmq-server"])  # fmt: skip
        return out.split("-")[0]

    @property
    def major(self) -> int:
        return 3 if self.kind == "host" else 4

    @property
    def urls(self) -> list[str]:
        return [m.url for m in self.members]

    def member(self, node_name: str) -> Member:
        for m in self.members:
            if m.node_name == node_name:
                return m
        raise KeyError(node_name)

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Network, nodes, cluster; returns when every member runs in one cluster."""
        reason = unavailable_reason()
        if reason is not None:
            raise HarnessError(reason)
        if self.root is not None and not (self.root.parent / "ready").exists():
            raise HarnessError(
                f"RabbitMQ {self.kind} is not provisioned: bash .ci/brokers.sh setup {self.kind}"
            )
        atexit.register(self.cleanup)
        self.cleanup()  # what a killed run of the same net left
        self._network()
        if self.root is not None:
            self._mount_root()
        for m in self.members:
            self._epmd(m)
            m.write_config()
        if self.major < 4:
            # 3.x: member 1 first, the others find it through peer discovery and join it
            # (started together, two may each form a cluster of their own)
            self.members[0].start()
            self.wait_answers(self.members[:1])
            for m in self.members[1:]:
                m.start()
        else:
            # 4.x: all at once (its peer discovery waits for the listed nodes and elects
            # one seed; a node started alone waits for the others)
            for m in self.members:
                m.start()
        self.wait_answers(self.members)
        self.wait_clustered()
        self.wait_amqp()

    def _network(self) -> None:
        run(["ip", "link", "add", self.bridge, "type", "bridge"])
        run(["ip", "addr", "add", f"10.23.{self.net}.1/24", "dev", self.bridge])
        run(["ip", "link", "set", self.bridge, "up"])
        for m in self.members:
            host_if = f"{PREFIX}v{self.net}-{m.index}"
            run(["ip", "netns", "add", m.ns])
            run(["ip", "link", "add", host_if, "type", "veth", "peer", "name", "eth0",
                 "netns", m.ns])  # fmt: skip
            run(["ip", "link", "set", host_if, "master", self.bridge])
            run(["ip", "link", "set", host_if, "up"])
            ns = ["ip", "netns", "exec", m.ns]
            run([*ns, "ip", "addr", "add", f"{m.address}/24", "dev", "eth0"])
            run([*ns, "ip", "link", "set", "eth0", "up"])
            run([*ns, "ip", "link", "set", "lo", "up"])
            run([*ns, "ip", "route", "add", "default", "via", f"10.23.{self.net}.1"])
            run([*ns, "nft", "add", "table", "inet", PREFIX])
            for chain, hook in (("input", "input"), ("output", "output")):
                run([*ns, "nft", "add", "chain", "inet", PREFIX, chain,
                     f"{{ type filter hook {hook} priority 0 ; policy accept ; }}"])  # fmt: skip

    def _epmd(self, m: Member) -> None:
        # Our own epmd per namespace, from the root namespace's filesystem, so that
        # brokers.sh (which kills the epmd of a Debian root when its last node stops)
        # never takes it away from a running member.
        self.procs.append(subprocess.Popen(
            ["ip", "netns", "exec", m.ns, "epmd", "-port", "4369"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,
        ))  # fmt: skip
        deadline = time.monotonic() + 10
        while not any(b"epmd" in _cmdline(p) for p in m.pids()):
            if time.monotonic() > deadline:
                raise HarnessError(f"epmd did not start in {m.ns}")
            time.sleep(0.1)
        time.sleep(0.3)

    def _root_lock(self) -> int:
        fd = os.open(BROKERS_DIR / f"mount-{self.kind}.lock", os.O_CREAT | os.O_RDWR, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        return fd

    def _mount_root(self) -> None:
        # as brokers.sh's mount_root, under its lock
        assert self.root is not None
        fd = self._root_lock()
        try:
            if subprocess.run(["mountpoint", "-q", str(self.root / "proc")]).returncode:
                run(["mount", "-t", "proc", "proc", str(self.root / "proc")])
            if subprocess.run(["mountpoint", "-q", str(self.root / "dev")]).returncode:
                run(["mount", "--bind", "/dev", str(self.root / "dev")])
        finally:
            os.close(fd)

    def _maybe_umount_root(self) -> None:
        """As brokers.sh's maybe_umount: unmount /proc and /dev of the root when none of
        its nodes (brokers.sh's or ours) runs."""
        if self.root is None or not self.root.exists():
            return
        fd = self._root_lock()
        try:
            for pid_file in self.base_dir.glob("*/node.pid"):
                with contextlib.suppress(OSError, ValueError):
                    os.kill(int(pid_file.read_text().strip()), 0)
                    return
            for m in ("dev", "proc"):
                path = self.root / m
                if subprocess.run(["mountpoint", "-q", str(path)]).returncode == 0:
                    run(["umount", "-l", str(path)], check=False)
        finally:
            os.close(fd)

    def wait_answers(self, members: Iterable[Member], timeout: float = BOOT_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        for m in members:
            while not m.answers():
                if time.monotonic() > deadline:
                    raise HarnessError(f"{m.node_name} did not boot in {timeout}s:\n{m.log_tail()}")
                time.sleep(0.3)

    def wait_amqp(self, timeout: float = 90.0) -> None:
        """Until every member completes an AMQP handshake (a booting 4.x node accepts TCP
        connections before it can serve them)."""
        import pika
        import pika.exceptions

        deadline = time.monotonic() + timeout
        for m in self.members:
            while True:
                params = pika.URLParameters(m.url)
                params.connection_attempts = 1
                params.socket_timeout = 10
                try:
                    pika.BlockingConnection(params).close()
                    break
                except (pika.exceptions.AMQPError, OSError) as exc:
                    if time.monotonic() > deadline:
                        raise HarnessError(
                            f"{m.node_name}: no AMQP in {timeout}s: {exc!r}"
                        ) from None
                    time.sleep(1)

    def wait_clustered(self, timeout: float = 90.0) -> None:
        want = sorted(m.node_name for m in self.members)
        deadline = time.monotonic() + timeout
        while True:
            seen = [m.running_nodes() for m in self.members]
            if all(s == want for s in seen):
                return
            if time.monotonic() > deadline:
                raise HarnessError(f"not one cluster of {want} after {timeout}s: {seen}")
            time.sleep(1)

    def cleanup(self) -> None:
        """Kill everything in our namespaces, delete them and the bridge, and the data."""
        for m in self.members:
            for pid in m.pids():
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        for m in self.members:
            deadline = time.monotonic() + 10
            while m.pids() and time.monotonic() < deadline:
                time.sleep(0.1)
            run(["ip", "netns", "del", m.ns], check=False)
            run(["ip", "link", "del", f"{PREFIX}v{self.net}-{m.index}"], check=False)
        run(["ip", "link", "del", self.bridge], check=False)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        self.procs.clear()
        for m in self.members:
            shutil.rmtree(m.host_dir, ignore_errors=True)
        self._maybe_umount_root()
        self.cut_pairs.clear()

    # -- faults ------------------------------------------------------------------------------

    def _nft(self, m: Member, *args: str) -> None:
        run(["ip", "netns", "exec", m.ns, "nft", *args])

    def cut(self, a: Member, b: Member) -> None:
        """No packet between a and b, either way (drop: as a cable pulled, not a refusal)."""
        for x, y in ((a, b), (b, a)):
            self._nft(x, "add", "rule", "inet", PREFIX, "input", "ip", "saddr", y.address, "drop")
            self._nft(x, "add", "rule", "inet", PREFIX, "output", "ip", "daddr", y.address, "drop")
        self.cut_pairs.add(frozenset((a.index, b.index)))

    def partition(self, *groups: Sequence[Member]) -> None:
        """Split the members into `groups`: each sees only its own group."""
        self.heal()
        for i, g in enumerate(groups):
            for h in groups[i + 1 :]:
                for a in g:
                    for b in h:
                        self.cut(a, b)

    def isolate(self, m: Member) -> None:
        """`m` alone, the others together (with 3 nodes: a minority of one)."""
        self.partition([m], [o for o in self.members if o is not m])

    def bridge_through(self, m: Member) -> None:
        """`m` sees everyone; the others do not see each other (a bridge)."""
        self.heal()
        others = [o for o in self.members if o is not m]
        for i, a in enumerate(others):
            for b in others[i + 1 :]:
                self.cut(a, b)

    def heal(self) -> None:
        """Remove every rule: all members see each other again."""
        for m in self.members:
            for chain in ("input", "output"):
                self._nft(m, "flush", "chain", "inet", PREFIX, chain)
        self.cut_pairs.clear()

    def describe_cut(self) -> str:
        return ",".join(sorted("-".join(map(str, sorted(p))) for p in self.cut_pairs)) or "none"

    def recover(self, timeout: float = 60.0) -> None:
        """After heal: wait until one cluster runs again. On 3.x, a member that Mnesia
        still reports partitioned from others (`cluster_partition_handling = ignore`
        leaves the halves apart after the network heals; `autoheal` restarts one itself)
        is restarted, as an operator would: the one partitioned from the most others.
        A member that does not come back within `timeout` (RabbitMQ 3.10 can hang in boot
        after pause_minority, rabbitmq-server #6034) is killed and started again, once.
        Both count in `restarts_after_heal`."""
        for _ in range(self.size):
            try:
                self.wait_clustered(timeout)
            except HarnessError:
                if not self.partitions():
                    break
            split = self.partitions()
            if not split:
                return
            self.partitioned_after_heal += 1
            worst = max(self.members, key=lambda m: len(split.get(m.node_name, ())))
            self.restarts_after_heal += 1
            worst.kill()
            time.sleep(1)
            worst.start()
            self.wait_answers([worst])
        want = sorted(m.node_name for m in self.members)
        views = {m.index: m.running_nodes() for m in self.members}
        for m in self.members:
            if views[m.index] != want:
                self.restarts_after_heal += 1
                m.kill()
                time.sleep(1)
                m.start()
        self.wait_answers(self.members)
        self.wait_clustered(BOOT_TIMEOUT_S)
        self.wait_amqp()

    def partitions(self) -> dict[str, list[str]]:
        """Node -> the nodes Mnesia says it is partitioned from, as the members answer
        (3.x; {} when none is, or on 4.x, which has no Mnesia partitions)."""
        if self.major >= 4:
            return {}
        found: dict[str, list[str]] = {}
        for m in self.members:
            try:
                data = json.loads(m.ctl("cluster_status", "--formatter", "json", timeout=30))
            except (HarnessError, ValueError, subprocess.TimeoutExpired):
                continue
            split = data.get("partitions") or {}
            if isinstance(split, dict):
                for node, others in split.items():
                    if others:
                        found[str(node)] = sorted(str(o) for o in others)
        return found

    def transfer_leadership(self, queue: str) -> str:
        """Move the leadership of quorum queue `queue` (vhost /) to another member: its new
        leader starts a dead-letter worker of its own, which sends again what the old one
        had dead-lettered and not got confirmed (the 3.10 stall, docs/reliability.md).
        Returns the new leader's node name."""
        leaders = self.leaders()
        current = self.member(leaders[queue])
        target = next(m for m in self.members if m is not current)
        ra = f"'%2F_{queue}'"
        current.ctl(
            "eval",
            f"ra:transfer_leadership({{{ra}, '{current.node_name}'}}, "
            f"{{{ra}, '{target.node_name}'}}).",
        )
        return target.node_name

    def transfer_leaderships(self, queues: Sequence[str]) -> dict[str, str]:
        """`transfer_leadership` of each of `queues` (vhost /), in one rabbitmqctl call:
        queue -> its new leader."""
        leaders = self.leaders()
        moves: dict[str, tuple[Member, Member]] = {}
        for q in queues:
            if q in leaders:
                current = self.member(leaders[q])
                # the next member round the ring: spread, not all onto one node
                target = self.members[current.index % self.size]
                moves[q] = (current, target)
        if not moves:
            return {}
        calls = ", ".join(
            f"ra:transfer_leadership({{'%2F_{q}', '{c.node_name}'}}, "
            f"{{'%2F_{q}', '{t.node_name}'}})"
            for q, (c, t) in moves.items()
        )
        self.members[0].ctl("eval", f"[{calls}].", timeout=120)
        return {q: t.node_name for q, (_c, t) in moves.items()}

    def dead_letters_held(self, queues: Sequence[str]) -> dict[str, int]:
        """Queue -> the dead letters its leader still holds (dead-lettered, not confirmed
        by the target: rabbit_fifo's num_discarded + num_discard_checked_out), asked of
        each quorum queue's leader itself: unlike the management API's messages_dlx,
        which RabbitMQ 3.10 stops reporting for the queues of a node after a partition.
        -1 for a queue its leader did not answer for; queues without a leader left out."""
        leaders = self.leaders()
        asked = [(q, leaders[q]) for q in queues if leaders.get(q)]
        if not asked:
            return {}
        pairs = ", ".join(f"{{'%2F_{q}', '{n}'}}" for q, n in asked)
        expr = (
            "[try {ok, {_, O}, _} = rpc:call(N, ra, local_query, [{R, N}, "
            "fun rabbit_fifo:overview/1], 10000), maps:get(num_discarded, O, 0) + "
            "maps:get(num_discard_checked_out, O, 0) catch _:_ -> -1 end "
            f"|| {{R, N}} <- [{pairs}]]."
        )
        for m in self.members:
            with contextlib.suppress(HarnessError, subprocess.TimeoutExpired):
                out = " ".join(m.ctl("eval", expr, timeout=120).split()).strip("[] ")
                counts = [int(x) for x in out.split(",") if x.strip()]
                return {q: n for (q, _), n in zip(asked, counts, strict=True)}
        return {q: -1 for q, _ in asked}

    def leaders(self) -> dict[str, str]:
        """Queue name -> the node leading it (quorum queues), as a running member says."""
        for m in self.members:
            with contextlib.suppress(HarnessError, subprocess.TimeoutExpired):
                out = m.ctl("list_queues", "name", "leader", "--formatter", "json", timeout=30)
                return {str(q["name"]): str(q.get("leader", "")) for q in json.loads(out)}
        return {}


def leftovers() -> list[str]:
    """Namespaces, links and nft tables of this harness still present (should be none)."""
    found = [f"netns {n.split()[0]}" for n in run(["ip", "netns", "list"]).splitlines()
             if n.startswith(PREFIX)]  # fmt: skip
    found += [
        f"link {line.split(':')[1].strip().split('@')[0]}"
        for line in run(["ip", "-o", "link"]).splitlines()
        if line.split(":")[1].strip().startswith(PREFIX)
    ]
    return found


def cleanup_all() -> list[str]:
    """Remove everything of this harness on the machine (any net): what was removed."""
    removed = leftovers()
    for line in run(["ip", "netns", "list"]).splitlines():
        ns = line.split()[0]
        if not ns.startswith(f"{PREFIX}-"):
            continue
        for pid in run(["ip", "netns", "pids", ns], check=False).split():
            with contextlib.suppress(OSError):
                os.kill(int(pid), signal.SIGKILL)
        time.sleep(0.5)
        run(["ip", "netns", "del", ns], check=False)
    for line in run(["ip", "-o", "link"]).splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if name.startswith(PREFIX):
            run(["ip", "link", "del", name], check=False)
    for kind in ("host", *ROOT_UIDS):
        c = PartitionCluster(kind)
        if c.base_dir.exists():
            for d in c.base_dir.glob(f"{PREFIX}-*"):
                shutil.rmtree(d, ignore_errors=True)
            c._maybe_umount_root()
    return removed
