"""Name -> lazy factory registries for backends and passes.

A registry is a value (no import-time global state is mutated by registering): built-ins are
declared as `"module:attr"` strings and imported on first use, plug-ins come from one
entry-point group, and a name may be registered only once.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from importlib.metadata import entry_points
from typing import Generic, TypeVar

from .errors import RegistryError

T = TypeVar("T")

__all__ = ["Registry"]


class Registry(Generic[T]):
    """`kind` names what is registered ("backend", "pass"); `group` is the entry-point group."""

    def __init__(self, kind: str, group: str, builtins: dict[str, str]) -> None:
        self.kind = kind
        self.group = group
        self._specs: dict[str, str | Callable[[], T]] = dict(builtins)
        self._plugins_loaded = False

    def register(self, name: str, factory: str | Callable[[], T]) -> None:
        """Add `name`; `factory` is a `"module:attr"` string or an object/callable."""
        if name in self._specs:
            raise RegistryError(
                f"{self.kind} {name!r} is already registered",
                fix=f"choose another name; registered {self.kind}s: {', '.join(self.names())}",
            )
        self._specs[name] = factory

    @contextlib.contextmanager
    def temporarily(self, name: str, factory: str | Callable[[], T]) -> Iterator[None]:
        """`name` registered for the duration of a `with` block only (tools, tests)."""
        self.register(name, factory)
        try:
            yield
        finally:
            self._specs.pop(name, None)

    def names(self) -> list[str]:
        self._load_plugins()
        return sorted(self._specs)

    def get(self, name: str) -> T:
        """The registered object (a class for backends and passes), imported on first use."""
        self._load_plugins()
        spec = self._specs.get(name)
        if spec is None:
            raise RegistryError(
                f"unknown {self.kind} {name!r}",
                fix=f"use one of: {', '.join(self.names())}",
            )
        if isinstance(spec, str):
            module, _, attr = spec.partition(":")
            try:
                spec = getattr(importlib.import_module(module), attr)
            except (ImportError, AttributeError) as exc:
                raise RegistryError(
                    f"{self.kind} {name!r} could not be loaded from {module}:{attr}: {exc}",
                    fix="install the package that provides it (see `portable backends`)",
                ) from exc
            self._specs[name] = spec
        return spec  # type: ignore[return-value]

    def _load_plugins(self) -> None:
        if self._plugins_loaded:
            return
        self._plugins_loaded = True
        for ep in entry_points(group=self.group):
            self.register(ep.name, ep.value)
