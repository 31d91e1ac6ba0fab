"""Transformer blocks shared across layers, each use with its own adapters (Zamba2,
arXiv:2411.15242).

`SharedBlock` holds one set of attention + MLP weights that several layers run;
`SharedBlockUse` a use's own low-rank adapters (on q, k, v and the MLP) and output
projection: `use(x, block=, embeddings=) -> t [B, T, D]`, from `[x; e]` (width
W = 2D, or D without the concatenation), added to the layer's mixer input. Each use
keeps its own K/V cache; the shared weights' gradient sums the uses.
See docs/layers.md.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from tfjax.config import SharedBlockConfig
from tfjax.nn.attention import MultiHeadAttention
from tfjax.nn.ffn import FeedForward
from tfjax.parallel.sharding import shard, with_logical_axes
from tfjax.typing import DType

__all__ = ["SharedBlock", "SharedBlockUse"]


class SharedBlock(nnx.Module):
    """The shared weights: `in_norm` (width W), `attn` (W in, D out), `ffn_norm` and
    `ffn` (width D), composed from built submodules (it knows nothing of configs).
    `concat_embedding`: the block reads [x; e] (W = 2D), else x (W = D)."""

    def __init__(self, *, attn: MultiHeadAttention, ffn: FeedForward, in_norm: nnx.Module,
                 ffn_norm: nnx.Module, concat_embedding: bool = True):
        self.attn, self.ffn, self.in_norm, self.ffn_norm = attn, ffn, in_norm, ffn_norm
        self.concat_embedding = concat_embedding

    def __call__(self, x, embeddings, use: "SharedBlockUse", *, mask=None, bias=None,
                 positions=None, state=None, slots=None):
        """x, embeddings `[B,T,D]` -> y `[B,T,D]` (before the use's `out`) with `use`'s
        adapters; with `state` (the use's K/V, `attn.init_state`) and the step's `slots`
        -> `(y, new_state)`."""
        h = jnp.concatenate([x, embeddings.astype(x.dtype)], axis=-1) if self.concat_embedding \
            else x
        a = self.attn(self.in_norm(h), mask=mask, bias=bias, positions=positions, state=state,
                      slots=slots, adapter=use.qkv_deltas if use.has_attn_adapter else None)
        if state is not None:
            a, state = a
        y = self.ffn(self.ffn_norm(a), adapter=use.mlp_deltas if use.has_mlp_adapter else None)
        y = shard(y, ("batch", "length", "embed"))
        return y if state is None else (y, state)


class SharedBlockUse(nnx.Module):
    """One use of a shared block: its adapters and its output projection `out` `[D, D]`.
    `shared` (`tfjax.config.SharedBlockConfig`): the adapters' rank `adapter_rank`
    (none when 0) and which exist, `attn_adapter` and `mlp_adapter` (its `d_ff` is
    not read: `d_ff` is the block's MLP width, resolved by the caller). Called with
    the block it uses: `use(x, block=, embeddings=, mask=, bias=, positions=, state=,
    slots=)` -> t `[B,T,D]` (and the new state of the block's attention with `state`)."""

    def __init__(self, d_model: int, width: int, shared: SharedBlockConfig = SharedBlockConfig(),
                 *, num_heads: int, num_kv_heads: int, head_dim: int, v_head_dim: int,
                 d_ff: int, gated: bool, dtype: DType = jnp.float32,
                 param_dtype: DType = jnp.float32, init_std: float = 0.02, rngs: nnx.Rngs):
        rank = shared.adapter_rank
        self.dtype = dtype
        normal = nnx.initializers.normal(init_std)

        def param(shape, names):
            return nnx.Param(with_logical_axes(normal, names)(rngs.params(), shape, param_dtype))

        self.has_attn_adapter = bool(rank and shared.attn_adapter)
        self.has_mlp_adapter = bool(rank and shared.mlp_adapter)
        if self.has_attn_adapter:
            W, r = width, rank
            self.q_a, self.k_a, self.v_a = (param((W, r), ("embed", None)) for _ in range(3))
            self.q_b = param((r, num_heads, head_dim), (None, "heads", "head_dim"))
            self.k_b = param((r, num_kv_heads, head_dim), (None, "kv_heads", "head_dim"))
            self.v_b = param((r, num_kv_heads, v_head_dim), (None, "kv_heads", "head_dim"))
        if self.has_mlp_adapter:
            self.mlp_a = param((d_model, rank), ("embed", None))
            self.mlp_b = param((rank, 2 if gated else 1, d_ff), (None, None, "mlp"))
        self.out = param((d_model, d_model), ("embed", None))

    def _low_rank(self, x, a, b):
        """(x A) B: x `[B,T,W]`, A `[W, r]`, B `[r, ...]` -> `[B, T, ...]`."""
        dt = self.dtype
        xa = jnp.einsum("BTW,WR->BTR", x.astype(dt), a[...].astype(dt))
        return jnp.einsum("BTR,R...->BT...", xa, b[...].astype(dt))

    def qkv_deltas(self, x, context):
        """The attention adapters' (dq `[B,T,N,H]`, dk, dv `[B,S,K,H]`) of the block's
        normed input (`MultiHeadAttention.project`'s `adapter`)."""
        return (self._low_rank(x, self.q_a, self.q_b), self._low_rank(context, self.k_a, self.k_b),
                self._low_rank(context, self.v_a, self.v_b))

    def mlp_deltas(self, x):
        """The MLP adapter's deltas of its input projections (`FeedForward`'s `adapter`):
        (d_gate, d_up) `[B,T,F]` each, or (d_wi,) ungated."""
        d = self._low_rank(x, self.mlp_a, self.mlp_b)  # [B, T, 1 | 2, F]
        return tuple(d[:, :, i] for i in range(d.shape[2]))

    def __call__(self, x, *, block: SharedBlock, embeddings, mask=None, bias=None,
                 positions=None, state=None, slots=None):
        out = block(x, embeddings, self, mask=mask, bias=bias, positions=positions, state=state,
                    slots=slots)
        y, state = out if state is not None else (out, None)
        t = jnp.einsum("BTD,DE->BTE", y.astype(self.dtype), self.out[...].astype(self.dtype))
        t = shard(t, ("batch", "length", "embed"))
        return t if state is None else (t, state)
