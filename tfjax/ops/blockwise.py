"""Blockwise attention: pure-JAX tiled online softmax with a recomputing backward.

FlashAttention-2 (Dao 2023) in `lax.scan` / `lax.while_loop`, so it runs on any
backend: `blockwise_attention(q, k, v, mask, ...)` visits only the tiles the mask's
block view does not call EMPTY, never builds the `T x S` logits, and returns out
`[B,T,N,H]` (and the fp32 logsumexp `[B,N,T]`, differentiable); its `custom_vjp`
keeps O(T*H) activation memory. Native GQA; ALiBi and T5's bias per tile.
`IMPLEMENTATION` ("blockwise") serves every request. See docs/attention.md.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from tfjax.ops import masks as masks_lib
from tfjax.ops.implementation import Implementation
from tfjax.ops.reference import Alibi, RelativeBias, check_relative_bias, make_alibi
from tfjax.ops.tiles import cdiv, logit_scaling, logits, pad_axis, round_up, tile_tables
from tfjax.ops.vjp import attention_vjp

__all__ = ["DEFAULT_BLOCK", "IMPLEMENTATION", "blockwise_attention", "blockwise_attention_backward"]

DEFAULT_BLOCK = 512  # a CPU / XLA sweet spot; kernels choose their own tiles


@dataclasses.dataclass(frozen=True)
class _Config:
    scale: float
    softcap: float | None
    block_q: int
    block_kv: int


def blockwise_attention(q, k, v, mask: masks_lib.Mask | None = None, *, bias=None, scale=None,
                        softcap=None, alibi_slopes=None, alibi_positions=None,
                        relative_bias: RelativeBias | None = None, q_offset=0,
                        kv_offset=0, return_lse: bool = False, block_q: int = DEFAULT_BLOCK,
                        block_kv: int = DEFAULT_BLOCK):
    """q `[B,T,N,H]`, k/v `[B,S,K,H]` -> out `[B,T,N,H]` (and lse `[B,N,T]` fp32).

    Same semantics as `attention_reference`; `block_q` / `block_kv` are the tile
    sizes (clamped to the sequence lengths, rounded up to 8)."""
    cfg, alibi, rel, offsets = _setup(q, k, scale, softcap, block_q, block_kv, alibi_slopes,
                                      alibi_positions, relative_bias, q_offset, kv_offset)
    out, lse = _attention(cfg, q, k, v, mask, bias, alibi, rel, offsets)
    return (out, lse) if return_lse else out


def _setup(q, k, scale, softcap, block_q, block_kv, alibi_slopes, alibi_positions,
           relative_bias, q_offset, kv_offset):
    """(the static config, the checked ALiBi and T5 bias, the offsets as int32)."""
    B, T, N, H = q.shape
    S = k.shape[1]
    cfg = _Config(*logit_scaling(H, scale, softcap), block_q=min(int(block_q), round_up(T, 8)),
                  block_kv=min(int(block_kv), round_up(S, 8)))
    alibi = make_alibi(alibi_slopes, alibi_positions, B, N, T, S)
    rel = check_relative_bias(relative_bias, B, N, T, S)
    offsets = (jnp.asarray(q_offset, jnp.int32), jnp.asarray(kv_offset, jnp.int32))
    return cfg, alibi, rel, offsets


# --------------------------------------------------------------------------- #
# Batch handling: vmap over B, with per-example mask data and bias.
# --------------------------------------------------------------------------- #


def _mask_axes(mask):
    """vmap in_axes for the mask, and a function making the per-example mask look
    like a batch-1 mask again (its views keep their leading [1] axis)."""
    if mask is None or mask.batch_size is None:
        return None, lambda m: m
    return 0, lambda m: jax.tree.map(lambda x: x[None], m)


def _bias_axes(bias, B):
    if bias is None:
        return None, None
    if bias.shape[0] == 1 and B != 1:
        return None, bias[0]
    return 0, bias


def _alibi_axes(alibi: Alibi | None, B):
    """vmap axes of an `Alibi` (slopes `[B|1, N]`, positions `[B, L]` or None)."""
    if alibi is None:
        return None, None
    s_axis, slopes = _bias_axes(alibi.slopes, B)
    pos_axis = None if alibi.q_positions is None else 0
    return Alibi(s_axis, pos_axis, pos_axis), Alibi(slopes, alibi.q_positions, alibi.kv_positions)


def _rel_axes(rel: RelativeBias | None):
    """vmap axes of a `RelativeBias` (the table is shared, positions `[B, L]`)."""
    if rel is None:
        return None
    pos_axis = None if rel.q_positions is None else 0
    return dataclasses.replace(rel, table=None, q_positions=pos_axis, kv_positions=pos_axis)


def _vmap_batch(fn, q, k, v, mask, bias, alibi, rel, *rest_batched, direct_b1=False):
    """fn of one example, over the batch. `direct_b1`: at B = 1 call fn on the
    example itself rather than vmap it (the layouts XLA then picks for the
    training forward save memory; see `_attention_fwd`)."""
    B = q.shape[0]
    if direct_b1 and B == 1:
        first = lambda tree: jax.tree.map(lambda x: x[0], tree)  # None stays None
        if rel is not None and rel.q_positions is not None:
            rel = dataclasses.replace(rel, q_positions=rel.q_positions[0],
                                      kv_positions=rel.kv_positions[0])
        outs = fn(q[0], k[0], v[0], mask, first(bias), first(alibi), rel,
                  *map(first, rest_batched))
        return jax.tree.map(lambda x: x[None], outs)
    mask_axis, unbatch = _mask_axes(mask)
    bias_axis, bias = _bias_axes(bias, B)
    alibi_axis, alibi = _alibi_axes(alibi, B)

    def one(q, k, v, mask, bias, alibi, rel, *rest):
        return fn(q, k, v, unbatch(mask), bias, alibi, rel, *rest)

    in_axes = (0, 0, 0, mask_axis, bias_axis, alibi_axis, _rel_axes(rel)) + \
        (0,) * len(rest_batched)
    return jax.vmap(one, in_axes=in_axes)(q, k, v, mask, bias, alibi, rel, *rest_batched)


# --------------------------------------------------------------------------- #
# Shared tile helpers (one example: q [T,N,H], k/v [S,K,H], bias [Nb,T,S]).
# --------------------------------------------------------------------------- #


def _tables(mask, T, S, bq, bk, qo, ko, transpose=False):
    """One example's tile tables (`tiles.tile_tables`: order, count, code of each
    row), untouched by the tails (`_tile_allowed` bounds every tile)."""
    tab = tile_tables(mask, T, S, bq, bk, q_offset=qo, kv_offset=ko, transpose=transpose,
                      tails=False)
    return tab.order[0], tab.count[0], tab.code[0]


def _tile_allowed(cfg, mask, code, qi, kj, T, S, qo, ko) -> jax.Array:
    """bool `[bq, bk]`: the mask on this tile (evaluated only when PARTIAL) and the
    tails (padded rows and columns are never allowed)."""
    bq, bk = cfg.block_q, cfg.block_kv
    q_idx = qi * bq + jnp.arange(bq, dtype=jnp.int32)
    kv_idx = kj * bk + jnp.arange(bk, dtype=jnp.int32)
    valid = (q_idx < T)[:, None] & (kv_idx < S)[None, :]
    if mask is None:
        return valid

    def partial():
        return mask.evaluate(jnp.minimum(q_idx, T - 1), jnp.minimum(kv_idx, S - 1),
                             q_offset=qo, kv_offset=ko)[0]

    # Loops visit only non-EMPTY tiles; the single-tile path visits EMPTY ones too.
    allowed = lax.cond(code != masks_lib.FULL, partial, lambda: jnp.ones((bq, bk), bool))
    return allowed & valid


def _alibi_example(alibi, K, G, Tp, Sp):
    """One example's `Alibi` (slopes `[N]`, positions `[T]`/`[S]` or None) with the
    slopes as `[K, G]` and the positions padded to the tiled lengths."""
    if alibi is None:
        return None
    qp = None if alibi.q_positions is None else pad_axis(alibi.q_positions, 0, Tp)
    kp = None if alibi.kv_positions is None else pad_axis(alibi.kv_positions, 0, Sp)
    return Alibi(alibi.slopes.reshape(K, G), qp, kp)


def _tile_positions(q_positions, kv_positions, qi, kj, bq, bk, qo, ko):
    """Query positions `[bq]` and kv positions `[bk]` of a tile: slices of the
    (padded) explicit positions, or the global indices."""
    if q_positions is not None:
        return (lax.dynamic_slice_in_dim(q_positions, qi * bq, bq),
                lax.dynamic_slice_in_dim(kv_positions, kj * bk, bk))
    return (qo + qi * bq + jnp.arange(bq, dtype=jnp.int32),
            ko + kj * bk + jnp.arange(bk, dtype=jnp.int32))


def _alibi_tile(alibi, qi, kj, bq, bk, qo, ko):
    """(slopes `[K,G]`, query positions `[bq]`, kv positions `[bk]`) of a tile, or None."""
    if alibi is None:
        return None
    return (alibi.slopes, *_tile_positions(alibi.q_positions, alibi.kv_positions,
                                           qi, kj, bq, bk, qo, ko))


def _rel_example(rel, Tp, Sp):
    """One example's `RelativeBias` with its positions padded to the tiled lengths."""
    if rel is None or rel.q_positions is None:
        return rel
    return dataclasses.replace(rel, q_positions=pad_axis(rel.q_positions, 0, Tp),
                               kv_positions=pad_axis(rel.kv_positions, 0, Sp))


