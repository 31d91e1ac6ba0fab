"""The materialising reference: plain jnp attention that builds the T x S logits.

It is the ground truth for every implementation and kernel test, so it favours
being obviously right over being fast: fp32 logits and softmax, GQA by
reshaping the query heads into [K, G] groups (K/V are never repeated), and an
explicit treatment of fully masked rows (output 0, logsumexp -inf).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from tfjax.ops import masks as masks_lib
from tfjax.ops.implementation import Implementation

__all__ = ["IMPLEMENTATION", "Alibi", "RelativeBias", "attend_pattern", "attention_pattern",
           "attention_reference", "attention_scores", "check_relative_bias",
           "make_alibi", "relative_position_bucket"]


def attention_reference(q, k, v, mask=None, *, bias=None, scale=None, softcap=None,
                        alibi_slopes=None, alibi_positions=None, relative_bias=None,
                        sinks=None, q_offset=0, kv_offset=0, return_lse=False):
    """q `[B,T,N,H]`, k `[B,S,K,H]`, v `[B,S,K,Hv]` -> out `[B,T,N,Hv]` (and lse
    `[B,N,T]` fp32).

    logits = softcap * tanh(scale * q.k / softcap) + bias - slope * |q_pos - kv_pos|
    + table[bucket(kv_pos - q_pos)], masked, softmax over keys (ALiBi: see
    `make_alibi`; the T5 bias: `RelativeBias`). `sinks` `[N]`: one more logit per
    row that has no value (`tfjax.ops.sinks`), here a literal extra column of the
    softmax; a fully masked row then has lse = its sink.
    """
    B, T, N, H = q.shape
    S, K, Hv = k.shape[1], k.shape[2], v.shape[-1]
    G = N // K
    logits = _masked_logits(q, k, mask, bias=bias, scale=scale, softcap=softcap,
                            alibi_slopes=alibi_slopes, alibi_positions=alibi_positions,
                            relative_bias=relative_bias, q_offset=q_offset,
                            kv_offset=kv_offset)  # [B, K, G, T, S]
    probs, denom, row_max = _softmax(logits, sinks)
    out = jnp.einsum("BKGTS,BSKH->BTKGH", probs, v.astype(jnp.float32))
    out = out.reshape(B, T, N, Hv).astype(q.dtype)
    if not return_lse:
        return out
    # row_max is a constant shift (stop_gradient): d lse / d logits is the softmax.
    safe = jnp.where(denom[..., 0] > 0, denom[..., 0], 1.0)
    lse = jnp.where(denom[..., 0] > 0,
                    jnp.log(safe) + jax.lax.stop_gradient(row_max[..., 0]), -jnp.inf)  # [B,K,G,T]
    return out, lse.reshape(B, N, T)


def attention_scores(q, k, mask=None, *, bias=None, scale=None, softcap=None,
                     alibi_slopes=None, alibi_positions=None, relative_bias=None,
                     q_offset=0, kv_offset=0):
    """The reference's logits `[B,N,T,S]` fp32 of q `[B,T,N,H]` and k `[B,S,K,H]`
    (arguments as `attention_reference`), -inf where the mask forbids: what
    TransformerLens calls the attention scores (`tfjax.interp`)."""
    B, T, N, _ = q.shape
    logits = _masked_logits(q, k, mask, bias=bias, scale=scale, softcap=softcap,
                            alibi_slopes=alibi_slopes, alibi_positions=alibi_positions,
                            relative_bias=relative_bias, q_offset=q_offset, kv_offset=kv_offset)
    return logits.reshape(B, N, T, k.shape[1])


def attention_pattern(scores, sinks=None):
    """Scores `[B,N,T,S]` (`attention_scores`) -> the reference's softmax over keys
    `[B,N,T,S]` fp32: a fully masked row is 0; with `sinks` `[N]` each row's sink
    takes its share (the row sums to less than 1)."""
    B, N, T, S = scores.shape
    probs, _, _ = _softmax(scores.astype(jnp.float32).reshape(B, N, 1, T, S), sinks)
    return probs.reshape(B, N, T, S)


def attend_pattern(pattern, v):
    """A pattern `[B,N,T,S]` over values v `[B,S,K,Hv]` -> `[B,T,N,Hv]` fp32 (query
    head n reads kv head n // (N / K), as `attention_reference`)."""
    B, N, T, S = pattern.shape
    K, Hv = v.shape[2], v.shape[3]
    out = jnp.einsum("BKGTS,BSKH->BTKGH", pattern.astype(jnp.float32).reshape(B, K, N // K, T, S),
                     v.astype(jnp.float32))
    return out.reshape(B, T, N, Hv)


def _masked_logits(q, k, mask, *, bias, scale, softcap, alibi_slopes, alibi_positions,
                   relative_bias, q_offset, kv_offset):
    """The logits `[B,K,G,T,S]` fp32 of `attention_reference`, -inf where masked."""
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
    relative_bias = check_relative_bias(relative_bias, B, N, T, S)
    if relative_bias is not None:
        r = relative_bias.dense(T, S, q_offset, kv_offset).astype(jnp.float32)
        logits = logits + r.reshape(r.shape[0], K, G, T, S)
    allowed = masks_lib.dense(mask, T, S, q_offset=q_offset, kv_offset=kv_offset)  # [B|1, T, S]
    allowed = allowed[:, None, None]
    return jnp.where(allowed, logits, -jnp.inf)


def _softmax(logits, sinks):
    """Softmax over the keys of logits `[B,K,G,T,S]` with an optional sink column
    (`sinks` `[N]`, N = K * G): (probs `[B,K,G,T,S]`, the row sums and maxima the
    logsumexp needs); a fully masked row (no sink) gets 0."""
    B, K, G, T, S = logits.shape
    if sinks is not None:  # the sink column: a logit without a value
        sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, K, G, 1, 1), (B, K, G, T, 1))
        logits = jnp.concatenate([logits, sink], axis=-1)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    p = jnp.exp(logits - jax.lax.stop_gradient(row_max))
    denom = jnp.sum(p, axis=-1, keepdims=True)
    probs = p / jnp.where(denom > 0, denom, 1.0)
    if sinks is not None:
        probs = probs[..., :S]
    return probs, denom, row_max


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
        return _positions(self.q_positions, self.kv_positions, T, S, q_offset, kv_offset)

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
    qp, kp = _check_positions("alibi_positions", alibi_positions, B, T, S)
    return Alibi(slopes, qp, kp)


