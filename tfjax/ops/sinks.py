"""Learned attention sinks (gpt-oss): one logit per query head in every row's softmax.

`sinks` `[N]` join each row's softmax denominator and carry no value.
`add_sinks(out, lse, sinks)` rescales a finished (out `[B,T,N,Hv]`, lse `[B,N,T]` fp32)
exactly: `lse' = logaddexp(lse, s)`, `out' = out * exp(lse - lse')`.
`sinks_gradient` is the sinks' gradient from the final out / lse (ring attention's
backward); `check_sinks` checks the shape. See docs/attention.md.
"""

from __future__ import annotations

import jax.numpy as jnp

__all__ = ["add_sinks", "check_sinks", "sinks_gradient"]


def check_sinks(sinks, num_heads: int, where: str = "dot_product_attention"):
    """`sinks` as an array of shape `[num_heads]`, or a ValueError naming the shape."""
    if sinks is None:
        return None
    sinks = jnp.asarray(sinks)
    if sinks.shape != (num_heads,):
        raise ValueError(f"{where}: sinks must have one logit per query head, shape "
                         f"[{num_heads}], got {tuple(sinks.shape)}")
    if not jnp.issubdtype(sinks.dtype, jnp.floating):
        raise ValueError(f"{where}: sinks must be floating point, got {sinks.dtype}")
    return sinks


def add_sinks(out, lse, sinks):
    """(out `[B,T,N,Hv]`, lse `[B,N,T]` fp32) of attention without sinks -> the same
    with `sinks` `[N]` in every row's denominator. Fully masked rows (lse -inf)
    stay zero, their lse becomes the sink's logit."""
    s = sinks.astype(jnp.float32)[None, :, None]  # [1, N, 1]
    lse_new = jnp.logaddexp(lse.astype(jnp.float32), s)
    weight = jnp.exp(lse - lse_new)  # [B, N, T]: the keys' share of the row, 0 if none
    out = out.astype(jnp.float32) * weight.transpose(0, 2, 1)[..., None]
    return out, lse_new


def sinks_gradient(out, lse, dout, sinks, dlse=None):
    """d loss / d `sinks` from the final (with-sink) `out` `[B,T,N,Hv]`, `lse`
    `[B,N,T]`, the output cotangent `dout` and optionally the lse cotangent `dlse`;
    fp32 `[N]`."""
    p_sink = jnp.exp(sinks.astype(jnp.float32)[None, :, None] - lse)  # [B, N, T]
    delta = jnp.einsum("BTNH,BTNH->BNT", dout.astype(jnp.float32), out.astype(jnp.float32))
    if dlse is not None:
        delta = delta - dlse.astype(jnp.float32)
    return -(p_sink * delta).sum((0, 2))
