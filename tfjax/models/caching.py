"""The model side of inference caches: an empty cache shaped like the model's layer
stack, its size, and what a cached step gives the layers.

    cache = model.init_cache(batch, max_len)          # DecoderLM / EncoderDecoderModel
    cache_bytes(cfg, batch, length)                   # abstract: nothing is allocated
    logits, cache = model.step(tokens, cache, ...)

A `ModelCache`'s layers are the stack's layout (`tfjax.models.layout`) over again:
`{"cycles": (one state per cycle position, stacked over the scanned cycles),
"blocks": (one per unrolled block)}`, each a dict of sublayer states ("attn": the
layer kind's own state, from its record's `cache`; "shared": the K/V of the layer's
use of a shared block, for kinds with `shared_block`; "cross": the decoder's
cross-attention K/V in an encoder-decoder). The states themselves, and the slot
positions the masks are built from, are `tfjax.inference.kv_cache`'s.

`begin_step` is the shared start of the models' `step`: positions, each kind's
mask and bias (`attention_inputs`), the layer states set up for the call
(`kv_cache.for_step`) and each row's new length.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tfjax.config import ModelConfig
from tfjax.inference import kv_cache
from tfjax.inference.kv_cache import CrossKVCache, ModelCache, slot_positions
from tfjax.models.attention_inputs import cache_masks, layer_biases, layer_masks
from tfjax.models.layer_kinds import LAYER_KINDS, shared_block_cache
from tfjax.models.layout import StackLayout

__all__ = ["StepInputs", "begin_step", "cache_bytes", "empty_cache", "kv_bytes_per_token",
           "last_token"]


def _layer_state(cfg: ModelConfig, kind: str, batch: int, max_len: int, dtype,
                 encoder_len: int | None) -> dict:
    rec = LAYER_KINDS.get(kind, field="model.layer_pattern")
    if rec.cache is None:
        raise NotImplementedError(
            f"no inference cache for layer kind {kind!r} (model.layer_pattern); give its "
            f"LayerKind a cache in tfjax.models.layer_kinds")
    state = {"attn": rec.cache(cfg, batch, max_len, dtype)}
    if rec.shared_block:
        state["shared"] = shared_block_cache(cfg, batch, max_len, dtype)
    if encoder_len is not None:
        state["cross"] = CrossKVCache.empty(batch, encoder_len, cfg.kv_heads, cfg.head_size, dtype,
                                            v_head_dim=cfg.value_head_size)
    return state


def _layer_states(cfg: ModelConfig, layout: StackLayout, batch: int, max_len: int, dtype,
                  encoder_len: int | None) -> dict:
    def make(kind):
        return _layer_state(cfg, kind, batch, max_len, dtype, encoder_len)

    cycles = None
    if layout.num_cycles:
        cycles = tuple(jax.tree.map(lambda a: jnp.broadcast_to(a, (layout.num_cycles,) + a.shape),
                                    make(kind)) for kind in layout.pattern)
    blocks = tuple(make(layout.kind(layout.block_layer(j))) for j in range(layout.num_blocks))
    return {"cycles": cycles, "blocks": blocks}


def empty_cache(cfg: ModelConfig, layout: StackLayout, batch: int, max_len: int, *, dtype=None,
                encoder_len: int | None = None, encoder_length=None) -> ModelCache:
    """An empty cache for a stack of `layout`: `batch` rows of up to `max_len` tokens
    (prompt + generated). With cross-attention, `encoder_len` is the encoder output's
    length S and `encoder_length` `[B]` its real tokens per row (default S)."""
    dtype = jnp.dtype(dtype or cfg.dtype)
    layers = _layer_states(cfg, layout, batch, max_len, dtype, encoder_len)
    if encoder_len is not None:
        encoder_length = (jnp.full((batch,), encoder_len, jnp.int32) if encoder_length is None
                          else jnp.asarray(encoder_length, jnp.int32))
    return ModelCache(layers, jnp.zeros((batch,), jnp.int32),
                      None if encoder_len is None else encoder_length, max_len)


def cache_bytes(cfg: ModelConfig, batch: int, length: int, *, dtype=None,
                encoder_len: int = 0) -> int:
    """Bytes of the K/V (and other float state) of a cache of `batch` rows of `length`
    tokens for the model of `cfg` (abstract: nothing is allocated; counters excluded).
    Local layers count their W+1 slots, cross-attention (encoder_len > 0) its encoder K/V."""
    dtype = jnp.dtype(dtype or cfg.dtype)
    cross = cfg.arch == "encoder_decoder"
    layout = StackLayout.of(cfg)
    tree = jax.eval_shape(lambda: _layer_states(cfg, layout, batch, length, dtype,
                                                max(encoder_len, 1) if cross else None))
    total = 0
    for leaf in jax.tree.leaves(tree):
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            total += int(np.prod(leaf.shape)) * leaf.dtype.itemsize
    if cross and not encoder_len:  # counted with S=1 above; take it out
        total -= (cfg.num_layers * batch * cfg.kv_heads * (cfg.head_size + cfg.value_head_size)
                  * dtype.itemsize)
    return total


def kv_bytes_per_token(cfg: ModelConfig, *, dtype=None) -> int:
    """The bytes one more token adds to a short cache: one token's cache if every
    layer were global (for K/V layers the textbook layers x kv heads x (K's + V's
    head dims) x bytes; MLA layers their latent; recurrent states add nothing, and
    local layers cost less past W)."""
    return cache_bytes(cfg, 1, 2, dtype=dtype) - cache_bytes(cfg, 1, 1, dtype=dtype)


@dataclasses.dataclass
class StepInputs:
    positions: jax.Array  # [B, T]
    masks: dict  # layer kind -> mask
    biases: dict  # layer kind -> position bias (or None)
    layers: Any  # layer states set up for this call
    length: jax.Array  # [B] after this step
    last: jax.Array  # [B] index of each row's last real token among the T new ones
    cache: ModelCache
    chunk: bool = False

    def finish(self, layers) -> ModelCache:
        """The cache after the call, from the states the layers returned."""
        if self.chunk:
            layers = kv_cache.for_step(layers, self.length, chunk=False)
        return self.cache.replace(layers=layers, length=self.length)


def begin_step(cfg: ModelConfig, cache: ModelCache, tokens, lengths, *, rel_bias,
               base_mask, extend: bool = False) -> StepInputs:
    """Positions, masks, biases and updated counters for appending `tokens` `[B,T]`.

    T > 1: a prefill into an empty cache, `lengths` `[B]` real tokens per row
    (right-padded; default T), at positions 0..T-1, under the model's `base_mask`.
    T == 1: a decode step at position `cache.length` over the cache's slots.
    `extend=True`: a chunk of a chunked prefill (any T): row b appends `lengths[b]`
    (may be 0) real tokens at positions `cache.length[b]`.., causally over the
    cache's slots then the fresh keys (by position).
    """
    B, T = tokens.shape
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
                          kv_cache.for_step(cache.layers, length, chunk=True), length,
                          jnp.maximum(lengths - 1, 0), cache, chunk=True)
    if T > 1:
        lengths = (jnp.full((B,), T, jnp.int32) if lengths is None
                   else jnp.asarray(lengths, jnp.int32))
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        length = cache.length + lengths
        return StepInputs(positions, layer_masks(cfg, base_mask),
                          layer_biases(cfg, rel_bias, positions, positions),
                          kv_cache.for_step(cache.layers, length), length, lengths - 1, cache)
    positions = cache.length[:, None].astype(jnp.int32)  # [B, 1]
    length = cache.length + 1
    masks, biases = cache_masks(cfg, rel_bias, positions,
                                lambda size: slot_positions(length, size), cache.max_len)
    return StepInputs(positions, masks, biases, kv_cache.for_step(cache.layers, length), length,
                      jnp.zeros((B,), jnp.int32), cache)


def last_token(x: jax.Array, last: jax.Array) -> jax.Array:
    """x `[B, T, D]` -> `[B, 1, D]` at index `last[b]` of each row."""
    return jnp.take_along_axis(x, last.astype(jnp.int32)[:, None, None], axis=1)
