"""`implementation="xla"`: `jax.nn.dot_product_attention(implementation="xla")`.

XLA's own fused attention, on any backend. It materialises what jax.nn takes: the
mask's dense view `[B|1, 1, T, S]` and ALiBi as a dense bias. It has no logit
soft-cap and returns no logsumexp, so it refuses those requests. jax.nn averages
the values uniformly on a fully masked row; this wrapper returns zeros there, as
every implementation does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tfjax.ops.implementation import AttentionRequest, Implementation

__all__ = ["IMPLEMENTATION", "supports", "xla_attention"]


def supports(r: AttentionRequest) -> str | None:
    if r.softcap:
        return "jax.nn.dot_product_attention has no logit soft-cap (use 'reference')"
    if r.return_lse:
        return "jax.nn.dot_product_attention does not return the logsumexp"
    return None


def xla_attention(q, k, v, mask, *, bias, alibi, scale, softcap, q_offset, kv_offset,
                  return_lse):
    del softcap, return_lse  # refused by `supports`
    T, S = q.shape[1], k.shape[1]
    if alibi is not None:  # materialised, like any bias jax.nn takes
        a = alibi.dense(T, S, q_offset, kv_offset)
        bias = a if bias is None else bias.astype(jnp.float32) + a
    allowed = None
    if mask is not None:
        allowed = mask.dense(T, S, q_offset=q_offset, kv_offset=kv_offset)[:, None]  # [B|1,1,T,S]
    out = jax.nn.dot_product_attention(q, k, v, bias=bias, mask=allowed, scale=scale,
                                       implementation="xla")
    if allowed is not None:  # jax gives a uniform average on fully masked rows; we give 0
        any_key = jnp.any(allowed[:, 0], axis=-1)  # [B|1, T]
        out = jnp.where(any_key[:, :, None, None], out, jnp.zeros((), out.dtype))
    return out


IMPLEMENTATION = Implementation(xla_attention, supports)
