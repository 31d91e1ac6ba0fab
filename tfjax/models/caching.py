"""The model side of inference caches: an empty cache shaped like the model's layer
stack, and what a cached step gives the layers.

    cache = model.init_cache(batch, max_len)          # DecoderLM / EncoderDecoderModel
    logits, cache = model.step(tokens, cache, ...)

`empty_cache` lays the mixers' `init_state`s out as the stack's layout ("attn",
"shared", "cross" per layer), `empty_paged_cache` the engine's (page pools for the
pageable states); `begin_step` computes a step's positions, masks, biases, `Slots`
and new lengths (`StepInputs`). See docs/models.md.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from tfjax.config import ModelConfig
from tfjax.inference.cache import ModelCache, PageTables, paged_size
from tfjax.inference.slots import slot_positions, step_slots
from tfjax.ops import paged as paged_lib
from tfjax.models.attention_inputs import cache_masks, layer_biases, layer_masks
from tfjax.models.layer_kinds import LAYER_KINDS
from tfjax.nn.attention import MultiHeadAttention
from tfjax.nn.latent_attention import MultiHeadLatentAttention
from tfjax.nn.state import Slots

__all__ = ["StepInputs", "begin_step", "empty_cache", "empty_paged_cache", "last_token",
           "layer_states", "page_geometries"]


def _state_size(cfg: ModelConfig, kind: str, max_len: int) -> tuple[int, int]:
    """(size, window) of a layer kind's state: its `slots`, or max_len for a recurrent
    state (which ignores it)."""
    rec = LAYER_KINDS.get(kind, field="model.layer_pattern")
    return rec.slots(cfg, max_len) if rec.slots is not None else (max_len, 0)


def _init_state(mixer, batch: int, size: int, dtype, window: int, pages, kv_quant="none"):
    """`mixer`'s empty state; with `pages` (a function of the geometry's size -> the
    number of pages, and the page size) a pageable state's page pool. `kv_quant`: an
    8-bit K/V cache for attention layers (recurrent states stay float; a latent (MLA)
    cache has no heads to scale: refused)."""
    kw = dict(window=window)
    if kv_quant != "none":
        if isinstance(mixer, MultiHeadAttention):
            kw["quant"] = kv_quant
        elif isinstance(mixer, MultiHeadLatentAttention):
            raise ValueError(f"model.kv_quant={kv_quant!r}: an MLA layer's cache is a latent "
                             f"without kv heads to scale; kv_quant takes multi-head K/V "
                             f"caches (global, local, chunked, nope layers): use "
                             f"model.kv_quant='none' for MLA models")
    if pages is not None:
        count, page_size = pages
        kind = jax.eval_shape(lambda: mixer.init_state(1, 1, dtype, **kw))
        if type(kind).pageable:
            return mixer.init_state(count(size), page_size, dtype, **kw)
    return mixer.init_state(batch, size, dtype, **kw)


def _layer_state(cfg: ModelConfig, block, kind: str, shared_attn, batch: int, max_len: int,
                 dtype, encoder_len: int | None, pages=None) -> dict:
    if not hasattr(block.attn, "init_state"):
        raise NotImplementedError(
            f"no inference cache for layer kind {kind!r} (model.layer_pattern): its mixer "
            f"{type(block.attn).__name__} has no init_state")
    if LAYER_KINDS.get(kind).context:  # the context's K/V, written at the step that passes it
        if encoder_len is None:
            raise ValueError(f"layer kind {kind!r} (model.layer_pattern) caches its context's "
                             "K/V: pass its length, DecoderLM.init_cache(..., context_len=)")
        return {"attn": block.attn.init_cross_state(batch, encoder_len, dtype)}
    size, window = _state_size(cfg, kind, max_len)
    state = {"attn": _init_state(block.attn, batch, size, dtype, window, pages, cfg.kv_quant)}
    if LAYER_KINDS.get(kind).shared_block:  # a use's own K/V (the uses' inputs differ)
        state["shared"] = _init_state(shared_attn, batch, max_len, dtype, 0, pages,
                                      cfg.kv_quant)
    if encoder_len is not None and block.cross_attn is not None:
        state["cross"] = block.cross_attn.init_cross_state(batch, encoder_len, dtype)
    return state


def layer_states(cfg: ModelConfig, stack, batch: int, max_len: int, dtype,
                 encoder_len: int | None = None, pages=None) -> dict:
    """The empty states of `stack`'s layers (a `LayerStack`, abstract or not: only its
    mixers' shapes are read), laid out as the stack is; `pages`: see `_init_state`."""
    layout = stack.layout
    shared_attn = None if stack.shared is None else stack.shared.attn

    def make(block, kind):
        return _layer_state(cfg, block, kind, shared_attn, batch, max_len, dtype, encoder_len,
                            pages)

    cycles = None
    if layout.num_cycles:
        cycles = tuple(jax.tree.map(lambda a: jnp.broadcast_to(a, (layout.num_cycles,) + a.shape),
                                    make(block, kind))
                       for kind, block in zip(layout.pattern, stack.cycles.layers))
    blocks = tuple(make(block, layout.kind(layout.block_layer(j)))
                   for j, block in enumerate(stack.blocks))
    return {"cycles": cycles, "blocks": blocks}


