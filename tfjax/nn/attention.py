"""Multi-head attention (Vaswani et al. 2017) with grouped / multi-query heads.

One module serves MHA (K = N), GQA (Ainslie et al. 2023, 1 < K < N) and MQA
(Shazeer 2019, K = 1), self- and cross-attention. Design choices:

- Projections are einsums over explicit head axes (`BTD,DNH->BTNH`), so
  parameters carry logical names per axis ("embed", "heads", "kv_heads",
  "head_dim") and tensor parallelism splits heads with a rules change.
- K/V are projected to K heads only and never repeated: the attention op groups
  the N query heads as [K, G] (the kv head of query head n is n // G).
- Optional QK-norm (Dehghani et al. 2023) normalises q and k before RoPE, per head
  over H (`qk_norm_over="head"`: Qwen3, Gemma 3) or over the whole projection, all
  heads at once (`"projection"`: OLMo 2); soft-capping (Gemma 2) and a scale
  override (Gemma's query_pre_attn_scalar, T5's unscaled logits) pass to the op.
- `temperature=(floor, scale)`: Llama 4's query temperature for layers without
  RoPE, `q *= 1 + scale * ln(1 + floor((p + 1) / floor))` at query position p,
  which keeps long-context attention sharp.
- Values may have a head dim of their own (`v_head_dim`, DeepSeek's 128 against
  q/k's 192); `sinks=True` learns gpt-oss's per-head sink logit (`[N]`, N(0,
  init_std) at init as gpt-oss's; `tfjax.ops.sinks`), which every implementation
  and cache path receives.
- The attention itself is `tfjax.ops.dot_product_attention`: the layer never
  chooses a kernel, `implementation` does (default "auto").
- Context parallelism: under an active mesh whose rules split "length" over a
  mesh axis of size > 1 (the trainer with `mesh.sequence > 1`), self-attention
  runs as `context_parallel` says: "ring" (ring attention, K/V circulate) or
  "all_gather" (each device gathers the whole K/V); see
  `tfjax.parallel.context_parallel`. `implementation` reaches it too: the ring
  runs it per block ("auto", "blockwise" or "pallas"; any other raises while
  tracing, naming these), all-gather per device. `zigzag` balances the causal
  ring: "data" (inside the trainer's steps the batch is already in zig-zag order,
  so no per-layer re-layout), "layer" or "none".
- `project(...)` and `attend(...)` are separate so a KV cache can sit between
  them (the inference code stores k, v after RoPE).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from tfjax.nn.norms import make_norm
from tfjax.nn.positions import RotaryEmbedding, default_positions
from tfjax.ops import Alibi, RelativeBias, dot_product_attention
from tfjax.ops.masks import Mask
from tfjax.parallel.context_parallel import CONTEXT_PARALLEL_MODES, context_parallel_attention
from tfjax.parallel.sharding import shard, with_logical_axes
from tfjax.parallel.zigzag import ZIGZAG_MODES, zigzag_data_devices
from tfjax.typing import DType

__all__ = ["MultiHeadAttention", "attention", "head_projections"]


class MultiHeadAttention(nnx.Module):
    """`x [B,T,D]` (and `context [B,S,Dc]` for cross-attention) -> `[B,T,D]`."""

    def __init__(self, d_model: int, num_heads: int, *, num_kv_heads: int | None = None,
                 head_dim: int | None = None, v_head_dim: int | None = None,
                 context_dim: int | None = None, sinks: bool = False,
                 qkv_bias: bool = False, out_bias: bool = False, qk_norm: bool = False,
                 qk_norm_kind: str = "rmsnorm", qk_norm_over: str = "head",
                 norm_eps: float = 1e-6, temperature: tuple[int, float] | None = None,
                 scale: float | None = None, softcap: float | None = None,
                 rope: RotaryEmbedding | None = None, implementation: str = "auto",
                 context_parallel: str = "ring", zigzag: str = "data",
                 dtype: DType = jnp.float32, param_dtype: DType = jnp.float32,
                 init_std: float = 0.02, out_init_std: float | None = None, rngs: nnx.Rngs):
        K = num_kv_heads or num_heads
        if num_heads % K:
            raise ValueError(f"num_kv_heads={K} must divide num_heads={num_heads}")
        H = head_dim or d_model // num_heads
        if not head_dim and d_model % num_heads:
            raise ValueError(f"d_model={d_model} is not divisible by num_heads={num_heads}; "
                             "pass head_dim")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, K, H
        self.v_head_dim = v_head_dim or H
        self.scale = H ** -0.5 if scale is None else scale
        self.softcap = softcap or None
        self.rope = rope
        self.implementation = implementation
        if context_parallel not in CONTEXT_PARALLEL_MODES:
            raise ValueError(f"context_parallel: got {context_parallel!r}; allowed: "
                             f"{', '.join(map(repr, CONTEXT_PARALLEL_MODES))}")
        self.context_parallel = context_parallel
        if zigzag not in ZIGZAG_MODES:
            raise ValueError(f"zigzag: got {zigzag!r}; allowed: "
                             f"{', '.join(map(repr, ZIGZAG_MODES))}")
        self.zigzag = zigzag
        self.q, self.k, self.v, self.o = head_projections(
            d_model, num_heads, K, H, v_head_dim=self.v_head_dim, context_dim=context_dim,
            qkv_bias=qkv_bias, out_bias=out_bias, dtype=dtype, param_dtype=param_dtype,
            init_std=init_std, out_init_std=out_init_std, rngs=rngs)
        if sinks:
            init = with_logical_axes(nnx.initializers.normal(init_std), ("heads",))
            self.sinks = nnx.Param(init(rngs.params(), (num_heads,), param_dtype))
        else:
            self.sinks = None
        if qk_norm_over not in ("head", "projection"):
            raise ValueError(f"qk_norm_over: got {qk_norm_over!r}; allowed: 'head', 'projection'")
        self.qk_norm_over = qk_norm_over
        if qk_norm:
            per = 1 if qk_norm_over == "head" else None  # "projection": N*H and K*H wide
            self.q_norm = make_norm(qk_norm_kind, H * (per or num_heads), eps=norm_eps,
                                    dtype=dtype, param_dtype=param_dtype, rngs=rngs)
            self.k_norm = make_norm(qk_norm_kind, H * (per or K), eps=norm_eps, dtype=dtype,
                                    param_dtype=param_dtype, rngs=rngs)
        else:
            self.q_norm = self.k_norm = None
        if temperature is not None and (temperature[0] < 1 or rope is not None):
            raise ValueError(f"temperature=(floor, scale) needs floor >= 1 and no RoPE (Llama 4's "
                             f"NoPE layers), got {temperature} with rope={rope is not None}")
        self.temperature = temperature

    def project(self, x, context=None, *, positions=None, kv_positions=None):
        """q `[B,T,N,H]`, k `[B,S,K,H]`, v `[B,S,K,Hv]`; q and k after QK-norm and RoPE."""
        context = x if context is None else context
        q = shard(self.q(x), ("batch", "length", "heads", "head_dim"))
        k = shard(self.k(context), ("batch", "length", "kv_heads", "head_dim"))
        v = shard(self.v(context), ("batch", "length", "kv_heads", "head_dim"))
        if self.q_norm is not None:
            q, k = self._norm(self.q_norm, q), self._norm(self.k_norm, k)
        if self.rope is not None or self.temperature is not None:
            if positions is None:
                positions = default_positions(x)
            if kv_positions is None:
                kv_positions = positions if context is x else default_positions(context)
        if self.rope is not None:
            q, k = self.rope(q, positions), self.rope(k, kv_positions)
        return self._temper(q, positions), k, v

    def _norm(self, norm, x):
        """QK-norm of x `[B, L, n, H]`: per head, or over the whole projection."""
        if self.qk_norm_over == "head":
            return norm(x)
        return norm(x.reshape(*x.shape[:2], -1)).reshape(x.shape)

    def _temper(self, q, positions):
        """Llama 4's NoPE query temperature at `positions` `[B, T]` (see the module)."""
        if self.temperature is None:
            return q
        floor, scale = self.temperature
        t = 1.0 + scale * jnp.log1p(jnp.floor((positions.astype(jnp.float32) + 1.0) / floor))
        return (q * t[:, :, None, None]).astype(q.dtype)

    def attend(self, q, k, v, mask: Mask | None = None, bias=None, *, q_offset=0, kv_offset=0):
        """`bias`: None, an additive `[B|1, N|1, T, S]` array, a `tfjax.ops.Alibi` or
        a `tfjax.ops.RelativeBias` (T5; both evaluated per tile by the tiled
        implementations)."""
        out = attention(q, k, v, mask, bias, scale=self.scale, softcap=self.softcap,
                        sinks=None if self.sinks is None else self.sinks[...],
                        implementation=self.implementation,
                        context_parallel=self.context_parallel, zigzag=self.zigzag,
                        q_offset=q_offset, kv_offset=kv_offset)
        return shard(self.o(out), ("batch", "length", "embed"))

    def project_query(self, x, *, positions=None):
        """q `[B,T,N,H]` alone (after QK-norm and RoPE): cross-attention decode steps
        reuse the cached K/V of the encoder output."""
        q = shard(self.q(x), ("batch", "length", "heads", "head_dim"))
        if self.q_norm is not None:
            q = self._norm(self.q_norm, q)
        positions = default_positions(x) if positions is None else positions
        if self.rope is not None:
            q = self.rope(q, positions)
        return self._temper(q, positions)

    def __call__(self, x, context=None, *, mask: Mask | None = None, bias=None, positions=None,
                 kv_positions=None, cache=None):
        """With `cache` (a `tfjax.inference.kv_cache` layer cache), the cache decides
        what to project, store and attend over, and this returns `(out, new_cache)`."""
        if cache is not None:
            return cache.apply(self, x, context, mask=mask, bias=bias, positions=positions,
                               kv_positions=kv_positions)
        q, k, v = self.project(x, context, positions=positions, kv_positions=kv_positions)
        return self.attend(q, k, v, mask, bias)


