"""`run_with_cache`, `run_with_hooks` and `hook_names`: one call of a model inside a
hook session (`tfjax.nn.hooks`), eager or under the caller's jit.

Names are TransformerLens's (`hook_embed`, `blocks.{l}.hook_resid_pre`,
`blocks.{l}.attn.hook_pattern`, `ln_final.hook_normalized`, ...), with the shapes it
gives (`hook_z` `[B,T,N,H]`, `hook_pattern` `[B,N,T,S]`). A name no hook point has is
an error naming the closest ones. See docs/interp.md.
"""

from __future__ import annotations

import difflib
import re
from typing import Callable, Iterable

import jax
from flax import nnx

from tfjax.nn import hooks

__all__ = ["hook_names", "run_with_cache", "run_with_hooks"]

Names = Iterable[str] | str | Callable[[str], bool] | None


def run_with_cache(model, tokens, names: Names = None, *, fwd_hooks=(), **inputs):
    """`(model(tokens, **inputs), cache)`: `cache` maps each hook name to its
    activation (as replaced by `fwd_hooks`, see `run_with_hooks`). `names`: None
    keeps every activation; a name, a list of names or a predicate `name -> bool`
    keeps those (attention patterns are computed only for the layers kept). Scanned
    stacks give each layer's values under its own `blocks.{l}` name."""
    keep, wanted = _selector(names)
    session = hooks.Session(keep=keep)
    _add_hooks(session, fwd_hooks)
    out = _run(model, tokens, inputs, session, wanted)
    return out, {n: session.cache[n] for n in _ordered(session.seen) if n in session.cache}


def run_with_hooks(model, tokens, fwd_hooks=(), **inputs):
    """`model(tokens, **inputs)` with the activations replaced: `fwd_hooks` is a list
    of `(name, fn)` (a name, or a predicate `name -> bool`); `fn(activation, hook)`
    returns the replacement of the same shape, `hook` a `HookPoint` (`.name`,
    `.layer`: a Python int, also inside a scanned stack, where the cycle's traced
    index selects the layer's function). Several functions on one name run in order."""
    session = hooks.Session()
    _add_hooks(session, fwd_hooks)
    return _run(model, tokens, inputs, session, ())


def hook_names(model, tokens, **inputs) -> list[str]:
    """Every hook name of `model` on inputs like `tokens`, layer by layer (traced
    abstractly: nothing is computed)."""
    session = hooks.Session()
    graphdef, state = nnx.split(model)

    def call(state, tokens, inputs):
        with hooks.session(session):
            return nnx.merge(graphdef, state)(tokens, **inputs)

    jax.eval_shape(call, state, tokens, inputs)
    return _ordered(session.seen)


def _run(model, tokens, inputs, session: hooks.Session, wanted: tuple[str, ...]):
    """model(tokens, **inputs) in `session`, jitted (one program, not op by op; inlined
    under the caller's jit); the session's cache gets the kept values."""
    @nnx.jit
    def call(model, tokens, inputs):
        with hooks.session(session):
            out = model(tokens, **inputs)
        return out, dict(session.cache)

    out, session.cache = call(model, tokens, inputs)
    named = wanted + tuple(n for n in session.hooks)
    missing = [n for n in named if n not in session.seen]
    if missing:
        close = difflib.get_close_matches(missing[0], list(session.seen), n=3, cutoff=0.5)
        raise ValueError(f"no hook point {missing[0]!r} in this {type(model).__name__}; "
                         f"closest: {', '.join(close) or 'none'} (tfjax.interp.hook_names "
                         f"lists them)")
    return out


def _selector(names: Names) -> tuple[Callable[[str], bool], tuple[str, ...]]:
    """(keep predicate, the explicit names to check)."""
    if names is None:
        return (lambda name: True), ()
    if callable(names):
        return names, ()
    wanted = (names,) if isinstance(names, str) else tuple(names)
    bad = [n for n in wanted if not isinstance(n, str)]
    if bad:
        raise TypeError(f"names: hook names are strings, got {bad[0]!r}")
    chosen = frozenset(wanted)
    return chosen.__contains__, wanted


def _add_hooks(session: hooks.Session, fwd_hooks) -> None:
    for pair in fwd_hooks:
        try:
            name, fn = pair
        except (TypeError, ValueError):
            raise TypeError(f"fwd_hooks: each entry is a pair (name, fn), got {pair!r}") from None
        if not callable(fn):
            raise TypeError(f"fwd_hooks: the function for {name!r} is not callable: {fn!r}")
        if isinstance(name, str):
            session.hooks.setdefault(name, []).append(fn)
        elif callable(name):
            session.match.append((name, fn))
        else:
            raise TypeError(f"fwd_hooks: a name is a string or a predicate, got {name!r}")


def _ordered(seen: dict) -> list[str]:
    """Hook names in execution order, a stack's blocks by layer index."""
    order = {n: i for i, n in enumerate(seen)}
    block = {n: re.match(r"(.*?)blocks\.(\d+)\.", n) for n in seen}
    start: dict[str, int] = {}  # a stack (its prefix) -> where its first block name is
    for n, m in block.items():
        if m:
            start.setdefault(m.group(1), order[n])

    def key(name):
        m = block[name]
        return (start[m.group(1)], int(m.group(2)), order[name]) if m else (order[name], -1, 0)

    return sorted(seen, key=key)
