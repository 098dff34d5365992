"""The public surface: exactly what `__all__` promises, and no transport on import."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import rabbit_delay

# What an application writes: the app, handlers' signals and context, the transports
# (lazily), the topology, reconciliation, connection settings and the error tree.
EXPECTED = {
    "App",
    "HandlerContext",
    "Retry",
    "Reject",
    "Publisher",
    "AsyncPublisher",
    "Worker",
    "AsyncWorker",
    "Topology",
    "load_topology",
    "topology_from_dict",
    "redact",
    "Resubmit",
    "ReconcileContext",
    "AsyncReconcileContext",
    "ConnectionSettings",
    "ReconnectBackoff",
    "TLSOptions",
    "__version__",
    # the schedule (a topology with [schedule])
    "Scheduled",
    "ScheduleRecord",
    "ScheduleState",
    # the error tree (rabbit_delay._errors)
    "RabbitDelayError",
    "ConfigError",
    "DurationError",
    "TopologyError",
    "PublishError",
    "DelayError",
    "UnknownTargetError",
    "EncodeError",
    "DuplicateMessageError",
    "UnroutableError",
    "NackError",
    "UnconfirmedError",
    "BrokerBlocked",
    "BrokerError",
    "BrokerUnavailable",
    "ConnectionLost",
    "AccessRefused",
    "DeclarationConflict",
    "MissingObjectError",
    "MissingPluginError",
    "ManagementUnavailable",
    "IncompatibleBroker",
    "OutboxError",
    "StoreError",
    "DecodeError",
}

# The documented submodules, each with its own small surface.
SUBMODULES = {
    "rabbit_delay.sync": {
        "Publisher",
        "Schedule",
        "Worker",
        "broker_info",
        "connect",
        "connected",
        "declare",
        "delete_topology",
        "plan",
    },
    "rabbit_delay.aio": {
        "AsyncPublisher",
        "AsyncSchedule",
        "AsyncWorker",
        "broker_info",
        "connect",
        "declare",
        "plan",
    },
    "rabbit_delay.stores": {
        "AsyncGuard",
        "AsyncIdempotencyStore",
        "AsyncPostgresStore",
        "AsyncRedisStore",
        "AsyncSQLiteStore",
        "ClaimResult",
        "Guard",
        "IdempotencyStore",
        "MemoryStore",
        "PostgresStore",
        "RedisStore",
        "SQLiteStore",
    },
    "rabbit_delay.metrics": {"Metrics", "default_metrics", "start_metrics_server"},
    "rabbit_delay.tracing": {"configure"},
}


def test_all_is_exactly_the_public_surface() -> None:
    assert set(rabbit_delay.__all__) == EXPECTED
    assert len(rabbit_delay.__all__) == len(EXPECTED), "duplicates in __all__"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_exported_member_resolves(name: str) -> None:
    member = getattr(rabbit_delay, name)
    assert member is not None
    module = getattr(member, "__module__", "rabbit_delay")
    assert module.startswith("rabbit_delay"), f"{name} comes from {module}"


def test_public_classes_are_shown_under_their_public_name() -> None:
    # repr, pickling and the rd-error-type header name them as a user imports them
    for name in ("App", "Retry", "Reject", "ConfigError", "HandlerContext"):
        assert getattr(rabbit_delay, name).__module__ == "rabbit_delay"


def test_errors_share_one_root() -> None:
    for name in EXPECTED:
        member = getattr(rabbit_delay, name)
        if (
            isinstance(member, type)
            and issubclass(member, Exception)
            and name
            not in (
                "Retry",
                "Reject",
            )
        ):
            assert issubclass(member, rabbit_delay.RabbitDelayError), name
    # handler signals are control flow, not failures of the library
    assert not issubclass(rabbit_delay.Retry, rabbit_delay.RabbitDelayError)


def test_unknown_attribute() -> None:
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        rabbit_delay.Nope  # noqa: B018


@pytest.mark.parametrize("module", sorted(SUBMODULES))
def test_documented_submodules_export_exactly_their_surface(module: str) -> None:
    imported = importlib.import_module(module)
    assert set(imported.__all__) == SUBMODULES[module]
    for name in imported.__all__:
        assert getattr(imported, name) is not None


def test_the_top_level_transports_are_the_transport_packages_own() -> None:
    import rabbit_delay.aio
    import rabbit_delay.sync

    assert rabbit_delay.Publisher is rabbit_delay.sync.Publisher
    assert rabbit_delay.Worker is rabbit_delay.sync.Worker
    assert rabbit_delay.AsyncPublisher is rabbit_delay.aio.AsyncPublisher
    assert rabbit_delay.AsyncWorker is rabbit_delay.aio.AsyncWorker


def test_every_other_module_is_private() -> None:
    """Outside the documented modules, every module and package name is underscored."""
    import pkgutil

    public = {"rabbit_delay", *SUBMODULES, "rabbit_delay.testing", "rabbit_delay.outbox"}
    public.add("rabbit_delay.testing.pytest_plugin")  # a pytest entry point, by its path
    for info in pkgutil.walk_packages(rabbit_delay.__path__, "rabbit_delay."):
        name = info.name
        if name in public or name == "rabbit_delay.__main__":
            continue
        parts = name.split(".")[1:]
        assert any(part.startswith("_") for part in parts), f"{name} is public but undocumented"


@pytest.mark.parametrize(
    ("statement", "absent"),
    [
        ("import rabbit_delay", ("pika", "aio_pika", "aiormq")),
        ("from rabbit_delay import Publisher", ("aio_pika", "aiormq")),
        ("from rabbit_delay import AsyncPublisher", ("pika",)),
        ("import rabbit_delay.sync", ("aio_pika", "aiormq")),
        ("import rabbit_delay.aio", ("pika",)),
        # tracing is optional: only an application that imported it makes spans
        (
            "import rabbit_delay._sync.worker, rabbit_delay._aio.worker, rabbit_delay._cli.app\n"
            "from rabbit_delay._observe import tracing\n"
            "assert tracing.active() is None",
            ("opentelemetry",),
        ),
        ("import rabbit_delay.testing", ("pika", "aio_pika", "aiormq")),
    ],
)
def test_importing_pulls_in_only_the_transport_used(
    statement: str, absent: tuple[str, ...]
) -> None:
    code = f"import sys\n{statement}\nprint(','.join(m for m in {absent!r} if m in sys.modules))"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "", f"{statement} imported {done.stdout.strip()}"


def test_py_typed_is_shipped() -> None:
    from importlib.resources import files

    assert files("rabbit_delay").joinpath("py.typed").is_file()
