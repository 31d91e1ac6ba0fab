"""Llama-3.2-Vision (`MllamaModel`): the vision model, its projector and a decoder whose
"cross" layers attend to the projected image features, with Hugging Face's input names.

    logits = model(input_ids, pixel_values=, aspect_ratio_ids=, aspect_ratio_mask=,
                   cross_attention_mask=)                       # [B, T, V] float32
    tokens = model.generate(input_ids, max_new_tokens, pixel_values=, ...)   # greedy

A token whose mask row is all 0 attends to every image key and its cross layers' ffn
residual is dropped (HF's); without images the cross layers are skipped; logits are cut
to `text_vocab` (HF's embedding has 8 more rows). See docs/multimodal.md.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from tfjax.config import ModelConfig
from tfjax.config.mllama import MllamaVisionConfig
from tfjax.models.decoder import DecoderLM
from tfjax.models.layer_kinds import LAYER_KINDS
from tfjax.models.mllama_vision import MllamaVisionModel, check_images
from tfjax.nn import hooks

__all__ = ["MllamaModel", "cross_attention_inputs"]


def cross_attention_inputs(cross_attention_mask, patches: int):
    """cross_attention_mask `[B, T, M, tiles]` -> (the cross layers' additive bias
    `[B, 1, T, M tiles P]`, rows `[B, T]`: 1 where the token sees some tile)."""
    allowed = jnp.repeat(jnp.asarray(cross_attention_mask).astype(bool), patches, axis=-1)
    allowed = allowed.reshape(*allowed.shape[:2], -1)
    rows = allowed.any(-1)
    bias = jnp.where(allowed | ~rows[..., None], 0.0, jnp.finfo(jnp.float32).min)
    return bias[:, None], rows.astype(jnp.float32)


@nnx.jit
def _step(text: DecoderLM, tokens, cache, context: dict):
    """One jitted cached step of the decoder (the prefill and each new token)."""
    return text.step(tokens, cache, **context)


class MllamaModel(nnx.Module):
    """`tfjax.models.build` makes it for a decoder with images (`model.vision.image_size`)
    and "cross" layers; its vision tower is `MllamaVisionConfig.of(cfg)`."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        if not any(LAYER_KINDS.get(k, field="model.layer_pattern").context
                   for k in cfg.layer_pattern):
            raise ValueError("model.layer_pattern: MllamaModel has no 'cross' layer to attend "
                             "to the images; add one")
        if not cfg.vision.image_size:
            raise ValueError("model.vision.image_size: MllamaModel needs its tiles' size in "
                             "pixels (and the tower in model.vision)")
        vision = MllamaVisionConfig.of(cfg)
        self.config, self.vision_config = cfg, vision
        self.text_vocab = cfg.vocab_size - cfg.vision.image_token_rows
        self.vision = MllamaVisionModel(vision, rngs=rngs)
        self.projector = nnx.Linear(vision.output_dim, cfg.d_model, use_bias=True, rngs=rngs)
        self.text = DecoderLM(cfg, rngs=rngs)

    def image_features(self, pixel_values, aspect_ratio_ids, aspect_ratio_mask=None):
        """The cross layers' context `[B, M tiles P, D]`."""
        with hooks.scope("vision"):  # the tower's hook names "vision.*" (tfjax.nn.hooks)
            f = self.projector(self.vision(pixel_values, aspect_ratio_ids, aspect_ratio_mask))
        return f.reshape(f.shape[0], -1, f.shape[-1])

    def _check(self, input_ids, pixel_values, aspect_ratio_ids, aspect_ratio_mask,
               cross_attention_mask):
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids: expected [batch, length] token ids, got shape "
                             f"{tuple(input_ids.shape)}")
        if pixel_values is None:
            if cross_attention_mask is not None:
                raise ValueError("cross_attention_mask given without pixel_values: pass the "
                                 "images it masks, or neither")
            return
        check_images(self.vision_config, pixel_values, aspect_ratio_ids, aspect_ratio_mask)
        B, M, tiles = pixel_values.shape[:3]
        if input_ids.shape[0] != B:
            raise ValueError(f"pixel_values: {B} rows of images for {input_ids.shape[0]} rows "
                             "of input_ids")
        want = (B, input_ids.shape[1], M, tiles)
        if cross_attention_mask is not None and tuple(cross_attention_mask.shape) != want:
            raise ValueError(f"cross_attention_mask: expected shape {want} ([batch, tokens, "
                             f"images, tiles] of these pixel_values), got "
                             f"{tuple(cross_attention_mask.shape)}")

    def _context(self, input_ids, pixel_values, aspect_ratio_ids, aspect_ratio_mask,
                 cross_attention_mask) -> dict:
        self._check(input_ids, pixel_values, aspect_ratio_ids, aspect_ratio_mask,
                    cross_attention_mask)
        if pixel_values is None:
            return {}
        context = self.image_features(pixel_values, aspect_ratio_ids, aspect_ratio_mask)
        if cross_attention_mask is None:  # every token sees every tile
            B, T = input_ids.shape
            return dict(context=context, context_bias=jnp.zeros((B, 1, T, context.shape[1])))
        bias, rows = cross_attention_inputs(cross_attention_mask, self.vision_config.patches)
        return dict(context=context, context_bias=bias, context_rows=rows)

    def __call__(self, input_ids, pixel_values=None, aspect_ratio_ids=None,
                 aspect_ratio_mask=None, cross_attention_mask=None, positions=None):
        """Logits `[B, T, text_vocab]` float32 (module docstring)."""
        context = self._context(input_ids, pixel_values, aspect_ratio_ids, aspect_ratio_mask,
                                cross_attention_mask)
        return self.text(input_ids, positions, **context)[..., :self.text_vocab]

    def generate(self, input_ids, max_new_tokens: int, pixel_values=None, aspect_ratio_ids=None,
                 aspect_ratio_mask=None, cross_attention_mask=None):
        """Greedy continuation `[B, max_new_tokens]` of `input_ids` `[B, T]` (no padding):
        the prompt and images prefilled at once, then one token a step over the cache."""
        context = self._context(input_ids, pixel_values, aspect_ratio_ids, aspect_ratio_mask,
                                cross_attention_mask)
        B, T = input_ids.shape
        S = context["context"].shape[1] if context else 1  # no image: the cross layers skip
        cache = self.text.init_cache(B, T + max_new_tokens, context_len=S)
        logits, cache = _step(self.text, jnp.asarray(input_ids, jnp.int32), cache, context)
        last = {k: v[..., -1:] if k == "context_rows" else v[:, :, -1:]
                for k, v in context.items() if k != "context"}
        out = []
        for _ in range(max_new_tokens):
            token = jnp.argmax(logits[:, -1, :self.text_vocab], axis=-1)[:, None]
            out.append(token)
            if len(out) == max_new_tokens:
                break
            logits, cache = _step(self.text, token.astype(jnp.int32), cache, last)
        return jnp.concatenate(out, axis=1)
