"""Vision encoder, ViT / SigLIP (Dosovitskiy et al. 2021; Zhai et al. 2023).

    hidden = model(pixel_values)        # [B, C, H, W] -> [B, P (+1 with a class token), D]
    pooled = model.pool(hidden)         # [B, D]: the class token's feature or the MAP head's

Patches through `tfjax.nn.PatchEmbedding`, learned positions, an optional class
token, the model's layer kinds as a bidirectional `LayerStack` (pre-LN blocks), the
final norm, and the pooling of `model.vision.pooling`. `tower_config` is the stack's
config: the model's own for `arch="vision"`, else the ViT tower a vision-language
model carries in `model.vision`. Images are checked against the config before
anything is traced. See docs/multimodal.md.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

from tfjax.config import AttentionConfig, ModelConfig
from tfjax.models.attention_inputs import layer_masks
from tfjax.models.layer_kinds import attention
from tfjax.models.stack import LayerStack, build_norm, dtype_of
from tfjax.nn.ffn import FeedForward
from tfjax.nn.norms import hooked_norm
from tfjax.nn.patch_embedding import PatchEmbedding
from tfjax.nn.positions import LearnedPositions
from tfjax.parallel.sharding import shard, with_logical_axes

__all__ = ["AttentionPool", "VisionEncoder", "check_images", "tower_config"]


def tower_config(cfg: ModelConfig) -> ModelConfig:
    """The config of the image tower's stack: `cfg` itself for arch="vision"; else a
    ViT tower (pre-LN LayerNorms with biases, biased attention and ffn, global
    layers, no RoPE) of model.vision's width, depth, heads, ffn, activation and eps
    (each 0 / "": the model's)."""
    if cfg.arch == "vision":
        return cfg
    v = cfg.vision
    return dataclasses.replace(
        cfg, arch="vision", d_model=v.d_model or cfg.d_model,
        num_layers=v.num_layers or cfg.num_layers, num_heads=v.num_heads or cfg.num_heads,
        num_kv_heads=0, head_dim=0, v_head_dim=0, d_ff=v.d_ff or cfg.d_ff,
        activation=v.activation or cfg.activation, norm_eps=v.norm_eps or cfg.norm_eps,
        ffn_bias=True, norm="layernorm", norm_bias=True, norm_placement="pre", final_norm=True,
        embed_norm=False, block="sequential", position="learned", layer_pattern=("global",),
        ffn_pattern=("dense",), attention=AttentionConfig(
            impl=cfg.attention.impl, qkv_bias=True, out_bias=True),
        mtp_depth=0, prefix_lm=False, mup_base_width=0, mup_base_head_dim=0)


def check_images(pixel_values, cfg: ModelConfig, name: str = "pixel_values") -> None:
    """A one-line ValueError unless `pixel_values` is `[B, C, H, W]` of model.vision's
    channels and size (shapes are static: raised while tracing, before compiling)."""
    v = cfg.vision
    want = (v.channels, v.image_size, v.width)
    shape = tuple(getattr(pixel_values, "shape", ()))
    if len(shape) != 4 or shape[1:] != want:
        raise ValueError(f"{name}: expected images [batch, {v.channels} channels, "
                         f"{v.image_size}, {v.width}] (model.vision.channels, image_size, "
                         f"image_width), got shape {shape}; resize the images or set "
                         f"model.vision to match")


class AttentionPool(nnx.Module):
    """Multihead attention pooling (SigLIP's MAP head; Lee et al. 2019): a learned
    probe attends over the features, then `x + ffn(norm(x))` -> `[B, D]`."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        D, pdt = cfg.d_model, dtype_of(cfg.param_dtype)
        init = with_logical_axes(nnx.initializers.normal(cfg.init_std), (None, None, "embed"))
        self.probe = nnx.Param(init(rngs.params(), (1, 1, D), pdt))
        self.attn = attention(cfg, rngs, positions=False)
        self.norm = build_norm(cfg, rngs)
        self.ffn = FeedForward(D, cfg.d_ff, activation=cfg.activation, use_bias=True,
                               dtype=dtype_of(cfg.dtype), param_dtype=pdt,
                               init_std=cfg.init_std, rngs=rngs)

    def __call__(self, hidden):
        probe = jnp.broadcast_to(self.probe[...].astype(hidden.dtype),
                                 (hidden.shape[0], 1, hidden.shape[-1]))
        x = self.attn(probe, hidden)
        return (x + self.ffn(self.norm(x)))[:, 0]


class VisionEncoder(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.config = cfg
        self.tower = t = tower_config(cfg)
        v, dt, pdt = cfg.vision, dtype_of(t.dtype), dtype_of(t.param_dtype)
        self.pooling = v.pooling
        self.patches = PatchEmbedding(v.patch_size, v.channels, t.d_model, init_std=t.init_std,
                                      dtype=dt, param_dtype=pdt, rngs=rngs)
        if v.pooling == "cls":
            init = with_logical_axes(nnx.initializers.normal(t.init_std), (None, None, "embed"))
            self.cls = nnx.Param(init(rngs.params(), (1, 1, t.d_model), pdt))
        else:
            self.cls = None
        self.positions = LearnedPositions(v.num_patches + (v.pooling == "cls"), t.d_model,
                                          init_std=t.init_std, param_dtype=pdt, rngs=rngs)
        self.layers = LayerStack(t, rngs, num_layers=t.num_layers)
        self.final_norm = build_norm(t, rngs) if t.final_norm else None
        self.head = AttentionPool(t, rngs) if v.pooling == "map" else None

    def __call__(self, pixel_values):
        """`pixel_values` `[B, C, H, W]` -> the last hidden state `[B, P, D]` (after the
        final norm; P counts the class token first, if any)."""
        return self.encode(pixel_values)

    def encode(self, pixel_values):
        check_images(pixel_values, self.config)
        x = self.patches(pixel_values)
        if self.cls is not None:
            cls = jnp.broadcast_to(self.cls[...].astype(x.dtype), (x.shape[0], 1, x.shape[-1]))
            x = jnp.concatenate([cls, x], axis=1)
        x = x + self.positions.embedding[...].astype(x.dtype)[None]
        x = shard(x, ("batch", "length", "embed"))
        masks = layer_masks(self.tower, None, bidirectional=True)
        x = self.layers(x, masks=masks, biases=dict.fromkeys(masks))
        return x if self.final_norm is None else hooked_norm("ln_final", self.final_norm, x)

    def pool(self, hidden):
        """The last hidden state `[B, P, D]` -> `[B, D]`: the class token's feature
        (pooling="cls") or the MAP head's (pooling="map")."""
        if self.pooling == "cls":
            return hidden[:, 0]
        if self.head is None:
            raise ValueError("this vision encoder has no pooling: set model.vision.pooling to "
                             "'cls' or 'map'")
        return self.head(hidden)