def _rel_tile(rel, qi, kj, bq, bk, qo, ko):
    """(table `[nb, N]`, buckets `[bq, bk]` int32) of a tile, or None."""
    if rel is None:
        return None
    return rel.table, rel.buckets(*_tile_positions(rel.q_positions, rel.kv_positions,
                                                   qi, kj, bq, bk, qo, ko))


def _rel_table_grad(ds, buckets, nb):
    """d table `[nb, N]` of a tile: dlogits `[K,G,bq,bk]` summed per bucket."""
    N = ds.shape[0] * ds.shape[1]
    return jax.ops.segment_sum(ds.reshape(N, -1).T, buckets.reshape(-1), num_segments=nb)


def _logits(cfg, qt, kt, bias_t, alibi_t=None, rel_t=None):
    """fp32 logits `[K,G,bq,bk]` of a query tile `[K,G,bq,H]` and a key tile `[bk,K,H]`
    (and tanh of the soft-cap, for the backward), the extras laid out as
    `[K, G, bq, bk]` for `tiles.logits`."""
    s = jnp.einsum("KGQH,SKH->KGQS", qt, kt, preferred_element_type=jnp.float32)
    K, G = s.shape[:2]
    bias = alibi = rel = None
    if bias_t is not None:  # [N|1, bq, bk] -> [K|1, G|1, bq, bk]
        shape = (K, G) if bias_t.shape[0] != 1 else (1, 1)
        bias = bias_t.reshape(*shape, *bias_t.shape[1:])
    if alibi_t is not None:  # -slope * |q_pos - kv_pos|, slopes [K, G]
        slopes, qpos, kpos = alibi_t
        alibi = slopes[:, :, None, None], qpos[:, None], kpos[None, :]
    if rel_t is not None:  # table[bucket, n], the table [nb, N]
        table, buckets = rel_t
        vals = jnp.take(table.astype(jnp.float32), buckets, axis=0)  # [bq, bk, N]
        rel = jnp.moveaxis(vals, -1, 0).reshape(K, G, *buckets.shape)
    return logits(s, cfg.scale, cfg.softcap, bias, alibi, rel)


