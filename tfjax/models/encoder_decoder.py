"""Encoder-decoder (the original Transformer, Vaswani et al. 2017; T5, Raffel et al. 2020).

    logits = model(encoder_tokens, decoder_tokens, encoder_segment_ids=None,
                   decoder_segment_ids=None)                       # [B, T, V]
    encoded = model.encode(encoder_tokens, ...)                    # [B, S, D]
    logits  = model.decode(decoder_tokens, encoded, ...)

One token embedding is shared by the encoder, the decoder and (tied) the output; the
decoder's blocks add cross-attention; segment ids (0 = padding) pair decoder tokens
with encoder tokens. See docs/models.md.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from tfjax.config import ModelConfig
from tfjax.inference.cache import ModelCache
from tfjax.models import caching
from tfjax.models.attention_inputs import layer_biases, layer_masks, relative_bias
from tfjax.models.stack import Embedder, LayerStack, build_norm, default_positions
from tfjax.nn.hooks import scope
from tfjax.nn.norms import hooked_norm
from tfjax.ops import masks as masks_lib

__all__ = ["EncoderDecoderModel"]


class EncoderDecoderModel(nnx.Module):
    """`encoder_config`: the encoder's blocks' config where they differ from the
    decoder's (heads, feed-forward: `tfjax.models.speech`); default `cfg`."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs,
                 encoder_config: ModelConfig | None = None):
        self.config = cfg
        self.embed = Embedder(cfg, rngs)
        self.encoder_rel_bias = relative_bias(cfg, rngs, bidirectional=True)
        self.decoder_rel_bias = relative_bias(cfg, rngs, bidirectional=False)
        self.encoder = LayerStack(encoder_config or cfg, rngs, num_layers=cfg.encoder_layers)
        self.decoder = LayerStack(cfg, rngs, num_layers=cfg.num_layers, cross=True)
        final = cfg.final_norm and cfg.norm_placement != "post"
        self.encoder_norm = build_norm(cfg, rngs) if final else None
        self.decoder_norm = build_norm(cfg, rngs) if final else None

    def encode(self, encoder_tokens, encoder_segment_ids=None, encoder_positions=None):
        with scope("encoder"):  # hook names "encoder.*" (tfjax.nn.hooks)
            return self._encode(encoder_tokens, encoder_segment_ids, encoder_positions)

    def _encode(self, encoder_tokens, encoder_segment_ids, encoder_positions):
        if encoder_tokens.ndim != 2:
            raise ValueError(f"encoder_tokens must be [B, S] integers, got {encoder_tokens.shape}")
        positions = (default_positions(encoder_tokens) if encoder_positions is None
                     else encoder_positions)
        base = None if encoder_segment_ids is None else masks_lib.segments(encoder_segment_ids)
        masks = layer_masks(self.config, base, bidirectional=True)
        biases = layer_biases(self.config, self.encoder_rel_bias, positions, positions)
        x = self.embed(encoder_tokens, positions)
        x = self.encoder(x, masks=masks, biases=biases, positions=positions)
        return x if self.encoder_norm is None else hooked_norm("ln_final", self.encoder_norm, x)

    def decode(self, decoder_tokens, encoded, encoder_segment_ids=None, decoder_segment_ids=None,
               decoder_positions=None):
        with scope("decoder"):  # hook names "decoder.*" (tfjax.nn.hooks)
            return self._decode(decoder_tokens, encoded, encoder_segment_ids,
                                decoder_segment_ids, decoder_positions)

    def _decode(self, decoder_tokens, encoded, encoder_segment_ids, decoder_segment_ids,
                decoder_positions):
        if decoder_tokens.ndim != 2:
            raise ValueError(f"decoder_tokens must be [B, T] integers, got {decoder_tokens.shape}")
        positions = (default_positions(decoder_tokens) if decoder_positions is None
                     else decoder_positions)
        if encoder_segment_ids is not None and decoder_segment_ids is None:
            decoder_segment_ids = jnp.ones(decoder_tokens.shape, jnp.int32)
        base = masks_lib.causal()
        cross = None
        if decoder_segment_ids is not None:
            base = base & masks_lib.segments(decoder_segment_ids)
        if encoder_segment_ids is not None:
            cross = masks_lib.segments(decoder_segment_ids, encoder_segment_ids)
        masks = layer_masks(self.config, base)
        biases = layer_biases(self.config, self.decoder_rel_bias, positions, positions)
        x = self.embed(decoder_tokens, positions)
        x = self.decoder(x, masks=masks, biases=biases, positions=positions, context=encoded,
                         context_mask=cross)
        if self.decoder_norm is not None:
            x = hooked_norm("ln_final", self.decoder_norm, x)
        return self.embed.logits(x)

    def init_cache(self, batch: int, max_len: int, *, encoder_len: int, encoder_length=None,
                   dtype=None) -> ModelCache:
        """An empty inference cache for the decoder: `batch` rows of up to `max_len`
        decoder tokens; `encoder_len` is the encoder output's length S (the
        cross-attention K/V) and `encoder_length` `[B]` its real tokens per row."""
        if not encoder_len:
            raise ValueError("init_cache: an encoder-decoder needs encoder_len (the encoder "
                             "output's length) for its cross-attention cache")
        return caching.empty_cache(self.config, self.decoder, batch, max_len, dtype=dtype,
                                   encoder_len=encoder_len, encoder_length=encoder_length)

    def step(self, decoder_tokens, cache: ModelCache, encoded=None, lengths=None, *,
             all_logits=False):
        """Inference: append `decoder_tokens` `[B,T]` to `cache` (`init_cache`, made
        with the encoder's length and per-row real lengths). Pass `encoded` (the
        encoder output) at the first step: cross-attention K/V are computed from it
        once and reused after. Returns (logits `[B,1,V]` at each row's last real token,
        or `[B,T,V]` with `all_logits`, the new cache)."""
        s = caching.begin_step(self.config, cache, decoder_tokens, lengths,
                               rel_bias=self.decoder_rel_bias, base_mask=masks_lib.causal())
        x = self.embed(decoder_tokens, s.positions)
        x, layers = self.decoder(x, masks=s.masks, biases=s.biases, positions=s.positions,
                                 state=s.cache.layers, slots=s.slots, context=encoded,
                                 context_mask=masks_lib.padding(cache.encoder_length))
        if not all_logits:
            x = caching.last_token(x, s.last)
        if self.decoder_norm is not None:
            x = self.decoder_norm(x)
        return self.embed.logits(x), s.finish(layers)

    def __call__(self, encoder_tokens, decoder_tokens, encoder_segment_ids=None,
                 decoder_segment_ids=None, encoder_positions=None, decoder_positions=None):
        encoded = self.encode(encoder_tokens, encoder_segment_ids, encoder_positions)
        return self.decode(decoder_tokens, encoded, encoder_segment_ids, decoder_segment_ids,
                           decoder_positions)
