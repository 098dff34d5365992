"""`rabbit-delay asyncapi` (rabbit_delay._ops.asyncapi.rules): the AsyncAPI 3.0 document of
a topology, validated against the official AsyncAPI 3.0.0 JSON schema (vendored in
tests/schemas, see its README: @asyncapi/specs 6.11.1, Apache-2.0), and checked against
the desired state `declare` creates, the router's rules and the header constants."""

from __future__ import annotations

import hashlib
import json
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from typer.testing import CliRunner

from rabbit_delay import Topology, topology_from_dict
from rabbit_delay import _headers as h
from rabbit_delay._cli.app import app
from rabbit_delay._consumer.decide import ParkReason
from rabbit_delay._ops.asyncapi.rules import (
    HEADERS,
    MESSAGE,
    PLUGIN_MESSAGE,
    document,
    headers_schema,
)
from rabbit_delay._plan.desired import desired
from rabbit_delay._topology.delays import cascade_routing_key
from rabbit_delay._urls import URL_ENV

SCHEMA = Path(__file__).resolve().parent.parent / "schemas" / "asyncapi-3.0.0.json"
SCHEMA_SHA256 = "d4571a420e6ffb7fcc7066c95a6db1202f299a3c51daa103d0706bf30f95e626"
SECRET = "s3cret-pw"

TIERS_AND_CASCADE = {
    "namespace": "shop",
    "tiers": {"1s": "1s", "5m": "5m", "1h": "1h"},
    "cascade": {"levels": 5, "resolution": "1s"},
    "scaling": {"tier_shards": {"1s": 3}},
    "queues": {
        "orders.cancel": {"bindings": ["order.timeout"], "alias": "oc"},
        "mail": {"tiers": ["5m"], "retry": {"tiers": ["1h"]}},
        "push": {"bindings": ["push.any", "order.timeout"]},
    },
}
PLUGIN = {
    "namespace": "plug",
    "version": 2,
    "queue_type": "classic",
    "tiers": {"30s": "30s"},
    "plugin": {},
    "queues": {"jobs": {}},
}


@cache
def validator() -> jsonschema.Draft7Validator:
    schema = json.loads(SCHEMA.read_text(encoding="utf-8"))
    return jsonschema.Draft7Validator(schema, format_checker=jsonschema.FormatChecker())


