"""Layer kinds and ffn kinds: one record per kind, registered once.

A layer is a mixer followed by an optional feed-forward; `model.layer_pattern` cycles
over layer kinds (`LayerKind` records in `LAYER_KINDS`: the mixer's builder, its mask,
positions, decode-state slots and flags) and `model.ffn_pattern` over ffn kinds
(`FfnKind` records in `FFN_KINDS`). Nothing outside this file names a kind: the stack,
the masks, the caches, `check_names` and the trainer read the records. Each kind's
copy of the attention config (`attention`) and the shared blocks (`shared_block`,
`shared_block_use`) are built here too. Adding a kind is its mixer's module and one
`LAYER_KINDS.register(name, LayerKind(...))`. See docs/models.md.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax.numpy as jnp
from flax import nnx

from tfjax.config import ModelConfig, RopeConfig
from tfjax.nn.attention import MultiHeadAttention
from tfjax.nn.ffn import ACTIVATIONS, FeedForward
from tfjax.nn.gated_deltanet import GatedDeltaNet
from tfjax.nn.latent_attention import MultiHeadLatentAttention, mla_scale
from tfjax.nn.linear_attention import LinearAttention
from tfjax.nn.mamba2 import Mamba2
from tfjax.nn.moe import MoE
from tfjax.nn.norms import make_norm
from tfjax.nn.positions import RotaryEmbedding
from tfjax.nn.shared_block import SharedBlock, SharedBlockUse
from tfjax.nn.ssm import Mamba
from tfjax.ops import masks as masks_lib
from tfjax.registry import Registry

__all__ = ["FFN_KINDS", "FfnKind", "LAYER_KINDS", "LayerKind", "attention", "shared_block",
           "shared_block_use"]

MaskRule = Callable[[ModelConfig, "masks_lib.Mask | None", bool], "masks_lib.Mask | None"]


@dataclasses.dataclass(frozen=True)
class LayerKind:
    """What a layer kind is (each field: docs/howto/layer_kind.md, "The record")."""

    doc: str
    mixer: Callable[..., nnx.Module]
    mask: MaskRule | None = None
    positions: bool = True
    slots: Callable[[ModelConfig, int], tuple[int, int]] | None = None
    cache_mask: Callable[..., "masks_lib.Mask"] | None = None
    decoder_only: bool = False
    order_dependent: bool = False
    variants: bool = False
    shared_block: bool = False
    context: bool = False


@dataclasses.dataclass(frozen=True)
class FfnKind:
    """What an ffn kind is: its builder and when it depends on the tokens' order."""

    doc: str
    build: Callable[[ModelConfig, nnx.Rngs], nnx.Module | None]
    order_dependence: Callable[[ModelConfig], str | None] = lambda cfg: None


LAYER_KINDS: Registry[LayerKind] = Registry("layer kind")
FFN_KINDS: Registry[FfnKind] = Registry("ffn kind")


def _out_std(cfg: ModelConfig) -> float:
    return cfg.init_std / math.sqrt(2 * cfg.num_layers)


def _dtypes(cfg: ModelConfig) -> dict:
    """A layer's dtypes and init scales, as every builder here passes them."""
    return dict(dtype=jnp.dtype(cfg.dtype), param_dtype=jnp.dtype(cfg.param_dtype),
                init_std=cfg.init_std, out_init_std=_out_std(cfg))


def _rope(cfg: ModelConfig, head_dim: int | None = None,
          theta: float = 0.0) -> RotaryEmbedding | None:
    """The model's RoPE over `head_dim` (default the attention head dim), or None;
    `theta` > 0: that base, unscaled, instead (Gemma 3's local layers): the model's
    fraction and layout, no scaling."""
    if cfg.position != "rope":
        return None
    r = cfg.rope
    if theta:
        r = RopeConfig(theta=theta, fraction=r.fraction, layout=r.layout)
    return RotaryEmbedding(head_dim or cfg.head_size, r)


