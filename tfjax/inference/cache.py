"""The model's cache: every layer's decode state (each made by its mixer's
`init_state`, `tfjax.nn.state`) laid out as the layer stack is, and each row's length.

The model makes it (`model.init_cache(batch, max_len)`, `tfjax.models.caching`) and
each `model.step` returns the next; the loops here only carry it. `logical_axes` names
its arrays' axes so the rules table that shards the model shards it; `rewind` lowers
the lengths, which undoes steps of caches whose slots are positions (global K/V and
latent caches: `DecodeState.rewindable`). See docs/inference.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from tfjax.nn.state import DecodeState, decode_state, static_field

__all__ = ["ModelCache", "check_rewindable", "logical_axes", "rewind"]


@decode_state
class ModelCache:
    """The whole model's inference state.

    layers: the layer stack's states, `{"cycles": (per pattern position, stacked
      [cycles, ...]), "blocks": (per unrolled block)}`, each a dict of sublayer states
      ("attn", "shared" for a shared block's use, "cross" in an encoder-decoder).
    length: `[B]` tokens of each row in the cache (the next token's position).
    encoder_length: `[B]` real encoder tokens (encoder-decoder), else None.
    """

    layers: Any
    length: jax.Array
    encoder_length: Any = None
    max_len: int = static_field(default=0)

    def replace(self, **kw):
        return dataclasses.replace(self, **kw)


def _states(layers) -> list:
    return jax.tree.leaves(layers, is_leaf=lambda c: isinstance(c, DecodeState))


def logical_axes(cache: ModelCache):
    """A tree like `cache` of logical axis names per array (for `logical_to_spec`):
    each state's `AXES` (K/V `(layers?, batch, kv_heads, None, head_dim)`, ...),
    counters `(batch,)`; a leading stacked axis is "layers"."""
    def names(x, base):
        extra = x.ndim - len(base)
        return ("layers",) * extra + tuple(base) if extra >= 0 else tuple(base[: x.ndim])

    def one(c):
        if not isinstance(c, DecodeState):
            return names(c, ("batch",))
        return c.replace(**{f.name: names(getattr(c, f.name), c.AXES.get(f.name, ("batch",)))
                            for f in dataclasses.fields(c) if not f.metadata.get("static")})

    return jax.tree.map(one, cache, is_leaf=lambda c: isinstance(c, DecodeState))


def check_rewindable(cache: ModelCache, what: str) -> None:
    """Raise unless every layer state of `cache` can be rewound (`rewind`): global K/V
    and latent caches, whose slots are positions."""
    for c in _states(cache.layers):
        if c.rewindable:
            continue
        window = getattr(c, "window", 0)
        kind = type(c).__name__ + (f"(window={window})" if window else "")
        raise ValueError(f"speculative decoding: {what} keeps a {kind} state, which cannot be "
                         "rolled back to the accepted tokens; only global attention and "
                         "latent (MLA) layers can (model.layer_pattern)")


def rewind(cache: ModelCache, length: jax.Array) -> ModelCache:
    """`cache` cut back to `length` `[B]` tokens per row (only for rewindable states: the
    slots past the length are then empty to the masks and overwritten by later steps)."""
    return cache.replace(length=length)
