"""The materialising reference: plain jnp attention that builds the T x S logits.

It is the ground truth for every implementation and kernel test, so it favours
being obviously right over being fast: fp32 logits and softmax, GQA by
reshaping the query heads into [K, G] groups (K/V are never repeated), and an
explicit treatment of fully masked rows (output 0, logsumexp -inf).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from tfjax.ops import masks as masks_lib

__all__ = ["Alibi", "attention_reference", "make_alibi"]


def attention_reference(q, k, v, mask=None, *, bias=None, scale=None, softcap=None,
                        alibi_slopes=None, alibi_positions=None, q_offset=0, kv_offset=0,
                        return_lse=False):
    """q `[B,T,N,H]`, k/v `[B,S,K,H]` -> out `[B,T,N,H]` (and lse `[B,N,T]` fp32).

    logits = softcap * tanh(scale * q.k / softcap) + bias - slope * |q_pos - kv_pos|,
    masked, softmax over keys (ALiBi: see `make_alibi`).
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
    alibi = make_alibi(alibi_slopes, alibi_positions, B, N, T, S)
    if alibi is not None:
        a = alibi.dense(T, S, q_offset, kv_offset)
        logits = logits + a.reshape(a.shape[0], K, G, T, S)
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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Alibi:
    """ALiBi (Press et al. 2022) as the attention ops take it: the bias
    `-slope * |q_pos - kv_pos|`, evaluated per tile by the tiled implementations
    (never a materialised `[B, N, T, S]` array).

    slopes: fp32 `[B|1, N]`, without gradient (ALiBi's slopes are fixed; a learned
    per-head slope goes through `bias=`). Positions: int32 `[B, T]` and `[B, S]`
    (packed documents restart them), or None for the global index positions
    `q_offset + i` and `kv_offset + j`."""

    slopes: jax.Array
    q_positions: jax.Array | None = None
    kv_positions: jax.Array | None = None

    def positions(self, T: int, S: int, q_offset=0, kv_offset=0):
        """(`[B|1, T]`, `[B|1, S]`) int32 query and key positions."""
        if self.q_positions is not None:
            return self.q_positions, self.kv_positions
        qp = jnp.arange(T, dtype=jnp.int32) + jnp.asarray(q_offset, jnp.int32)
        kp = jnp.arange(S, dtype=jnp.int32) + jnp.asarray(kv_offset, jnp.int32)
        return qp[None], kp[None]

    @staticmethod
    def kwargs(alibi: "Alibi | None") -> dict:
        """`alibi` (or None) back as the public `alibi_slopes` / `alibi_positions`
        arguments of the attention functions."""
        if alibi is None:
            return {}
        pos = None if alibi.q_positions is None else (alibi.q_positions, alibi.kv_positions)
        return dict(alibi_slopes=alibi.slopes, alibi_positions=pos)

    def dense(self, T: int, S: int, q_offset=0, kv_offset=0):
        """The materialised bias `[B|1, N, T, S]` fp32 (reference and "xla" only)."""
        qp, kp = self.positions(T, S, q_offset, kv_offset)
        dist = jnp.abs(qp[:, :, None] - kp[:, None, :]).astype(jnp.float32)  # [B|1, T, S]
        return -self.slopes[:, :, None, None] * dist[:, None]


def make_alibi(alibi_slopes, alibi_positions, B: int, N: int, T: int, S: int) -> Alibi | None:
    """Check and normalise the ALiBi arguments of an attention call: `alibi_slopes`
    `[N]` or `[B|1, N]`; `alibi_positions` None or `(q_positions [B|1, T],
    kv_positions [B|1, S])` integer arrays. None without slopes."""
    if alibi_slopes is None:
        if alibi_positions is not None:
            raise ValueError("alibi_positions given without alibi_slopes: pass the per-head "
                             "slopes too (tfjax.nn.alibi_slopes(N))")
        return None
    shape = tuple(jnp.shape(alibi_slopes))
    if shape not in ((N,), (1, N), (B, N)):
        raise ValueError(f"alibi_slopes must be [N] or [B|1, N] = [{N}] or [{B}|1, {N}], got "
                         f"{shape}; one slope per query head (tfjax.nn.alibi_slopes(N))")
    slopes = jax.lax.stop_gradient(jnp.asarray(alibi_slopes, jnp.float32))
    slopes = slopes[None] if slopes.ndim == 1 else slopes
    if alibi_positions is None:
        return Alibi(slopes)
    try:
        qp, kp = alibi_positions
    except (TypeError, ValueError):
        raise ValueError("alibi_positions must be a pair (q_positions [B|1, T], kv_positions "
                         "[B|1, S])") from None
    for name, x, L in (("q_positions", qp, T), ("kv_positions", kp, S)):
        if jnp.ndim(x) != 2 or jnp.shape(x)[0] not in (1, B) or jnp.shape(x)[1] != L:
            raise ValueError(f"alibi_positions: {name} must be [B|1, {L}] = [{B}|1, {L}], got "
                             f"{tuple(jnp.shape(x))}")
        if not jnp.issubdtype(jnp.asarray(x).dtype, jnp.integer):
            raise ValueError(f"alibi_positions: {name} must be integers, got "
                             f"{jnp.asarray(x).dtype}")
    return Alibi(slopes, jnp.broadcast_to(jnp.asarray(qp, jnp.int32), (B, T)),
                 jnp.broadcast_to(jnp.asarray(kp, jnp.int32), (B, S)))