def attention(cfg: ModelConfig, rngs: nnx.Rngs, *, positions: bool, rope_theta: float = 0.0,
              temperature: bool = False) -> MultiHeadAttention:
    """The model's attention: self-attention of the attention kinds (`positions`: the
    model's RoPE, if any; `rope_theta` > 0: that base instead; `temperature`: Llama
    4's NoPE query temperature when model.attention.temperature_floor > 0) and the
    decoder's cross-attention (positions=False). model.attention.differential and
    model.attention.value_residual (decoder only, so never a cross-attention) reach every one:
    differential attention rotates half-heads, a RoPE of head_dim / 2.

    What differs per layer is this layer's copy of model.attention: QK-norm only on
    layers that rotate under qk_norm_layers="rope", its kind "" the model's norm, the
    temperature only where asked, the μP-aware scale (`ModelConfig.attention_scale`)."""
    a = cfg.attention
    layer = dataclasses.replace(
        a, qk_norm=a.qk_norm and (a.qk_norm_layers == "all" or bool(positions)),
        qk_norm_kind=a.qk_norm_kind or cfg.norm, scale=cfg.attention_scale,
        temperature_floor=a.temperature_floor if temperature else 0)
    rope_dims = cfg.head_size // 2 if a.differential else None
    return MultiHeadAttention(
        cfg.d_model, cfg.num_heads, num_kv_heads=cfg.kv_heads, head_dim=cfg.head_size,
        v_head_dim=cfg.value_head_size, attention=layer,
        rope=_rope(cfg, rope_dims, theta=rope_theta) if positions else None,
        norm_eps=cfg.norm_eps, rngs=rngs, **_dtypes(cfg))


# --------------------------------------------------------------------------- #
# Attention kinds: a KV cache of `slots` slots; the window is the only difference.
# --------------------------------------------------------------------------- #


def _attention_kind(doc: str, window_of: Callable[[ModelConfig], int], *,
                    rope_theta_of: Callable[[ModelConfig], float] = lambda cfg: 0.0,
                    positions: bool = True) -> LayerKind:
    """An attention layer that sees `window_of(cfg)` keys before the query (0: all),
    with RoPE of base `rope_theta_of(cfg)` (0: the model's) or, `positions=False`,
    none (NoPE, with Llama 4's query temperature if configured)."""

    def mixer(cfg, rngs, *, positions):
        return attention(cfg, rngs, positions=positions, rope_theta=rope_theta_of(cfg),
                         temperature=not positions)

    def mask(cfg, base, bidirectional):
        w = window_of(cfg)
        if not w:
            return base
        return masks_lib.windowed(base, w, w if bidirectional else 0)

    def slots(cfg, max_len):  # a rolling buffer of W + 1 slots: the query and W keys
        w = window_of(cfg)
        return (min(w + 1, max_len), w) if w else (max_len, 0)

    return LayerKind(doc=doc, mixer=mixer, mask=mask, slots=slots,
                     positions=positions, variants=True)


LAYER_KINDS.register("global", _attention_kind(
    "full attention under the model's mask", lambda cfg: 0))
LAYER_KINDS.register("local", _attention_kind(
    "sliding-window attention of model.attention.sliding_window keys back (RoPE base "
    "model.attention.local_rope_theta if set)", lambda cfg: cfg.attention.sliding_window,
    rope_theta_of=lambda cfg: cfg.attention.local_rope_theta))
def _cross(cfg: ModelConfig, rngs: nnx.Rngs, *, positions: bool) -> MultiHeadAttention:
    """The gated cross-attention layers' attention: the model's heads over the context
    (no positions), each head's q and k normalised by the model's norm (MLlama)."""
    a = dataclasses.replace(cfg.attention, qk_norm=True, qk_norm_layers="all",
                            qk_norm_over="head", sliding_window=0)
    return attention(dataclasses.replace(cfg, attention=a), rngs, positions=False)


LAYER_KINDS.register("cross", LayerKind(
    "gated cross-attention to the model's context (image features; Llama-3.2-Vision): "
    "x + tanh(a) xattn(norm(x), context), x + tanh(m) ffn(norm(x)), per-head QK-norm, no "
    "positions; the context's K/V computed once and cached; skipped without a context",
    _cross, positions=False, decoder_only=True, context=True))
LAYER_KINDS.register("nope", _attention_kind(
    "full attention without the model's position encoding (NoPE: Llama 4, SmolLM3; "
    "model.attention.temperature_floor)", lambda cfg: 0, positions=False))


def _chunked_mask(cfg, base, bidirectional):
    return masks_lib.combine(base, masks_lib.chunked_causal(cfg.attention.chunk))


