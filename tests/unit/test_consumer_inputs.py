"""What a handler receives (rabbit_delay._consumer.inputs): `model=`, else the annotation
of its first parameter, resolved from strings too; every edge case decided there."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any

import pytest
from pydantic import BaseModel, Field
from typing_extensions import TypedDict  # pydantic's rule on Python < 3.12

from rabbit_delay import App, ConfigError, HandlerContext, topology_from_dict
from rabbit_delay import _headers as h
from rabbit_delay._consumer.app import Consumer, Prepared
from rabbit_delay._consumer.decide import Park, ParkReason
from rabbit_delay._consumer.inputs import annotated_input
from rabbit_delay.stores import MemoryStore

from . import _eager_handlers as eager

if TYPE_CHECKING:  # a name the type checker sees and the running program never does
    from rabbit_delay._consumer.context import HandlerContext as OnlyForTheTypeChecker

NOW = 1_800_000_000_000


class Order(BaseModel):
    order_id: int


class Job(TypedDict):
    job: str
    tries: int


@dataclasses.dataclass
class Point:
    x: int
    y: int


class Plain:
    """A class pydantic has no schema for."""


def app() -> App:
    topology = topology_from_dict(
        {"namespace": "shop", "tiers": {"1s": "1s"}, "queues": {"orders": {}, "mail": {}}}
    )
    return App(topology, store=MemoryStore())


def consumer_of(handler: Callable[..., Any], **options: Any) -> Consumer:
    return app().add_consumer("orders", handler, **options)


def received(handler: Callable[..., Any], body: bytes, **options: Any) -> Any:
    """What `handler` receives for `body` (through prepare, as a worker reads it)."""
    prepared = consumer_of(handler, **options).prepare(
        "m-1", {h.H_ATTEMPT: 1}, False, body, "application/json", NOW
    )
    assert isinstance(prepared, Prepared), prepared
    return prepared.message


def parked(handler: Callable[..., Any], body: bytes, **options: Any) -> Park:
    action = consumer_of(handler, **options).prepare(
        "m-1", {h.H_ATTEMPT: 1}, False, body, "application/json", NOW
    )
    assert isinstance(action, Park), action
    return action


# -- module-level handlers, string annotations (this module's __future__ import) ----------


def takes_dict(msg: dict[str, Any], ctx: HandlerContext) -> None: ...


def takes_bare_dict(msg: dict, ctx: HandlerContext) -> None: ...  # type: ignore[type-arg]


def takes_job(msg: Job, ctx: HandlerContext) -> None: ...


def takes_ints(msg: list[int]) -> None: ...


def takes_order(msg: Order, ctx: HandlerContext) -> None: ...


def takes_optional_order(msg: Order | None) -> None: ...


def takes_int_or_text(msg: int | str) -> None: ...


def takes_point(msg: Point) -> None: ...


def takes_some_ints(msg: Annotated[list[int], Field(min_length=1)]) -> None: ...


def takes_text(msg: str, ctx: HandlerContext) -> None: ...


def takes_bytes(msg: bytes, ctx: HandlerContext) -> None: ...


def takes_any(msg: Any, ctx: HandlerContext) -> None: ...


def takes_object(msg: object, ctx: HandlerContext) -> None: ...


def takes_anything(msg, ctx):  # type: ignore[no-untyped-def]
    ...


async def takes_dict_async(msg: dict[str, int], ctx: HandlerContext) -> None: ...


def takes_args(*args: Any) -> None: ...


def context_only_for_the_type_checker(msg: dict[str, int], ctx: OnlyForTheTypeChecker) -> None: ...


@pytest.mark.parametrize(
    ("handler", "body", "expected"),
    [
        (takes_dict, b'{"order_id": 5}', {"order_id": 5}),
        (takes_bare_dict, b'{"a": [1, 2]}', {"a": [1, 2]}),
        (takes_job, b'{"job": "mail", "tries": 2}', {"job": "mail", "tries": 2}),
        (takes_ints, b"[1, 2, 3]", [1, 2, 3]),
        (takes_order, b'{"order_id": 5}', Order(order_id=5)),
        (takes_optional_order, b"null", None),
        (takes_optional_order, b'{"order_id": 6}', Order(order_id=6)),
        (takes_int_or_text, b"7", 7),
        (takes_int_or_text, b'"seven"', "seven"),
        (takes_point, b'{"x": 1, "y": 2}', Point(1, 2)),
        (takes_some_ints, b"[4]", [4]),
        (takes_text, "zwölf ✓".encode(), "zwölf ✓"),
        (takes_text, b'{"not": "parsed"}', '{"not": "parsed"}'),  # text, not JSON
        (takes_bytes, b"\xff raw", b"\xff raw"),
        (takes_any, b"\xff raw", b"\xff raw"),
        (takes_object, b"\xff raw", b"\xff raw"),
        (takes_anything, b"\xff raw", b"\xff raw"),
        (takes_args, b"\xff raw", b"\xff raw"),
        (takes_dict_async, b'{"a": 1}', {"a": 1}),
        (context_only_for_the_type_checker, b'{"a": 1}', {"a": 1}),
    ],
    ids=lambda v: getattr(v, "__name__", None) or repr(v)[:24],
)
def test_the_annotation_of_the_first_parameter_decides(
    handler: Callable[..., Any], body: bytes, expected: Any
) -> None:
    message = received(handler, body)
    assert message == expected
    assert type(message) is type(expected)


@pytest.mark.parametrize(
    ("handler", "body", "expected"),
    [
        (eager.takes_dict, b'{"a": 1}', {"a": 1}),
        (eager.takes_job, b'{"job": "x", "tries": 1}', {"job": "x", "tries": 1}),
        (eager.takes_ints, b"[1]", [1]),
        (eager.takes_order, b'{"order_id": 1}', eager.Order(order_id=1)),
        (eager.takes_text, b"hello", "hello"),
        (eager.takes_bytes, b"hello", b"hello"),
    ],
    ids=lambda v: getattr(v, "__name__", None) or repr(v)[:24],
)
def test_annotations_evaluated_at_definition_decide_alike(
    handler: Callable[..., Any], body: bytes, expected: Any
) -> None:
    assert received(handler, body) == expected


def test_model_wins_over_the_annotation() -> None:
    assert received(takes_dict, b'{"order_id": 5}', model=Order) == Order(order_id=5)
    assert received(takes_order, b'{"order_id": 5}', model=bytes) == b'{"order_id": 5}'
    assert received(takes_bytes, b"[1]", model=list[int]) == [1]
    consumer = consumer_of(takes_dict, model=Order)
    assert consumer.model is Order


def test_model_bytes_and_str_mean_what_the_annotations_mean() -> None:
    # model=str is text, as the annotation str: not a JSON string (as it was before).
    assert received(takes_anything, b"plain", model=str) == "plain"
    assert received(takes_anything, b"\xff", model=bytes) == b"\xff"


def test_the_decided_type_is_the_consumers_model() -> None:
    assert consumer_of(takes_job).model is Job
    assert consumer_of(takes_anything).model is None
    assert consumer_of(takes_bytes).model is bytes


# -- callables that are not plain functions ------------------------------------------------


class CallableHandler:
    def __init__(self) -> None:
        self.seen: list[Any] = []

    def __call__(self, msg: Order, ctx: HandlerContext) -> None:
        self.seen.append(msg)


class AsyncCallableHandler:
    async def __call__(self, msg: list[int]) -> None: ...


class Service:
    def handle(self, msg: Job, ctx: HandlerContext) -> None: ...


def with_settings(settings: dict[str, str], msg: Order, ctx: HandlerContext) -> None: ...


def logged(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    return wrapper


@logged
def decorated(msg: Order, ctx: HandlerContext) -> None: ...


def test_a_callable_object_a_method_a_partial_and_a_decorated_function() -> None:
    assert received(CallableHandler(), b'{"order_id": 1}') == Order(order_id=1)
    assert received(AsyncCallableHandler(), b"[1, 2]") == [1, 2]
    assert consumer_of(AsyncCallableHandler()).is_async
    assert received(Service().handle, b'{"job": "j", "tries": 0}') == {"job": "j", "tries": 0}
    partial = functools.partial(with_settings, {"region": "eu"})
    assert received(partial, b'{"order_id": 2}') == Order(order_id=2)
    assert consumer_of(partial).takes_context
    twice = functools.partial(functools.partial(with_settings, {}))
    assert received(twice, b'{"order_id": 3}') == Order(order_id=3)
    assert received(decorated, b'{"order_id": 4}') == Order(order_id=4)


def test_a_lambda_and_a_builtin_get_the_raw_body() -> None:
    assert received(lambda m, c: None, b"\xff") == b"\xff"
    assert annotated_input(print, "print") is None


# -- what does not fit ---------------------------------------------------------------------


def test_a_body_that_does_not_fit_is_parked_with_the_reason() -> None:
    assert parked(takes_dict, b"[1, 2]").reason is ParkReason.VALIDATION_ERROR
    assert parked(takes_dict, b"{not json").reason is ParkReason.DECODE_ERROR
    assert parked(takes_job, b'{"job": "x"}').reason is ParkReason.VALIDATION_ERROR
    assert parked(takes_ints, b'["a"]').reason is ParkReason.VALIDATION_ERROR
    not_text = parked(takes_text, b"\xff\xfe")
    assert not_text.reason is ParkReason.DECODE_ERROR
    assert not_text.outgoing.headers[h.H_ERROR_TYPE] == "UnicodeDecodeError"
    assert not_text.outgoing.body == b"\xff\xfe"  # parked as it came


def test_an_annotation_that_does_not_resolve_is_refused_at_registration() -> None:
    class Local(BaseModel):  # defined in a function: a string annotation cannot reach it
        order_id: int

    def handle(msg: Local, ctx: HandlerContext) -> None: ...

    with pytest.raises(ConfigError) as refused:
        consumer_of(handle)
    said = str(refused.value)
    assert "consumer for 'orders'" in said
    assert "handle" in said
    assert "'Local' does not resolve" in said
    assert "NameError" in said
    assert "model=" in said
    # model= decides without reading the annotation: nothing to resolve, nothing refused
    assert received(handle, b'{"order_id": 1}', model=Local) == Local(order_id=1)


def test_a_message_annotation_only_the_type_checker_sees_is_refused() -> None:
    def handle(msg: OnlyForTheTypeChecker) -> None: ...

    with pytest.raises(ConfigError, match="not only under TYPE_CHECKING"):
        consumer_of(handle)


def test_a_type_pydantic_cannot_validate_is_refused_at_registration() -> None:
    def handle(msg: Plain) -> None: ...

    with pytest.raises(ConfigError, match=r"pydantic cannot validate a message into Plain"):
        consumer_of(handle)
    with pytest.raises(ConfigError, match=r"pydantic cannot validate a message into Plain"):
        consumer_of(takes_anything, model=Plain)


def test_the_decorator_and_add_consumer_decide_alike() -> None:
    application = app()

    @application.consumer("orders")
    def handle(msg: dict[str, int], ctx: HandlerContext) -> None: ...

    consumer = application.consumers["orders"]
    assert consumer.model == dict[str, int]
    assert consumer.decode(b'{"a": 1}') == {"a": 1}


def test_a_typing_typed_dict_on_python_3_11_is_refused_with_pydantics_reason() -> None:
    import sys
    import typing

    class Old(typing.TypedDict):
        a: int

    def handle(msg: dict[str, int]) -> None: ...

    if sys.version_info >= (3, 12):
        assert received(handle, b'{"a": 1}', model=Old) == {"a": 1}
        return
    with pytest.raises(ConfigError, match=r"typing_extensions\.TypedDict"):
        consumer_of(handle, model=Old)