def _positions(q_positions, kv_positions, T, S, q_offset, kv_offset):
    """The explicit positions, or the global indices `offset + i` as `[1, T]`, `[1, S]`."""
    if q_positions is not None:
        return q_positions, kv_positions
    qp = jnp.arange(T, dtype=jnp.int32) + jnp.asarray(q_offset, jnp.int32)
    kp = jnp.arange(S, dtype=jnp.int32) + jnp.asarray(kv_offset, jnp.int32)
    return qp[None], kp[None]


def _check_positions(what: str, positions, B: int, T: int, S: int):
    """`positions` = (q `[B|1, T]`, kv `[B|1, S]`) integers -> int32 `[B, T]`, `[B, S]`;
    a ValueError naming `what` otherwise."""
    try:
        qp, kp = positions
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a pair (q_positions [B|1, T], kv_positions "
                         "[B|1, S])") from None
    for name, x, L in (("q_positions", qp, T), ("kv_positions", kp, S)):
        if jnp.ndim(x) != 2 or jnp.shape(x)[0] not in (1, B) or jnp.shape(x)[1] != L:
            raise ValueError(f"{what}: {name} must be [B|1, {L}] = [{B}|1, {L}], got "
                             f"{tuple(jnp.shape(x))}")
        if not jnp.issubdtype(jnp.asarray(x).dtype, jnp.integer):
            raise ValueError(f"{what}: {name} must be integers, got {jnp.asarray(x).dtype}")
    return (jnp.broadcast_to(jnp.asarray(qp, jnp.int32), (B, T)),
            jnp.broadcast_to(jnp.asarray(kp, jnp.int32), (B, S)))


# --------------------------------------------------------------------------- #
# T5's bucketed relative position bias.
# --------------------------------------------------------------------------- #


def check_buckets(num_buckets: int, max_distance: int, bidirectional: bool) -> None:
    """ValueError unless T5's bucketing is well defined for these settings."""
    half = num_buckets // 2 if bidirectional else num_buckets
    if half // 2 < 1:
        raise ValueError(f"num_buckets={num_buckets} is too small: need >= "
                         f"{4 if bidirectional else 2} (bidirectional={bidirectional})")
    if max_distance <= half // 2:
        raise ValueError(f"max_distance={max_distance} must exceed the {half // 2} exact "
                         f"buckets (num_buckets={num_buckets}, bidirectional={bidirectional})")