def _chunked_cache_mask(cfg, q_positions, kv_positions, window):
    """By position: causal within the query's own chunk (chunk index as a segment id;
    an empty slot's -1 is in no chunk)."""
    C = cfg.attention.chunk
    return masks_lib.positions(q_positions, kv_positions) & masks_lib.segments(
        q_positions // C, jnp.where(kv_positions >= 0, kv_positions // C, -1))


def _chunked_slots(cfg, max_len):  # a rolling buffer of one chunk
    return min(cfg.attention.chunk, max_len), 0


LAYER_KINDS.register("chunked", LayerKind(
    "causal attention within chunks of model.attention.chunk positions (Llama 4): a rolling "
    "cache of one chunk", attention, mask=_chunked_mask, slots=_chunked_slots, cache_mask=_chunked_cache_mask, decoder_only=True, variants=True))


def _mla(cfg: ModelConfig, rngs: nnx.Rngs, *, positions: bool) -> MultiHeadLatentAttention:
    """MLA of model.mla: model.attention's scale or DeepSeek's (with its YaRN factor)."""
    m, r = cfg.mla, cfg.rope
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    scale = cfg.attention.scale or mla_scale(qk, rope_scaling=r.scaling, rope_factor=r.factor,
                                             mscale_all_dim=m.mscale_all_dim)
    return MultiHeadLatentAttention(
        cfg.d_model, cfg.num_heads, m, rope=_rope(cfg, m.qk_rope_head_dim) if positions else None,
        attention=dataclasses.replace(cfg.attention, scale=scale), norm_eps=cfg.norm_eps,
        rngs=rngs, **_dtypes(cfg))


LAYER_KINDS.register("mla", LayerKind(
    "DeepSeek's Multi-head Latent Attention under the model's mask (tfjax.nn.latent_attention; "
    "model.mla): a latent cache, absorbed decode", _mla,
    mask=lambda cfg, base, bidirectional: base, slots=lambda cfg, max_len: (max_len, 0)))


# --------------------------------------------------------------------------- #
# Recurrent kinds: an O(1) state, no mask, decoder only.
# --------------------------------------------------------------------------- #


def _mamba(cfg: ModelConfig, rngs: nnx.Rngs, *, positions: bool) -> Mamba:
    return Mamba(cfg.d_model, cfg.ssm, norm_eps=cfg.norm_eps, rngs=rngs, **_dtypes(cfg))


def _mamba2(cfg: ModelConfig, rngs: nnx.Rngs, *, positions: bool) -> Mamba2:
    return Mamba2(cfg.d_model, cfg.mamba2, norm_eps=cfg.norm_eps, rngs=rngs, **_dtypes(cfg))


# --------------------------------------------------------------------------- #
# Shared transformer blocks (model.shared; Zamba2): the blocks, a layer's use, its cache.
# --------------------------------------------------------------------------- #


def _shared_width(cfg: ModelConfig) -> int:
    """The shared block's input width W: 2D with the embedding concatenated, else D."""
    return cfg.d_model * (2 if cfg.shared.concat_embedding else 1)


def shared_block(cfg: ModelConfig, rngs: nnx.Rngs) -> SharedBlock:
    """One shared block of model.shared: a norm of width W, attention of model.num_heads
    / num_kv_heads heads of model.head_dim (W in, D out; the model's RoPE, if any),
    a norm and the feed-forward of model.activation and shared.d_ff (or model.d_ff)."""
    W, dt, pdt = _shared_width(cfg), jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
    norm = dict(eps=cfg.norm_eps, use_bias=cfg.norm_bias, dtype=dt, param_dtype=pdt, rngs=rngs)
    # the block's attention: model.attention's biases, scale and implementation, none of
    # its per-layer variants (no QK-norm, soft-cap, sinks, gate, temperature)
    plain = dataclasses.replace(
        cfg.attention, qk_norm=False, softcap=0.0, sinks=False, differential=False,
        value_residual="none", output_gate=False, temperature_floor=0,
        scale=cfg.attention_scale)
    attn = MultiHeadAttention(
        W, cfg.num_heads, num_kv_heads=cfg.kv_heads, head_dim=cfg.head_size,
        v_head_dim=cfg.value_head_size, out_dim=cfg.d_model, attention=plain, rope=_rope(cfg),
        rngs=rngs, **_dtypes(cfg))
    ffn = FeedForward(cfg.d_model, cfg.shared.d_ff or cfg.d_ff, **_ffn_kw(cfg, rngs))
    return SharedBlock(attn=attn, ffn=ffn, in_norm=make_norm(cfg.norm, W, **norm),
                       ffn_norm=make_norm(cfg.norm, cfg.d_model, **norm),
                       concat_embedding=cfg.shared.concat_embedding)


def shared_block_use(cfg: ModelConfig, rngs: nnx.Rngs) -> SharedBlockUse:
    """A layer's use of a shared block: its adapters of rank shared.adapter_rank and its
    output projection."""
    return SharedBlockUse(
        cfg.d_model, _shared_width(cfg), cfg.shared, num_heads=cfg.num_heads,
        num_kv_heads=cfg.kv_heads, head_dim=cfg.head_size, v_head_dim=cfg.value_head_size,
        d_ff=cfg.shared.d_ff or cfg.d_ff,
        gated=ACTIVATIONS.get(cfg.activation, field="model.activation")[1],
        dtype=jnp.dtype(cfg.dtype), param_dtype=jnp.dtype(cfg.param_dtype),
        init_std=cfg.init_std, rngs=rngs)


def _linear(cfg: ModelConfig, rngs: nnx.Rngs, *, positions: bool) -> LinearAttention:
    return LinearAttention(cfg.d_model, cfg.num_heads, cfg.linear, num_kv_heads=cfg.kv_heads,
                           head_dim=cfg.head_size, attention=cfg.attention, rngs=rngs,
                           **_dtypes(cfg))


LAYER_KINDS.register("mamba", LayerKind(
    "Mamba selective SSM mixer (tfjax.nn.ssm; model.ssm; decoder only)", _mamba,
    positions=False, decoder_only=True, order_dependent=True))
LAYER_KINDS.register("mamba2", LayerKind(
    "Mamba-2 state-space-duality mixer (tfjax.nn.mamba2; model.mamba2; decoder only)", _mamba2,
    positions=False, decoder_only=True, order_dependent=True))
LAYER_KINDS.register("mamba2_shared", LayerKind(
    "a Mamba-2 layer whose input also takes a use of one of the model's shared transformer "
    "blocks, x + mamba2(norm(x + use(x, embeddings))) (Zamba2's hybrid layer; model.shared, "
    "tfjax.nn.shared_block; decoder only): the block's attention takes the model's mask and "
    "RoPE and a K/V cache per use", _mamba2,
    mask=lambda cfg, base, bidirectional: base, slots=lambda cfg, max_len: (max_len, 0), decoder_only=True, order_dependent=True,
    shared_block=True))
LAYER_KINDS.register("linear", LayerKind(
    "causal linear attention (tfjax.nn.linear_attention; model.linear; decoder only)", _linear,
    positions=False, decoder_only=True, order_dependent=True))


def _gdn(cfg: ModelConfig, rngs: nnx.Rngs, *, positions: bool) -> GatedDeltaNet:
    return GatedDeltaNet(cfg.d_model, cfg.gdn.resolved(cfg.num_heads, cfg.head_size),
                         norm_eps=cfg.norm_eps, rngs=rngs, **_dtypes(cfg))


LAYER_KINDS.register("gated_deltanet", LayerKind(
    "Gated DeltaNet, the gated delta rule (Qwen3-Next's linear attention; "
    "tfjax.nn.gated_deltanet; model.gdn; decoder only)", _gdn,
    positions=False, decoder_only=True, order_dependent=True))


# --------------------------------------------------------------------------- #
# Ffn kinds.
# --------------------------------------------------------------------------- #


def _ffn_kw(cfg: ModelConfig, rngs: nnx.Rngs) -> dict:
    return dict(activation=cfg.activation, use_bias=cfg.ffn_bias, rngs=rngs, **_dtypes(cfg))


def _dense(cfg: ModelConfig, rngs: nnx.Rngs) -> FeedForward:
    return FeedForward(cfg.d_model, cfg.d_ff, **_ffn_kw(cfg, rngs))


def _moe(cfg: ModelConfig, rngs: nnx.Rngs) -> MoE:
    return MoE(cfg.d_model, cfg.moe.d_ff or cfg.d_ff, cfg.moe, **_ffn_kw(cfg, rngs))


def _moe_order(cfg: ModelConfig) -> str | None:
    if cfg.moe.capacity_factor > 0:
        return "model.moe.capacity_factor > 0 MoE fills expert slots in token order"
    return None


FFN_KINDS.register("dense", FfnKind("the feed-forward of model.activation and model.d_ff", _dense))
FFN_KINDS.register("moe", FfnKind("a routed Mixture of Experts (tfjax.nn.moe; model.moe)", _moe,
                                  order_dependence=_moe_order))
FFN_KINDS.register("none", FfnKind("no feed-forward sublayer (Mamba: mixer only)",
                                   lambda cfg, rngs: None))
