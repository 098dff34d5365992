"""Least privilege on the broker under test: users with exactly the permissions
`rabbit_delay._plan.permissions` computes (no tags), each in the test's own namespace.

The declarer declares; the publisher publishes (both transports); the worker consumes,
retries and parks (both transports) without any configure permission. Given too
little, each fails with AccessRefused naming the permission. Also the management API's
answers to such users (HTTP 401): no management tag falls back to AMQP and says why; a
wrong password at a management URL the user named is an error.

Users are created and deleted through the management API with the guest credentials of
the test URL (creating users does not reconfigure the broker); every user is deleted
afterwards, also when the test fails.
"""

from __future__ import annotations

import asyncio
import base64
import json
import secrets
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import pytest
from conftest import MakeTopology, message_count, server_info, wait_for
from typer.testing import CliRunner

from rabbit_delay import AccessRefused, App, HandlerContext, ManagementUnavailable, Topology, aio
from rabbit_delay._broker import BrokerInfo
from rabbit_delay._cli.app import app as cli_app
from rabbit_delay._io.management import checked, get_json
from rabbit_delay._plan.permissions import Permissions, Role, permissions
from rabbit_delay._urls import ManagementEndpoint, management_endpoints, vhost_of
from rabbit_delay.stores import MemoryStore
from rabbit_delay.sync import Publisher, connect, connected, declare

from .workers.harness import KINDS, RunningWorker, get_all

pytestmark = pytest.mark.integration

QUEUE = "orders.cancel"


def _admin(endpoint: ManagementEndpoint, method: str, path: str, body: Any = None) -> None:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(endpoint.url(path), data=data, method=method)
    request.add_header("Content-Type", "application/json")
    token = base64.b64encode(f"{endpoint.username}:{endpoint.password}".encode()).decode()
    request.add_header("Authorization", f"Basic {token}")
    with urllib.request.urlopen(request, timeout=10):
        pass


@dataclass(frozen=True)
class User:
    name: str
    password: str
    url: str  # the broker under test's URL with this user's credentials


Grant = Callable[..., User]


@pytest.fixture
def grant(broker_url: str, management: ManagementEndpoint) -> Iterator[Grant]:
    """grant(permissions or None, tags="", read=..., ...) -> a new user with exactly those
    permissions on the test vhost (keyword arguments replace a regex); deleted afterwards."""
    made: list[str] = []
    vhost = quote(vhost_of(broker_url), safe="")

    def make(granted: Permissions | None, *, tags: str = "", **replace: str) -> User:
        name = f"rd-test-{uuid.uuid4().hex[:10]}"
        password = secrets.token_urlsafe(18)
        _admin(management, "PUT", f"users/{name}", {"password": password, "tags": tags})
        made.append(name)
        if granted is not None:
            body = granted.as_json() | replace
            _admin(management, "PUT", f"permissions/{vhost}/{name}", body)
        parts = urlsplit(broker_url)
        netloc = f"{name}:{quote(password, safe='')}@{parts.hostname}:{parts.port or 5672}"
        return User(name, password, urlunsplit(parts._replace(netloc=netloc)))

    yield make
    failed: list[str] = []
    for name in made:  # every one, even when one fails
        try:
            _admin(management, "DELETE", f"users/{name}")
        except urllib.error.HTTPError as exc:
            if exc.code != 404:
                failed.append(f"{name}: HTTP {exc.code}")
        except OSError as exc:
            failed.append(f"{name}: {exc}")
    assert not failed, f"test users left on the broker: {failed}"


@pytest.fixture
def topology(make_topology: MakeTopology) -> Topology:
    """One 1 s tier; a business queue retried once through it, then parked."""
    return make_topology(
        tiers={"1s": "1s"},
        queues={QUEUE: {"retry": {"tiers": ["1s"], "max_attempts": 2}}},
    )


def _role(topology: Topology, role: Role) -> Permissions:
    return permissions(topology, role)


def _declare_as(user: User, topology: Topology) -> None:
    with connected(user.url, name="rd-test least-privilege declare") as connection:
        declare(connection, topology)


def _refused(error: BaseException, permission: str) -> str:
    assert isinstance(error, AccessRefused), repr(error)
    assert error.permission == permission, (error.permission, str(error))
    text = str(error)
    assert permission in text, text
    assert "403" in text, text
    assert "docs/security.md" in text
    return text


# -- the three roles, each with exactly its permissions ------------------------------------------


def _toml(topology: Topology, tmp_path: Path) -> Path:
    """The `topology` fixture's topology as a file, for the CLI."""
    path = tmp_path / "topology.toml"
    path.write_text(
        f'namespace = "{topology.namespace}"\n'
        f'queue_type = "{topology.queue_type.value}"\n'
        '[tiers]\n1s = "1s"\n'
        f'[queues."{QUEUE}".retry]\ntiers = ["1s"]\nmax_attempts = 2\n'
    )
    return path


