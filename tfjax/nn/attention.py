"""Multi-head attention with grouped / multi-query heads (MHA, GQA, MQA), self or cross.

`MultiHeadAttention(d_model, num_heads, num_kv_heads=, attention=AttentionConfig(...),
rope=)`: `x [B, T, D]` (and `context [B, S, Dc]`) -> `[B, T, D]` (`out_dim` if set);
q `[B, T, N, H]`, k/v `[B, S, K, H]` (values of `v_head_dim`), never repeated to N heads.
The attention is `tfjax.ops.dot_product_attention` (`attention.impl`; context-parallel
under a sequence mesh). The record's options: QK-norm, soft-cap, scale, NoPE query
temperature, sinks, output gate, differential attention, value residuals. Decoding:
`init_state` makes a `KVCache` (`init_cross_state` a `CrossKVCache`); the call with
`state=` and `slots=` returns `(out, new_state)`. See docs/layers.md.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from tfjax.config import AttentionConfig
from tfjax.config.attention import VALUE_RESIDUALS
from tfjax.nn.hooks import active, hook, patched, scope
from tfjax.nn.norms import make_norm
from tfjax.nn.positions import RotaryEmbedding, default_positions
from tfjax.nn.state import (DecodeState, Slots, cached_attention, decode_state, slots_major,
                            static_field)
from tfjax.ops import Alibi, RelativeBias, dot_product_attention, kv_quant
from tfjax.ops.reference import attend_pattern, attention_pattern, attention_scores
from tfjax.ops.paged import Paged, dense
from tfjax.ops.masks import Mask
from tfjax.parallel.context_parallel import CONTEXT_PARALLEL_MODES, context_parallel_attention
from tfjax.parallel.sharding import shard, with_logical_axes
from tfjax.parallel.zigzag import ZIGZAG_MODES, zigzag_data_devices
from tfjax.typing import DType

__all__ = ["VALUE_RESIDUALS", "CrossKVCache", "KVCache", "MultiHeadAttention", "attention",
           "diff_lambda_init", "head_projections"]

KV_AXES = ("batch", None, "kv_heads", "head_dim")  # [B, S, K, H]: as attended; S replicated
STORED_KV_AXES = ("batch", "kv_heads", None, "head_dim")  # [B, K, S, H]: as stored
SCALE_AXES = ("batch", None, "kv_heads")  # an 8-bit cache's scales [B, S, K]: as attended
STORED_SCALE_AXES = ("batch", "kv_heads", None)  # [B, K, S]: as stored


@decode_state
class KVCache(DecodeState):
    """Self-attention K/V of `size` slots, stored heads-major `[B, K, size, H]` (the
    layout the TPU kernels read, so a decode step does not relay the cache out, even
    across a jit boundary where H = 128; `slots_major` gives the op's `[B, size, K, H]`
    view; experiments/results/attention_layer_tpu_aot_20261204.md). `window` > 0: a
    rolling buffer of a sliding window (size = min(window + 1, max_len)), whose slots
    are reused, so it cannot be rewound. An 8-bit cache (`model.kv_quant`,
    `tfjax.ops.kv_quant`) stores k and v as int8 / fp8 with `k_scale` and `v_scale`
    `[B, K, size]`, one scale per token and kv head; a float cache has None there."""

    k: jax.Array
    v: jax.Array
    window: int = static_field(default=0)
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None
    AXES = {"k": STORED_KV_AXES, "v": STORED_KV_AXES, "k_scale": STORED_SCALE_AXES,
            "v_scale": STORED_SCALE_AXES}
    pageable = True
    reads_runs = True

    @property
    def quant(self) -> str:
        """The 8-bit format ("int8", "fp8") or "none"."""
        if self.k_scale is None:
            return "none"
        return "int8" if self.k.dtype == jnp.int8 else "fp8"

    @property
    def rewindable(self) -> bool:
        return self.window == 0


@decode_state
class CrossKVCache(DecodeState):
    """Cross-attention K/V of the encoder output, stored heads-major `[B, K, S_enc, H]`
    as `KVCache`'s: computed at the step that passes `context`, reused after."""

    k: jax.Array
    v: jax.Array
    AXES = {"k": STORED_KV_AXES, "v": STORED_KV_AXES}