def _loop(cond, body, init, max_trips):
    """`lax.while_loop`, or one direct call when a row has a single tile (small
    problems then compile about as fast as plain attention; an EMPTY tile visited
    this way is hidden by its mask)."""
    if max_trips == 1:
        return body(init)
    return lax.while_loop(cond, body, init)


def _scan(f, carry, xs):
    """`lax.scan`, or a direct call for a single tile."""
    if jax.tree.leaves(xs)[0].shape[0] == 1:
        carry, ys = f(carry, jax.tree.map(lambda x: x[0], xs))
        return carry, jax.tree.map(lambda y: y[None], ys)
    return lax.scan(f, carry, xs)


def _tile_index(order, row, step, n):
    """The tile a loop visits at `step` of `row` (`order[row, step]`), or a static 0
    when there is one tile (the order can only say 0): indexing with a constant, XLA
    slices the tiles in place where a traced index gathers and scatters copies."""
    return 0 if n == 1 else order[row, step]


def _query_tiles(x, nq, bq, K, G):
    """`[T, N, H]` -> `[nq, K, G, bq, H]`, the query-side tiles (q, dout, dq) laid out
    as the logits `[K, G, bq, bk]`: every tile contraction then reads the `[bq, bk]`
    logits, probabilities and their gradients row-major, and only the H-wide tiles
    are transposed (XLA:CPU otherwise transposed the logits themselves)."""
    return pad_axis(x, 0, nq * bq).reshape(nq, bq, K, G, x.shape[-1]).transpose(0, 2, 3, 1, 4)


def _bias_tile(bias, qi, kj, bq, bk):
    if bias is None:
        return None
    return lax.dynamic_slice(bias, (0, qi * bq, kj * bk), (bias.shape[0], bq, bk))


