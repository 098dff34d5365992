"""Topology files: validation errors name the file, the field path and the allowed keys."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rabbit_delay import ConfigError, Topology, TopologyError, load_topology, topology_from_dict
from rabbit_delay._topology.model import IdempotencyConfig, QueueType

ROOT = Path(__file__).resolve().parents[2]

BASE = """\
namespace = "shop"

[tiers]
1s = "1s"
5m = "5m"

[queues."orders.cancel"]
tiers = ["5m"]
bindings = ["order.timeout"]
[queues."orders.cancel".retry]
max_attempts = 3
tiers = ["1s", "5m"]

[queues.push]
"""


def write(tmp_path: Path, text: str, name: str = "topo.toml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def load_error(tmp_path: Path, text: str) -> str:
    path = write(tmp_path, text)
    with pytest.raises(TopologyError) as info:
        load_topology(path)
    message = str(info.value)
    assert str(path) in message, "the error must name the file"
    return message


def minimal(**overrides: Any) -> dict[str, Any]:
    data: dict[str, Any] = {"namespace": "shop", "tiers": {"1s": "1s"}, "queues": {"a": {}}}
    data.update(overrides)
    return data


# -- the shipped example -----------------------------------------------------------------


def test_loading_the_shipped_orders_topology() -> None:
    topology = load_topology(ROOT / "topology" / "orders.toml")
    assert topology.namespace == "shop"
    assert topology.version == 1
    assert topology.queue_type is QueueType.QUORUM
    assert topology.tiers == {"5m": 300_000, "30m": 1_800_000, "2h": 7_200_000}
    assert set(topology.queues) == {"orders.cancel-unpaid", "coupons.expire", "push.send"}
    cancel = topology.queues["orders.cancel-unpaid"]
    assert cancel.tiers == ("30m",)
    assert cancel.bindings == ("order.payment-timeout",)
    assert cancel.delivery_limit == 5
    assert cancel.retry.max_attempts == 4
    assert cancel.retry.tiers == ("5m", "5m", "30m")
    assert topology.idempotency.lease == 30_000
    assert topology.idempotency.retention == 7 * 86_400_000


def test_a_directory_with_one_toml_file_is_loaded(tmp_path: Path) -> None:
    write(tmp_path, BASE)
    assert load_topology(tmp_path).namespace == "shop"


def test_a_directory_with_several_files_asks_for_a_name(tmp_path: Path) -> None:
    write(tmp_path, BASE, "a.toml")
    write(tmp_path, BASE, "b.toml")
    with pytest.raises(TopologyError, match=r"found a\.toml, b\.toml; name the file"):
        load_topology(tmp_path)


def test_defaults(tmp_path: Path) -> None:
    topology = load_topology(write(tmp_path, BASE))
    assert topology.version == 1
    assert topology.queue_type is QueueType.QUORUM
    assert topology.tiers == {"1s": 1_000, "5m": 300_000}
    push = topology.queues["push"]
    assert push.tiers is None  # every tier may target it
    assert push.delivery_limit == 10
    assert topology.cascade is None
    assert topology.plugin is None
    assert topology.idempotency.store == "sqlite"
    assert topology.idempotency.lease == 30_000  # renewed every lease / 3 by the workers
    assert topology.idempotency.retention == 7 * 86_400_000
    assert topology.idempotency.path == str(tmp_path / "rabbit-delay-idempotency.sqlite3")


def test_models_are_frozen(tmp_path: Path) -> None:
    topology = load_topology(write(tmp_path, BASE))
    with pytest.raises(ValueError, match="frozen"):
        topology.namespace = "other"  # type: ignore[misc]


# -- unknown keys, anywhere --------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "path", "allowed"),
    [
        (
            'colour = "red"\n' + BASE,
            "colour",
            ["namespace", "version", "queue_type", "tiers", "queues"],
        ),
        (
            BASE.replace('tiers = ["5m"]', 'tiers = ["5m"]\nbinding = ["x"]'),
            "queues.orders.cancel.binding",
            ["bindings", "tiers", "retry", "delivery_limit", "alias"],
        ),
        (
            BASE.replace("max_attempts = 3", "max_attempt = 3"),
            "queues.orders.cancel.retry.max_attempt",
            ["max_attempts", "tiers", "backoff"],
        ),
        (BASE + "[cascade]\nlevel = 4\n", "cascade.level", ["levels", "resolution"]),
        (
            BASE + '[cascade]\n[queues.other.retry.backoff]\ninitail = "1s"\n',
            "queues.other.retry.backoff.initail",
            ["initial", "factor", "max"],
        ),
        (
            BASE + '[idempotency]\nstorage = "memory"\n',
            "idempotency.storage",
            ["store", "path", "lease"],
        ),
        (BASE + '[plugin]\ntype = "direct"\n', "plugin.type", ["this table takes no keys"]),
    ],
)
def test_unknown_keys_name_file_field_path_and_allowed_keys(
    tmp_path: Path, extra: str, path: str, allowed: list[str]
) -> None:
    message = load_error(tmp_path, extra)
    unknown = path.rsplit(".", 1)[-1]
    assert f"{path}: unknown key {unknown!r}" in message
    line = next(line for line in message.splitlines() if path in line)
    for key in allowed:
        assert key in line


# -- bad values ----------------------------------------------------------------------------


def test_bad_tier_durations_are_named(tmp_path: Path) -> None:
    message = load_error(
        tmp_path,
        BASE.replace(
            '1s = "1s"', '1s = "1s"\nbad = "5x"\nneg = "-3s"\nbare = 5\nlong = "60d"\nzero = "0s"'
        ),
    )
    assert "tiers.bad: '5x' is not a duration" in message
    assert "tiers.neg: '-3s' is negative" in message
    assert "tiers.bare: 5: write a duration with its unit" in message
    assert "tiers.long: '60d' is 60d, longer than the maximum" in message
    assert "tiers.zero: '0s' must be longer than zero" in message


def test_bad_duration_elsewhere(tmp_path: Path) -> None:
    message = load_error(tmp_path, BASE + '[idempotency]\nlease = "soon"\n')
    assert "idempotency.lease: 'soon' is not a duration" in message


@pytest.mark.parametrize(
    ("queue_text", "field"),
    [
        ('tiers = ["2h"]', "queues.push.tiers"),
        ('[queues.push.retry]\ntiers = ["1s", "2h"]', "queues.push.retry.tiers"),
    ],
)
def test_unknown_tier_referenced_by_a_queue(tmp_path: Path, queue_text: str, field: str) -> None:
    message = load_error(tmp_path, BASE + queue_text + "\n")
    assert f"{field}: unknown tier '2h'; tiers are ['1s', '5m']" in message


def test_duplicate_durations(tmp_path: Path) -> None:
    message = load_error(tmp_path, BASE.replace('5m = "5m"', '5m = "5m"\nfive = "300s"'))
    assert "tiers '5m' and 'five' have the same duration" in message


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.toml"
    with pytest.raises(TopologyError, match="cannot read topology file") as info:
        load_topology(path)
    assert str(path) in str(info.value)


def test_toml_syntax_error(tmp_path: Path) -> None:
    message = load_error(tmp_path, 'namespace = "shop"\n[tiers\n1s = "1s"\n')
    assert "not valid TOML" in message
    assert "line 2" in message


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"namespace": "Shop Online"}, "namespace: 'Shop Online' is not allowed"),
        ({"version": 0}, "version:"),
        ({"queue_type": "stream"}, "queue_type: Input should be 'quorum' or 'classic'"),
        ({"tiers": {}}, "tiers: Dictionary should have at least 1 item"),
        ({"queues": {}}, "queues: Dictionary should have at least 1 item"),
        ({"tiers": {"1 s": "1s"}}, "'1 s' is not allowed"),
        ({"queues": {"Orders": {}}}, "'Orders' is not allowed"),
        ({"queues": {"a": {"delivery_limit": 0}}}, "queues.a.delivery_limit:"),
        ({"queues": {"a": {"retry": {"max_attempts": 0}}}}, "queues.a.retry.max_attempts:"),
        (
            {"queues": {"a": {"bindings": ["shop.v1.q.b"]}, "b": {}}},
            "'shop.v1.q.b' is reserved for a queue",
        ),
        ({"cascade": {}, "plugin": {}}, "`cascade` or `plugin`, not both"),
        (
            {"queues": {"a": {"retry": {"backoff": {}}}}},
            "queues.a.retry.backoff needs exact delays",
        ),
        (
            {"queues": {"a": {"retry": {"tiers": ["1s"], "backoff": {}}}}, "cascade": {}},
            "either `tiers` or `backoff`",
        ),
        ({"namespace": None}, "namespace:"),
    ],
)
def test_invalid_models(overrides: dict[str, Any], expected: str) -> None:
    with pytest.raises(TopologyError) as info:
        topology_from_dict(minimal(**overrides), "inline.toml")
    message = str(info.value)
    assert message.startswith("inline.toml: invalid topology")
    assert expected in message


def test_missing_namespace() -> None:
    data = minimal()
    del data["namespace"]
    with pytest.raises(TopologyError, match="namespace: Field required"):
        topology_from_dict(data)


def test_every_error_is_reported_at_once() -> None:
    with pytest.raises(TopologyError) as info:
        topology_from_dict(minimal(version="x", colour=1, tiers={"a": "5x"}))
    message = str(info.value)
    assert "version:" in message
    assert "colour: unknown key" in message
    assert "tiers.a:" in message


def test_topology_error_is_a_config_and_value_error() -> None:
    assert issubclass(TopologyError, ConfigError)
    assert issubclass(TopologyError, ValueError)


# -- helpers on the model -----------------------------------------------------------------


def test_tier_for_ms_and_retry_tiers(tmp_path: Path) -> None:
    topology: Topology = load_topology(write(tmp_path, BASE))
    assert topology.tier_for_ms(300_000) == "5m"
    assert topology.tier_for_ms(2_000) is None
    assert topology.retry_tiers("orders.cancel") == ("1s", "5m")
    assert topology.retry_tiers("push") == ("1s",)  # the shortest tier by default
    assert topology.names.prefix == "shop.v1"


# -- the idempotency store's file ---------------------------------------------------------


@pytest.fixture
def elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A current directory that is not the topology's."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return cwd


@pytest.mark.parametrize(
    ("written", "expected"),
    [
        (None, "topology/rabbit-delay-idempotency.sqlite3"),  # the default, next to the file
        ("idem.sqlite3", "topology/idem.sqlite3"),
        ("state/idem.sqlite3", "topology/state/idem.sqlite3"),
        ("../shared/idem.sqlite3", "shared/idem.sqlite3"),
    ],
)
def test_a_relative_sqlite_path_is_resolved_against_the_topology_file(
    tmp_path: Path, elsewhere: Path, written: str | None, expected: str
) -> None:
    topology_dir = tmp_path / "topology"
    topology_dir.mkdir()
    text = BASE if written is None else BASE + f'[idempotency]\npath = "{written}"\n'
    path = write(topology_dir, text)
    by_file = load_topology(path).idempotency.path
    assert by_file == str(tmp_path / expected)
    assert load_topology(topology_dir).idempotency.path == by_file  # a directory: the same
    assert not by_file.startswith(str(elsewhere))


def test_a_relative_topology_path_is_resolved_at_load_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "conf").mkdir()
    write(tmp_path / "conf", BASE)
    monkeypatch.chdir(tmp_path)
    topology = load_topology("conf/topo.toml")
    assert topology.idempotency.path == str(tmp_path / "conf" / "rabbit-delay-idempotency.sqlite3")


def test_an_absolute_sqlite_path_is_kept(tmp_path: Path, elsewhere: Path) -> None:
    target = tmp_path / "var" / "idem.sqlite3"
    path = write(tmp_path, BASE + f'[idempotency]\npath = "{target}"\n')
    assert load_topology(path).idempotency.path == str(target)


def test_a_topology_from_a_dict_resolves_against_the_current_directory(elsewhere: Path) -> None:
    data = {"namespace": "shop", "tiers": {"1s": "1s"}, "queues": {"push": {}}}
    assert topology_from_dict(data).idempotency.path == str(
        elsewhere / "rabbit-delay-idempotency.sqlite3"
    )
    with_path = {**data, "idempotency": {"path": "x/idem.sqlite3"}}
    assert topology_from_dict(with_path).idempotency.path == str(elsewhere / "x" / "idem.sqlite3")
    base = elsewhere.parent / "base"
    assert topology_from_dict(with_path, base_dir=base).idempotency.path == str(
        base / "x" / "idem.sqlite3"
    )
    assert IdempotencyConfig(path="y.sqlite3").path == str(elsewhere / "y.sqlite3")
    assert IdempotencyConfig().path == str(elsewhere / "rabbit-delay-idempotency.sqlite3")


def test_an_empty_sqlite_path_is_an_error(tmp_path: Path) -> None:
    message = load_error(tmp_path, BASE + '[idempotency]\npath = ""\n')
    assert "idempotency.path" in message


# -- the network stores' url ------------------------------------------------------------------


def test_a_postgres_store_takes_its_url(tmp_path: Path) -> None:
    text = BASE + '[idempotency]\nstore = "postgres"\nurl = "postgresql://u:pw@db:5432/shop"\n'
    cfg = load_topology(write(tmp_path, text)).idempotency
    assert (cfg.store, cfg.url) == ("postgres", "postgresql://u:pw@db:5432/shop")
    assert IdempotencyConfig(store="postgres", url="postgres://db/shop").url == "postgres://db/shop"


def test_a_postgres_store_without_a_url_is_an_error(tmp_path: Path) -> None:
    message = load_error(tmp_path, BASE + '[idempotency]\nstore = "postgres"\n')
    assert 'idempotency: store = "postgres" needs the database\'s url' in message
    assert "postgresql://user:password@host:5432/dbname" in message


@pytest.mark.parametrize(
    ("store", "url", "said"),
    [
        ("postgres", "redis://u:secret@h:6379/0", "is not a PostgreSQL URL"),
        ("postgres", "db.example:5432", "is not a PostgreSQL URL"),
        ("redis", "postgresql://u:secret@h/db", 'a PostgreSQL URL: store = "postgres"?'),
        ("redis", "http://u:secret@h:6379", "is not a Redis URL"),
    ],
)
def test_a_url_that_does_not_fit_the_store_is_an_error(
    tmp_path: Path, store: str, url: str, said: str
) -> None:
    message = load_error(tmp_path, BASE + f'[idempotency]\nstore = "{store}"\nurl = "{url}"\n')
    assert said in message
    assert "secret" not in message


def test_files_written_for_redis_and_sqlite_still_load(tmp_path: Path) -> None:
    for extra in (
        '[idempotency]\nstore = "redis"\n',  # the default url
        '[idempotency]\nstore = "redis"\nurl = "rediss://h:6380/1"\n',
        '[idempotency]\nstore = "redis"\nurl = "unix:///run/redis.sock"\n',
        '[idempotency]\nstore = "sqlite"\nurl = "redis://h:6379/0"\n',  # url unused
        '[idempotency]\nstore = "memory"\n',
    ):
        load_topology(write(tmp_path, BASE + extra))


# -- [scaling] ------------------------------------------------------------------------------


SCALED = (
    BASE
    + """