class MultiHeadAttention(nnx.Module):
    """`x [B,T,D]` (and `context [B,S,Dc]` for cross-attention) -> `[B,T,D]`."""

    def __init__(self, d_model: int, num_heads: int, *, num_kv_heads: int | None = None,
                 head_dim: int | None = None, v_head_dim: int | None = None,
                 context_dim: int | None = None, out_dim: int | None = None,
                 attention: AttentionConfig = AttentionConfig(),
                 rope: RotaryEmbedding | None = None, norm_eps: float = 1e-6,
                 dtype: DType = jnp.float32, param_dtype: DType = jnp.float32,
                 init_std: float = 0.02, out_init_std: float | None = None, rngs: nnx.Rngs):
        """`attention`: the knobs of `tfjax.config.AttentionConfig`, taken as this layer
        has them (what differs per layer is the caller's `dataclasses.replace`): its
        `qk_norm_kind` "" is "rmsnorm" here, `scale` 0 the default (head_dim, or its
        half when differential)^-1/2, `softcap` 0 none, `temperature_floor` > 0 the
        NoPE query temperature (with `temperature_scale`; no `rope` then).
        `qk_norm_layers`, `sliding_window`, `chunk` and `local_rope_theta` are the
        layer kinds' (`tfjax.models.layer_kinds`), not read here."""
        a = attention
        K = num_kv_heads or num_heads
        if num_heads % K:
            raise ValueError(f"num_kv_heads={K} must divide num_heads={num_heads}")
        H = head_dim or d_model // num_heads
        if not head_dim and d_model % num_heads:
            raise ValueError(f"d_model={d_model} is not divisible by num_heads={num_heads}; "
                             "pass head_dim")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, K, H
        self.v_head_dim = v_head_dim or H
        if a.differential and (H % 2 or a.sinks or a.qk_norm):
            raise ValueError(f"differential attention splits each head's q and k in halves: it "
                             f"needs an even head_dim (got {H}), no sinks and no qk_norm")
        self.differential = a.differential
        self.scale = (H // (2 if a.differential else 1)) ** -0.5 if not a.scale else a.scale
        self.softcap = a.softcap or None
        self.rope = rope
        self.implementation = a.impl
        if a.context_parallel not in CONTEXT_PARALLEL_MODES:
            raise ValueError(f"context_parallel: got {a.context_parallel!r}; allowed: "
                             f"{', '.join(map(repr, CONTEXT_PARALLEL_MODES))}")
        self.context_parallel, self.ulysses_size = a.context_parallel, a.ulysses_size
        if a.zigzag not in ZIGZAG_MODES:
            raise ValueError(f"zigzag: got {a.zigzag!r}; allowed: "
                             f"{', '.join(map(repr, ZIGZAG_MODES))}")
        self.zigzag = a.zigzag
        self.q, self.k, self.v, self.o = head_projections(
            d_model, num_heads, K, H, v_head_dim=self.v_head_dim, context_dim=context_dim,
            out_dim=out_dim, qkv_bias=a.qkv_bias, k_bias=a.qkv_bias and a.k_bias,
            out_bias=a.out_bias, dtype=dtype,
            param_dtype=param_dtype, init_std=init_std, out_init_std=out_init_std, rngs=rngs)
        if a.sinks:
            init = with_logical_axes(nnx.initializers.normal(init_std), ("heads",))
            self.sinks = nnx.Param(init(rngs.params(), (num_heads,), param_dtype))
        else:
            self.sinks = None
        if a.qk_norm_over not in ("head", "projection"):
            raise ValueError(f"qk_norm_over: got {a.qk_norm_over!r}; allowed: 'head', "
                             "'projection'")
        self.qk_norm_over = a.qk_norm_over
        if a.qk_norm:
            per = 1 if a.qk_norm_over == "head" else None  # "projection": N*H and K*H wide
            kind = a.qk_norm_kind or "rmsnorm"
            self.q_norm = make_norm(kind, H * (per or num_heads), eps=norm_eps, dtype=dtype,
                                    param_dtype=param_dtype, rngs=rngs)
            self.k_norm = make_norm(kind, H * (per or K), eps=norm_eps, dtype=dtype,
                                    param_dtype=param_dtype, rngs=rngs)
        else:
            self.q_norm = self.k_norm = None
        temperature = ((a.temperature_floor, a.temperature_scale) if a.temperature_floor
                       else None)
        if temperature is not None and (temperature[0] < 1 or rope is not None):
            raise ValueError(f"temperature_floor={a.temperature_floor}: the query temperature "
                             f"needs floor >= 1 and no RoPE (Llama 4's NoPE layers), got "
                             f"rope={rope is not None}")
        self.temperature = temperature
        if a.differential:  # rows lq1, lk1, lq2, lk2 (docs/layers.md)
            init = with_logical_axes(nnx.initializers.normal(0.1), (None, "head_dim"))
            self.diff_lambda = nnx.Param(init(rngs.params(), (4, H // 2), param_dtype))
            self.diff_norm = make_norm("rmsnorm", self.v_head_dim, eps=norm_eps, dtype=dtype,
                                       param_dtype=param_dtype, rngs=rngs)
        else:
            self.diff_lambda = self.diff_norm = None
        if a.value_residual not in VALUE_RESIDUALS:
            raise ValueError(f"value_residual: got {a.value_residual!r}; allowed: "
                             f"{', '.join(map(repr, VALUE_RESIDUALS))}")
        self.value_residual = a.value_residual
        self.value_lambda = (nnx.Param(jnp.full((2,), 0.5, param_dtype))
                             if a.value_residual == "learned" else None)
        # Qwen3-Next's gated attention: out * sigmoid(x @ gate) per head, before o
        self.gate = nnx.Einsum(
            "BTD,DNH->BTNH", (d_model, num_heads, self.v_head_dim),
            (num_heads, self.v_head_dim) if a.qkv_bias else None, dtype=dtype,
            param_dtype=param_dtype,
            kernel_init=with_logical_axes(nnx.initializers.normal(init_std),
                                          ("embed", "heads", "head_dim")),
            bias_init=with_logical_axes(nnx.initializers.zeros_init(), ("heads", "head_dim")),
            rngs=rngs) if a.output_gate else None

    def values(self, x):
        """v `[B,S,K,Hv]` of `x` as projected, before any value residual: what the
        first layer gives the others (`first_values`)."""
        return shard(self.v(x), ("batch", "length", "kv_heads", "head_dim"))

    def mix_values(self, v, first_values, layer):
        """Value residual: `l1 v + l2 first_values`, or v itself at layer 0."""
        if self.value_residual == "none":
            raise ValueError("first_values given to an attention layer built with "
                             "value_residual='none'")
        l1, l2 = ((0.5, 0.5) if self.value_lambda is None else
                  (self.value_lambda[0], self.value_lambda[1]))
        mixed = (l1 * v + l2 * first_values.astype(v.dtype)).astype(v.dtype)
        return mixed if layer is None else jnp.where(jnp.asarray(layer) == 0, v, mixed)

    def project(self, x, context=None, *, positions=None, kv_positions=None, layer=None,
                first_values=None, adapter=None, rope_tables=None):
        """q `[B,T,N,H]`, k `[B,S,K,H]`, v `[B,S,K,Hv]`; q and k after QK-norm and RoPE
        (per half-head when differential); v mixed with `first_values` (the first
        layer's v of the same tokens) when given and `layer` (None: not 0) > 0;
        `adapter(x, context)` -> deltas (dq, dk, dv) added to the projections first;
        `rope_tables`: `rope.tables(positions)` when the caller has them (a layer stack
        computes them once for all its layers), else they are computed here."""
        context = x if context is None else context
        q, k, v = self.q(x), self.k(context), self.v(context)
        if adapter is not None:
            dq, dk, dv = adapter(x, context)
            q, k, v = q + dq.astype(q.dtype), k + dk.astype(k.dtype), v + dv.astype(v.dtype)
        q = shard(q, ("batch", "length", "heads", "head_dim"))
        k = shard(k, ("batch", "length", "kv_heads", "head_dim"))
        v = shard(v, ("batch", "length", "kv_heads", "head_dim"))
        q, k, v = hook("hook_q", q), hook("hook_k", k), hook("hook_v", v)
        if first_values is not None:
            v = self.mix_values(v, first_values, layer)
        if self.q_norm is not None:
            q, k = self._norm(self.q_norm, q), self._norm(self.k_norm, k)
        if self.rope is not None or self.temperature is not None:
            if positions is None:
                positions = default_positions(x)
            if kv_positions is None:
                kv_positions = positions if context is x else default_positions(context)
        if self.rope is not None:
            q_tables = self.rope.tables(positions) if rope_tables is None else rope_tables
            kv_tables = q_tables if kv_positions is positions else self.rope.tables(kv_positions)
            q, k = self._rotate(q, q_tables), self._rotate(k, kv_tables)
            q, k = hook("hook_rot_q", q), hook("hook_rot_k", k)
        return (checkpoint_name(self._temper(q, positions), "attn_q"),
                checkpoint_name(k, "attn_k"), checkpoint_name(v, "attn_v"))

    def _rotate(self, x, tables):
        """RoPE of x `[B, L, n, H]` by `rope.tables(positions)`; differential: each
        half-head on its own."""
        if not self.differential:
            return self.rope.rotate(x, tables)
        B, L, n, H = x.shape
        return self.rope.rotate(x.reshape(B, L, 2 * n, H // 2), tables).reshape(x.shape)

    def _norm(self, norm, x):
        """QK-norm of x `[B, L, n, H]`: per head, or over the whole projection."""
        if self.qk_norm_over == "head":
            return norm(x)
        return norm(x.reshape(*x.shape[:2], -1)).reshape(x.shape)

    def _temper(self, q, positions):
        """Llama 4's NoPE query temperature at `positions` `[B, T]` (docs/layers.md)."""
        if self.temperature is None:
            return q
        floor, scale = self.temperature
        t = 1.0 + scale * jnp.log1p(jnp.floor((positions.astype(jnp.float32) + 1.0) / floor))
        return (q * t[:, :, None, None]).astype(q.dtype)

    def attend(self, q, k, v, mask: Mask | None = None, bias=None, *, q_offset=0, kv_offset=0,
               layer=None, x=None):
        """`bias`: None, an additive `[B|1, N|1, T, S]` array, a `tfjax.ops.Alibi` or
        a `tfjax.ops.RelativeBias` (T5; both evaluated per tile by the tiled
        implementations). `layer`: the layer index (differential attention's
        lam_init; None: 0). `x`: the queries' input `[B,T,D]`, which the output gate
        (`output_gate`) reads; required then."""
        def run(q, k):
            return attention(q, k, v, mask, bias, scale=self.scale, softcap=self.softcap,
                             sinks=None if self.sinks is None else self.sinks[...],
                             implementation=self.implementation,
                             context_parallel=self.context_parallel, zigzag=self.zigzag,
                             ulysses_size=self.ulysses_size, q_offset=q_offset,
                             kv_offset=kv_offset)

        if not self.differential:
            out = run(q, k)
        else:  # two maps over the same values, on the halves of each head
            k, v = dense(k), dense(v)  # a paged cache's pages, gathered
            half = self.head_dim // 2
            with scope("positive"):  # each map's hook points (tfjax.nn.hooks) apart
                a1 = run(q[..., :half], k[..., :half])
            with scope("negative"):
                a2 = run(q[..., half:], k[..., half:])
            init = diff_lambda_init(0 if layer is None else layer)
            lq1, lk1, lq2, lk2 = self.diff_lambda[...].astype(jnp.float32)
            lam = jnp.exp(jnp.sum(lq1 * lk1)) - jnp.exp(jnp.sum(lq2 * lk2)) + init
            out = (a1.astype(jnp.float32) - lam * a2.astype(jnp.float32)).astype(a1.dtype)
            out = (self.diff_norm(out) * (1.0 - init)).astype(a1.dtype)
        if self.gate is not None:
            if x is None:
                raise ValueError("an attention layer with an output gate needs attend(..., x=) "
                                 "(the queries' input)")
            out = (out * jax.nn.sigmoid(self.gate(x).astype(jnp.float32))).astype(out.dtype)
        return shard(self.o(hook("hook_z", out)), ("batch", "length", "embed"))

    def project_query(self, x, *, positions=None):
        """q `[B,T,N,H]` alone (after QK-norm and RoPE): cross-attention decode steps
        reuse the cached K/V of the encoder output."""
        q = shard(self.q(x), ("batch", "length", "heads", "head_dim"))
        if self.q_norm is not None:
            q = self._norm(self.q_norm, q)
        positions = default_positions(x) if positions is None else positions
        if self.rope is not None:
            q = self._rotate(q, self.rope.tables(positions))
        return self._temper(q, positions)

    def init_state(self, batch: int, size: int, dtype=jnp.float32, *,
                   window: int = 0, quant: str = "none") -> KVCache:
        """An empty `KVCache` of `size` slots (`window` > 0: a sliding window's rolling
        buffer, see `KVCache`); `quant` "int8" / "fp8": 8-bit K/V with scales in
        `dtype`."""
        if size < 1:
            raise ValueError(f"init_state: a K/V cache needs size >= 1 slots, got {size}")
        shape = (batch, self.num_kv_heads, size)
        if quant == "none":
            return KVCache(jnp.zeros((*shape, self.head_dim), dtype),
                           jnp.zeros((*shape, self.v_head_dim), dtype), window)
        stored = kv_quant.storage_dtype(quant)
        return KVCache(jnp.zeros((*shape, self.head_dim), stored),
                       jnp.zeros((*shape, self.v_head_dim), stored), window,
                       jnp.ones(shape, dtype), jnp.ones(shape, dtype))

    def init_cross_state(self, batch: int, length: int, dtype=jnp.float32) -> CrossKVCache:
        """An empty `CrossKVCache` for an encoder output of `length` tokens."""
        shape = (batch, self.num_kv_heads, length)
        return CrossKVCache(jnp.zeros((*shape, self.head_dim), dtype),
                            jnp.zeros((*shape, self.v_head_dim), dtype))

    def __call__(self, x, context=None, *, mask: Mask | None = None, bias=None, positions=None,
                 kv_positions=None, state: KVCache | CrossKVCache | None = None,
                 slots: Slots | None = None, layer=None, first_values=None, adapter=None,
                 rope_tables=None):
        """`layer` (the layer index) and `first_values` (the first layer's v): a layer
        stack's, for differential attention and the value residual. `adapter`: this
        call's projection deltas, `rope_tables`: the RoPE tables of `positions`
        (`project`).

        Decoding: with `state` (`init_state`) and the step's `slots` this projects the
        new tokens, writes their K/V into the state's slots (the mixed values with the
        value residual) and attends over them as `slots.mode` says; with a
        `CrossKVCache` (`init_cross_state`) it computes the encoder output's K/V when
        `context` is given and reuses them when it is not. Then it returns `(out,
        new_state)`."""
        depth = {} if layer is None and first_values is None else dict(
            layer=layer, first_values=first_values)
        if adapter is not None:
            depth["adapter"] = adapter
        if isinstance(state, CrossKVCache):
            return self._cross_step(x, context, state, mask, bias, positions, kv_positions)
        if state is not None:
            if context is not None:
                raise ValueError("a self-attention KV cache got a context (cross-attention "
                                 "keeps a CrossKVCache: init_cross_state)")
            q, k, v = self.project(x, positions=positions, rope_tables=rope_tables, **depth)
            extra = {} if layer is None else dict(layer=layer)
            if state.quant != "none":
                return self._quantized_step(q, k, v, state, slots, mask, bias, x, extra)
            out, (k, v) = cached_attention(
                (slots_major(state.k), slots_major(state.v)), (k, v), slots, KV_AXES,
                lambda kv, cached: self.attend(q, *kv, mask, bias, x=x, **extra))
            return out, state.replace(k=slots_major(k), v=slots_major(v))  # sharded as written
        q, k, v = self.project(x, context, positions=positions, kv_positions=kv_positions,
                               rope_tables=rope_tables, **depth)
        return self.attend(q, k, v, mask, bias, layer=layer, x=x)

    def _quantized_step(self, q, k, v, state: KVCache, slots, mask, bias, x, extra):
        """A cached step over an 8-bit `state`: the new K/V quantized as written (with
        their per token and kv head scales), the slots dequantized as attended (a
        paged step's `Paged` carries its scales, read by the op)."""
        (kq, ks), (vq, vs) = (kv_quant.quantize(a, state.quant, state.k_scale.dtype)
                              for a in (k, v))

        def attend(arrays, cached):
            k, v, ks, vs = arrays
            if isinstance(k, Paged):
                k, v = dataclasses.replace(k, scale=ks.pool), dataclasses.replace(v, scale=vs.pool)
            else:
                k, v = kv_quant.dequantize(k, ks, q.dtype), kv_quant.dequantize(v, vs, q.dtype)
            return self.attend(q, k, v, mask, bias, x=x, **extra)

        olds = tuple(map(slots_major, (state.k, state.v, state.k_scale, state.v_scale)))
        out, news = cached_attention(olds, (kq, vq, ks, vs), slots,
                                     (KV_AXES, KV_AXES, SCALE_AXES, SCALE_AXES), attend)
        k, v, ks, vs = map(slots_major, news)
        return out, state.replace(k=k, v=v, k_scale=ks, v_scale=vs)

    def _cross_step(self, x, context, state: CrossKVCache, mask, bias, positions, kv_positions):
        """A decode step of a cross-attention over the encoder output's cached K/V."""
        if context is not None:
            q, k, v = self.project(x, context, positions=positions, kv_positions=kv_positions)
            state = state.replace(
                k=shard(slots_major(k.astype(state.k.dtype)), STORED_KV_AXES),
                v=shard(slots_major(v.astype(state.v.dtype)), STORED_KV_AXES))
        else:
            q = self.project_query(x, positions=positions)
        return self.attend(q, slots_major(state.k), slots_major(state.v), mask, bias, x=x), state


def attention(q, k, v, mask: Mask | None = None, bias=None, *, scale: float,
              softcap: float | None = None, sinks=None, implementation: str = "auto",
              context_parallel: str = "ring", zigzag: str = "data", ulysses_size: int = 1,
              q_offset=0, kv_offset=0):
    """A layer's attention of q `[B,T,N,H]`, k `[B,S,K,H]`, v `[B,S,K,Hv]` ->
    `[B,T,N,Hv]`: context-parallel under a sequence-splitting mesh (`context_parallel`,
    `zigzag` and `ulysses_size` say how; only for a per-tile bias and no offsets), else
    `dot_product_attention`. `bias`: None, an additive array, a `tfjax.ops.Alibi` or
    a `tfjax.ops.RelativeBias`. Shared by every attention-like mixer.

    Its hook points (`tfjax.nn.hooks`): `hook_attn_scores` and `hook_pattern`
    `[B,N,T,S]`, computed only when a hook session asks, by the reference
    (`pattern_attention`) whatever the implementation."""
    kw = dict(scale=scale, softcap=softcap, sinks=sinks, implementation=implementation,
              context_parallel=context_parallel, zigzag=zigzag, ulysses_size=ulysses_size,
              q_offset=q_offset, kv_offset=kv_offset)
    if active("hook_attn_scores", "hook_pattern"):
        return pattern_attention(q, k, v, mask, bias, **kw)
    return _attention(q, k, v, mask, bias, **kw)


def pattern_attention(q, k, v, mask: Mask | None = None, bias=None, **kw):
    """`attention` with its scores and pattern materialised by the reference
    (`tfjax.ops.reference.attention_scores`, `attention_pattern`) for the hook points
    `hook_attn_scores` and `hook_pattern`: the output is the implementation's, or
    where a hook function replaced the scores or the pattern, the pattern's average
    of the values."""
    if zigzag_data_devices():
        raise ValueError("attention patterns (hook_pattern, hook_attn_scores) cannot read a "
                         "zig-zag ordered batch; use model.attention.zigzag='layer'")
    extra = {}
    if isinstance(bias, Alibi):
        extra, array_bias = Alibi.kwargs(bias), None
    elif isinstance(bias, RelativeBias):
        extra, array_bias = dict(relative_bias=bias), None
    else:
        array_bias = bias
    kd, vd = dense(k), dense(v)  # a paged cache's pages, gathered
    scores = attention_scores(q, kd, mask, bias=array_bias, scale=kw["scale"],
                              softcap=kw["softcap"], q_offset=kw["q_offset"],
                              kv_offset=kw["kv_offset"], **extra)
    scores = hook("hook_attn_scores", scores)
    sinks = kw["sinks"]
    pattern = hook("hook_pattern", attention_pattern(scores, sinks))
    hit = [patched("hook_attn_scores"), patched("hook_pattern")]  # bools, or traced ones
    if all(h is False for h in hit):
        return _attention(q, k, v, mask, bias, **kw)
    by_pattern = attend_pattern(pattern, vd).astype(q.dtype)
    if any(h is True for h in hit):
        return by_pattern
    return jnp.where(hit[0] | hit[1], by_pattern, _attention(q, k, v, mask, bias, **kw))


def _attention(q, k, v, mask, bias, *, scale, softcap, sinks, implementation,
               context_parallel, zigzag, ulysses_size, q_offset, kv_offset):
    """`attention` without hook points: the model's own path."""
    is_alibi, is_relative = isinstance(bias, Alibi), isinstance(bias, RelativeBias)
    per_tile = bias is None or is_alibi or is_relative  # not an array
    if per_tile and _is_zero(q_offset) and _is_zero(kv_offset):
        out = context_parallel_attention(q, k, v, mask, mode=context_parallel, zigzag=zigzag,
                                         implementation=implementation, scale=scale,
                                         softcap=softcap, alibi=bias if is_alibi else None,
                                         relative_bias=bias if is_relative else None,
                                         sinks=sinks, ulysses_size=ulysses_size)
        if out is not None:
            return out
    elif zigzag_data_devices():
        # The tokens are in zig-zag order; a bias [B,N,T,S] or offsets would be
        # read against the wrong positions by a mask in natural index order.
        raise ValueError("attention with a bias array or offsets cannot read a "
                         "zig-zag ordered batch; use model.attention.zigzag='layer'")
    extra = {}  # a position bias evaluated per tile
    if is_alibi:
        extra, bias = Alibi.kwargs(bias), None
    elif is_relative:
        extra, bias = dict(relative_bias=bias), None
    return dot_product_attention(q, k, v, mask, bias=bias, scale=scale, softcap=softcap,
                                 implementation=implementation, q_offset=q_offset,
                                 kv_offset=kv_offset, sinks=sinks, **extra)


def head_projections(d_model: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
                     v_head_dim: int | None = None, context_dim: int | None = None,
                     out_dim: int | None = None, qkv_bias: bool = False,
                     k_bias: bool | None = None, out_bias: bool = False, dtype: DType = jnp.float32,
                     param_dtype: DType = jnp.float32, init_std: float = 0.02,
                     out_init_std: float | None = None, rngs: nnx.Rngs):
    """The four einsum projections of an attention-like mixer: q `[D, N, H]`, k
    `[Dc, K, H]`, v `[Dc, K, Hv]` (Dc: `context_dim`, default D; Hv: `v_head_dim`,
    default H), o `[N, Hv, Do]` (Do: `out_dim`, default D), each with its
    logical axis names ("embed", "heads" / "kv_heads", "head_dim") and an optional
    zero-initialised bias (k's: `k_bias`, default `qkv_bias`); N(0, init_std) kernels,
    o's N(0, out_init_std)."""
    Dc, Hv = context_dim or d_model, v_head_dim or head_dim
    normal = nnx.initializers.normal(init_std)
    out_normal = nnx.initializers.normal(init_std if out_init_std is None else out_init_std)
    zeros = nnx.initializers.zeros_init()

    def proj(spec, shape, names, bias_names, init, use_bias):
        return nnx.Einsum(spec, shape, shape[-len(bias_names):] if use_bias else None,
                          dtype=dtype, param_dtype=param_dtype,
                          kernel_init=with_logical_axes(init, names),
                          bias_init=with_logical_axes(zeros, bias_names), rngs=rngs)

    q = proj("BTD,DNH->BTNH", (d_model, num_heads, head_dim), ("embed", "heads", "head_dim"),
             ("heads", "head_dim"), normal, qkv_bias)
    k = proj("BSD,DKH->BSKH", (Dc, num_kv_heads, head_dim), ("embed", "kv_heads", "head_dim"),
             ("kv_heads", "head_dim"), normal, qkv_bias if k_bias is None else k_bias)
    v = proj("BSD,DKH->BSKH", (Dc, num_kv_heads, Hv), ("embed", "kv_heads", "head_dim"),
             ("kv_heads", "head_dim"), normal, qkv_bias)
    o = proj("BTNH,NHD->BTD", (num_heads, Hv, out_dim or d_model), ("heads", "head_dim", "embed"),
             ("embed",), out_normal, out_bias)
    return q, k, v, o


def diff_lambda_init(layer):
    """Differential attention's lam_init of 0-based layer `layer` (an int, or traced
    under a scanned stack): 0.8 - 0.6 exp(-0.3 layer), the paper's l - 1 = layer."""
    return 0.8 - 0.6 * jnp.exp(-0.3 * jnp.asarray(layer, jnp.float32))


def _is_zero(offset) -> bool:
    return isinstance(offset, int) and offset == 0