def attention(q, k, v, mask: Mask | None = None, bias=None, *, scale: float,
              softcap: float | None = None, sinks=None, implementation: str = "auto",
              context_parallel: str = "ring", zigzag: str = "data", q_offset=0, kv_offset=0):
    """A layer's attention of q `[B,T,N,H]`, k `[B,S,K,H]`, v `[B,S,K,Hv]` ->
    `[B,T,N,Hv]`: context-parallel under a sequence-splitting mesh (`context_parallel`
    and `zigzag` say how; only for a per-tile bias and no offsets), else
    `dot_product_attention`. `bias`: None, an additive array, a `tfjax.ops.Alibi` or
    a `tfjax.ops.RelativeBias`. Shared by every attention-like mixer."""
    is_alibi, is_relative = isinstance(bias, Alibi), isinstance(bias, RelativeBias)
    per_tile = bias is None or is_alibi or is_relative  # not an array
    if per_tile and _is_zero(q_offset) and _is_zero(kv_offset):
        out = context_parallel_attention(q, k, v, mask, mode=context_parallel, zigzag=zigzag,
                                         implementation=implementation, scale=scale,
                                         softcap=softcap, alibi=bias if is_alibi else None,
                                         relative_bias=bias if is_relative else None,
                                         sinks=sinks)
        if out is not None:
            return out
    elif zigzag_data_devices():
        # The tokens are in zig-zag order; a bias [B,N,T,S] or offsets would be
        # read against the wrong positions by a mask in natural index order.
        raise ValueError("attention with a bias array or offsets cannot read a "
                         "zig-zag ordered batch; use model.zigzag='layer'")
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
                     qkv_bias: bool = False,
                     out_bias: bool = False, dtype: DType = jnp.float32,
                     param_dtype: DType = jnp.float32, init_std: float = 0.02,
                     out_init_std: float | None = None, rngs: nnx.Rngs):
    """The four einsum projections of an attention-like mixer: q `[D, N, H]`, k
    `[Dc, K, H]`, v `[Dc, K, Hv]` (Dc: `context_dim`, default D; Hv: `v_head_dim`,
    default H), o `[N, Hv, D]`, each with its
    logical axis names ("embed", "heads" / "kv_heads", "head_dim") and an optional
    zero-initialised bias; N(0, init_std) kernels, o's N(0, out_init_std)."""
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
             ("kv_heads", "head_dim"), normal, qkv_bias)
    v = proj("BSD,DKH->BSKH", (Dc, num_kv_heads, Hv), ("embed", "kv_heads", "head_dim"),
             ("kv_heads", "head_dim"), normal, qkv_bias)
    o = proj("BTNH,NHD->BTD", (num_heads, Hv, d_model), ("heads", "head_dim", "embed"),
             ("embed",), out_normal, out_bias)
    return q, k, v, o


def _is_zero(offset) -> bool:
    return isinstance(offset, int) and offset == 0
