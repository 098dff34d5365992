"""Handlers whose annotations are evaluated when they are defined (this module has no
`from __future__ import annotations`): the objects themselves, not strings. Used by
tests/unit/test_consumer_inputs.py."""

from typing import Any

from pydantic import BaseModel
from typing_extensions import TypedDict  # pydantic's rule on Python < 3.12


class Order(BaseModel):
    order_id: int


class Job(TypedDict):
    job: str
    tries: int


def takes_dict(msg: dict, ctx: Any) -> None: ...  # type: ignore[type-arg]


def takes_job(msg: Job, ctx: Any) -> None: ...


def takes_ints(msg: list[int]) -> None: ...


def takes_order(msg: Order) -> None: ...


def takes_text(msg: str, ctx: Any) -> None: ...


def takes_bytes(msg: bytes, ctx: Any) -> None: ...
