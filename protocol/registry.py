"""Name → implementation registries (engines, weight transports, verifiers) that refuse duplicates."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class Registry(dict):
    """A dict of implementations by name; ``register(name)`` is a decorator that refuses a second entry."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def register(self, name: str) -> Callable[[T], T]:
        def wrap(obj: T) -> T:
            if name in self:
                raise ValueError(f"{self.kind} {name!r} registered twice")
            self[name] = obj
            return obj

        return wrap

    def __missing__(self, name: str):
        raise KeyError(f"unknown {self.kind} {name!r}; registered: {sorted(self)}")
