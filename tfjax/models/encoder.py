"""Encoder-only model, BERT style (Devlin et al. 2019).

    mlm_logits = model(tokens, token_type_ids=None, attention_mask=None)
    hidden     = model.encode(tokens, ...)           # [B, T, D]
    pooled     = model.pool(hidden)                  # tanh(dense(hidden[:, 0]))  ([CLS])
    class_logits = model.classify(tokens, ...)       # [B, num_classes]

Bidirectional self-attention (`attention_mask` `[B, T]`: 1 = real token, 0 =
padding); layer kinds as in a decoder, with bidirectional masks; BERT's MLM head.
See docs/models.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from tfjax.config import ModelConfig
from tfjax.models.attention_inputs import layer_biases, layer_masks, relative_bias
from tfjax.models.stack import Embedder, LayerStack, build_norm, default_positions, dtype_of
from tfjax.nn.norms import hooked_norm
from tfjax.ops import masks as masks_lib
from tfjax.parallel.sharding import with_logical_axes

__all__ = ["EncoderModel"]


def _dense(d_in, d_out, cfg, rngs, names, use_bias=True):
    return nnx.Linear(d_in, d_out, use_bias=use_bias, dtype=dtype_of(cfg.dtype),
                      param_dtype=dtype_of(cfg.param_dtype),
                      kernel_init=with_logical_axes(nnx.initializers.normal(cfg.init_std), names),
                      bias_init=with_logical_axes(nnx.initializers.zeros_init(), names[1:]),
                      rngs=rngs)


class EncoderModel(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.config = cfg
        self.embed = Embedder(cfg, rngs)
        self.rel_bias = relative_bias(cfg, rngs, bidirectional=True)
        self.layers = LayerStack(cfg, rngs, num_layers=cfg.num_layers)
        self.final_norm = (build_norm(cfg, rngs)
                           if cfg.final_norm and cfg.norm_placement != "post" else None)
        self.mlm_dense = _dense(cfg.d_model, cfg.d_model, cfg, rngs, ("embed", "mlp"),
                                use_bias=cfg.mlm_dense_bias)
        self.mlm_norm = build_norm(cfg, rngs)
        self.mlm_bias = (nnx.Param(jnp.zeros((cfg.vocab_size,), dtype_of(cfg.param_dtype)))
                         if cfg.mlm_output_bias else None)
        self.pooler = _dense(cfg.d_model, cfg.d_model, cfg, rngs, ("embed", "mlp"))
        self.classifier = (_dense(cfg.d_model, cfg.num_classes, cfg, rngs, ("embed", None))
                           if cfg.num_classes else None)

    def encode(self, tokens, token_type_ids=None, attention_mask=None, segment_ids=None,
               positions=None):
        """tokens `[B,T]` -> hidden `[B,T,D]` (after the final norm, if any)."""
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [B, T] integers, got shape {tokens.shape}")
        positions = default_positions(tokens) if positions is None else positions
        base = None
        if attention_mask is not None:  # real tokens see real tokens; padding sees padding
            base = masks_lib.segments(jnp.asarray(attention_mask, jnp.int32))
        if segment_ids is not None:
            base = masks_lib.combine(base, masks_lib.segments(segment_ids))
        masks = layer_masks(self.config, base, bidirectional=True)
        biases = layer_biases(self.config, self.rel_bias, positions, positions)
        x = self.embed(tokens, positions, token_type_ids)
        x = self.layers(x, masks=masks, biases=biases, positions=positions)
        return x if self.final_norm is None else hooked_norm("ln_final", self.final_norm, x)

    def mlm_logits(self, hidden):
        h = self.mlm_norm(jax.nn.gelu(self.mlm_dense(hidden), approximate=False))
        logits = self.embed.logits(h)
        return logits if self.mlm_bias is None else logits + self.mlm_bias[...].astype(jnp.float32)

    def pool(self, hidden):
        """BERT pooler: tanh(dense(hidden of the first ([CLS]) token)) -> `[B, D]`."""
        return jnp.tanh(self.pooler(hidden[:, 0]))

    def classify(self, tokens, token_type_ids=None, attention_mask=None, segment_ids=None,
                 positions=None):
        if self.classifier is None:
            raise ValueError("this encoder has no classification head: set model.num_classes > 0")
        hidden = self.encode(tokens, token_type_ids, attention_mask, segment_ids, positions)
        return self.classifier(self.pool(hidden)).astype(jnp.float32)

    def __call__(self, tokens, token_type_ids=None, attention_mask=None, segment_ids=None,
                 positions=None):
        """MLM logits `[B,T,V]`."""
        return self.mlm_logits(self.encode(tokens, token_type_ids, attention_mask, segment_ids,
                                           positions))
