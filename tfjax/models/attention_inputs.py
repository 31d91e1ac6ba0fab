"""What each layer kind's attention is given: its mask and its position bias.

Over a whole sequence, a layer kind's mask is its record's rule applied to the
model's base mask (causal, prefix-LM, segments, padding; `layer_masks`). In a
cached step, the keys are a KV cache's slots, so the mask is by position:
`masks.Positions(q_positions, kv_positions, window)` over the positions each slot
holds (`tfjax.inference.slots.slot_positions`), the kind's window from its
record's `slots`, or its record's own `cache_mask` (`cache_masks`). ALiBi and T5
biases (`position_bias`) are lazy objects the tiled attention implementations
evaluate per tile, from the same query and key positions; a kind whose record says
`positions=False` gets none.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from tfjax import ops as ops_lib
from tfjax.config import ModelConfig
from tfjax.models.layer_kinds import LAYER_KINDS
from tfjax.nn import positions as pos_lib
from tfjax.ops import masks as masks_lib

__all__ = ["cache_masks", "layer_biases", "layer_masks", "position_bias", "relative_bias"]


def _kinds(cfg: ModelConfig):
    return dict.fromkeys(cfg.layer_pattern)


def layer_masks(cfg: ModelConfig, base: masks_lib.Mask | None, *,
                bidirectional: bool = False) -> dict:
    """The mask of each layer kind of `cfg.layer_pattern` over a whole sequence
    (global: `base`; local: `base` and the window; recurrent kinds: None)."""
    out = {}
    for kind in _kinds(cfg):
        rule = LAYER_KINDS.get(kind, field="model.layer_pattern").mask
        out[kind] = None if rule is None else rule(cfg, base, bidirectional)
    return out


def relative_bias(cfg: ModelConfig, rngs: nnx.Rngs, *, bidirectional: bool):
    """The T5 bucketed relative bias table of a stack, or None for other encodings."""
    if cfg.position != "t5":
        return None
    return pos_lib.T5RelativeBias(cfg.num_heads, cfg.t5, bidirectional=bidirectional,
                                  init_std=cfg.init_std, param_dtype=jnp.dtype(cfg.param_dtype),
                                  rngs=rngs)


def position_bias(cfg: ModelConfig, rel_bias, q_positions, kv_positions):
    """The attention bias of ALiBi / T5 encodings, else None: ALiBi as a
    `tfjax.ops.Alibi` (slopes and the positions), T5's as a
    `tfjax.ops.RelativeBias` (its learned table and the positions), which the
    tiled attention implementations evaluate per tile (the same values as
    `nn.positions.alibi_bias` / `T5RelativeBias.__call__`, never materialised)."""
    if cfg.position == "alibi":
        slopes = pos_lib.alibi_slopes(cfg.num_heads)
        (B, T), S = q_positions.shape, kv_positions.shape[-1]
        return ops_lib.make_alibi(slopes, (q_positions, kv_positions), B, cfg.num_heads, T, S)
    if cfg.position == "t5":
        return rel_bias.spec(q_positions, kv_positions)
    return None


def layer_biases(cfg: ModelConfig, rel_bias, q_positions, kv_positions) -> dict:
    """The position bias of each layer kind (None for kinds without positions)."""
    bias = position_bias(cfg, rel_bias, q_positions, kv_positions)
    return {kind: bias if LAYER_KINDS.get(kind).positions else None for kind in _kinds(cfg)}


def cache_masks(cfg: ModelConfig, rel_bias, q_positions: jax.Array,
                kv_positions: Callable[[int], jax.Array], max_len: int) -> tuple[dict, dict]:
    """(masks, biases) of each layer kind for a cached step: queries at `q_positions`
    `[B, T]` over keys at `kv_positions(size)` `[B, S]` (the positions a KV cache of
    `size` slots holds, and for a chunk its fresh keys after them; negative: empty).
    Kinds without slots (recurrent state) get neither."""
    masks, biases = {}, {}
    for kind in _kinds(cfg):
        rec = LAYER_KINDS.get(kind)
        if rec.slots is None:
            masks[kind] = biases[kind] = None
            continue
        size, window = rec.slots(cfg, max_len)
        kv = kv_positions(size)
        masks[kind] = (masks_lib.Positions(q_positions, kv, window) if rec.cache_mask is None
                       else rec.cache_mask(cfg, q_positions, kv, window))
        biases[kind] = position_bias(cfg, rel_bias, q_positions, kv) if rec.positions else None
    return masks, biases