def assert_valid(doc: dict[str, Any]) -> None:
    errors = sorted(validator().iter_errors(doc), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(
        f"{'/'.join(map(str, e.absolute_path))}: {e.message[:300]}" for e in errors[:10]
    )


def resolve(doc: dict[str, Any], ref: str) -> Any:
    assert ref.startswith("#/"), ref
    node: Any = doc
    for part in ref[2:].split("/"):
        node = node[part.replace("~1", "/").replace("~0", "~")]
    return node


def refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        found = [node["$ref"]] if "$ref" in node else []
        return found + [r for value in node.values() for r in refs(value)]
    if isinstance(node, list):
        return [r for item in node for r in refs(item)]
    return []


@pytest.fixture(scope="module")
def shop() -> Topology:
    return topology_from_dict(TIERS_AND_CASCADE)


@pytest.fixture(scope="module")
def plug() -> Topology:
    return topology_from_dict(PLUGIN)


def test_the_vendored_schema_is_the_one_its_readme_names() -> None:
    assert hashlib.sha256(SCHEMA.read_bytes()).hexdigest() == SCHEMA_SHA256
    schema = json.loads(SCHEMA.read_text(encoding="utf-8"))
    assert schema["$id"] == "http://asyncapi.com/definitions/3.0.0/asyncapi.json"


def test_the_schema_refuses_what_it_must() -> None:
    """The validator bites: a wrong version, a channel binding AsyncAPI does not know."""
    doc = document(topology_from_dict(TIERS_AND_CASCADE))
    assert_valid(doc)
    broken = json.loads(json.dumps(doc))
    broken["asyncapi"] = "2.6.0"
    assert not validator().is_valid(broken)
    broken = json.loads(json.dumps(doc))
    channel = broken["channels"]["shop.v1.delay.5m"]
    channel["bindings"]["amqp"]["exchange"]["type"] = "x-delayed-message"
    assert not validator().is_valid(broken)


@pytest.mark.parametrize("data", [TIERS_AND_CASCADE, PLUGIN], ids=["tiers+cascade", "plugin"])
@pytest.mark.parametrize("urls", [(), (f"amqp://app:{SECRET}@rabbit.example:5673/prod",)])
def test_the_document_is_valid_asyncapi_3(data: dict[str, Any], urls: tuple[str, ...]) -> None:
    doc = document(topology_from_dict(data), urls)
    assert_valid(doc)
    assert doc["asyncapi"] == "3.0.0"
    for ref in refs(doc):  # every reference points into the document
        resolve(doc, ref)
    for op in doc["operations"].values():  # an operation's messages are its channel's
        channel = resolve(doc, op["channel"]["$ref"])
        for message in op["messages"]:
            assert message["$ref"].startswith(op["channel"]["$ref"] + "/messages/")
            assert resolve(doc, message["$ref"]) in channel["messages"].values()
    assert SECRET not in json.dumps(doc)


def test_a_channel_per_tier_exchange_shard_cascade_entry_and_business_queue(
    shop: Topology,
) -> None:
    doc = document(shop)
    n = shop.names
    tier_exchanges = [e for tier in shop.tiers for e in shop.tier_exchanges(tier)]
    assert len(tier_exchanges) == 5  # 1s has 3 shards
    assert "shop.v1.delay.1s.2" in tier_exchanges
    entries = [n.cascade_entry_exchange(level) for level in range(5)]
    queues = [n.business_queue(q) for q in shop.queues]
    assert list(doc["channels"]) == [*tier_exchanges, *entries, *queues]
    assert list(doc["operations"]) == [
        *(f"send.{e}" for e in tier_exchanges + entries),
        *(f"receive.{q}" for q in shop.queues),
    ]
    for name in tier_exchanges + entries:
        assert doc["operations"][f"send.{name}"]["action"] == "send"
        assert doc["channels"][name]["address"] == "{routingKey}"
        assert doc["channels"][name]["bindings"]["amqp"]["is"] == "routingKey"
    for queue in shop.queues:
        name = n.business_queue(queue)
        assert doc["operations"][f"receive.{queue}"]["action"] == "receive"
        assert doc["channels"][name]["address"] == name
        assert doc["channels"][name]["bindings"]["amqp"]["is"] == "queue"
    assert "crc32(message_id) % 3" in doc["channels"]["shop.v1.delay.1s.1"]["description"]


@pytest.mark.parametrize("data", [TIERS_AND_CASCADE, PLUGIN], ids=["tiers+cascade", "plugin"])
def test_bindings_carry_what_declare_creates(data: dict[str, Any]) -> None:
    """Exchange types, durability and every argument come from the desired state."""
    topology = topology_from_dict(data)
    want = desired(topology)
    exchanges = {e.name: e for e in want.exchanges}
    queues = {q.name: q for q in want.queues}
    doc = document(topology)
    for channel in doc["channels"].values():
        amqp = channel["bindings"]["amqp"]
        assert amqp["bindingVersion"] == "0.3.0"
        if amqp["is"] == "queue":
            spec = queues[amqp["queue"]["name"]]
            assert amqp["queue"]["durable"] is spec.durable
            assert amqp["queue"].get("x-arguments", {}) == dict(spec.arguments)
            bound = {(b.source, b.routing_key) for b in want.bindings if b.destination == spec.name}
            assert {(b["exchange"], b["routingKey"]) for b in amqp["x-bindings"]} == bound
            continue
        exchange = exchanges[amqp["exchange"]["name"]]
        assert amqp["exchange"].get("type", amqp["exchange"].get("x-type")) == exchange.type
        assert amqp["exchange"]["durable"] is exchange.durable
        assert amqp["exchange"].get("x-arguments", {}) == dict(exchange.arguments)
        if "x-buffer-queue" in amqp:
            buffer = queues[amqp["x-buffer-queue"]["name"]]
            assert amqp["x-buffer-queue"]["arguments"] == dict(buffer.arguments)
            assert any(
                b.source == exchange.name and b.destination == buffer.name for b in want.bindings
            )
    buffers = {
        c["bindings"]["amqp"].get("x-buffer-queue", {}).get("name")
        for c in doc["channels"].values()
    }
    assert {q for tier in topology.tiers for q in topology.tier_queues(tier)} <= buffers


def test_the_buffer_of_a_tier_says_its_ttl_and_dead_letter_exchange(shop: Topology) -> None:
    buffer = document(shop)["channels"]["shop.v1.delay.5m"]["bindings"]["amqp"]["x-buffer-queue"]
    assert buffer["name"] == "shop.v1.delay.5m"
    assert buffer["arguments"]["x-message-ttl"] == 300_000
    assert buffer["arguments"]["x-dead-letter-exchange"] == "shop.v1.due"
    assert buffer["arguments"]["x-queue-type"] == "quorum"


def test_the_plugin_exchange_names_its_type_in_an_extension(plug: Topology) -> None:
    doc = document(plug)
    channel = doc["channels"]["plug.v2.delayed"]
    exchange = channel["bindings"]["amqp"]["exchange"]
    assert "type" not in exchange  # AsyncAPI's AMQP binding knows no x-delayed-message
    assert exchange["x-type"] == "x-delayed-message"
    assert exchange["x-arguments"] == {"x-delayed-type": "fanout"}
    assert list(channel["messages"]) == [PLUGIN_MESSAGE]
    headers = doc["components"]["messages"][PLUGIN_MESSAGE]["headers"]
    assert headers["required"] == [h.H_PLUGIN_DELAY]
    assert doc["operations"]["send.plug.v2.delayed"]["bindings"]["amqp"]["mandatory"] is False
    assert doc["operations"]["send.plug.v2.delay.30s"]["bindings"]["amqp"]["mandatory"] is True
    assert doc["info"]["version"] == "2.0.0"


def test_routing_keys_are_those_the_router_accepts(shop: Topology) -> None:
    doc = document(shop)
    n = shop.names
    keys = {
        name: set(channel["parameters"]["routingKey"].get("enum", []))
        for name, channel in doc["channels"].items()
        if "parameters" in channel
    }
    everything = {n.queue_key("orders.cancel"), n.queue_key("push"), "order.timeout", "push.any"}
    assert keys["shop.v1.delay.1s"] == everything  # mail accepts only 5m (and 1h to retry)
    assert keys["shop.v1.delay.1s.2"] == everything
    assert keys["shop.v1.delay.5m"] == everything | {n.queue_key("mail")}
    assert keys["shop.v1.delay.1h"] == everything | {n.queue_key("mail")}
    entry = doc["channels"]["shop.v1.cascade.02.in"]["parameters"]["routingKey"]
    assert entry["examples"] == [cascade_routing_key(4, 5, "oc")]  # the alias
    assert "`oc` (queue orders.cancel)" in entry["description"]


def test_every_header_is_in_the_schema_with_a_type_and_a_description() -> None:
    ours = {
        value
        for name, value in vars(h).items()
        if name.isupper() and isinstance(value, str) and value.startswith("rd-")
    }
    assert ours <= set(HEADERS), f"describe in rules.HEADERS: {sorted(ours - set(HEADERS))}"
    assert set(HEADERS) == ours | set(h.TRACE_HEADERS)
    schema = headers_schema(["1s"])
    for name, prop in schema["properties"].items():
        assert prop["type"] in ("integer", "string"), name
        assert len(prop["description"]) > 20, name
    assert schema["properties"][h.H_TIER]["enum"] == ["1s"]
    assert schema["properties"][h.H_PARK_REASON]["enum"] == [r.value for r in ParkReason]
    assert schema["properties"][h.H_DUE_AT]["type"] == "integer"
    assert "required" not in schema  # a worker takes a message without them


def test_a_message_with_the_headers_a_publish_sets_fits_the_schema(shop: Topology) -> None:
    from rabbit_delay._publishing.core import PublisherCore

    out = PublisherCore(shop).prepare({"order_id": 1}, "5m", queue="orders.cancel")
    doc = document(shop)
    schema = doc["components"]["messages"][MESSAGE]["headers"]
    jsonschema.validate(out.headers, schema)
    assert not jsonschema.Draft7Validator(schema).is_valid({**out.headers, h.H_DUE_AT: "soon"})
    assert set(schema["properties"][h.H_TIER]["enum"]) == {"1s", "5m", "1h", "now", "cascade"}


def test_servers_name_hosts_and_vhosts_never_credentials(shop: Topology) -> None:
    urls = (f"amqps://app:{SECRET}@a.example/shop%2Fprod", f"amqp://app:{SECRET}@[::1]:5673/")
    doc = document(shop, urls)
    assert doc["servers"] == {
        "broker-1": {
            "host": "a.example:5671",
            "protocol": "amqps",
            "protocolVersion": "0.9.1",
            "description": "RabbitMQ, vhost `shop/prod`.",
        },
        "broker-2": {
            "host": "[::1]:5673",
            "protocol": "amqp",
            "protocolVersion": "0.9.1",
            "description": "RabbitMQ, vhost `/`.",
        },
    }
    channel = doc["channels"]["shop.v1.delay.5m"]
    assert channel["servers"] == [{"$ref": "#/servers/broker-1"}, {"$ref": "#/servers/broker-2"}]
    assert channel["bindings"]["amqp"]["exchange"]["vhost"] == "shop/prod"
    assert SECRET not in json.dumps(doc)
    assert "servers" not in document(shop)


# -- the command ---------------------------------------------------------------------------


@pytest.fixture
def shop_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv(URL_ENV, raising=False)
    path = tmp_path / "shop.toml"
    path.write_text(
        'namespace = "shop"\n[tiers]\n1s = "1s"\n5m = "5m"\n[scaling]\ntier_shards = { 1s = 2 }\n'
        "[queues.push]\n",
        encoding="utf-8",
    )
    return path


def test_the_command_prints_the_document(shop_file: Path) -> None:
    from rabbit_delay import load_topology

    result = CliRunner().invoke(app, ["asyncapi", str(shop_file)])
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc == document(load_topology(shop_file))
    assert_valid(doc)
    same = CliRunner().invoke(app, ["asyncapi", "-f", str(shop_file)])
    assert json.loads(same.stdout) == doc


def test_the_command_writes_a_file_and_names_servers(shop_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "asyncapi.json"
    url = f"amqp://app:{SECRET}@rabbit.example:5672/"
    result = CliRunner().invoke(app, ["asyncapi", str(shop_file), "-o", str(out), "--url", url])
    assert result.exit_code == 0, result.stderr
    assert result.stdout == f"wrote {out}: AsyncAPI 3.0.0, 4 channels, 4 operations\n"
    doc = json.loads(out.read_text(encoding="utf-8"))
    assert_valid(doc)
    assert doc["servers"]["broker"]["host"] == "rabbit.example:5672"
    assert SECRET not in out.read_text(encoding="utf-8") + result.stdout
    as_json = CliRunner().invoke(app, ["asyncapi", str(shop_file), "-o", str(out), "--json"])
    assert json.loads(as_json.stdout) == {"output": str(out), "channels": 4, "operations": 4}


def test_the_command_takes_the_url_from_the_environment(
    shop_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(URL_ENV, "amqp://guest:guest@node-a:5672/,amqp://guest:guest@node-b:5672/")
    result = CliRunner().invoke(app, ["asyncapi", str(shop_file)])
    assert result.exit_code == 0, result.stderr
    assert list(json.loads(result.stdout)["servers"]) == ["broker-1", "broker-2"]


def test_an_unwritable_output_is_an_error(shop_file: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["asyncapi", str(shop_file), "-o", str(tmp_path / "no" / "x")])
    assert result.exit_code == 1
    assert result.stderr.startswith("error: cannot write")


def test_a_held_topology_documents_its_holding_exchange() -> None:
    topology = topology_from_dict({**TIERS_AND_CASCADE, "cascade": None, "held": {}})
    doc = document(topology)
    assert_valid(doc)
    held = topology.names.held_exchange()
    assert any(held in json.dumps(channel) for channel in doc["channels"].values())
    for ref in refs(doc):
        assert resolve(doc, ref) is not None
