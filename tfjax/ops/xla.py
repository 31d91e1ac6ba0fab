"""`implementation="xla"`: `jax.nn.dot_product_attention(implementation="xla")`.

XLA's own fused attention, on any backend. It materialises what jax.nn takes: the
mask's dense view `[B|1, 1, T, S]` and ALiBi as a dense bias. It has no logit
soft-cap and returns no logsumexp, so it refuses those requests and learned sinks
(which the dispatch adds through the logsumexp). jax.nn averages
the values uniformly on a fully masked row; this wrapper returns zeros there, as
every implementation does. jax.nn takes one head dim for q, k and v: values of
a head dim of their own are served by zero-padding the narrower of (q, k) and v
to the wider (dot products and outputs unchanged; the output is sliced back).
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
    if r.has_sinks:
        return ("jax.nn.dot_product_attention has no attention sinks and returns no logsumexp "
                "to add them to (use 'blockwise', 'pallas' or 'reference')")
    return None


def xla_attention(q, k, v, mask, *, bias, alibi, scale, softcap, q_offset, kv_offset,
                  return_lse):
    del softcap, return_lse  # refused by `supports`
    T, S = q.shape[1], k.shape[1]
    H, Hv = q.shape[-1], v.shape[-1]
    if H != Hv:  # one head dim for jax.nn: zeros change no dot product
        scale = H ** -0.5 if scale is None else scale
        widen = lambda x: jnp.pad(x, [(0, 0)] * 3 + [(0, max(H, Hv) - x.shape[-1])])
        q, k, v = widen(q), widen(k), widen(v)
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
    return out[..., :Hv]


IMPLEMENTATION = Implementation(xla_attention, supports)