# --------------------------------------------------------------------------- #
# Forward.
# --------------------------------------------------------------------------- #


def _example(cfg, q, k, bias, alibi, rel):
    """One example's sizes (T, S, N, K, G, H, nq, nk), and its bias, ALiBi and T5 bias
    padded to the tiled lengths."""
    T, N, H = q.shape
    S, K, _ = k.shape
    nq, nk = cdiv(T, cfg.block_q), cdiv(S, cfg.block_kv)
    Tp, Sp = nq * cfg.block_q, nk * cfg.block_kv
    if bias is not None:
        bias = pad_axis(pad_axis(bias, 1, Tp), 2, Sp)
    return ((T, S, N, K, N // K, H, nq, nk), bias, _alibi_example(alibi, K, N // K, Tp, Sp),
            _rel_example(rel, Tp, Sp))


def _forward_one(cfg, q, k, v, mask, bias, alibi, rel, qo, ko):
    (T, S, N, K, G, H, nq, nk), bias, alibi, rel = _example(cfg, q, k, bias, alibi, rel)
    bq, bk, Hv = cfg.block_q, cfg.block_kv, v.shape[-1]
    qp = _query_tiles(q, nq, bq, K, G)
    kp = pad_axis(k, 0, nk * bk)
    vp = pad_axis(v, 0, nk * bk)
    order, counts, codes = _tables(mask, T, S, bq, bk, qo, ko)

    def q_tile(_, xs):
        qi, qt = xs

        def body(carry):
            j, m, l, acc = carry
            kj = _tile_index(order, qi, j, nk)
            kt = lax.dynamic_slice_in_dim(kp, kj * bk, bk)
            vt = lax.dynamic_slice_in_dim(vp, kj * bk, bk)
            s, _ = _logits(cfg, qt, kt, _bias_tile(bias, qi, kj, bq, bk),
                           _alibi_tile(alibi, qi, kj, bq, bk, qo, ko),
                           _rel_tile(rel, qi, kj, bq, bk, qo, ko))
            allowed = _tile_allowed(cfg, mask, codes[qi, j], qi, kj, T, S, qo, ko)
            s = jnp.where(allowed, s, -jnp.inf)
            m_new = jnp.maximum(m, s.max(-1))
            m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            p = jnp.exp(s - m_safe[..., None])
            alpha = jnp.exp(m - m_safe)
            l = alpha * l + p.sum(-1)
            pv = jnp.einsum("KGQS,SKH->KGQH", p.astype(v.dtype), vt,
                            preferred_element_type=jnp.float32)
            return j + 1, m_new, l, alpha[..., None] * acc + pv

        init = (jnp.int32(0), jnp.full((K, G, bq), -jnp.inf, jnp.float32),
                jnp.zeros((K, G, bq), jnp.float32), jnp.zeros((K, G, bq, Hv), jnp.float32))
        _, m, l, acc = _loop(lambda c: c[0] < counts[qi], body, init, nk)
        has = l > 0
        out = jnp.where(has[..., None], acc / jnp.where(has, l, 1.0)[..., None], 0.0)
        lse = jnp.where(has, m + jnp.log(jnp.where(has, l, 1.0)), -jnp.inf)
        return None, (out.astype(q.dtype), lse)

    _, (out, lse) = _scan(q_tile, None, (jnp.arange(nq, dtype=jnp.int32), qp))
    out = out.transpose(0, 3, 1, 2, 4).reshape(nq * bq, N, Hv)[:T]  # [nq,K,G,bq,Hv] -> [T,N,Hv]
    lse = lse.transpose(1, 2, 0, 3).reshape(N, nq * bq)[:, :T]  # [nq,K,G,bq] -> [N,T]
    return out, lse


def _forward(cfg, q, k, v, mask, bias, alibi, rel, offsets, direct_b1=False):
    fn = lambda q, k, v, mask, bias, alibi, rel: _forward_one(cfg, q, k, v, mask, bias, alibi,
                                                              rel, *offsets)
    return _vmap_batch(fn, q, k, v, mask, bias, alibi, rel, direct_b1=direct_b1)


def _forward_for_grad(cfg, q, k, v, mask, bias, alibi, rel, offsets):
    """The forward under differentiation: at B = 1 the example is called directly
    rather than vmapped, which XLA lays out with smaller training temporaries (the
    primal forward keeps vmap, whose inference temporaries are the smaller:
    experiments/results/attention_memory.md)."""
    return _forward(cfg, q, k, v, mask, bias, alibi, rel, offsets, direct_b1=True)


# --------------------------------------------------------------------------- #
# Backward.
# --------------------------------------------------------------------------- #


def _backward_one(cfg, q, k, v, mask, bias, alibi, rel, qo, ko, out, lse, dout, dlse,
                  grad_dtype=None):
    (T, S, N, K, G, H, nq, nk), bias, alibi, rel = _example(cfg, q, k, bias, alibi, rel)
    bq, bk, Hv = cfg.block_q, cfg.block_kv, v.shape[-1]
    # D_i = sum_h dO*O - dlse_i: the softmax backward's row term (dlse enters here).
    delta = jnp.einsum("TNH,TNH->NT", dout.astype(jnp.float32), out.astype(jnp.float32)) - dlse
    qp, dop = _query_tiles(q, nq, bq, K, G), _query_tiles(dout, nq, bq, K, G)
    lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
    lsep = pad_axis(lse, 1, nq * bq).reshape(K, G, nq, bq).transpose(2, 0, 1, 3)  # [nq,K,G,bq]
    dp_ = pad_axis(delta, 1, nq * bq).reshape(K, G, nq, bq).transpose(2, 0, 1, 3)
    kp = pad_axis(k, 0, nk * bk).reshape(nk, bk, K, H)
    vp = pad_axis(v, 0, nk * bk).reshape(nk, bk, K, Hv)
    Nb = None if bias is None else bias.shape[0]
    order_t, counts_t, codes_t = _tables(mask, T, S, bq, bk, qo, ko, transpose=True)

    def kv_tile(carry, xs):
        dq, dbias, dtable = carry
        kj, kt, vt = xs

        def body(c):
            i, dq, dbias, dtable, dk, dv = c
            qi = _tile_index(order_t, kj, i, nq)
            qt, dot = qp[qi], dop[qi]
            rel_t = _rel_tile(rel, qi, kj, bq, bk, qo, ko)
            s, t = _logits(cfg, qt, kt, _bias_tile(bias, qi, kj, bq, bk),
                           _alibi_tile(alibi, qi, kj, bq, bk, qo, ko), rel_t)
            allowed = _tile_allowed(cfg, mask, codes_t[kj, i], qi, kj, T, S, qo, ko)
            p = jnp.where(allowed, jnp.exp(s - lsep[qi][..., None]), 0.0)  # [K,G,bq,bk]
            dv = dv + jnp.einsum("KGQH,KGQS->KHS", dot, p.astype(dout.dtype),
                                 preferred_element_type=jnp.float32)
            dp = jnp.einsum("KGQH,SKH->KGQS", dot, vt, preferred_element_type=jnp.float32)
            ds = p * (dp - dp_[qi][..., None])  # d logits
            if dbias is not None:
                db = ds.reshape(N, bq, bk)
                db = db if Nb == N else db.sum(0, keepdims=True)
                cur = lax.dynamic_slice(dbias, (0, qi * bq, kj * bk), (Nb, bq, bk))
                dbias = lax.dynamic_update_slice(dbias, cur + db, (0, qi * bq, kj * bk))
            if dtable is not None:
                dtable = dtable + _rel_table_grad(ds, rel_t[1], dtable.shape[0])
            if t is not None:
                ds = ds * (1.0 - t * t)
            ds = ds * cfg.scale
            dq = dq.at[qi].add(jnp.einsum("KGQS,SKH->KGQH", ds.astype(k.dtype), kt,
                                          preferred_element_type=jnp.float32))
            dk = dk + jnp.einsum("KGQH,KGQS->KHS", qt, ds.astype(q.dtype),
                                 preferred_element_type=jnp.float32)
            return i + 1, dq, dbias, dtable, dk, dv

        _, dq, dbias, dtable, dk, dv = _loop(
            lambda c: c[0] < counts_t[kj], body,
            (jnp.int32(0), dq, dbias, dtable, jnp.zeros((K, H, bk), jnp.float32),
             jnp.zeros((K, Hv, bk), jnp.float32)), nq)
        return (dq, dbias, dtable), (dk.transpose(2, 0, 1), dv.transpose(2, 0, 1))

    dq0 = jnp.zeros((nq, K, G, bq, H), jnp.float32)
    db0 = None if bias is None else jnp.zeros(bias.shape, jnp.float32)
    dt0 = None if rel is None else jnp.zeros(rel.table.shape, jnp.float32)
    (dq, dbias, dtable), (dk, dv) = _scan(kv_tile, (dq0, db0, dt0),
                                          (jnp.arange(nk, dtype=jnp.int32), kp, vp))
    dq = dq.transpose(0, 3, 1, 2, 4).reshape(nq * bq, N, H)[:T].astype(grad_dtype or q.dtype)
    dk = dk.reshape(nk * bk, K, H)[:S].astype(grad_dtype or k.dtype)
    dv = dv.reshape(nk * bk, K, Hv)[:S].astype(grad_dtype or v.dtype)
    if dbias is not None:
        dbias = dbias[:, :T, :S]
    return dq, dk, dv, dbias, dtable


# --------------------------------------------------------------------------- #
# The VJP (`tfjax.ops.vjp`'s shell) and the ring's per-block backward.
# --------------------------------------------------------------------------- #


def _backward(cfg, q, k, v, mask, bias, alibi, rel, offsets, out, lse, dout, dlse):
    B = q.shape[0]

    def fn(q, k, v, mask, bias, alibi, rel, out, lse, dout, dlse):
        return _backward_one(cfg, q, k, v, mask, bias, alibi, rel, *offsets, out, lse, dout,
                             dlse)

    dq, dk, dv, dbias, dtable = _vmap_batch(fn, q, k, v, mask, bias, alibi, rel, out, lse,
                                            dout.astype(out.dtype),
                                            dlse.astype(jnp.float32), direct_b1=True)
    if dbias is not None:
        if bias.shape[0] == 1 and B != 1:
            dbias = dbias.sum(0, keepdims=True)
        dbias = dbias.astype(bias.dtype)
    # per-example table grads [B, nb, N] summed over the batch
    return dq, dk, dv, dbias, None if dtable is None else dtable.sum(0)


_attention = attention_vjp(_forward, _backward, forward_for_grad=_forward_for_grad)


def blockwise_attention_backward(q, k, v, mask, out, lse, dout, *, scale=None, softcap=None,
                                 alibi_slopes=None, alibi_positions=None,
                                 relative_bias: RelativeBias | None = None, q_offset=0,
                                 kv_offset=0, block_q: int = DEFAULT_BLOCK,
                                 block_kv: int = DEFAULT_BLOCK, grad_dtype=jnp.float32):
    """The backward of one (q block, kv block) pair: -> dq `[B,T,N,H]`, dk, dv `[B,S,K,H]`
    (and, with `relative_bias`, the fp32 gradient of its table `[num_buckets, N]`).

    `out` `[B,T,N,H]` and `lse` `[B,N,T]` (fp32) are the *final* attention output
    and logsumexp of these queries, which may span more keys than `k`/`v` (ring
    attention passes the merged result over all blocks): probabilities are
    recomputed per tile as `exp(logits - lse)`, so the returned gradients are this
    block's exact contribution, and summing them over the blocks gives the full
    gradient. No bias array (ALiBi slopes and T5's table, functions of positions,
    are taken); gradients in `grad_dtype` (fp32 by default, for accumulation).
    """
    cfg, alibi, rel, offsets = _setup(q, k, scale, softcap, block_q, block_kv, alibi_slopes,
                                      alibi_positions, relative_bias, q_offset, kv_offset)

    def fn(q, k, v, mask, bias, alibi, rel, out, lse, dout):
        dlse = jnp.zeros(lse.shape, jnp.float32)
        dq, dk, dv, _, dtable = _backward_one(cfg, q, k, v, mask, None, alibi, rel, *offsets,
                                              out, lse, dout, dlse, grad_dtype)
        return dq, dk, dv, dtable

    dq, dk, dv, dtable = _vmap_batch(fn, q, k, v, mask, None, alibi, rel, out,
                                     lse.astype(jnp.float32), dout.astype(out.dtype))
    return (dq, dk, dv) if rel is None else (dq, dk, dv, dtable.sum(0))


# --------------------------------------------------------------------------- #
# implementation="blockwise": serves every request; first in "auto" on CPU.
# --------------------------------------------------------------------------- #


def _impl(q, k, v, mask, *, bias, alibi, scale, softcap, q_offset, kv_offset, return_lse,
          relative_bias=None):
    return blockwise_attention(q, k, v, mask, bias=bias, scale=scale, softcap=softcap,
                               q_offset=q_offset, kv_offset=kv_offset, return_lse=return_lse,
                               relative_bias=relative_bias, **Alibi.kwargs(alibi))


IMPLEMENTATION = Implementation(_impl, relative_bias=True)
