"""The JSON of a record from its named fields, for the `as_json` of the reports that
the CLI prints and the dashboard serves: each name written once, as the key and as the
attribute it reads. Pure."""

from __future__ import annotations

from typing import Any


def fields_json(record: object, *names: str) -> dict[str, Any]:
    """`{name: record.<name>}` for each of `names`, in their order (a field or a
    property alike)."""
    return {name: getattr(record, name) for name in names}


__all__ = ["fields_json"]
