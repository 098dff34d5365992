"""What a handler receives: the body decoded into `model=`, or else into the annotation of
the handler's first parameter. Pure; decided once, when the handler is registered.

    the type (model=, else the annotation)   the handler receives
    none, bytes, Any, object                  the body as it came (bytes)
    str                                       the body as UTF-8 text (not JSON)
    a pydantic model                          Model.model_validate_json(body)
    anything else pydantic validates          TypeAdapter(type).validate_json(body): dict,
                                              list[int], a TypedDict, a dataclass,
                                              Optional and unions, ...

A string annotation (`from __future__ import annotations`, or quoted) is resolved in the
handler's module as `typing.get_type_hints` does; one that does not resolve (a class
imported only under TYPE_CHECKING, or defined inside a function) is refused with a
ConfigError at registration, never silently turned into bytes: a handler written for a
dict would otherwise fail on every attempt until its message is parked.
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable
from typing import Annotated, Any

from pydantic import BaseModel, PydanticUserError, TypeAdapter

from rabbit_delay._errors import ConfigError

# The types that mean "the body as it came": nothing to decode.
RAW_TYPES: tuple[object, ...] = (bytes, Any, object)
TEXT_ENCODING = "utf-8"


def _as_text(body: bytes) -> str:
    """The body as text: strict UTF-8 (a body that is not is refused: decode_error)."""
    return body.decode(TEXT_ENCODING)


def decoder_for(input_type: Any, where: str) -> Callable[[bytes], Any]:
    """The function turning a delivered body into what the handler receives, for
    `input_type` (None: the body as it came). `where` names the handler in errors.

    Raises ConfigError for a type pydantic cannot validate JSON into."""
    base = _without_annotated(input_type)
    if input_type is None or any(base is raw for raw in RAW_TYPES):
        return bytes
    if base is str:
        return _as_text
    if isinstance(base, type) and issubclass(base, BaseModel) and base is input_type:
        return base.model_validate_json
    try:
        return TypeAdapter(input_type).validate_json
    except (PydanticUserError, TypeError, ValueError) as exc:  # no schema for that type
        raise ConfigError(
            f"{where}: pydantic cannot validate a message into {_shown(input_type)} ({exc}); "
            "annotate the message with a pydantic model, dict, list or TypedDict, or bytes for "
            "the raw body, or pass model=..."
        ) from None


def annotated_input(handler: Callable[..., Any], where: str) -> Any:
    """The resolved annotation of the handler's first parameter (the message); None for a
    handler without one (no annotation, only *args, or no signature to read).

    Raises ConfigError for a string annotation that does not resolve."""
    try:
        params = list(inspect.signature(handler).parameters.values())
    except (TypeError, ValueError):
        return None  # a builtin or C callable: nothing to read
    first = next((p for p in params if p.kind is not p.KEYWORD_ONLY), None)
    if first is None or first.kind in (first.VAR_POSITIONAL, first.VAR_KEYWORD):
        return None
    annotation = first.annotation
    if annotation is inspect.Parameter.empty:
        return None
    if not isinstance(annotation, str):
        return annotation
    return _resolve(annotation, first.name, _function_of(handler), where)


def _function_of(handler: Callable[..., Any]) -> Any:
    """The function whose source holds the handler's annotations: through partials,
    decorators (`__wrapped__`), bound methods and a callable object's `__call__`."""
    fn: Any = handler
    for _ in range(100):  # a cycle of __wrapped__ would never end
        if isinstance(fn, functools.partial):
            fn = fn.func
        elif hasattr(fn, "__wrapped__"):
            fn = fn.__wrapped__
        elif inspect.ismethod(fn):
            fn = fn.__func__
        elif not inspect.isfunction(fn) and callable(fn) and not isinstance(fn, type):
            fn = type(fn).__call__
            if not inspect.isfunction(fn):
                break  # a builtin's slot wrapper
        else:
            break
    return fn


class _OneHint:
    """A stand-in with one annotation and the handler's module namespace, so that
    `typing.get_type_hints` resolves that annotation alone (the handler's other
    annotations, the context's say, may name what only a type checker imports)."""

    def __init__(self, name: str, text: str, namespace: dict[str, Any]) -> None:
        self.__annotations__ = {name: text}
        self.__globals__ = namespace


def _resolve(text: str, name: str, fn: Any, where: str) -> Any:
    namespace = getattr(fn, "__globals__", None)
    if not isinstance(namespace, dict):
        namespace = {}
    try:
        return typing.get_type_hints(_OneHint(name, text, namespace), include_extras=True)[name]
    except Exception as exc:  # NameError mostly; a SyntaxError or TypeError as well
        raise ConfigError(
            f"{where}: the message annotation {text!r} does not resolve in "
            f"{getattr(fn, '__module__', None) or 'its module'} ({type(exc).__name__}: {exc}); "
            "define or import the type at module level before the handler (not only under "
            "TYPE_CHECKING), or pass model=... (model=bytes for the raw body)"
        ) from None


def _without_annotated(tp: Any) -> Any:
    return typing.get_args(tp)[0] if typing.get_origin(tp) is Annotated else tp


def _shown(tp: Any) -> str:
    return tp.__qualname__ if isinstance(tp, type) else repr(tp)
