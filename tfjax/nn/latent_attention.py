"""Multi-head Latent Attention (DeepSeek-V2, DeepSeek-V3): keys and values from one
small latent per token, `c = RMSNorm(x W_dkv)` `[B, S, r]`, plus one rotary key
`k_pe` `[B, S, dr]` shared by the heads.

`MultiHeadLatentAttention(d_model, num_heads, mla, rope=, attention=)`: `x [B, T, D]
-> [B, T, D]`, materialised (per-head K/V, every flash implementation) for training
and prefill, absorbed (`W_uk` folded into the queries, MQA over the latents) for
decoding over a cache. `init_state` makes a `LatentCache` of `[c; k_pe]`, r + dr
values per token; `mla_scale` is DeepSeek's softmax scale. See docs/layers.md.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from tfjax.config import AttentionConfig, MLAConfig
from tfjax.nn.attention import attention
from tfjax.nn.norms import make_norm
from tfjax.nn.positions import RotaryEmbedding, default_positions
from tfjax.nn.state import DecodeState, Slots, cached_attention, decode_state
from tfjax.ops.masks import Mask
from tfjax.ops.paged import dense, split_runs
from tfjax.parallel.sharding import shard, with_logical_axes
from tfjax.typing import DType

__all__ = ["LatentCache", "MultiHeadLatentAttention", "mla_scale"]

LATENT_AXES = ("batch", None, "latent")  # [B, S, r + dr]


@decode_state
class LatentCache(DecodeState):
    """Per token only the normalised latent and the rotated shared key, `latent` `[B,
    size, r + dr]`; slots as a `KVCache`'s. A prefill runs the materialised form over
    the fresh tokens; a decode step or a chunk the absorbed form over the slots (and
    the chunk's fresh latents)."""

    latent: jax.Array
    AXES = {"latent": LATENT_AXES}
    rewindable = True
    pageable = True
    reads_runs = True


def mla_scale(qk_head_dim: int, *, rope_scaling: str = "none", rope_factor: float = 1.0,
              mscale_all_dim: float = 0.0) -> float:
    """DeepSeek's softmax scale: `qk_head_dim^-1/2`, times `m^2` with `m = 0.1 *
    mscale_all_dim * ln(rope_factor) + 1` under YaRN (`rope_scaling="yarn"`,
    factor > 1 and mscale_all_dim > 0)."""
    scale = qk_head_dim ** -0.5
    if rope_scaling == "yarn" and rope_factor > 1.0 and mscale_all_dim > 0:
        m = 0.1 * mscale_all_dim * math.log(rope_factor) + 1.0  # a Python float: traceable
        scale *= m * m
    return scale


class MultiHeadLatentAttention(nnx.Module):
    """`x [B,T,D]` -> `[B,T,D]` with DeepSeek's latent attention (docs/layers.md).

    Parameters (logical axes in brackets): `q` `[D, N, dn+dr]` or `q_a` `[D, rq]` +
    `q_norm` + `q_b` `[rq, N, dn+dr]`; `kv_a` `[D, r+dr]` (the latent and the rotary
    key); `kv_norm` over r; `kv_b` `[r, N, dn+dv]`; `o` `[N, dv, D]`. No biases.
    `mla` (`tfjax.config.MLAConfig`): the ranks and head dims (its `mscale_all_dim`
    enters through the scale: `mla_scale`). `rope` rotates the dr-dim parts (its
    head_dim must be `qk_rope_head_dim`); None: no positions (the dr parts are then
    plain dot products). `attention` (`tfjax.config.AttentionConfig`): only its
    `scale` (0: (dn + dr)^-1/2), `impl`, `context_parallel` and `zigzag` are read."""

    def __init__(self, d_model: int, num_heads: int, mla: MLAConfig, *,
                 rope: RotaryEmbedding | None = None,
                 attention: AttentionConfig = AttentionConfig(), norm_eps: float = 1e-6,
                 dtype: DType = jnp.float32, param_dtype: DType = jnp.float32,
                 init_std: float = 0.02, out_init_std: float | None = None, rngs: nnx.Rngs):
        N, r, dn, dr = num_heads, mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim
        dv, q_lora_rank = mla.v_head_dim, mla.q_lora_rank
        for name, value in (("kv_lora_rank", r), ("qk_rope_head_dim", dr), ("v_head_dim", dv)):
            if value < 1:
                raise ValueError(f"MultiHeadLatentAttention: {name} must be >= 1, got {value}")
        if dn < 0 or q_lora_rank < 0:
            raise ValueError("MultiHeadLatentAttention: qk_nope_head_dim and q_lora_rank must "
                             f"be >= 0, got {dn} and {q_lora_rank}")
        if rope is not None and rope.head_dim != dr:
            raise ValueError(f"MultiHeadLatentAttention: rope.head_dim={rope.head_dim} must be "
                             f"qk_rope_head_dim={dr} (RoPE rotates the decoupled part only)")
        self.num_heads, self.kv_lora_rank = N, r
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = dn, dr, dv
        self.scale = attention.scale or (dn + dr) ** -0.5
        self.rope, self.implementation = rope, attention.impl
        self.context_parallel, self.zigzag = attention.context_parallel, attention.zigzag
        self.ulysses_size = attention.ulysses_size
        normal = nnx.initializers.normal(init_std)
        out_normal = nnx.initializers.normal(init_std if out_init_std is None else out_init_std)

        def proj(spec, shape, names, init=normal):
            return nnx.Einsum(spec, shape, None, dtype=dtype, param_dtype=param_dtype,
                              kernel_init=with_logical_axes(init, names), rngs=rngs)

        def norm(dim):
            return make_norm("rmsnorm", dim, eps=norm_eps, dtype=dtype, param_dtype=param_dtype,
                             rngs=rngs)

        if q_lora_rank:
            self.q_a = proj("BTD,DR->BTR", (d_model, q_lora_rank), ("embed", "latent"))
            self.q_norm = norm(q_lora_rank)
            self.q_b = proj("BTR,RNH->BTNH", (q_lora_rank, N, dn + dr),
                            ("latent", "heads", "head_dim"))
            self.q = None
        else:
            self.q_a = self.q_norm = self.q_b = None
            self.q = proj("BTD,DNH->BTNH", (d_model, N, dn + dr), ("embed", "heads", "head_dim"))
        self.kv_a = proj("BSD,DR->BSR", (d_model, r + dr), ("embed", "latent"))
        self.kv_norm = norm(r)
        self.kv_b = proj("BSR,RNH->BSNH", (r, N, dn + dv), ("latent", "heads", "head_dim"))
        self.o = proj("BTNH,NHD->BTD", (N, dv, d_model), ("heads", "head_dim", "embed"),
                      out_normal)

    # -- the parts ---------------------------------------------------------- #

    def tables(self, positions):
        """`rope.tables(positions)`, or None without RoPE: one pair for q_pe and k_pe
        (`queries`, `latent`)."""
        return None if self.rope is None else self.rope.tables(positions)

    def _rotate(self, x, positions, tables=None):
        """RoPE of `x` `[B, T, n, dr]` at `positions` `[B, T]` (none without rope);
        `tables`: `tables(positions)` when the caller has them."""
        if self.rope is None:
            return x
        return self.rope.rotate(x, self.tables(positions) if tables is None else tables)

    def queries(self, x, positions, tables=None):
        """(q_nope `[B,T,N,dn]`, q_pe `[B,T,N,dr]` rotated)."""
        q = self.q(x) if self.q is not None else self.q_b(self.q_norm(self.q_a(x)))
        q = shard(q, ("batch", "length", "heads", "head_dim"))
        dn = self.qk_nope_head_dim
        return q[..., :dn], self._rotate(q[..., dn:], positions, tables)

    def latent(self, x, positions, tables=None):
        """`[B, S, r + dr]`: the normalised latent c and the rotated shared key k_pe, what
        a cache stores per token."""
        a = self.kv_a(x)
        r = self.kv_lora_rank
        k_pe = self._rotate(a[..., None, r:], positions, tables)[..., 0, :]
        return jnp.concatenate([self.kv_norm(a[..., :r]), k_pe.astype(a.dtype)], axis=-1)

    def expand(self, latent):
        """Per-head keys `[B,S,N,dn+dr]` and values `[B,S,N,dv]` from `latent` `[B,S,r+dr]`."""
        r, dn = self.kv_lora_rank, self.qk_nope_head_dim
        kv = self.kv_b(latent[..., :r])  # [B, S, N, dn + dv]
        k_pe = jnp.broadcast_to(latent[..., None, r:], (*kv.shape[:3], self.qk_rope_head_dim))
        k = jnp.concatenate([kv[..., :dn], k_pe.astype(kv.dtype)], axis=-1)
        k = shard(k, ("batch", "length", "heads", "head_dim"))
        return k, shard(kv[..., dn:], ("batch", "length", "heads", "head_dim"))

    # -- the two forms -------------------------------------------------------- #

    def attend(self, q_nope, q_pe, latent, mask: Mask | None = None, *, q_offset=0,
               kv_offset=0):
        """The materialised form: per-head K/V from `latent`, multi-head attention."""
        k, v = self.expand(latent)
        q = jnp.concatenate([q_nope, q_pe.astype(q_nope.dtype)], axis=-1)
        out = attention(q, k, v, mask, scale=self.scale, implementation=self.implementation,
                        context_parallel=self.context_parallel, zigzag=self.zigzag,
                        ulysses_size=self.ulysses_size, q_offset=q_offset,
                        kv_offset=kv_offset)  # [B, T, N, dv]
        return shard(self.o(out), ("batch", "length", "embed"))

    def attend_absorbed(self, q_nope, q_pe, latent, mask: Mask | None = None, *, q_offset=0,
                        kv_offset=0):
        """The absorbed form (decode): MQA over the latents, `W_uk` folded into the
        queries and `W_uv` applied to the attended latent."""
        r, dn = self.kv_lora_rank, self.qk_nope_head_dim
        kernel = self.kv_b.kernel  # weight-only quantized: tfjax.nn.quant.QuantizedKernel
        w = (kernel.dequantized() if hasattr(kernel, "dequantized") else kernel[...])
        w = w.astype(q_nope.dtype)  # [r, N, dn + dv]
        q_lat = jnp.einsum("BTNH,RNH->BTNR", q_nope, w[..., :dn])
        q = jnp.concatenate([q_lat, q_pe.astype(q_lat.dtype)], axis=-1)  # [B, T, N, r + dr]
        kv = latent[:, :, None, :].astype(q.dtype)  # [B, S, 1, r + dr]
        out = attention(q, kv, kv, mask, scale=self.scale, implementation=self.implementation,
                        context_parallel=self.context_parallel, zigzag=self.zigzag,
                        ulysses_size=self.ulysses_size, q_offset=q_offset,
                        kv_offset=kv_offset)
        out = jnp.einsum("BTNR,RNH->BTNH", out[..., :r], w[..., dn:])  # [B, T, N, dv]
        return shard(self.o(out), ("batch", "length", "embed"))

    def init_state(self, batch: int, size: int, dtype=jnp.float32, *,
                   window: int = 0) -> LatentCache:
        """An empty `LatentCache` of `size` slots (a latent layer has no window)."""
        if window:
            raise ValueError("a latent attention cache has no sliding window")
        return LatentCache(jnp.zeros((batch, size, self.kv_lora_rank + self.qk_rope_head_dim),
                                     dtype))

    def __call__(self, x, context=None, *, mask: Mask | None = None, bias=None, positions=None,
                 kv_positions=None, state: LatentCache | None = None, slots: Slots | None = None,
                 rope_tables=None):
        """Self-attention only (`context` must be None; `bias`: None, RoPE is the
        position signal; `rope_tables`: `rope.tables(positions)`, when a layer stack
        has them). Decoding: with `state` and the step's `slots` the new tokens'
        latents are written and attended (a prefill in the materialised form, a decode
        step or a chunk in the absorbed form), and this returns `(out, new_state)`."""
        if context is not None:
            raise ValueError("MultiHeadLatentAttention is self-attention: it takes no context")
        if bias is not None:
            raise ValueError("MultiHeadLatentAttention takes no attention bias (model.position "
                             "must be 'rope' or 'none' for 'mla' layers)")
        if state is not None:
            return self._step(x, state, slots, mask, positions)
        positions = default_positions(x) if positions is None else positions
        tables = self.tables(positions) if rope_tables is None else rope_tables
        q_nope, q_pe = self.queries(x, positions, tables)
        return self.attend(q_nope, q_pe, self.latent(x, positions, tables), mask)

    def _step(self, x, state: LatentCache, slots: Slots, mask, positions):
        tables = self.tables(positions)  # q_pe's and k_pe's
        q_nope, q_pe = self.queries(x, positions, tables)

        def attend(arrays, cached):  # the absorbed form over cached latents
            form, latent = (self.attend_absorbed if cached else self.attend), arrays[0]
            if not getattr(latent, "runs", ()):
                return form(q_nope, q_pe, dense(latent), mask)  # pages gathered
            R, C = latent.runs  # a ragged step: a run's pages gathered once
            (first, runs, runs_mask), (rest, single, single_mask) = split_runs(latent, mask)
            lead = lambda a: a[first].reshape(R, C, *a.shape[2:])  # noqa: E731
            out = form(lead(q_nope), lead(q_pe), dense(runs), runs_mask)
            return jnp.concatenate([out.reshape(R * C, 1, out.shape[-1]),
                                    form(q_nope[rest], q_pe[rest], dense(single), single_mask)])

        out, (latent,) = cached_attention((state.latent,), (self.latent(x, positions, tables),),
                                          slots, LATENT_AXES, attend)
        return out, state.replace(latent=latent)