def test_declarer_declares_and_publisher_publishes_with_exactly_their_permissions(
    topology: Topology, grant: Grant, broker_url: str, tmp_path: Path
) -> None:
    runner = CliRunner()
    path = _toml(topology, tmp_path)
    # the permissions as `rabbit-delay permissions` prints them
    printed = runner.invoke(cli_app, ["permissions", "declarer", "-f", str(path), "--json"])
    assert printed.exit_code == 0, printed.output
    regexes = json.loads(printed.output)
    assert {k: regexes[k] for k in ("configure", "write", "read")} == (
        _role(topology, Role.DECLARER).as_json()
    )
    declarer = grant(_role(topology, Role.DECLARER))
    declared = runner.invoke(cli_app, ["declare", str(path), "--url", declarer.url])
    assert declared.exit_code == 0, declared.output
    assert "object(s) created" in declared.output
    # no management tag: passive declares instead of the API, and the output says why
    assert "Not management user" in declared.output, declared.output
    _declare_as(declarer, topology)  # again: re-declaring what exists (configure only)

    publisher = grant(_role(topology, Role.PUBLISHER))
    with Publisher(topology, publisher.url) as sync_publisher:
        sync_publisher.publish_delayed({"n": 1}, "1s", queue=QUEUE)

    async def publish_async() -> None:
        async with aio.AsyncPublisher(topology, publisher.url) as async_publisher:
            await async_publisher.publish_delayed({"n": 2}, "1s", queue=QUEUE)

    asyncio.run(publish_async())
    business = topology.names.business_queue(QUEUE)
    wait_for(lambda: message_count(broker_url, business) == 2, 10, "both messages to be due")


@pytest.mark.parametrize("kind", KINDS)
def test_worker_consumes_retries_and_parks_without_configure_permission(
    kind: str, topology: Topology, grant: Grant, broker_url: str
) -> None:
    with connected(broker_url, name="rd-test least-privilege declare") as connection:
        declare(connection, topology)
    worker_user = grant(_role(topology, Role.WORKER))
    assert _role(topology, Role.WORKER).configure == ""
    attempts: list[int] = []

    def fail(_message: Any, ctx: HandlerContext) -> None:
        attempts.append(ctx.attempt)
        raise ValueError("payment service down")

    async def fail_async(message: Any, ctx: HandlerContext) -> None:
        fail(message, ctx)

    app = App(topology, store=MemoryStore())
    app.add_consumer(QUEUE, fail if kind == "sync" else fail_async)
    worker = RunningWorker(kind, app, worker_user.url).start()
    try:
        with Publisher(topology, broker_url) as publisher:
            message_id = publisher.publish_delayed({"n": 1}, "1s", queue=QUEUE)
        parked = get_all(broker_url, topology.names.parking_queue(QUEUE), 1, timeout=20)
    finally:
        worker.stop()
    assert parked[0].properties.message_id == message_id
    assert attempts == [1, 2]  # consumed, retried through the 1 s tier, then parked
    assert worker.stats.retried == 1
    assert worker.stats.parked == 1


# -- too little: one clear 403 naming the permission ------------------------------------------


def test_too_little_permission_is_a_clear_403_naming_it(
    topology: Topology, grant: Grant, broker_url: str
) -> None:
    publisher = grant(_role(topology, Role.PUBLISHER))
    # the publisher may not declare: configure
    with pytest.raises(AccessRefused) as caught:
        _declare_as(publisher, topology)
    _refused(caught.value, "configure")

    with connected(broker_url, name="rd-test least-privilege declare") as connection:
        declare(connection, topology)
    # a publisher without write on the tier exchange
    no_write = grant(_role(topology, Role.PUBLISHER), write="")
    with pytest.raises(AccessRefused) as caught, Publisher(topology, no_write.url) as refused:
        refused.publish_delayed({"n": 1}, "1s", queue=QUEUE)
    text = _refused(caught.value, "write")
    assert topology.names.tier_exchange("1s") in text


@pytest.mark.parametrize("kind", KINDS)
def test_a_worker_without_read_is_refused_with_a_clear_403(
    kind: str, topology: Topology, grant: Grant, broker_url: str
) -> None:
    with connected(broker_url, name="rd-test least-privilege declare") as connection:
        declare(connection, topology)
    no_read = grant(_role(topology, Role.WORKER), read="")
    app = App(topology, store=MemoryStore())

    async def handle(_message: Any, _ctx: HandlerContext) -> None:
        pass

    app.add_consumer(QUEUE, handle if kind == "async" else (lambda _m, _c: None))
    worker = RunningWorker(kind, app, no_read.url)
    worker.thread.start()
    worker.thread.join(20)
    assert not worker.thread.is_alive(), "the worker kept running without read permission"
    assert worker.error is not None
    text = _refused(worker.error, "read")
    assert topology.names.business_queue(QUEUE) in text


# -- the management API and least-privilege users ------------------------------------------------


