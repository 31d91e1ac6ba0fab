"""The model's cache: every layer's decode state (each made by its mixer's
`init_state`, `tfjax.nn.state`) laid out as the layer stack is, and each row's length.

The model makes it (`model.init_cache(batch, max_len)`, `tfjax.models.caching`) and
each `model.step` returns the next; the loops here only carry it. `logical_axes` names
its arrays' axes so the rules table that shards the model shards it; `rewind` lowers
the lengths, which undoes steps of caches whose slots are positions (global K/V and
latent caches: `DecodeState.rewindable`). The engine's cache is paged (`pages`, a
`PageTables`: its pageable states hold page pools). See docs/inference.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from tfjax.nn.state import DecodeState, decode_state, static_field

__all__ = ["ModelCache", "PageTables", "check_rewindable", "has_row_states", "logical_axes",
           "paged_size", "reads_runs", "rewind"]


def paged_size(size: int, *, max_len: int, page_size: int, chunk: int) -> int:
    """The logical slots a row keeps in pages for a cache geometry of `size` slots:
    all of `max_len` (whole pages) for a global cache, and for a rolling buffer (a
    window) enough whole pages that a step of up to `chunk` new tokens, written before
    it is attended, overwrites no key its queries still see (`size - 1 + chunk`)."""
    pages = min(-(-(size - 1 + chunk) // page_size), -(-max_len // page_size))
    return pages * page_size


@decode_state
class PageTables:
    """The page tables of a paged `ModelCache` (the engine's): `tables` maps each cache
    geometry's `paged_size` to `[B, n]` page ids (row b's logical slot s in page
    `tables[size][b, s // page_size]`); a step gives each row at most `chunk` new tokens.
    `runs` (R, C): a ragged step's, one token a row, rows [0, R*C) R runs of C tokens of
    one sequence each (`tfjax.ops.paged.Paged`)."""

    tables: dict
    page_size: int = static_field(default=16)
    chunk: int = static_field(default=1)
    runs: tuple = static_field(default=())

    def replace(self, **kw):
        return dataclasses.replace(self, **kw)

    def size(self, slots: int, max_len: int) -> int:
        """The paged size of a geometry of `slots` slots (`paged_size`)."""
        return paged_size(slots, max_len=max_len, page_size=self.page_size, chunk=self.chunk)


@decode_state
class ModelCache:
    """The whole model's inference state.

    layers: the layer stack's states, `{"cycles": (per pattern position, stacked
      [cycles, ...]), "blocks": (per unrolled block)}`, each a dict of sublayer states
      ("attn", "shared" for a shared block's use, "cross" in an encoder-decoder).
    length: `[B]` tokens of each row in the cache (the next token's position).
    encoder_length: `[B]` real encoder tokens (encoder-decoder), else None.
    pages: the engine's `PageTables` when the pageable states hold page pools, else None.
    """

    layers: Any
    length: jax.Array
    encoder_length: Any = None
    pages: Any = None
    max_len: int = static_field(default=0)

    def replace(self, **kw):
        return dataclasses.replace(self, **kw)


def _states(layers) -> list:
    return jax.tree.leaves(layers, is_leaf=lambda c: isinstance(c, DecodeState))


def has_row_states(cache: ModelCache) -> bool:
    """Whether some layer keeps a state per row (a recurrent mixer's), not in pages."""
    return any(not c.pageable for c in _states(cache.layers))


def reads_runs(cache: ModelCache) -> bool:
    """Whether every layer keeps pages its attention reads once per run of a ragged
    step (`DecodeState.reads_runs`; a recurrent state, per row, does not)."""
    return all(c.reads_runs for c in _states(cache.layers))


def logical_axes(cache: ModelCache):
    """A tree like `cache` of logical axis names per array (for `logical_to_spec`):
    each state's `AXES` (K/V `(layers?, batch, kv_heads, None, head_dim)`, ...),
    counters `(batch,)`; a leading stacked axis is "layers". Page pools (a paged
    cache's pageable states) have no batch axis: their pages belong to no row."""
    def names(x, base):
        extra = x.ndim - len(base)
        return ("layers",) * extra + tuple(base) if extra >= 0 else tuple(base[: x.ndim])

    def one(c):
        if not isinstance(c, DecodeState):
            return names(c, ("batch",))
        pooled = cache.pages is not None and c.pageable

        def axes(name):
            base = c.AXES.get(name, ("batch",))
            return (None,) + tuple(base[1:]) if pooled else base

        return c.replace(**{f.name: names(getattr(c, f.name), axes(f.name))
                            for f in dataclasses.fields(c)
                            if not f.metadata.get("static") and getattr(c, f.name) is not None})

    tree = cache.replace(pages=None)
    out = jax.tree.map(one, tree, is_leaf=lambda c: isinstance(c, DecodeState))
    if cache.pages is None:
        return out
    return out.replace(pages=jax.tree.map(lambda t: ("batch", None), cache.pages))


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
