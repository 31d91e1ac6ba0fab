"""Multi-token prediction (DeepSeek-V3, Liu et al. 2024, section 2.2): `model.mtp_depth`
sequential modules after a decoder LM, sharing its embedding and output head.

Module k at position i reads the previous depth's hidden state and the embedding of
token i + k, and predicts token i + k + 1 (`MTPModule`: one layer of the decoder's
last layer kind, `block_config`, with its own cache at inference, `step`).
`mtp_predictions` gives each depth's features, targets and mask for the training loss
(`tfjax.train.objectives`); the modules are also the draft of
`tfjax.inference.speculative`. See docs/models.md.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from tfjax.config import ModelConfig
from tfjax.models import caching
from tfjax.models.stack import LayerStack, build_norm, dtype_of
from tfjax.parallel.sharding import with_logical_axes

__all__ = ["MTPModule", "block_config", "mtp_predictions", "shift_left"]


def block_config(cfg: ModelConfig) -> ModelConfig:
    """The config of an MTP module's one-layer stack: the decoder's last layer kind
    and feed-forward kind, unrolled."""
    last = cfg.num_layers - 1
    return dataclasses.replace(cfg, num_layers=1, layer_pattern=(cfg.layer_kind(last),),
                               ffn_pattern=(cfg.ffn_kind(last),), scan_layers=False)


class MTPModule(nnx.Module):
    """One depth of multi-token prediction: norms of the previous hidden state and of
    the next token's embedding, their concatenation projected to `d_model`
    (`proj`, `[2D, D]`), one layer, and the norm before the shared head."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.config = block_config(cfg)
        D = cfg.d_model
        self.hidden_norm = build_norm(cfg, rngs)
        self.embed_norm = build_norm(cfg, rngs)
        self.proj = nnx.Linear(2 * D, D, use_bias=False, dtype=dtype_of(cfg.dtype),
                               param_dtype=dtype_of(cfg.param_dtype),
                               kernel_init=with_logical_axes(
                                   nnx.initializers.normal(cfg.init_std), ("mlp", "embed")),
                               rngs=rngs)
        self.layers = LayerStack(self.config, rngs, num_layers=1)
        self.norm = build_norm(cfg, rngs)

    def _input(self, h, e):
        return self.proj(jnp.concatenate([self.hidden_norm(h), self.embed_norm(e)], axis=-1))

    def __call__(self, h, e, *, masks: dict, biases: dict, positions):
        """h `[B,T,D]` (depth k-1), e `[B,T,D]` (embeddings of tokens i+k) -> h^k `[B,T,D]`."""
        return self.layers(self._input(h, e), masks=masks, biases=biases, positions=positions)

    def init_cache(self, batch: int, max_len: int, *, dtype=None):
        return caching.empty_cache(self.config, self.layers, batch, max_len, dtype=dtype)

    def step(self, h, e, cache, lengths, *, rel_bias=None):
        """Inference: append a chunk of `lengths[b]` (>= 0) real positions of row b to
        this module's cache (at positions `cache.length[b]`..), causally -> (h^k `[B,T,D]`,
        the new cache). The caller rolls the cache back (`tfjax.inference.cache.rewind`)
        to the positions whose inputs were all final."""
        s = caching.begin_step(self.config, cache, h[..., 0], lengths, rel_bias=rel_bias,
                               base_mask=None, extend=True)
        x, layers = self.layers(self._input(h, e), masks=s.masks, biases=s.biases,
                                positions=s.positions, state=s.cache.layers, slots=s.slots)
        return x, s.finish(layers)


def shift_left(x: jax.Array, k: int, fill=0) -> jax.Array:
    """`[B, T, ...]` -> row b's positions k.. moved to 0.., the last k filled."""
    if k == 0:
        return x
    pad = jnp.full((x.shape[0], k) + x.shape[2:], fill, x.dtype)
    return jnp.concatenate([x[:, k:], pad], axis=1)


def mtp_predictions(model, hidden: jax.Array, batch: dict) -> list[dict]:
    """Each depth's predictions for a causal-LM batch (`inputs`, `targets`, `mask`,
    and optionally `positions`, `segment_ids`, `target_bytes`) given the decoder's
    `hidden` `[B,T,D]` (`model.hidden`, before the final norm): per depth k, `features`
    `[B,T,D]` (h^k, what the shared head reads: `model.head(features)` at position i
    predicts token i + k + 1, and depth k + 1 reads), `targets`, `mask` (1 where the
    position counts at depth k: the inputs i..i+k in one document and target i + k
    counted) and `target_bytes`
    (None without them). The training loss (`tfjax.train.objectives`) sums their
    cross-entropies."""
    inputs, targets, mask = batch["inputs"], batch["targets"], batch["mask"]
    positions, seg = batch.get("positions"), batch.get("segment_ids")
    positions = jnp.broadcast_to(jnp.arange(inputs.shape[1]), inputs.shape) \
        if positions is None else positions
    seg = jnp.zeros_like(inputs) if seg is None else seg
    masks, biases = model.mtp_attention_inputs(inputs, positions, seg)
    target_bytes = batch.get("target_bytes")
    valid = jnp.ones(inputs.shape, bool)
    h, out = model.head_input(hidden), []
    for k, module in enumerate(model.mtp, start=1):
        e = model.embed(shift_left(inputs, k), positions + k)
        h = module.norm(module(h, e, masks=masks, biases=biases, positions=positions))
        valid = valid & (shift_left(seg, k, fill=-1) == seg) & (shift_left(mask, k) > 0)
        out.append(dict(features=h,
                        targets=shift_left(targets, k), mask=valid.astype(jnp.float32),
                        target_bytes=None if target_bytes is None
                        else shift_left(target_bytes, k)))
    return out