def relative_position_bucket(relative_position, *, bidirectional: bool, num_buckets: int = 32,
                             max_distance: int = 128):
    """T5's bucket of relative_position = key_pos - query_pos (mesh-tensorflow formula).

    Bidirectional: keys after the query use the upper half of the buckets. Within a
    half, distances below half/2 get their own bucket, larger ones log-spaced buckets
    up to max_distance, beyond which they share the last bucket. Unidirectional: keys
    after the query (never seen causally) all land in bucket 0.
    """
    check_buckets(num_buckets, max_distance, bidirectional)
    n = -jnp.asarray(relative_position, jnp.int32)  # distance into the past
    ret = jnp.zeros_like(n)
    if bidirectional:
        num_buckets //= 2
        ret = ret + (n < 0).astype(jnp.int32) * num_buckets
        n = jnp.abs(n)
    else:
        n = jnp.maximum(n, 0)
    max_exact = num_buckets // 2
    is_small = n < max_exact
    # float32 and this order of operations, as mesh-tensorflow and HF, so bucket edges
    # agree with trained checkpoints; max() keeps log() finite on the unused branch.
    n_large = jnp.maximum(n, max_exact).astype(jnp.float32)
    log_ratio = jnp.log(n_large / max_exact) / math.log(max_distance / max_exact)
    val_if_large = max_exact + (log_ratio * (num_buckets - max_exact)).astype(jnp.int32)
    val_if_large = jnp.minimum(val_if_large, num_buckets - 1)
    return ret + jnp.where(is_small, n, val_if_large)


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["table", "q_positions", "kv_positions"],
                   meta_fields=["bidirectional", "max_distance"])
@dataclasses.dataclass(frozen=True)
class RelativeBias:
    """T5's relative position bias (Raffel et al. 2020) as the attention ops take it:
    `table[bucket(kv_pos - q_pos), n]` added to head n's logits, evaluated per tile
    by "blockwise" and the Pallas TPU / Triton kernels (never a materialised
    `[B, N, T, S]` array; its gradient is accumulated per bucket) and materialised
    for the other implementations.

    table: `[num_buckets, N]` (the layout of T5 / HF checkpoints), differentiable.
    bidirectional / max_distance: the bucketing (`relative_position_bucket`).
    Positions: int32 `[B|1, T]` and `[B|1, S]` (packed documents restart them), or
    None for the global index positions `q_offset + i` and `kv_offset + j`."""

    table: jax.Array
    bidirectional: bool
    max_distance: int = 128
    q_positions: jax.Array | None = None
    kv_positions: jax.Array | None = None

    @property
    def num_buckets(self) -> int:
        return self.table.shape[0]

    def positions(self, T: int, S: int, q_offset=0, kv_offset=0):
        """(`[B|1, T]`, `[B|1, S]`) int32 query and key positions."""
        return _positions(self.q_positions, self.kv_positions, T, S, q_offset, kv_offset)

    def buckets(self, q_positions, kv_positions):
        """int32 buckets `[..., T, S]` of positions `[..., T]` and `[..., S]`."""
        rel = kv_positions[..., None, :] - q_positions[..., :, None]
        return relative_position_bucket(rel, bidirectional=self.bidirectional,
                                        num_buckets=self.num_buckets,
                                        max_distance=self.max_distance)

    def dense(self, T: int, S: int, q_offset=0, kv_offset=0):
        """The materialised bias `[B|1, N, T, S]` in the table's dtype (differentiable
        in the table: the implementations without per-tile support take this)."""
        b = self.buckets(*self.positions(T, S, q_offset, kv_offset))  # [B|1, T, S]
        return jnp.transpose(jnp.take(self.table, b, axis=0), (0, 3, 1, 2))


