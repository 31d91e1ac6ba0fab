"""The field checks every config section uses: each failure is a `ValueError`
that starts with the field's dotted path (`model.num_kv_heads: ...`)."""

from __future__ import annotations

from typing import Any, Iterable

__all__ = ["fail", "non_negative", "one_of", "positive"]


def fail(field: str, msg: str) -> None:
    raise ValueError(f"{field}: {msg}")


def one_of(field: str, value: Any, allowed: Iterable) -> None:
    allowed = tuple(allowed)
    if value not in allowed:
        fail(field, f"got {value!r}; allowed: {', '.join(map(repr, allowed))}")


def positive(field: str, value: int | float) -> None:
    if value <= 0:
        fail(field, f"must be > 0, got {value!r}")


def non_negative(field: str, value: int | float) -> None:
    if value < 0:
        fail(field, f"must be >= 0 (0 means off), got {value!r}")