def test_a_user_without_the_management_tag_falls_back_to_amqp_and_says_why(
    topology: Topology, grant: Grant, broker_url: str, management: ManagementEndpoint
) -> None:
    user = grant(_role(topology, Role.WORKER))
    info = server_info(broker_url)
    # the API is refused with 401 "Not management user": passive declares, said once
    derived = checked(management_endpoints(user.url), info)
    explicit = checked(management_endpoints(user.url, management.base), info)
    for access in (derived, explicit):
        assert access.endpoint is None
        assert "Not management user" in access.note, access.note
        assert "monitoring" in access.note
        assert user.password not in access.note


def test_a_wrong_password_is_an_error_at_a_named_management_url(
    tmp_path: Path, grant: Grant, broker_url: str, management: ManagementEndpoint
) -> None:
    info = server_info(broker_url)
    parts = urlsplit(management.base)
    wrong = f"{parts.scheme}://{management.username}:not-the-password@{parts.netloc}"
    with pytest.raises(AccessRefused) as caught:
        checked(management_endpoints(broker_url, wrong), info)
    text = str(caught.value)
    for part in (management.base, "--management-url", "--no-management"):
        assert part in text, text
    assert "not-the-password" not in text
    # derived from an AMQP URL whose credentials the broker does not know: a wrong
    # guess at the API's address (another broker's), skipped and said so
    amqp = urlsplit(broker_url)
    stranger = urlunsplit(
        amqp._replace(netloc=f"nobody-{uuid.uuid4().hex[:6]}:x@{amqp.netloc.split('@')[-1]}")
    )
    access = checked(management_endpoints(stranger), info)
    assert access.endpoint is None
    assert "refused the login" in access.note, access.note

    path = tmp_path / "t.toml"
    path.write_text('namespace = "nothing"\n[tiers]\n1s = "1s"\n[queues.q]\n')
    result = CliRunner().invoke(
        cli_app, ["plan", str(path), "--url", broker_url, "--management-url", wrong]
    )
    assert result.exit_code == 1, result.output
    assert "refused the login" in result.output
    assert "not-the-password" not in result.output
    assert "Traceback" not in result.output


def test_peeking_without_read_permission_names_it(
    topology: Topology, grant: Grant, broker_url: str, management: ManagementEndpoint
) -> None:
    with connected(broker_url, name="rd-test least-privilege declare") as connection:
        declare(connection, topology)
    # a monitoring user (may use the API) that may read nothing
    user = grant(_role(topology, Role.PUBLISHER), tags="monitoring")
    endpoint = management_endpoints(user.url, management.base)[0]
    parking = topology.names.parking_queue(QUEUE)
    with pytest.raises(AccessRefused) as caught:  # the API's get: a read of the queue
        get_json(
            endpoint,
            f"queues/{endpoint.vhost_quoted}/{quote(parking, safe='')}/get",
            {"count": 1, "ackmode": "ack_requeue_true", "encoding": "auto"},
            doing=f"peeking into queue {parking!r}",
            permission="read",
        )
    assert caught.value.permission == "read"
    assert parking in str(caught.value)
    assert not isinstance(caught.value, ManagementUnavailable)  # not a reason to fall back
    # ... while the same user's derived access to the API works (it has the tag)
    access = checked(management_endpoints(user.url, management.base), server_info(broker_url))
    assert access.endpoint is not None, access.note


def test_connect_as_each_role_needs_no_permission_beyond_the_vhost(
    topology: Topology, grant: Grant
) -> None:
    """Connecting (and the passive declares of `plan`) need only access to the vhost."""
    user = grant(_role(topology, Role.PUBLISHER), write="")
    connect(user.url, name="rd-test least-privilege connect").close()


def test_status_as_a_user_that_may_not_read_the_buffers(
    make_topology: MakeTopology,
    grant: Grant,
    broker_url: str,
    broker_info: BrokerInfo,
    tmp_path: Path,
) -> None:
    """Peeking a buffer's head for its age needs `read` (counting does not): without it,
    status still works and says why the ages are missing."""
    if not broker_info.peeks_quorum_buffers_freely:
        pytest.skip(f"status peeks no quorum buffer on {broker_info.describe()}")
    topology = make_topology(tiers={"30s": "30s"}, queues={QUEUE: {}})
    with connected(broker_url, name="rd-test declare") as connection:
        declare(connection, topology)
    with Publisher(topology, broker_url) as publisher:
        publisher.publish_delayed({"k": 1}, "30s", queue=QUEUE)
    # 4.3 refuses a passive declare without `configure` on the queue: the declarer's
    # permissions, without `read`.
    user = grant(_role(topology, Role.DECLARER), read="^$")
    path = tmp_path / "topology.toml"
    path.write_text(
        f'namespace = "{topology.namespace}"\n[tiers]\n30s = "30s"\n[queues."{QUEUE}"]\n'
    )
    result = CliRunner().invoke(cli_app, ["status", str(path), "--url", user.url, "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    buffer = {r["name"]: r for r in data["queues"]}[topology.names.tier_queue("30s")]
    assert (buffer["ready"], buffer["oldest_age_ms"]) == (1, None)
    (note,) = [n for n in data["notes"] if n.startswith("buffer ages not read")]
    assert "read" in note
    assert user.password not in result.output
