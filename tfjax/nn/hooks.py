"""Hook points: activations named as TransformerLens names them, kept or replaced
only while a hook session (`tfjax.interp`) is active.

    q = hook("hook_q", q)     # in a layer: q itself unless a session wants it
    with scope("attn"): ...   # hook names inside get the prefix "attn."

The session is trace-time context (a contextvar), not an argument of the layers;
without one every function here returns at once, so the traced program is the
model's own. In a scanned stack a hook selects its layer by the traced cycle
(`lax.switch`) and kept values leave the scan as outputs (`Frame`). See docs/interp.md.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

__all__ = ["Frame", "HookPoint", "Session", "active", "hook", "layer_scope", "patched",
           "recording", "scope", "session"]

LAYER = "{layer}"  # where a block's index goes in a scope's name template


@dataclasses.dataclass(frozen=True)
class HookPoint:
    """What a hook function gets besides the activation: the full name
    (`"blocks.3.attn.hook_z"`) and the layer index (None outside the blocks)."""

    name: str
    layer: int | None


@dataclasses.dataclass
class Session:
    """One hooked run: `keep(name)` says which activations go into `cache`; `hooks`
    maps a name to its functions `fn(activation, HookPoint) -> replacement`, and
    `match` (pairs `(predicate, fn)`) adds functions by predicate. `seen` collects
    every name the run passes (the valid names), in the order passed."""

    keep: Callable[[str], bool] = lambda name: False
    hooks: dict[str, list] = dataclasses.field(default_factory=dict)
    match: list = dataclasses.field(default_factory=list)
    cache: dict[str, Any] = dataclasses.field(default_factory=dict)
    seen: dict[str, None] = dataclasses.field(default_factory=dict)

    def functions(self, name: str) -> list:
        return list(self.hooks.get(name, ())) + [fn for pred, fn in self.match if pred(name)]


@dataclasses.dataclass
class Frame:
    """The values a scanned cycle keeps: `values[key]` (traced, one cycle's) and
    `names[key]`, the full name of each cycle's layer (the key: cycle 0's); `emit`
    splits the scan's stacked outputs `[C, ...]` into the session's cache."""

    values: dict[str, Any] = dataclasses.field(default_factory=dict)
    names: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)

    def emit(self, stacked: dict[str, Any]) -> None:
        s = _SESSION.get()
        for key, ys in stacked.items():
            for c, name in enumerate(self.names[key]):
                if s.keep(name):
                    s.cache[name] = ys[c]


@dataclasses.dataclass(frozen=True)
class _Scope:
    path: str = ""                       # name template, "{layer}" where the index goes
    layers: tuple[int, ...] | None = None  # the candidate layer indices (one unless scanned)
    cycle: Any = None                    # traced index into `layers` (scanned), else None
    frame: Frame | None = None           # where a scanned block's kept values go

    def template(self, name: str) -> str:
        return f"{self.path}.{name}" if self.path else name

    def names(self, name: str) -> tuple[str, ...]:
        t = self.template(name)
        if self.layers is None:
            return (t,)
        return tuple(t.replace(LAYER, str(layer)) for layer in self.layers)


_SESSION: contextvars.ContextVar[Session | None] = contextvars.ContextVar("tfjax_hooks",
                                                                          default=None)
_SCOPE: contextvars.ContextVar[_Scope] = contextvars.ContextVar("tfjax_hook_scope",
                                                                default=_Scope())


@contextlib.contextmanager
def session(s: Session):
    """Activate `s` for the calls traced inside (hook names from the top scope)."""
    token, top = _SESSION.set(s), _SCOPE.set(_Scope())
    try:
        yield s
    finally:
        _SCOPE.reset(top)
        _SESSION.reset(token)


def recording() -> bool:
    """Whether a session is active (the stack then emits the scan's kept values)."""
    return _SESSION.get() is not None


@contextlib.contextmanager
def _set_scope(new: _Scope):
    token = _SCOPE.set(new)
    try:
        yield
    finally:
        _SCOPE.reset(token)


def scope(name: str):
    """Hook names inside get the prefix `name.` (a no-op without a session)."""
    if _SESSION.get() is None:
        return contextlib.nullcontext()
    return _set_scope(dataclasses.replace(_SCOPE.get(), path=_SCOPE.get().template(name)))


def layer_scope(prefix: str, layers: tuple[int, ...], cycle=None, frame: Frame | None = None):
    """The scope of one block: `prefix.{l}.` for l in `layers` (one layer, or under a
    scan the layer of each cycle, `cycle` the traced cycle index and `frame` where
    the kept values go)."""
    if _SESSION.get() is None:
        return contextlib.nullcontext()
    s = _SCOPE.get()
    return _set_scope(_Scope(s.template(f"{prefix}.{LAYER}"), tuple(layers), cycle, frame))


def hook(name: str, x):
    """The activation `x` at hook point `name` (local to the current scope): x itself
    without a session; else the session's functions applied (per layer: selected by
    the traced cycle in a scanned block), and kept when the session wants it."""
    s = _SESSION.get()
    if s is None:
        return x
    sc = _SCOPE.get()
    names = sc.names(name)
    s.seen.update(dict.fromkeys(names))
    fns = [s.functions(n) for n in names]
    if any(fns):
        layers = sc.layers or (None,)
        apply = [_applier(n, layer, f, x) for n, layer, f in zip(names, layers, fns)]
        x = apply[0](x) if sc.cycle is None else jax.lax.switch(sc.cycle, apply, x)
    keep = [s.keep(n) for n in names]
    if any(keep):
        if sc.cycle is None:
            s.cache[names[0]] = x
        else:
            sc.frame.values[names[0]], sc.frame.names[names[0]] = x, names
    return x


def _applier(name: str, layer, fns: list, like):
    """x -> the hook functions `fns` of `name` applied in order (identity when none),
    each result checked against x's shape and cast to its dtype."""
    def apply(x):
        for fn in fns:
            y = fn(x, HookPoint(name, layer))
            if y is None:
                raise ValueError(f"hook function for {name} returned None; return the "
                                 f"activation (or its replacement)")
            if jnp.shape(y) != jnp.shape(like):
                raise ValueError(f"hook function for {name} returned shape {jnp.shape(y)}; "
                                 f"the activation's is {jnp.shape(like)}")
            x = jnp.asarray(y).astype(like.dtype)
        return x

    return apply


def active(*names: str) -> bool:
    """Whether a session keeps or hooks any of `names` (local) at the current scope:
    layers compute what only a hook needs (attention patterns) when this is True."""
    s = _SESSION.get()
    if s is None:
        return False
    full = [n for name in names for n in _SCOPE.get().names(name)]
    s.seen.update(dict.fromkeys(full))
    return any(s.keep(n) or s.functions(n) for n in full)


def patched(name: str):
    """Whether a hook function replaces `name` here: a Python bool, or in a scanned
    block where only some cycles' layers are hooked a traced bool of the cycle."""
    s = _SESSION.get()
    if s is None:
        return False
    sc = _SCOPE.get()
    hit = [bool(s.functions(n)) for n in sc.names(name)]
    if all(hit) or not any(hit):
        return all(hit)
    return jnp.asarray(hit)[sc.cycle]