[scaling]
shards = 2
tier_shards = { "1s" = 8 }
leader_locator = "client-local"
replicas = 3
"""
)


def test_scaling_defaults_are_one_shard_balanced_broker_replicas() -> None:
    topology = topology_from_dict(minimal())
    assert topology.scaling.shards == 1
    assert topology.scaling.tier_shards == {}
    assert topology.scaling.leader_locator.value == "balanced"
    assert topology.scaling.replicas is None
    assert topology.shards("1s") == 1
    assert topology.tier_queues("1s") == ("shop.v1.delay.1s",)  # today's name, unchanged


def test_scaling_from_a_file(tmp_path: Path) -> None:
    topology = load_topology(write(tmp_path, SCALED))
    assert topology.shards("1s") == 8
    assert topology.shards("5m") == 2  # the default for tiers not overridden
    assert topology.tier_queues("5m") == ("shop.v1.delay.5m", "shop.v1.delay.5m.1")
    assert topology.tier_exchanges("5m") == topology.tier_queues("5m")
    assert topology.tier_queues("1s")[0] == "shop.v1.delay.1s"
    assert topology.tier_queues("1s")[-1] == "shop.v1.delay.1s.7"
    assert topology.scaling.leader_locator.value == "client-local"
    assert topology.scaling.replicas == 3
    with pytest.raises(KeyError):
        topology.shards("2h")


@pytest.mark.parametrize(
    ("scaling", "expected"),
    [
        ({"shards": 0}, "scaling.shards: Input should be greater than or equal to 1"),
        ({"shards": 33}, "scaling.shards: Input should be less than or equal to 32"),
        ({"tier_shards": {"1s": 0}}, "scaling.tier_shards.1s: Input should be greater than"),
        ({"tier_shards": {"1s": 64}}, "scaling.tier_shards.1s: Input should be less than"),
        ({"tier_shards": {"2h": 4}}, "scaling.tier_shards: unknown tier '2h'; tiers are ['1s']"),
        ({"leader_locator": "min-masters"}, "scaling.leader_locator: Input should be 'balanced'"),
        ({"replicas": 0}, "scaling.replicas: Input should be greater than or equal to 1"),
        ({"replicas": 9}, "scaling.replicas: Input should be less than or equal to 7"),
        (
            {"shard": 2},
            "scaling.shard: unknown key 'shard'; allowed keys here: shards, tier_shards",
        ),
    ],
)
def test_invalid_scaling(scaling: dict[str, Any], expected: str) -> None:
    with pytest.raises(TopologyError) as info:
        topology_from_dict(minimal(scaling=scaling), "inline.toml")
    assert expected in str(info.value)


@pytest.mark.parametrize("placement", [{"leader_locator": "balanced"}, {"replicas": 3}])
def test_placement_of_classic_queues_is_refused(placement: dict[str, Any]) -> None:
    with pytest.raises(TopologyError, match="places quorum queues"):
        topology_from_dict(minimal(queue_type="classic", scaling=placement))


def test_classic_queues_may_have_shards() -> None:
    topology = topology_from_dict(minimal(queue_type="classic", scaling={"shards": 3}))
    assert len(topology.tier_queues("1s")) == 3


@pytest.mark.parametrize(
    ("text", "named"),
    [
        (BASE.replace('1s = "1s"', '1s = "1s"\n1s = "2s"'), "key 1s in table [tiers]"),
        (
            BASE.replace("max_attempts = 3", "max_attempts = 3\nmax_attempts = 4"),
            'key max_attempts in table [queues."orders.cancel".retry]',
        ),
        ('namespace = "shop"\nnamespace = "other"\n', "key namespace is defined twice"),
        (BASE.replace('5m = "5m"', '5m = "5m"\n"5m" = "6m"'), 'key "5m" in table [tiers]'),
    ],
)
def test_a_key_written_twice_is_named(tmp_path: Path, text: str, named: str) -> None:
    message = load_error(tmp_path, text)
    assert "not valid TOML" in message
    assert named in message
    assert "defined twice" in message
    assert "Cannot overwrite a value (at line" in message  # tomllib's own words, kept