def check_relative_bias(relative_bias, B: int, N: int, T: int, S: int) -> RelativeBias | None:
    """Check the `relative_bias` argument of an attention call (None passes) and
    return it with its positions as int32 `[B, T]` / `[B, S]`."""
    if relative_bias is None:
        return None
    if not isinstance(relative_bias, RelativeBias):
        raise TypeError(f"relative_bias must be a tfjax.ops.RelativeBias, got "
                        f"{type(relative_bias).__name__}; an additive array goes to bias=")
    table = relative_bias.table
    if jnp.ndim(table) != 2 or jnp.shape(table)[1] != N:
        raise ValueError(f"relative_bias.table must be [num_buckets, N] = [num_buckets, {N}] "
                         f"(one column per query head), got {tuple(jnp.shape(table))}")
    if not jnp.issubdtype(jnp.asarray(table).dtype, jnp.floating):
        raise ValueError(f"relative_bias.table must be floating point, got "
                         f"{jnp.asarray(table).dtype}")
    check_buckets(jnp.shape(table)[0], relative_bias.max_distance, relative_bias.bidirectional)
    if (relative_bias.q_positions is None) != (relative_bias.kv_positions is None):
        raise ValueError("relative_bias: give both q_positions and kv_positions, or neither "
                         "(the index positions q_offset + i, kv_offset + j)")
    if relative_bias.q_positions is None:
        return relative_bias
    qp, kp = _check_positions("relative_bias", (relative_bias.q_positions,
                                                relative_bias.kv_positions), B, T, S)
    return dataclasses.replace(relative_bias, q_positions=qp, kv_positions=kp)


# --------------------------------------------------------------------------- #
# T5's bias: tiles whose entries all share one bucket.
# --------------------------------------------------------------------------- #


def relative_tile_ranges(rel, bq: int, bk: int, Tp: int, Sp: int) -> list[jax.Array]:
    """For T5's bias at explicit positions, `[min, max]` of the positions of every
    query tile (`[B, Tp / bq]` int32 each) and kv tile (`[B, Sp / bk]`): 4 arrays
    the kernels read as scalars (`constant_bucket`). [] at index positions (or
    without `rel`). The tails repeat the last real position."""
    if rel is None or rel.q_positions is None:
        return []
    out = []
    for pos, n, Lp in ((rel.q_positions, bq, Tp), (rel.kv_positions, bk, Sp)):
        p = jnp.pad(pos, ((0, 0), (0, Lp - pos.shape[1])), mode="edge")
        p = p.reshape(pos.shape[0], Lp // n, n)
        out += [p.min(axis=-1), p.max(axis=-1)]
    return out


def constant_bucket(rel, bq: int, bk: int, b, q_tile, kv_tile, offs, ranges):
    """The bucket every entry of tile (`q_tile`, `kv_tile`) falls in, or -1 (int32
    scalar arithmetic, per tile): when all its relative positions lie at or beyond
    max_distance on one side (the last bucket of that side), or, unidirectional, at
    or after the query (bucket 0). A tile far from the diagonal then needs no
    per-entry bucketing, and its table gradient is one sum. `offs`: the global q/kv
    offsets (index positions); `ranges`: `relative_tile_ranges`' arrays (or refs)
    for explicit positions."""
    if ranges:
        q_min, q_max = ranges[0][b, q_tile], ranges[1][b, q_tile]
        kv_min, kv_max = ranges[2][b, kv_tile], ranges[3][b, kv_tile]
    else:
        q_min = offs[0] + q_tile * bq
        q_max = q_min + (bq - 1)
        kv_min = offs[1] + kv_tile * bk
        kv_max = kv_min + (bk - 1)
    d_min, d_max = kv_min - q_max, kv_max - q_min  # relative position kv - q
    md, nb = rel.max_distance, rel.num_buckets
    i32 = jnp.int32  # typed constants: Triton lowers a select of weak-typed ones as i1
    if rel.bidirectional:
        return jnp.where(d_max <= -md, i32(nb // 2 - 1),
                         jnp.where(d_min >= md, i32(nb - 1), i32(-1)))
    return jnp.where(d_max <= -md, i32(nb - 1), jnp.where(d_min >= 0, i32(0), i32(-1)))


# --------------------------------------------------------------------------- #
# implementation="reference": serves every request (never chosen first by "auto").
# --------------------------------------------------------------------------- #


def _reference(q, k, v, mask, *, alibi, **kw):
    return attention_reference(q, k, v, mask, **kw, **Alibi.kwargs(alibi))


IMPLEMENTATION = Implementation(_reference, sinks=True)
