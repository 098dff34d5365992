"""The public surface: exactly what `__all__` promises, and no transport on import."""

from __future__ import annotations

import subprocess
import sys

import pytest

import rabbit_delay

EXPECTED = {
    "AccessRefused",
    "ArgumentConflict",
    "BrokerBlocked",
    "ConnectionLost",
    "UnconfirmedError",
    "AsyncPublisher",
    "BrokerError",
    "BrokerUnavailable",
    "ConfigError",
    "DeclarationConflict",
    "DecodeError",
    "DelayError",
    "DurationError",
    "EncodeError",
    "MissingObjectError",
    "IncompatibleBroker",
    "ManagementUnavailable",
    "MissingPluginError",
    "NackError",
    "Names",
    "PublishError",
    "Publisher",
    "QueueType",
    "RabbitDelayError",
    "Topology",
    "TopologyError",
    "UnknownTargetError",
    "UnroutableError",
    "format_ms",
    "load_topology",
    "parse_ms",
    "redact",
    "topology_from_dict",
}


def test_all_is_exactly_the_public_surface() -> None:
    assert set(rabbit_delay.__all__) == EXPECTED
    assert len(rabbit_delay.__all__) == len(EXPECTED), "duplicates in __all__"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_exported_member_resolves(name: str) -> None:
    member = getattr(rabbit_delay, name)
    assert member is not None
    module = getattr(member, "__module__", "")
    assert module.startswith("rabbit_delay"), f"{name} comes from {module}"


def test_errors_share_one_root() -> None:
    for name in EXPECTED:
        member = getattr(rabbit_delay, name)
        if isinstance(member, type) and issubclass(member, Exception):
            assert issubclass(member, rabbit_delay.RabbitDelayError), name


def test_unknown_attribute() -> None:
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        rabbit_delay.Nope  # noqa: B018


def test_transports_all() -> None:
    import rabbit_delay.aio
    import rabbit_delay.sync

    assert sorted(rabbit_delay.sync.__all__) == [
        "Publisher",
        "Worker",
        "broker_info",
        "connect",
        "connected",
        "declare",
        "delete_topology",
        "plan",
    ]
    assert sorted(rabbit_delay.aio.__all__) == [
        "AsyncPublisher",
        "AsyncWorker",
        "broker_info",
        "connect",
        "declare",
        "plan",
    ]
    assert rabbit_delay.Publisher is rabbit_delay.sync.Publisher
    assert rabbit_delay.AsyncPublisher is rabbit_delay.aio.AsyncPublisher


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
            "import rabbit_delay.sync.worker, rabbit_delay.aio.worker, rabbit_delay.cli\n"
            "from rabbit_delay import tracing\n"
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
