"""One registry per kind of component (norms, activations, positions, attention
implementations, architectures). A registry maps a config name to a builder and
turns an unknown name into an error that lists the allowed ones."""

from __future__ import annotations

from typing import Any, Callable, Generic, Iterator, Mapping, TypeVar

T = TypeVar("T")
_MISSING = object()


class Registry(Generic[T]):
    """A named table of builders: `@REG.register("name")` and `REG.get("name")`.
    `Registry(kind, {...})` is a fixed table, written out where it is defined:
    `register` refuses to add to it."""

    def __init__(self, kind: str, items: Mapping[str, T] | None = None):
        self.kind = kind
        self._items: dict[str, T] = dict(items or {})
        self._fixed = items is not None

    def register(self, name: str, item: Any = _MISSING) -> Callable[[T], T] | T:
        def add(obj: T) -> T:
            if self._fixed:
                raise TypeError(f"the {self.kind} table is fixed where it is defined; add "
                                f"{name!r} to it there")
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._items[name] = obj
            return obj

        return add if item is _MISSING else add(item)

    def get(self, name: str, field: str | None = None) -> T:
        if name not in self._items:
            where = f"{field}={name!r}" if field else f"{self.kind} {name!r}"
            raise ValueError(f"unknown {where}; allowed: {', '.join(sorted(self._items))}")
        return self._items[name]

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._items))

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._items))
