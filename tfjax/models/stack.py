"""What every architecture shares: the config -> layer mapping, the layer stack
(scanned over repeats of the per-layer pattern), the embedder and the output head.

Scan over layers: layers are grouped into cycles of `layer_pattern` (e.g.
local, global); parameters of each position in the cycle are stacked over a
leading "layers" axis with `nnx.vmap` and applied with `nnx.scan`, so compile
time does not grow with depth. Layers left over when the depth is not a multiple
of the pattern run unrolled after the scan. `scan_layers=False` unrolls all.
The cycle is lcm(len(layer_pattern), len(ffn_pattern)) layers (`cycle_length`):
layer i has mixer kind `layer_pattern[i % len]` and ffn kind `ffn_pattern[i % len]`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from tfjax.config import ModelConfig
from tfjax.nn import positions as pos_lib
from tfjax.nn.attention import MultiHeadAttention
from tfjax.nn.blocks import TransformerBlock
from tfjax.nn.ffn import FeedForward
from tfjax.nn.linear_attention import LinearAttention
from tfjax.nn.moe import MoE
from tfjax.nn.ssm import Mamba
from tfjax.nn.norms import make_norm
from tfjax import ops as ops_lib
from tfjax.ops import masks as masks_lib
from tfjax.parallel.sharding import shard, with_logical_axes
from tfjax.registry import Registry

__all__ = ["REMAT_POLICIES", "LayerStack", "Embedder", "build_block", "build_norm", "cycle_length",
           "position_bias", "relative_bias", "layer_masks", "default_positions", "dtype_of"]

# Named rematerialisation policies for the scanned layer body.
REMAT_POLICIES: Registry = Registry("remat policy")
REMAT_POLICIES.register("none", None)
REMAT_POLICIES.register("full", jax.checkpoint_policies.nothing_saveable)
REMAT_POLICIES.register("dots", jax.checkpoint_policies.dots_saveable)
REMAT_POLICIES.register("dots_no_batch", jax.checkpoint_policies.dots_with_no_batch_dims_saveable)


def dtype_of(name: str):
    return jnp.dtype(name)


def default_positions(tokens: jax.Array) -> jax.Array:
    B, T = tokens.shape[:2]
    return jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))


def build_norm(cfg: ModelConfig, rngs: nnx.Rngs, dim: int | None = None) -> nnx.Module:
    return make_norm(cfg.norm, dim or cfg.d_model, eps=cfg.norm_eps, use_bias=cfg.norm_bias,
                     dtype=dtype_of(cfg.dtype), param_dtype=dtype_of(cfg.param_dtype), rngs=rngs)


def _rope(cfg: ModelConfig) -> pos_lib.RotaryEmbedding | None:
    if cfg.position != "rope":
        return None
    r = cfg.rope
    return pos_lib.RotaryEmbedding(
        head_dim=cfg.head_size, theta=r.theta, fraction=r.fraction, layout=r.layout,
        scaling=r.scaling, factor=r.factor, original_max_len=r.original_max_len,
        beta_fast=r.beta_fast, beta_slow=r.beta_slow, mscale=r.mscale,
        low_freq_factor=r.low_freq_factor, high_freq_factor=r.high_freq_factor)


def _attention(cfg: ModelConfig, rngs: nnx.Rngs, *, cross: bool) -> MultiHeadAttention:
    dt, pdt = dtype_of(cfg.dtype), dtype_of(cfg.param_dtype)
    return MultiHeadAttention(
        cfg.d_model, cfg.num_heads, num_kv_heads=cfg.kv_heads, head_dim=cfg.head_size,
        qkv_bias=cfg.qkv_bias, out_bias=cfg.out_bias, qk_norm=cfg.qk_norm,
        qk_norm_kind="layernorm" if cfg.norm == "layernorm" else cfg.norm, norm_eps=cfg.norm_eps,
        scale=cfg.scale, softcap=cfg.attn_softcap or None,
        rope=None if cross else _rope(cfg), implementation=cfg.attention_impl,
        context_parallel=cfg.context_parallel, zigzag=cfg.zigzag,
        dtype=dt, param_dtype=pdt, init_std=cfg.init_std,
        out_init_std=cfg.init_std / math.sqrt(2 * cfg.num_layers), rngs=rngs)


def cycle_length(cfg: ModelConfig) -> int:
    """Layers in one scanned cycle: lcm(len(layer_pattern), len(ffn_pattern))."""
    return math.lcm(len(cfg.layer_pattern), len(cfg.ffn_pattern))


def _ffn(cfg: ModelConfig, rngs: nnx.Rngs, kind: str) -> nnx.Module | None:
    kw = dict(activation=cfg.activation, use_bias=cfg.ffn_bias, dtype=dtype_of(cfg.dtype),
              param_dtype=dtype_of(cfg.param_dtype), init_std=cfg.init_std,
              out_init_std=cfg.init_std / math.sqrt(2 * cfg.num_layers), rngs=rngs)
    if kind == "none":
        return None
    if kind == "moe":
        return MoE(cfg.d_model, cfg.moe_d_ff or cfg.d_ff, num_experts=cfg.num_experts,
                   experts_per_token=cfg.experts_per_token, shared_experts=cfg.shared_experts,
                   renormalize=cfg.router_renormalize, capacity_factor=cfg.capacity_factor,
                   implementation=cfg.moe_impl, aux_loss_weight=cfg.moe_aux_loss_weight,
                   z_loss_weight=cfg.moe_z_loss_weight, **kw)
    return FeedForward(cfg.d_model, cfg.d_ff, **kw)


def _mixer(cfg: ModelConfig, rngs: nnx.Rngs, kind: str) -> nnx.Module:
    dt, pdt = dtype_of(cfg.dtype), dtype_of(cfg.param_dtype)
    out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
    if kind == "mamba":
        return Mamba(cfg.d_model, d_state=cfg.ssm_d_state, d_conv=cfg.ssm_d_conv,
                     expand=cfg.ssm_expand, dt_rank=cfg.ssm_dt_rank, chunk_size=cfg.ssm_chunk,
                     conv_bias=cfg.ssm_conv_bias, proj_bias=cfg.ssm_proj_bias,
                     inner_norm=cfg.ssm_inner_norm, norm_eps=cfg.norm_eps, dtype=dt,
                     param_dtype=pdt, init_std=cfg.init_std, out_init_std=out_std, rngs=rngs)
    if kind == "linear":
        return LinearAttention(cfg.d_model, cfg.num_heads, num_kv_heads=cfg.kv_heads,
                               head_dim=cfg.head_size, qkv_bias=cfg.qkv_bias,
                               out_bias=cfg.out_bias, feature_map=cfg.linear_feature_map,
                               chunk_size=cfg.linear_chunk, dtype=dt, param_dtype=pdt,
                               init_std=cfg.init_std, out_init_std=out_std, rngs=rngs)
    return _attention(cfg, rngs, cross=False)  # global / local: the kind only picks the mask


def build_block(cfg: ModelConfig, rngs: nnx.Rngs, *, cross: bool = False,
                layer: int = 0) -> TransformerBlock:
    """Layer `layer` as the config describes it: its layer kind picks the mixer
    (attention for global / local, which differ only in the mask they get; Mamba;
    linear attention), its ffn kind the feed-forward (dense, MoE or none)."""
    ffn = _ffn(cfg, rngs, cfg.ffn_kind(layer))
    return TransformerBlock(
        attn=_mixer(cfg, rngs, cfg.layer_kind(layer)), ffn=ffn, make_norm=lambda: build_norm(cfg, rngs),
        cross_attn=_attention(cfg, rngs, cross=True) if cross else None,
        placement=cfg.norm_placement, parallel=cfg.block == "parallel",
        parallel_shared_norm=cfg.parallel_shared_norm, dropout_rate=cfg.dropout_rate, rngs=rngs)


class _Cycle(nnx.Module):
    """One repeat of the layer pattern (the scanned unit)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, *, cross: bool):
        self.layers = nnx.List([build_block(cfg, rngs, cross=cross, layer=i)
                                for i in range(cycle_length(cfg))])