def empty_cache(cfg: ModelConfig, stack, batch: int, max_len: int, *, dtype=None,
                encoder_len: int | None = None, encoder_length=None) -> ModelCache:
    """An empty cache for `stack`: `batch` rows of up to `max_len` tokens (prompt +
    generated). With cross-attention, `encoder_len` is the encoder output's length S
    and `encoder_length` `[B]` its real tokens per row (default S)."""
    dtype = jnp.dtype(dtype or cfg.dtype)
    layers = layer_states(cfg, stack, batch, max_len, dtype, encoder_len)
    if encoder_len is not None:
        encoder_length = (jnp.full((batch,), encoder_len, jnp.int32) if encoder_length is None
                          else jnp.asarray(encoder_length, jnp.int32))
    return ModelCache(layers, jnp.zeros((batch,), jnp.int32),
                      None if encoder_len is None else encoder_length, max_len=max_len)


def page_geometries(cfg: ModelConfig, *, max_len: int, page_size: int, chunk: int) -> dict:
    """{paged size: pages per row} of the cache geometries of `cfg`'s layer kinds
    (`tfjax.inference.cache.paged_size`), shared blocks' K/V being global."""
    sizes = set()
    for kind in dict.fromkeys(cfg.layer_pattern):
        rec = LAYER_KINDS.get(kind, field="model.layer_pattern")
        if rec.slots is not None:
            sizes.add(rec.slots(cfg, max_len)[0])
        if rec.shared_block:
            sizes.add(max_len)
    paged = {paged_size(s, max_len=max_len, page_size=page_size, chunk=chunk) for s in sizes}
    return {s: s // page_size for s in sorted(paged)}


def empty_paged_cache(cfg: ModelConfig, stack, batch: int, max_len: int, *, page_size: int,
                      chunk: int, num_pages: dict, dtype=None) -> ModelCache:
    """The engine's empty cache: `batch` rows (slots) of up to `max_len` tokens, each
    pageable state a pool of `num_pages[size]` pages of `page_size` for its geometry's
    paged size (`page_geometries`), recurrent states one per row; page tables of
    zeros (the engine fills them before each step, which gives each row at most
    `chunk` new tokens)."""
    dtype = jnp.dtype(dtype or cfg.dtype)
    tables = PageTables({}, page_size, chunk)
    count = lambda size: num_pages[tables.size(size, max_len)]  # noqa: E731
    layers = layer_states(cfg, stack, batch, max_len, dtype, pages=(count, page_size))
    geometries = page_geometries(cfg, max_len=max_len, page_size=page_size, chunk=chunk)
    tables = tables.replace(tables={s: jnp.zeros((batch, n), jnp.int32)
                                    for s, n in geometries.items()})
    return ModelCache(layers, jnp.zeros((batch,), jnp.int32), pages=tables, max_len=max_len)


@dataclasses.dataclass
class StepInputs:
    positions: jax.Array  # [B, T]
    masks: dict  # layer kind -> mask
    biases: dict  # layer kind -> position bias (or None)
    slots: dict  # layer kind -> its `tfjax.nn.state.Slots` for this step
    length: jax.Array  # [B] after this step
    last: jax.Array  # [B] index of each row's last real token among the T new ones
    cache: ModelCache

    def finish(self, layers) -> ModelCache:
        """The cache after the call, from the states the layers returned."""
        return self.cache.replace(layers=layers, length=self.length)


def _slots(cfg: ModelConfig, start, length, T: int, max_len: int, mode: str) -> dict:
    """Each layer kind's `Slots`, computed once per cache geometry."""
    out, by_size = {}, {}
    for kind in dict.fromkeys(cfg.layer_pattern):
        rec = LAYER_KINDS.get(kind, field="model.layer_pattern")
        size = rec.slots(cfg, max_len)[0] if rec.slots is not None else None
        if size not in by_size:
            by_size[size] = step_slots(start, length, T, size, mode)
        out[kind] = by_size[size]
    return out


def begin_step(cfg: ModelConfig, cache: ModelCache, tokens, lengths, *, rel_bias,
               base_mask, extend: bool = False) -> StepInputs:
    """Positions, masks, biases, slots and updated counters for appending `tokens` `[B,T]`.

    T > 1: a prefill into an empty cache, `lengths` `[B]` real tokens per row
    (right-padded; default T), at positions 0..T-1, under the model's `base_mask`.
    T == 1: a decode step at position `cache.length` over the cache's slots.
    `extend=True`: a chunk of a chunked prefill (any T): row b appends `lengths[b]`
    (may be 0) real tokens at positions `cache.length[b]`.., causally over the
    cache's slots then the fresh keys (by position).
    """
    B, T = tokens.shape
    if cache.pages is not None:
        return _paged_step(cfg, cache, tokens, lengths, rel_bias)
    if extend:
        lengths = (jnp.full((B,), T, jnp.int32) if lengths is None
                   else jnp.asarray(lengths, jnp.int32))
        old = cache.length.astype(jnp.int32)
        positions = old[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]  # [B, T]
        fresh = jnp.where(jnp.arange(T)[None, :] < lengths[:, None], positions, -1)
        length = old + lengths
        masks, biases = cache_masks(
            cfg, rel_bias, positions,
            lambda size: jnp.concatenate([slot_positions(old, size), fresh], axis=1),
            cache.max_len)
        return StepInputs(positions, masks, biases,
                          _slots(cfg, positions[:, 0], length, T, cache.max_len, "chunk"),
                          length, jnp.maximum(lengths - 1, 0), cache)
    if T > 1:
        lengths = (jnp.full((B,), T, jnp.int32) if lengths is None
                   else jnp.asarray(lengths, jnp.int32))
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        length = cache.length + lengths
        return StepInputs(positions, layer_masks(cfg, base_mask),
                          layer_biases(cfg, rel_bias, positions, positions),
                          _slots(cfg, positions[:, 0], length, T, cache.max_len, "prefill"),
                          length, lengths - 1, cache)
    positions = cache.length[:, None].astype(jnp.int32)  # [B, 1]
    length = cache.length + 1
    masks, biases = cache_masks(cfg, rel_bias, positions,
                                lambda size: slot_positions(length, size), cache.max_len)
    return StepInputs(positions, masks, biases,
                      _slots(cfg, positions[:, 0], length, 1, cache.max_len, "decode"), length,
                      jnp.zeros((B,), jnp.int32), cache)


def _paged_step(cfg: ModelConfig, cache: ModelCache, tokens, lengths, rel_bias) -> StepInputs:
    """A step of a paged cache (the engine's): row b appends `lengths[b]` (0..T) tokens
    at positions `cache.length[b]`..; each geometry's new K/V are written into its
    pages first, then the queries attend over the row's pages by position."""
    B, T = tokens.shape
    pages, max_len = cache.pages, cache.max_len
    if T > pages.chunk:
        raise ValueError(f"a paged step takes at most chunk={pages.chunk} tokens per row, "
                         f"got {T}")
    lengths = (jnp.full((B,), T, jnp.int32) if lengths is None
               else jnp.asarray(lengths, jnp.int32))
    old = cache.length.astype(jnp.int32)
    positions = old[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]  # [B, T]
    length = old + lengths
    valid = jnp.arange(T)[None, :] < lengths[:, None]
    masks, biases = cache_masks(
        cfg, rel_bias, positions,
        lambda size: slot_positions(length, _attended(pages, size, max_len)), max_len)
    slots, by_size = {}, {}
    for kind in dict.fromkeys(cfg.layer_pattern):
        rec = LAYER_KINDS.get(kind, field="model.layer_pattern")
        size = None if rec.slots is None else pages.size(rec.slots(cfg, max_len)[0], max_len)
        if size not in by_size:
            index = table = None
            if size is not None:
                table = pages.tables[size]
                index = paged_lib.flat_index(table, positions % size, pages.page_size, valid)
            by_size[size] = Slots(lengths, index=index, table=table, mode="paged",
                                  runs=pages.runs)
        slots[kind] = by_size[size]
    return StepInputs(positions, masks, biases, slots, length, jnp.maximum(lengths - 1, 0),
                      cache)


def _attended(pages: PageTables, size: int, max_len: int) -> int:
    """The slots a paged step's rows attend in a geometry of `size` slots: its page
    table's, which for a global cache may be cut to the pages the step's rows hold
    (slot s holds position s, so the first slots are the first positions); a ring's
    table is whole (its slots wrap at the paged size)."""
    paged = pages.size(size, max_len)
    attended = pages.tables[paged].shape[1] * pages.page_size
    if attended < paged and size < max_len:
        raise ValueError(f"a paged step: the page table of a ring of {paged} slots (a window) "
                         f"was cut to {attended} slots; only a global cache's can be")
    return attended


def last_token(x: jax.Array, last: jax.Array) -> jax.Array:
    """x `[B, T, D]` -> `[B, 1, D]` at index `last[b]` of each row."""
    return jnp.take_along_axis(x, last.astype(jnp.int32)[:, None, None], axis=1)
