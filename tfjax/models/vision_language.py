"""A decoder with images in its prompt: PaliGemma's prefix (Beyer et al. 2024) or
Gemma 3's image blocks (`model.vision.image_attention`).

    logits = model(input_ids, pixel_values=..., token_type_ids=...)   # [B, T, V]

The tower (`VisionEncoder` of `model.vision`) and a projector (linear per patch, or
Gemma 3's pooled grid) make P features per image; they replace the embeddings of the
P image tokens of each row, in order. "prefix": the type-0 tokens (image and prompt)
are one bidirectional prefix (`model.prefix_lm`); "blocks": each run of type-1 tokens
(by default the image tokens) sees itself both ways. The rest is causal. Inputs are
checked before tracing. See docs/multimodal.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tfjax.config import ModelConfig
from tfjax.inference.cache import ModelCache
from tfjax.models import caching
from tfjax.models.attention_inputs import layer_biases, layer_masks
from tfjax.models.decoder import DecoderLM
from tfjax.models.stack import default_positions, dtype_of
from tfjax.models.vision import VisionEncoder, check_images, tower_config
from tfjax.nn import hooks
from tfjax.nn.norms import RMSNormPlusOne
from tfjax.ops import masks as masks_lib
from tfjax.parallel.sharding import with_logical_axes

__all__ = ["ImagePrefixLM", "PooledProjector", "check_image_tokens", "image_blocks",
           "prefix_lengths"]


def check_image_tokens(input_ids, pixel_values, cfg: ModelConfig) -> None:
    """One-line ValueErrors: images without image tokens, image tokens without images,
    or a row whose image-token count is not the tower's patch count (checked where
    `input_ids` has values, i.e. not under a trace)."""
    v = cfg.vision
    if pixel_values is not None:
        check_images(pixel_values, cfg)
    if isinstance(input_ids, jax.core.Tracer):
        return
    counts = np.sum(np.asarray(input_ids) == v.image_token_id, axis=-1)
    if pixel_values is None:
        if counts.any():
            raise ValueError(f"input_ids: holds image tokens (id {v.image_token_id}) but no "
                             f"pixel_values were given; pass the images or drop the tokens")
        return
    bad = np.flatnonzero(counts != v.image_tokens)
    if bad.size:
        per = "one per patch" if v.projector == "linear" else "model.vision.tokens_per_image"
        raise ValueError(f"input_ids: row {bad[0]} has {counts[bad[0]]} image tokens (id "
                         f"{v.image_token_id}), expected {v.image_tokens} ({per}) in "
                         f"every row with pixel_values; put the image tokens in the prompt")


def prefix_lengths(token_type_ids, tokens):
    """`[B]`: the tokens of type 0 (the bidirectional prefix), or 0 (all causal)."""
    if token_type_ids is None:
        return jnp.zeros(tokens.shape[:1], jnp.int32)
    return jnp.sum(jnp.asarray(token_type_ids) == 0, axis=-1).astype(jnp.int32)


def image_blocks(token_type_ids) -> jax.Array:
    """`[B, T]` ids for `masks.blocks`: each run of type-1 tokens (an image) its own id
    0, 1, ..., the other tokens -1 (transformers' `get_block_sequence_ids_for_mask`)."""
    image = jnp.asarray(token_type_ids) == 1
    start = image & ~jnp.pad(image, ((0, 0), (1, 0)))[:, :-1]
    return jnp.where(image, jnp.cumsum(start, axis=1) - 1, -1).astype(jnp.int32)


class PooledProjector(nnx.Module):
    """Gemma 3's projector: the tower's `[B, P, Dv]` patch grid (square, row-major)
    average-pooled in k x k windows to `tokens_per_image` tokens, an RMSNorm (1 + w) and
    a linear map to the decoder's width without a bias."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        t, v = tower_config(cfg), cfg.vision
        self.side = round(v.tokens_per_image ** 0.5)
        self.window = v.grid[0] // self.side
        self.norm = RMSNormPlusOne(t.d_model, eps=t.norm_eps, dtype=dtype_of(cfg.dtype),
                                   param_dtype=dtype_of(cfg.param_dtype), rngs=rngs)
        self.linear = nnx.Linear(
            t.d_model, cfg.d_model, use_bias=False, dtype=dtype_of(cfg.dtype),
            param_dtype=dtype_of(cfg.param_dtype),
            kernel_init=with_logical_axes(nnx.initializers.normal(cfg.init_std),
                                          ("mlp", "embed")), rngs=rngs)

    def __call__(self, x):
        B, _, D = x.shape
        s, k = self.side, self.window
        pooled = x.reshape(B, s, k, s, k, D).mean(axis=(2, 4)).reshape(B, s * s, D)
        return self.linear(self.norm(pooled))


class ImagePrefixLM(DecoderLM):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        prefix = cfg.vision.image_attention == "prefix"
        if cfg.prefix_lm != prefix:
            raise ValueError(
                "model.prefix_lm: a decoder whose image and prompt are one bidirectional "
                "prefix (model.vision.image_attention='prefix') needs True" if prefix else
                "model.prefix_lm: image blocks (model.vision.image_attention='blocks') are "
                "bidirectional within each image and causal elsewhere: set False")
        super().__init__(cfg, rngs=rngs)
        self.vision = VisionEncoder(cfg, rngs=rngs)
        D = tower_config(cfg).d_model
        if cfg.vision.projector == "pooled":
            self.projector = PooledProjector(cfg, rngs=rngs)
        else:
            self.projector = nnx.Linear(
                D, cfg.d_model, dtype=dtype_of(cfg.dtype),
                param_dtype=dtype_of(cfg.param_dtype),
                kernel_init=with_logical_axes(nnx.initializers.normal(cfg.init_std),
                                              ("mlp", "embed")),
                bias_init=with_logical_axes(nnx.initializers.zeros_init(), ("embed",)),
                rngs=rngs)

    def image_mask(self, tokens, token_type_ids=None, segment_ids=None, *, prefill=False):
        """The base mask of a whole row (or a prefill): "prefix": the type-0 tokens are
        the prefix (none without types; a prefill's default: the whole prompt);
        "blocks": causal, and each image's tokens see each other (types default to the
        image tokens)."""
        if self.config.vision.image_attention == "blocks":
            if token_type_ids is None:
                token_type_ids = tokens == self.config.vision.image_token_id
            ids = image_blocks(token_type_ids)
            return self.mask(tokens, segment_ids) | masks_lib.blocks(ids)
        if token_type_ids is None and prefill:
            return self.mask(tokens, segment_ids, jnp.full(tokens.shape[:1], tokens.shape[1]))
        return self.mask(tokens, segment_ids, prefix_lengths(token_type_ids, tokens))

    def check_inputs(self, input_ids, pixel_values=None) -> None:
        """The one-line checks of `check_image_tokens` (what `generate` runs first)."""
        check_image_tokens(input_ids, pixel_values, self.config)

    def image_features(self, pixel_values):
        """`[B, C, H, W]` -> the projected patch features `[B, P, D]`."""
        with hooks.scope("vision"):  # the tower's hook names "vision.*" (tfjax.nn.hooks)
            return self.projector(self.vision(pixel_values))

    def embed_inputs(self, tokens, positions, pixel_values=None):
        """The token embeddings with each row's image tokens replaced, in order, by its
        image's projected features."""
        image = tokens == self.config.vision.image_token_id
        x = self.embed(jnp.where(image, 0, tokens), positions)
        if pixel_values is None:
            return x
        feats = self.image_features(pixel_values).astype(x.dtype)
        k = jnp.clip(jnp.cumsum(image, axis=-1) - 1, 0, feats.shape[1] - 1)
        return jnp.where(image[..., None], jnp.take_along_axis(feats, k[..., None], axis=1), x)

    def __call__(self, input_ids, pixel_values=None, token_type_ids=None, positions=None,
                 segment_ids=None):
        """input_ids `[B, T]` -> logits `[B, T, V]` float32."""
        check_image_tokens(input_ids, pixel_values, self.config)
        tokens = jnp.asarray(input_ids)
        positions = default_positions(tokens) if positions is None else positions
        masks = layer_masks(self.config, self.image_mask(tokens, token_type_ids, segment_ids))
        biases = layer_biases(self.config, self.rel_bias, positions, positions)
        x = self.embed_inputs(tokens, positions, pixel_values)
        hidden = self.layers(x, masks=masks, biases=biases, positions=positions)
        return self.head(self.head_input(hidden))

    def step(self, tokens, cache: ModelCache, lengths=None, *, pixel_values=None,
             token_type_ids=None, all_logits: bool = False):
        """Inference, as `DecoderLM.step`: the prefill (T > 1) takes the images, computed
        once, and the prompt's type-0 tokens as the prefix (default: the whole
        prompt, as `generate` gives it); decode steps (T == 1) take neither."""
        if tokens.shape[1] > 1:
            check_image_tokens(tokens, pixel_values, self.config)
            if (lengths is not None and token_type_ids is None
                    and self.config.vision.image_attention == "prefix"):
                base = self.mask(tokens, prefix_lengths=lengths)
            else:
                base = self.image_mask(tokens, token_type_ids, prefill=True)
        elif pixel_values is not None:
            raise ValueError("pixel_values: a decode step (one token) takes no images; pass "
                             "them with the prompt's prefill")
        else:
            base = self.image_mask(tokens)
        s = caching.begin_step(self.config, cache, tokens, lengths, rel_bias=self.rel_bias,
                               base_mask=base)
        x = self.embed_inputs(tokens, s.positions, pixel_values)
        hidden, layers = self.layers(x, masks=s.masks, biases=s.biases, positions=s.positions,
                                     state=s.cache.layers, slots=s.slots)
        x = hidden if all_logits else caching.last_token(hidden, s.last)
        return self.head(self.head_input(x)), s.finish(layers)
