"""A decoder with images as its prefix (PaliGemma; Beyer et al. 2024).

    logits = model(input_ids, pixel_values=..., token_type_ids=...)   # [B, T, V]

The vision tower (`tfjax.models.vision.VisionEncoder` of `model.vision`) and a linear
projector make P features per image; they replace the embeddings of the P image
tokens (`model.vision.image_token_id`) of each row, in order. Tokens whose
`token_type_ids` are 0 (the image and the prompt) form the bidirectional prefix
(`model.prefix_lm`), the rest is causal; without token types the whole row is causal.
Inputs are checked before tracing. See docs/multimodal.md.
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
from tfjax.parallel.sharding import with_logical_axes

__all__ = ["ImagePrefixLM", "check_image_tokens", "prefix_lengths"]


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
    bad = np.flatnonzero(counts != v.num_patches)
    if bad.size:
        raise ValueError(f"input_ids: row {bad[0]} has {counts[bad[0]]} image tokens (id "
                         f"{v.image_token_id}), expected {v.num_patches} (one per patch) in "
                         f"every row with pixel_values; put the image tokens in the prompt")


def prefix_lengths(token_type_ids, tokens):
    """`[B]`: the tokens of type 0 (the bidirectional prefix), or 0 (all causal)."""
    if token_type_ids is None:
        return jnp.zeros(tokens.shape[:1], jnp.int32)
    return jnp.sum(jnp.asarray(token_type_ids) == 0, axis=-1).astype(jnp.int32)


class ImagePrefixLM(DecoderLM):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        if not cfg.prefix_lm:
            raise ValueError("model.prefix_lm: a decoder with images (model.vision.image_size "
                             "> 0) attends over its image and prompt as a prefix: set True")
        super().__init__(cfg, rngs=rngs)
        self.vision = VisionEncoder(cfg, rngs=rngs)
        D = tower_config(cfg).d_model
        self.projector = nnx.Linear(
            D, cfg.d_model, dtype=dtype_of(cfg.dtype), param_dtype=dtype_of(cfg.param_dtype),
            kernel_init=with_logical_axes(nnx.initializers.normal(cfg.init_std),
                                          ("mlp", "embed")),
            bias_init=with_logical_axes(nnx.initializers.zeros_init(), ("embed",)), rngs=rngs)

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
        prefix = prefix_lengths(token_type_ids, tokens)
        masks = layer_masks(self.config, self.mask(tokens, segment_ids, prefix))
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
            prefix = (lengths if lengths is not None else jnp.full(tokens.shape[:1],
                                                                   tokens.shape[1]))
            if token_type_ids is not None:
                prefix = prefix_lengths(token_type_ids, tokens)
            base = self.mask(tokens, prefix_lengths=prefix)
        elif pixel_values is not None:
            raise ValueError("pixel_values: a decode step (one token) takes no images; pass "
                             "them with the prompt's prefill")
        else:
            base = self.mask(tokens, prefix_lengths=jnp.zeros(tokens.shape[:1], jnp.int32))
        s = caching.begin_step(self.config, cache, tokens, lengths, rel_bias=self.rel_bias,
                               base_mask=base)
        x = self.embed_inputs(tokens, s.positions, pixel_values)
        hidden, layers = self.layers(x, masks=s.masks, biases=s.biases, positions=s.positions,
                                     state=s.cache.layers, slots=s.slots)
        x = hidden if all_logits else caching.last_token(hidden, s.last)
        return self.head(self.head_input(x)), s.finish(layers)
