"""The one `custom_vjp` shell of the tiled attentions (blockwise and the Pallas
kernels), its zero cotangents, and the backward's per-row terms.

    attention = attention_vjp(forward, backward)
    out, lse = attention(cfg, q, k, v, mask, bias, alibi, rel, offsets)

`cfg` is static (hashable: the tiles, scale, soft-cap, ...); `mask` a
`tfjax.ops.masks.Mask` or None, `bias` `[B|1, N|1, T, S]` or None, `alibi` a
checked `tfjax.ops.Alibi` or None, `rel` a checked `tfjax.ops.RelativeBias` or
None, `offsets` any pytree of int32 arrays (the global positions of query row 0
and key 0). The implementation supplies

    forward(cfg, q, k, v, mask, bias, alibi, rel, offsets) -> (out [B,T,N,H], lse [B,N,T] fp32)
    backward(cfg, q, k, v, mask, bias, alibi, rel, offsets, out, lse, dout, dlse)
        -> (dq, dk, dv, dbias or None, dtable [nb, N] or None)

and optionally `forward_for_grad` (same signature as `forward`), the forward run
when the call is differentiated (blockwise lays out a batch of one differently
there). The saved residuals are the inputs, out and lse (O(T*H) activation
memory), out and lse named "attn_out" and "attn_lse" (`checkpoint_name`) so a
rematerialisation policy can keep them and never rerun the forward kernel in the
backward (`tfjax.models.stack.REMAT_POLICIES`); the logsumexp is differentiable
(`dlse`, which ring attention's merge of partial results needs). Cotangents: the
mask, ALiBi's slopes and the offsets get zeros (float0 for integers); T5's table
gets `dtable` in its dtype, its positions zeros.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

__all__ = ["attention_vjp", "backward_rows", "zero_cotangent", "zero_cotangents"]


def zero_cotangent(x):
    """The zero cotangent of `x`: zeros of its dtype, float0 for integers and bools."""
    x = jnp.asarray(x)
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.zeros_like(x)
    return jnp.zeros(x.shape, jax.dtypes.float0)


def zero_cotangents(tree):
    """`zero_cotangent` of every leaf of `tree` (None stays None)."""
    return jax.tree.map(zero_cotangent, tree)


def backward_rows(out, lse, dout, dtype, dlse=None):
    """The softmax backward's per-row terms for kernels reading `[B,T,N,H]` tiles:
    (dO in `dtype`, lse `[B,N,T]` fp32 with fully masked rows (-inf) at 0, where
    their probabilities are 0 anyway, and delta = rowsum(dO * O) - dlse `[B,N,T]`
    fp32)."""
    do = dout.astype(dtype)
    delta = jnp.einsum("BTNH,BTNH->BNT", do.astype(jnp.float32), out.astype(jnp.float32))
    if dlse is not None:
        delta = delta - dlse.astype(jnp.float32)
    return do, jnp.where(lse == -jnp.inf, 0.0, lse.astype(jnp.float32)), delta


def attention_vjp(forward: Callable, backward: Callable, *,
                  forward_for_grad: Callable | None = None) -> Callable:
    """The differentiable attention of `forward` and `backward` (see the module)."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
    def attention(cfg, q, k, v, mask, bias, alibi, rel, offsets):
        return forward(cfg, q, k, v, mask, bias, alibi, rel, offsets)

    def attention_fwd(cfg, *args):
        out, lse = (forward_for_grad or forward)(cfg, *args)
        out, lse = checkpoint_name(out, "attn_out"), checkpoint_name(lse, "attn_lse")
        return (out, lse), (*args, out, lse)

    def attention_bwd(cfg, res, cts):
        q, k, v, mask, bias, alibi, rel, offsets, out, lse = res
        dout, dlse = cts
        dq, dk, dv, dbias, dtable = backward(cfg, q, k, v, mask, bias, alibi, rel, offsets, out,
                                             lse, dout, dlse)
        rel_ct = None
        if rel is not None:  # the table's gradient; positions are integers
            rel_ct = dataclasses.replace(zero_cotangents(rel), table=dtable.astype(rel.table.dtype))
        return (dq, dk, dv, zero_cotangents(mask), dbias, zero_cotangents(alibi), rel_ct,
                zero_cotangents(offsets))

    attention.defvjp(attention_fwd, attention_bwd)
    return attention
