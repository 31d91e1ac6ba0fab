"""Decoder-only language model (GPT, Llama, Mistral, Gemma 2, NeoX, BLOOM, ...).

    logits = model(tokens, positions=None, segment_ids=None, prefix_lengths=None)

Causal self-attention over the tokens; `segment_ids` `[B,T]` keep packed
documents apart (with `positions` restarting per document); in prefix-LM mode
(`prefix_lm=True`, Raffel et al. 2020 / UniLM) the first `prefix_lengths[b]`
tokens attend bidirectionally. "local" layers add a sliding window, "cross" layers
attend to `context=` (image features, docs/multimodal.md).
`model.mtp_depth` > 0: DeepSeek-V3's multi-token prediction modules (`self.mtp`,
`tfjax.models.mtp`; trained beside the loss, the draft of `tfjax.inference.speculative`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from tfjax.config import ModelConfig
from tfjax.inference.cache import ModelCache
from tfjax.models import caching
from tfjax.models.attention_inputs import layer_biases, layer_masks, relative_bias
from tfjax.models.layer_kinds import LAYER_KINDS
from tfjax.models.mtp import MTPModule, block_config
from tfjax.models.stack import Embedder, LayerStack, build_norm, default_positions
from tfjax.nn.norms import hooked_norm
from tfjax.ops import masks as masks_lib

__all__ = ["DecoderLM"]


_CONTEXT = ("context", "context_bias", "context_rows")


def _context(kwargs: dict) -> dict:
    """The given "cross"-layer inputs (None ones dropped), or a TypeError naming the
    unknown keyword."""
    unknown = set(kwargs) - set(_CONTEXT)
    if unknown:
        raise TypeError(f"DecoderLM: unknown keyword(s) {sorted(unknown)}; the cross-attention "
                        f"layers take {', '.join(_CONTEXT)}")
    return {k: v for k, v in kwargs.items() if v is not None}


class DecoderLM(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.config = cfg
        self.embed = Embedder(cfg, rngs)
        self.rel_bias = relative_bias(cfg, rngs, bidirectional=False)
        self.layers = LayerStack(cfg, rngs, num_layers=cfg.num_layers)
        self.final_norm = build_norm(cfg, rngs) if cfg.final_norm else None
        self.mtp = (nnx.List([MTPModule(cfg, rngs) for _ in range(cfg.mtp_depth)])
                    if cfg.mtp_depth else None)

    def mask(self, tokens, segment_ids=None, prefix_lengths=None) -> masks_lib.Mask:
        """The base (global-layer) mask: causal or prefix-LM, within segments."""
        if self.config.prefix_lm:
            if prefix_lengths is None:
                raise ValueError("model.prefix_lm=True: pass prefix_lengths [B] (the number of "
                                 "bidirectional prefix tokens of each row)")
            base = masks_lib.prefix_lm(prefix_lengths)
        else:
            if prefix_lengths is not None:
                raise ValueError("prefix_lengths given but model.prefix_lm=False; set "
                                 "--config.model.prefix_lm=True")
            base = masks_lib.causal()
        if segment_ids is not None:
            base = base & masks_lib.segments(segment_ids)
        return base

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None,
                 segment_ids: jax.Array | None = None, prefix_lengths: jax.Array | None = None,
                 **context):
        """tokens `[B,T]` int -> logits `[B,T,V]` float32; `context`: the "cross"
        layers' `context`, `context_bias`, `context_rows` (module docstring)."""
        return self.head(self.features(tokens, positions, segment_ids, prefix_lengths,
                                       **context))

    def head(self, x: jax.Array) -> jax.Array:
        """The output head: final hidden states `[B,T,D]` (`features`) -> logits
        `[B,T,V]` float32, row by row (the chunked loss calls it on chunks of T)."""
        return self.embed.logits(x)

    def features(self, tokens: jax.Array, positions: jax.Array | None = None,
                 segment_ids: jax.Array | None = None, prefix_lengths: jax.Array | None = None,
                 **context):
        """tokens `[B,T]` int -> the final hidden states `[B,T,D]` (after the final norm):
        what the output head reads (probes, embeddings, μP's coordinate check)."""
        return self.head_input(self.hidden(tokens, positions, segment_ids, prefix_lengths,
                                           **context))

    def head_input(self, hidden: jax.Array) -> jax.Array:
        """The last layer's output -> what the head reads (after the final norm)."""
        if self.final_norm is None:
            return hidden
        return hooked_norm("ln_final", self.final_norm, hidden)

    def hidden(self, tokens: jax.Array, positions: jax.Array | None = None,
               segment_ids: jax.Array | None = None, prefix_lengths: jax.Array | None = None,
               **context):
        """tokens `[B,T]` int -> the last layer's output `[B,T,D]` (before the final
        norm; `head_input` applies it)."""
        context = _context(context)
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [B, T] integers, got shape {tokens.shape}")
        positions = default_positions(tokens) if positions is None else positions
        masks = layer_masks(self.config, self.mask(tokens, segment_ids, prefix_lengths))
        biases = layer_biases(self.config, self.rel_bias, positions, positions)
        x = self.embed(tokens, positions)
        return self.layers(x, masks=masks, biases=biases, positions=positions, **context)

    def mtp_attention_inputs(self, tokens, positions, segment_ids):
        """The masks and biases of the MTP modules' layers (causal within documents)."""
        cfg = block_config(self.config)
        masks = layer_masks(cfg, masks_lib.causal() & masks_lib.segments(segment_ids))
        return masks, layer_biases(cfg, self.rel_bias, positions, positions)

    def init_cache(self, batch: int, max_len: int, *, dtype=None,
                   context_len: int | None = None) -> ModelCache:
        """An empty inference cache: `batch` rows of up to `max_len` tokens (prompt +
        generated), one state per layer as the layer kinds say (`tfjax.models.caching`);
        "cross" layers hold the K/V of a context of `context_len` tokens."""
        return caching.empty_cache(self.config, self.layers, batch, max_len, dtype=dtype,
                                   encoder_len=context_len)

    def init_paged_cache(self, batch: int, max_len: int, *, page_size: int, chunk: int,
                         num_pages: dict, dtype=None) -> ModelCache:
        """The inference engine's empty cache: `batch` rows (slots), page pools of
        `num_pages[size]` pages per cache geometry (`page_geometries`), steps of at most
        `chunk` new tokens per row (`tfjax.models.caching.empty_paged_cache`)."""
        if self.config.prefix_lm:
            raise ValueError("the inference engine prefills prompts in chunks, which a "
                             "prefix-LM model (model.prefix_lm=True) cannot take; use "
                             "tfjax.inference.generate")
        if any(LAYER_KINDS.get(k).context for k in self.config.layer_pattern):
            raise ValueError("the inference engine has no pages for a context's K/V: a model "
                             "with 'cross' layers (model.layer_pattern) generates with "
                             "tfjax.inference.generate")
        return caching.empty_paged_cache(self.config, self.layers, batch, max_len,
                                         page_size=page_size, chunk=chunk,
                                         num_pages=num_pages, dtype=dtype)

    def page_geometries(self, max_len: int, *, page_size: int, chunk: int) -> dict:
        """{paged size: pages per row} of this model's paged cache geometries."""
        return caching.page_geometries(self.config, max_len=max_len, page_size=page_size,
                                       chunk=chunk)

    def step(self, tokens: jax.Array, cache: ModelCache, lengths: jax.Array | None = None, *,
             all_logits: bool = False, extend: bool = False, return_hidden: bool = False,
             logits_at=None, **context):
        """Inference: append `tokens` `[B,T]` to `cache` (`init_cache`).

        T > 1 is a prefill into an empty cache (row b: `lengths[b]` real tokens,
        right-padded; prefix-LM models take them as the bidirectional prefix); T == 1
        a decode step. `extend=True`: a chunk of a chunked prefill, appended causally
        to a non-empty cache (row b: `lengths[b]` >= 0 real tokens; not prefix-LM).
        Returns (logits `[B,1,V]` at each row's last real token, or `[B,T,V]` with
        `all_logits`, the new cache), and with `return_hidden` also the last layer's
        output `[B,T,D]` for every new token (before the final norm; speculative
        decoding's MTP draft reads it). `logits_at` `[R]`: the logits of these rows
        only (`[R, ., V]`; the engine's ragged step). `context`: the "cross" layers' inputs
        (`context` at the step that writes its K/V into the cache, then only
        `context_bias` and `context_rows` of the new tokens).
        """
        context = _context(context)
        prefix = None
        if extend and self.config.prefix_lm:
            raise ValueError("step(extend=True): a prefix-LM prompt is one bidirectional "
                             "prefix and cannot be prefilled in chunks; prefill it at once")
        if self.config.prefix_lm:
            prefix = jnp.full(tokens.shape[:1], tokens.shape[1]) if lengths is None else lengths
        base = None if extend else self.mask(tokens, prefix_lengths=prefix)
        s = caching.begin_step(self.config, cache, tokens, lengths, rel_bias=self.rel_bias,
                               base_mask=base, extend=extend)
        x = self.embed(tokens, s.positions)
        hidden, layers = self.layers(x, masks=s.masks, biases=s.biases, positions=s.positions,
                                     state=s.cache.layers, slots=s.slots, **context)
        x = hidden if all_logits else caching.last_token(hidden, s.last)
        if logits_at is not None:
            x = x[logits_at]
        out = self.head(self.head_input(x)), s.finish(layers)
        return out + (hidden,) if return_hidden else out
