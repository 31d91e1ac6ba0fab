"""The one `custom_vjp` shell of the tiled attentions (blockwise and the Pallas
kernels), its zero cotangents, and the backward's per-row terms.

`attention_vjp(forward, backward)` -> `attention(cfg, q, k, v, mask, bias, alibi, rel,
offsets)` -> (out `[B,T,N,H]`, lse `[B,N,T]` fp32), with `cfg` static,
`forward(cfg, q, k, v, mask, bias, alibi, rel, offsets)` -> (out, lse) and
`backward(cfg, q, k, v, mask, bias, alibi, rel, offsets, out, lse, dout, dlse)` ->
(dq, dk, dv, dbias or None, dtable `[nb, N]` or None). The residuals are the inputs,
out and lse ("attn_out", "attn_lse" for remat policies); `backward_rows`,
`zero_cotangent` and `zero_cotangents` help the backwards. See docs/kernels.md.
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
