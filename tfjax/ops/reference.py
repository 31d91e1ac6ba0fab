"""The materialising reference: plain jnp attention that builds the T x S logits.

It is the ground truth for every implementation and kernel test, so it favours
being obviously right over being fast: fp32 logits and softmax, GQA by
reshaping the query heads into [K, G] groups (K/V are never repeated), and an
explicit treatment of fully masked rows (output 0, logsumexp -inf).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tfjax.ops import masks as masks_lib

__all__ = ["attention_reference"]


def attention_reference(q, k, v, mask=None, *, bias=None, scale=None, softcap=None,
                        q_offset=0, kv_offset=0, return_lse=False):
    """q `[B,T,N,H]`, k/v `[B,S,K,H]` -> out `[B,T,N,H]` (and lse `[B,N,T]` fp32).

    logits = softcap * tanh(scale * q.k / softcap) + bias, masked, softmax over keys.
    """
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    scale = H ** -0.5 if scale is None else scale
    qg = q.reshape(B, T, K, G, H)
    logits = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k,
                        preferred_element_type=jnp.float32) * scale  # [B, K, G, T, S]
    if softcap:
        logits = softcap * jnp.tanh(logits / softcap)
    if bias is not None:
        bias = jnp.broadcast_to(bias, (bias.shape[0], N, T, S)) if bias.shape[1] == 1 else bias
        logits = logits + bias.astype(jnp.float32).reshape(bias.shape[0], K, G, T, S)
    allowed = masks_lib.dense(mask, T, S, q_offset=q_offset, kv_offset=kv_offset)  # [B|1, T, S]
    allowed = allowed[:, None, None]
    logits = jnp.where(allowed, logits, -jnp.inf)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    p = jnp.exp(logits - jax.lax.stop_gradient(row_max))
    denom = jnp.sum(p, axis=-1, keepdims=True)
    probs = p / jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum("BKGTS,BSKH->BTKGH", probs, v.astype(jnp.float32))
    out = out.reshape(B, T, N, H).astype(q.dtype)
    if not return_lse:
        return out
    # row_max is a constant shift (stop_gradient): d lse / d logits is the softmax.
    safe = jnp.where(denom[..., 0] > 0, denom[..., 0], 1.0)
    lse = jnp.where(denom[..., 0] > 0,
                    jnp.log(safe) + jax.lax.stop_gradient(row_max[..., 0]), -jnp.inf)  # [B,K,G,T]
    return out, lse.reshape(B, N, T)
