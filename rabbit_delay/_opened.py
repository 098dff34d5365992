"""`with thing:` for what a program opens and closes (the outbox relay; any sync
resource with `open()` returning itself and `close()`): entering opens it, leaving
closes it, whatever happened inside. Pure."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Self


class Opened(ABC):
    """Opened by `with`, closed after the block (on an error too)."""

    @abstractmethod
    def open(self) -> Self:
        """Open it (idempotent); itself."""

    @abstractmethod
    def close(self) -> None:
        """Close it (idempotent)."""

    def __enter__(self) -> Self:
        return self.open()

    def __exit__(self, *exc_info: object) -> None:
        self.close()


__all__ = ["Opened"]
