"""Llama-3.2-Vision's image encoder (`MllamaVisionModel`) and its input checks.

    features = MllamaVisionModel(vcfg, rngs=)(pixel_values, aspect_ratio_ids, aspect_ratio_mask)
    # [B, M, tiles, C, H, W], [B, M], [B, M, tiles] -> [B, M, tiles, P, output_dim]

Patches, tanh-gated aspect-ratio and positional embeddings, a class token per tile; the
tiles of an image (each padded to a multiple of 8 tokens) through a local encoder, then
a gated global one; out: the global output and the local `intermediate_layers` outputs
concatenated. A pair is masked only where both tokens are padding (HF's mask). Built
from tfjax's blocks, attention, FFN and LayerNorm. See docs/multimodal.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from tfjax.config import AttentionConfig
from tfjax.config.mllama import MllamaVisionConfig
from tfjax.nn import hooks
from tfjax.nn.attention import MultiHeadAttention
from tfjax.nn.blocks import TransformerBlock
from tfjax.nn.ffn import FeedForward
from tfjax.nn.norms import make_norm

__all__ = ["MllamaVisionModel", "check_images"]

_PAD_TO = 8  # tokens per tile are padded to a multiple of 8 (HF's, Meta's)


def check_images(vcfg: MllamaVisionConfig, pixel_values, aspect_ratio_ids,
                 aspect_ratio_mask) -> None:
    """One-line ValueErrors naming the input and what was expected, before anything is
    traced: pixel_values `[B, M, tiles <= max_num_tiles, C, S, S]`, ids `[B, M]`, mask
    `[B, M, tiles]`."""
    s, c, n = vcfg.image_size, vcfg.num_channels, vcfg.max_num_tiles
    shape = tuple(pixel_values.shape)
    if len(shape) != 6:
        raise ValueError(f"pixel_values: expected [batch, images, tiles, {c}, {s}, {s}] "
                         f"(Hugging Face's layout), got shape {shape}")
    B, M, tiles, C, H, W = shape
    if C != c:
        raise ValueError(f"pixel_values: expected {c} channels (vision num_channels) at axis 3, "
                         f"got {C} (shape {shape})")
    if (H, W) != (s, s):
        raise ValueError(f"pixel_values: expected tiles of {s}x{s} pixels (vision image_size), "
                         f"got {H}x{W} (shape {shape})")
    if tiles != n:
        raise ValueError(f"pixel_values: expected {n} tiles per image (vision max_num_tiles; "
                         f"pad with zero tiles and aspect_ratio_mask 0), got {tiles}")
    if aspect_ratio_ids is None or tuple(aspect_ratio_ids.shape) != (B, M):
        got = None if aspect_ratio_ids is None else tuple(aspect_ratio_ids.shape)
        raise ValueError(f"aspect_ratio_ids: expected shape {(B, M)} (one id per image), got {got}")
    if aspect_ratio_mask is not None and tuple(aspect_ratio_mask.shape) != (B, M, tiles):
        raise ValueError(f"aspect_ratio_mask: expected shape {(B, M, tiles)} (1 per real tile), "
                         f"got {tuple(aspect_ratio_mask.shape)}")


def _param(rngs, shape, std):
    return nnx.Param(nnx.initializers.normal(std)(rngs.params(), shape, jnp.float32))


class _AspectRatioEmbedding(nnx.Module):
    """x `[BM, tiles, P, D]` + tanh(gate) embedding[id] per tile."""

    def __init__(self, vcfg: MllamaVisionConfig, rngs: nnx.Rngs):
        self.tiles, self.dim = vcfg.max_num_tiles, vcfg.d_model
        self.embedding = nnx.Embed(vcfg.max_aspect_ratio_id + 1, self.tiles * self.dim, rngs=rngs)
        self.gate = nnx.Param(jnp.zeros((), jnp.float32))

    def __call__(self, x, ids):
        e = self.embedding(ids).reshape(-1, self.tiles, 1, self.dim)
        return x + jnp.tanh(self.gate[...]) * e


class _GatedPositions(nnx.Module):
    """x `[BM, tiles, P, D]` + (1 - tanh g) pos `[P, D]` + tanh g tile_pos[id]."""

    def __init__(self, vcfg: MllamaVisionConfig, rngs: nnx.Rngs):
        self.tiles, self.patches, self.dim = vcfg.max_num_tiles, vcfg.patches, vcfg.d_model
        self.embedding = _param(rngs, (self.patches, self.dim), self.dim ** -0.5)
        self.tile_embedding = nnx.Embed(vcfg.max_aspect_ratio_id + 1,
                                        self.tiles * self.patches * self.dim, rngs=rngs)
        self.gate = nnx.Param(jnp.zeros((), jnp.float32))

    def __call__(self, x, ids):
        g = jnp.tanh(self.gate[...])
        tile = self.tile_embedding(ids).reshape(-1, self.tiles, self.patches, self.dim)
        return x + (1 - g) * self.embedding[...] + g * tile


def _encoder(vcfg: MllamaVisionConfig, n: int, gated: bool, rngs: nnx.Rngs) -> nnx.List:
    D = vcfg.d_model
    norm = lambda: make_norm("layernorm", D, eps=vcfg.norm_eps, rngs=rngs)  # noqa: E731

    def block():
        attn = MultiHeadAttention(D, vcfg.num_heads, attention=AttentionConfig(), rngs=rngs)
        ffn = FeedForward(D, vcfg.d_ff, activation=vcfg.activation, use_bias=True, rngs=rngs)
        return TransformerBlock(attn=attn, ffn=ffn, make_norm=norm, gated=gated, rngs=rngs)

    return nnx.List([block() for _ in range(n)])


class MllamaVisionModel(nnx.Module):
    """Images -> their features `[B, M, tiles, P, output_dim]` (module docstring)."""

    def __init__(self, vcfg: MllamaVisionConfig, *, rngs: nnx.Rngs):
        self.config = vcfg
        D, p, C = vcfg.d_model, vcfg.patch_size, vcfg.num_channels
        self.patch_embedding = _param(rngs, (C * p * p, D), (C * p * p) ** -0.5)  # [C p p, D]
        self.class_embedding = _param(rngs, (D,), D ** -0.5)
        self.gated_positional_embedding = _GatedPositions(vcfg, rngs)
        self.pre_tile_positional_embedding = _AspectRatioEmbedding(vcfg, rngs)
        self.post_tile_positional_embedding = _AspectRatioEmbedding(vcfg, rngs)
        self.layernorm_pre = make_norm("layernorm", D, eps=1e-5, rngs=rngs)
        self.layernorm_post = make_norm("layernorm", D, eps=1e-5, rngs=rngs)
        self.transformer = _encoder(vcfg, vcfg.num_layers, False, rngs)
        self.global_transformer = _encoder(vcfg, vcfg.num_global_layers, True, rngs)

    def patches(self, pixel_values):
        """`[N, C, H, W]` -> `[N, (H/p)(W/p), D]`: the stride-p patch projection, patches
        in row-major order, each flattened as (channel, row, column)."""
        N, C, H, W = pixel_values.shape
        p = self.config.patch_size
        x = pixel_values.reshape(N, C, H // p, p, W // p, p).transpose(0, 2, 4, 1, 3, 5)
        x = x.reshape(N, (H // p) * (W // p), C * p * p)
        return x.astype(jnp.float32) @ self.patch_embedding[...]

    def __call__(self, pixel_values, aspect_ratio_ids, aspect_ratio_mask=None):
        vcfg = self.config
        check_images(vcfg, pixel_values, aspect_ratio_ids, aspect_ratio_mask)
        B, M, tiles = pixel_values.shape[:3]
        D, P = vcfg.d_model, vcfg.patches
        if aspect_ratio_mask is None:
            aspect_ratio_mask = jnp.ones((B, M, tiles), jnp.int32)
        ids = aspect_ratio_ids.reshape(B * M)
        x = self.patches(pixel_values.reshape(B * M * tiles, *pixel_values.shape[3:]))
        x = self.pre_tile_positional_embedding(x.reshape(B * M, tiles, P - 1, D), ids)
        cls = jnp.broadcast_to(self.class_embedding[...], (B * M, tiles, 1, D))
        x = self.gated_positional_embedding(jnp.concatenate([cls, x], axis=2), ids)
        x = self.layernorm_pre(x)
        pad = (-P) % _PAD_TO
        x = jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0)))
        bias = self._bias(aspect_ratio_mask.reshape(B * M, tiles), P, pad)
        x = x.reshape(B * M, tiles * (P + pad), D)
        kept = {}
        for i, block in enumerate(self.transformer):
            with hooks.layer_scope("blocks", (i,)):  # hook names blocks.{i}.*
                x = block(x, bias=bias)
            if i in vcfg.intermediate_layers:
                kept[i] = x
        x = self.layernorm_post(x).reshape(B * M, tiles, P + pad, D)
        x = self.post_tile_positional_embedding(x, ids).reshape(B * M, tiles * (P + pad), D)
        for i, block in enumerate(self.global_transformer):
            with hooks.layer_scope("global_blocks", (i,)):
                x = block(x, bias=bias)
        out = x
        if vcfg.intermediate_layers:  # [BM, L, D, n] flattened D-major: HF's stack(dim=-1)
            kept = jnp.stack([kept[i] for i in vcfg.intermediate_layers], axis=-1)
            out = jnp.concatenate([x, kept.reshape(*x.shape[:2], -1)], axis=-1)
        out = out.reshape(B, M, tiles, P + pad, -1)[:, :, :, :P]
        return out

    @staticmethod
    def _bias(tile_mask, P: int, pad: int) -> jax.Array:
        """The encoders' additive bias `[BM, 1, L, L]`: a pair is masked only where both
        tokens are padding (a padding tile's, or a tile's pad tokens), as HF's
        `_prepare_aspect_ratio_attention_mask` (with at least one pad token a tile)."""
        real = jnp.broadcast_to(tile_mask[:, :, None].astype(bool), (*tile_mask.shape, P + pad))
        real = real & (jnp.arange(P + pad) < P)
        pad_tok = ~real.reshape(real.shape[0], -1)
        both = pad_tok[:, :, None] & pad_tok[:, None, :]
        return jnp.where(both, jnp.finfo(jnp.float32).min, 0.0)[:, None]