class LayerStack(nnx.Module):
    """`num_layers` blocks; layer i has kind `layer_pattern[i % len(pattern)]` (and ffn
    kind `ffn_pattern[i % len]`); `self.pattern` is the kinds of one scanned cycle."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, *, num_layers: int, cross: bool = False):
        self.pattern = tuple(cfg.layer_kind(i) for i in range(cycle_length(cfg)))
        self.remat = cfg.remat
        n_cycles, rest = divmod(num_layers, len(self.pattern))
        self.scanned = cfg.scan_layers and n_cycles >= 1
        if self.scanned:
            @nnx.split_rngs(splits=n_cycles)
            @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
            def create(rngs):
                return _Cycle(cfg, rngs, cross=cross)

            self.cycles = create(rngs)
            self.blocks = nnx.List([build_block(cfg, rngs, cross=cross,
                                                layer=n_cycles * len(self.pattern) + i)
                                    for i in range(rest)])
        else:
            self.cycles = None
            self.blocks = nnx.List([build_block(cfg, rngs, cross=cross, layer=i)
                                    for i in range(num_layers)])

    def __call__(self, x, *, masks: dict, cache=None, biases: dict | None = None, **kwargs):
        """`masks[kind]` is the mask of layers of that kind; kwargs go to every block.

        Inference: with `cache` (`{"cycles": per-pattern-position caches stacked over
        cycles, "blocks": per unrolled block}`, made by `tfjax.inference.kv_cache`)
        each block gets its cache (the stacked ones scanned alongside the layers) and
        this returns `(x, new_cache)`; `biases[kind]`, when given, is that kind's bias.
        """
        if cache is not None:
            return self._call_cached(x, masks, biases or {}, cache, kwargs)
        policy = REMAT_POLICIES.get(self.remat, field="model.remat")

        def apply(block, x, mask):
            return block(x, mask=mask, **kwargs)

        if self.remat != "none":
            apply = nnx.remat(apply, policy=policy)

        if self.cycles is not None:
            pattern = self.pattern

            def body(x, cycle):
                for kind, block in zip(pattern, cycle.layers):
                    x = apply(block, x, masks[kind])
                return x

            x = nnx.scan(body, in_axes=(nnx.Carry, 0), out_axes=nnx.Carry,
                         transform_metadata={nnx.PARTITION_NAME: "layers"})(x, self.cycles)
        # Unrolled layers (all of them, or those left after whole cycles): layer i of
        # them has the kind pattern[i % len(pattern)] since the scan ran whole cycles.
        for i, block in enumerate(self.blocks):
            x = apply(block, x, masks[self.pattern[i % len(self.pattern)]])
        return x

    def _call_cached(self, x, masks, biases, cache, kwargs):
        pattern = self.pattern
        bias = kwargs.pop("bias", None)

        def apply(block, x, kind, c):
            return block(x, mask=masks[kind], bias=biases.get(kind, bias), cache=c, **kwargs)

        cycles = cache.get("cycles")
        if self.cycles is not None:
            def body(x, cycle, cc):
                new = []
                for kind, block, c in zip(pattern, cycle.layers, cc):
                    x, c = apply(block, x, kind, c)
                    new.append(c)
                return x, tuple(new)

            x, cycles = nnx.scan(body, in_axes=(nnx.Carry, 0, 0), out_axes=(nnx.Carry, 0),
                                 transform_metadata={nnx.PARTITION_NAME: "layers"})(
                                     x, self.cycles, tuple(cycles))
        blocks = []
        for i, (block, c) in enumerate(zip(self.blocks, cache["blocks"])):
            x, c = apply(block, x, pattern[i % len(pattern)], c)
            blocks.append(c)
        return x, {"cycles": cycles, "blocks": tuple(blocks)}


def layer_masks(cfg: ModelConfig, base: masks_lib.Mask | None, *,
                bidirectional: bool = False) -> dict:
    """The mask of each layer kind: global layers use `base`, local ones add the window."""
    out = {"global": base}
    if cfg.sliding_window:
        right = cfg.sliding_window if bidirectional else 0
        out["local"] = masks_lib.combine(base, masks_lib.sliding_window(cfg.sliding_window, right))
    out["mamba"] = out["linear"] = None  # causal by construction; they take no mask
    return out


def relative_bias(cfg: ModelConfig, rngs: nnx.Rngs, *, bidirectional: bool):
    """The T5 bucketed relative bias table of a stack, or None for other encodings."""
    if cfg.position != "t5":
        return None
    return pos_lib.T5RelativeBias(cfg.num_heads, num_buckets=cfg.t5_num_buckets,
                                  max_distance=cfg.t5_max_distance, bidirectional=bidirectional,
                                  init_std=cfg.init_std, param_dtype=dtype_of(cfg.param_dtype),
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


class Embedder(nnx.Module):
    """Token (+ learned/sinusoidal position, + token-type) embeddings in; logits out.

    The output projection is the transposed embedding when tied (Press & Wolf
    2017), else its own `[D, V]` matrix; then an optional final soft-cap.
    """

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        dt, pdt = dtype_of(cfg.dtype), dtype_of(cfg.param_dtype)
        self.d_model, self.dtype = cfg.d_model, dt
        self.position = cfg.position
        self.scale = math.sqrt(cfg.d_model) if cfg.scale_embeddings else 1.0
        self.logits_scale, self.final_softcap = cfg.logits_scale, cfg.final_softcap
        normal = nnx.initializers.normal(cfg.init_std)
        self.tokens = nnx.Embed(cfg.vocab_size, cfg.d_model, dtype=dt, param_dtype=pdt,
                                embedding_init=with_logical_axes(normal, ("vocab", "embed")), rngs=rngs)
        self.positions = (pos_lib.LearnedPositions(cfg.max_len, cfg.d_model, init_std=cfg.init_std,
                                                   param_dtype=pdt, rngs=rngs)
                          if cfg.position == "learned" else None)
        self.token_types = (nnx.Embed(cfg.type_vocab_size, cfg.d_model, dtype=dt, param_dtype=pdt,
                                      embedding_init=with_logical_axes(normal, (None, "embed")), rngs=rngs)
                            if cfg.type_vocab_size else None)
        self.norm = build_norm(cfg, rngs) if cfg.embed_norm else None
        self.dropout = nnx.Dropout(cfg.dropout_rate, rngs=rngs) if cfg.dropout_rate > 0 else None
        self.head = (None if cfg.tie_embeddings else
                     nnx.Linear(cfg.d_model, cfg.vocab_size, use_bias=False, dtype=dt,
                                param_dtype=pdt, kernel_init=with_logical_axes(normal, ("embed", "vocab")),
                                rngs=rngs))

    def __call__(self, tokens, positions, token_types=None):
        x = self.tokens(tokens) * jnp.asarray(self.scale, self.dtype)  # [B, T, D]
        if self.position == "sinusoidal":
            x = x + pos_lib.sinusoidal_embedding(positions, self.d_model, dtype=x.dtype)
        elif self.positions is not None:
            x = x + self.positions(positions).astype(x.dtype)
        if self.token_types is not None:
            types = jnp.zeros_like(tokens) if token_types is None else token_types
            x = x + self.token_types(types)
        if self.norm is not None:
            x = self.norm(x)
        if self.dropout is not None:
            x = self.dropout(x)
        return shard(x, ("batch", "length", "embed"))

    def logits(self, x):
        """Final hidden `[B,T,D]` -> logits `[B,T,V]` (fp32)."""
        if self.logits_scale != 1.0:
            x = x * self.logits_scale
        logits = self.tokens.attend(x) if self.head is None else self.head(x)
        logits = logits.astype(jnp.float32)
        if self.final_softcap:
            logits = self.final_softcap * jnp.tanh(logits / self.final_softcap)
        return shard(logits, ("batch", "length", "vocab"))
