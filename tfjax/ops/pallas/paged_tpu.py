"""Paged attention for TPU in Pallas (Mosaic): a step's queries over a KV cache in pages.

`paged_attention_tpu(q, k, v, mask)`: q `[B,T,N,H]`, k and v `tfjax.ops.paged.Paged`
(pools `[P, page, K, H]`, `[P, page, K, Hv]`, one page table `[B, n]`) under the cache's
`Positions` mask -> out `[B,T,N,Hv]` (and lse `[B,N,T]` fp32): `attention_reference` on
the gathered arrays, for any slot order (rings too). One program per (row, query tile)
walks only its row's live pages, a block at a time, one DMA per page of every kv head
from the heads-major pool the cache stores, double-buffered; the G query heads of a kv
head run as rows. `IMPLEMENTATION`: the "paged_tpu" record. See docs/kernels.md.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tfjax.ops import masks as M
from tfjax.ops.implementation import AttentionRequest, Implementation
from tfjax.ops.paged import Paged, by_runs
from tfjax.ops.pallas.common import dot, dot_nt, tpu_interpret, tpu_pallas_call
from tfjax.ops.reference import attention_reference
from tfjax.ops.tiles import cdiv, logit_scaling, logits, pad_axis, round_up
from tfjax.ops.vjp import zero_cotangents

__all__ = ["DEFAULT_BLOCK_ROWS", "IMPLEMENTATION", "KEYS_PER_BLOCK", "default_pages_per_block",
           "live_pages", "paged_attention_tpu", "supports"]

KEYS_PER_BLOCK = 128  # keys a block of pages holds by default (one MXU pass wide)
BUFFER_BYTES = 4 << 20  # VMEM of the double-buffered K and V page blocks, at most by default
DEFAULT_BLOCK_ROWS = 256  # query rows (T * G of a kv head) per program, at most
LANES = 128


@dataclasses.dataclass(frozen=True)
class _Config:
    scale: float
    softcap: float | None
    window: int  # the mask's (0: none)
    pages_per_block: int
    block_rows: int
    interpret: Any


def default_pages_per_block(k: Paged, v: Paged) -> int:
    """`KEYS_PER_BLOCK` keys of pages, fewer when their double-buffered K and V would
    take more than `BUFFER_BYTES` of VMEM, at least one page, at most the table's."""
    P, page, K = k.pool.shape[:3]
    page_bytes = 2 * K * page * (k.pool.shape[-1] * k.pool.dtype.itemsize
                                 + v.pool.shape[-1] * v.pool.dtype.itemsize)
    return max(1, min(KEYS_PER_BLOCK // page, BUFFER_BYTES // page_bytes, k.table.shape[1]))


def paged_attention_tpu(q, k: Paged, v: Paged, mask: M.Positions, *, scale=None, softcap=None,
                        return_lse=False, pages_per_block: int | None = None,
                        block_rows: int = DEFAULT_BLOCK_ROWS, interpret: Any = None):
    """q `[B,T,N,H]`, k / v `Paged` of one table, `mask` their `Positions` -> out
    `[B,T,N,Hv]` (and lse `[B,N,T]` fp32). `pages_per_block`: pages per DMA block
    (None: `default_pages_per_block`); `block_rows`: query rows per program at most
    (a multiple of 128); `interpret`: None by the target (`common.tpu_interpret`).
    Differentiable: the backward is the reference's on the gathered pages."""
    _check(q, k, v, mask)
    p = default_pages_per_block(k, v) if pages_per_block is None else pages_per_block
    if isinstance(p, bool) or not isinstance(p, int) or p < 1:
        raise ValueError(f"paged_attention_tpu: pages_per_block must be a positive int, got {p!r}")
    if isinstance(block_rows, bool) or not isinstance(block_rows, int) or block_rows < LANES \
            or block_rows % LANES:
        raise ValueError(f"paged_attention_tpu: block_rows must be a positive multiple of "
                         f"{LANES} (the logsumexp's lanes), got {block_rows!r}")
    cfg = _Config(*logit_scaling(q.shape[-1], scale, softcap), mask.window,
                  min(p, max(k.table.shape[1], 1)), block_rows,
                  tpu_interpret(q, interpret, "paged_attention_tpu"))
    out, lse = _attention(cfg, q, k.pool, v.pool, k.table, mask.q_positions, mask.kv_positions)
    return (out, lse) if return_lse else out


def _check(q, k, v, mask) -> None:
    where = "paged_attention_tpu"
    if not (isinstance(k, Paged) and isinstance(v, Paged)):
        raise TypeError(f"{where}: k and v must be tfjax.ops.paged.Paged, got "
                        f"{type(k).__name__} and {type(v).__name__}")
    if not isinstance(mask, M.Positions):
        raise TypeError(f"{where}: mask must be the cache's tfjax.ops.masks.Positions, got "
                        f"{type(mask).__name__}")
    B, T = q.shape[:2]
    if k.table.shape != v.table.shape or k.pool.shape[:3] != v.pool.shape[:3]:
        raise ValueError(f"{where}: k and v must share pages and table: pools {k.pool.shape} "
                         f"and {v.pool.shape}, tables {k.table.shape} and {v.table.shape}")
    if k.table.shape[0] != B:
        raise ValueError(f"{where}: the page table has {k.table.shape[0]} rows, q {B}")
    S = k.shape[1]
    if mask.q_positions.shape != (B, T) or mask.kv_positions.shape != (B, S):
        raise ValueError(f"{where}: the mask's positions must be [B, T] = [{B}, {T}] and "
                         f"[B, n * page] = [{B}, {S}], got {mask.q_positions.shape} and "
                         f"{mask.kv_positions.shape}")


# --------------------------------------------------------------------------- #
# The differentiable call: the kernel forward, the reference's backward.
# --------------------------------------------------------------------------- #


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(cfg, q, k_pool, v_pool, table, q_pos, kv_pos):
    return _forward(cfg, q, k_pool, v_pool, table, q_pos, kv_pos)


def _attention_fwd(cfg, *args):
    return _forward(cfg, *args), args


def _attention_bwd(cfg, args, cts):
    q, k_pool, v_pool, table, q_pos, kv_pos = args
    mask = M.positions(q_pos, kv_pos, window=cfg.window)

    def reference(q, k_pool, v_pool):
        return attention_reference(q, Paged(k_pool, table).dense(), Paged(v_pool, table).dense(),
                                   mask, scale=cfg.scale, softcap=cfg.softcap, return_lse=True)

    _, vjp = jax.vjp(reference, q, k_pool, v_pool)
    return (*vjp(cts), *zero_cotangents((table, q_pos, kv_pos)))


_attention.defvjp(_attention_fwd, _attention_bwd)


def live_pages(table, q_pos, kv_pos, page: int, window: int, num_pages: int, slots: int):
    """Each row's live pages first, in table order: (page ids `[B, slots]`, clipped into
    the pool; past a row's live pages its last one again, which a block's tail re-reads
    harmlessly), the positions their slots hold `[B, slots, page]` (-1 past the live
    pages: nothing there is attended) and the live count `[B]`. A page is live when one
    of its slots holds a position some query of the row sees (at most the row's latest
    query position, within the window of its earliest)."""
    B, n = table.shape
    kv = kv_pos.astype(jnp.int32).reshape(B, n, page)
    qp = q_pos.astype(jnp.int32)
    has = qp >= 0
    q_max = jnp.where(has, qp, -1).max(axis=1)[:, None, None]
    seen = (kv >= 0) & (kv <= q_max)
    if window:
        q_min = jnp.where(has, qp, jnp.iinfo(jnp.int32).max).min(axis=1)[:, None, None]
        seen = seen & (q_min - kv <= window)
    live = seen.any(axis=-1)  # [B, n]
    count = live.sum(axis=1, dtype=jnp.int32)
    order = jnp.argsort(~live, axis=1, stable=True)  # live first, in table order
    idx = jnp.arange(slots, dtype=jnp.int32)[None, :]
    src = jnp.take_along_axis(order, jnp.minimum(idx, jnp.maximum(count[:, None] - 1, 0)), axis=1)
    pages = jnp.clip(jnp.take_along_axis(table.astype(jnp.int32), src, axis=1), 0, num_pages - 1)
    positions = jnp.where((idx < count[:, None])[..., None],
                          jnp.take_along_axis(kv, src[..., None], axis=1), -1)
    return pages, positions, count


# --------------------------------------------------------------------------- #
# The kernel: grid (B, query tiles); each program loops over its row's live blocks.
# --------------------------------------------------------------------------- #


def _forward(cfg: _Config, q, k_pool, v_pool, table, q_pos, kv_pos):
    """(out `[B,T,N,Hv]`, lse `[B,N,T]` fp32)."""
    B, T, N, H = q.shape
    P, page, K = k_pool.shape[:3]
    Hv = v_pool.shape[-1]
    G, n, p = N // K, table.shape[1], cfg.pages_per_block
    R = T * G
    if B * R == 0 or n == 0:  # nothing to attend: zeros, no key in any row
        return (jnp.zeros((B, T, N, Hv), q.dtype), jnp.full((B, N, T), -jnp.inf, jnp.float32))
    bq = round_up(R, 8) if R <= cfg.block_rows else cfg.block_rows
    Rp, steps = round_up(R, bq), cdiv(n, p)
    # row t * G + g of kv head h: token t of query head h * G + g
    rows = pad_axis(q.reshape(B, T, K, G, H).transpose(0, 2, 1, 3, 4).reshape(B, K, R, H), 2, Rp)
    row_pos = pad_axis(jnp.repeat(q_pos.astype(jnp.int32), G, axis=1), 1, Rp, -1)[:, :, None]
    pages, positions, count = live_pages(table, q_pos, kv_pos, page, cfg.window, P, steps * p)
    positions = positions.reshape(B, steps, p, page)
    # the cache's heads-major pages (KVCache stores [P, K, page, H]: the swaps cancel)
    k_heads, v_heads = jnp.swapaxes(k_pool, 1, 2), jnp.swapaxes(v_pool, 1, 2)
    dtype = jnp.promote_types(q.dtype, k_pool.dtype)

    def kernel(pages_ref, count_ref, q_ref, pos_ref, kvp_ref, k_hbm, v_hbm, o_ref, lse_ref,
               k_buf, v_buf, sems, m_sc, l_sc, acc_sc):
        b = pl.program_id(0)
        blocks = lax.div(count_ref[b] + (p - 1), p)

        def copies(c, slot):  # block c's pages into buffer `slot`, K and V
            out = []
            for t in range(p):
                page_id = pages_ref[b, c * p + t]
                out.append(pltpu.make_async_copy(k_hbm.at[page_id], k_buf.at[slot, t],
                                                 sems.at[0, slot]))
                out.append(pltpu.make_async_copy(v_hbm.at[page_id], v_buf.at[slot, t],
                                                 sems.at[1, slot]))
            return out

        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

        @pl.when(blocks > 0)
        def _first():
            for cp in copies(0, 0):
                cp.start()

        def block(c, carry):
            slot = lax.rem(c, 2)

            @pl.when(c + 1 < blocks)
            def _next():
                for cp in copies(c + 1, 1 - slot):
                    cp.start()

            for cp in copies(c, slot):
                cp.wait()
            kv_block, qp = kvp_ref[c], pos_ref[...]  # [p, page], [bq, 1]

            def head(h, carry):
                qh = q_ref[h].astype(dtype)  # [bq, H]
                scores = []
                for t in range(p):
                    kp = kv_block[t:t + 1, :]  # [1, page]
                    s, _ = logits(dot_nt(qh, k_buf[slot, t, h].astype(dtype)), cfg.scale,
                                  cfg.softcap)
                    ok = (kp >= 0) & (kp <= qp)
                    if cfg.window:
                        ok = ok & (qp - kp <= cfg.window)
                    scores.append(jnp.where(ok, s, -jnp.inf))
                m_prev = m_sc[h]  # [bq, 1]
                m_new = functools.reduce(jnp.maximum,
                                         [s.max(axis=-1, keepdims=True) for s in scores], m_prev)
                m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
                alpha = jnp.exp(m_prev - m_safe)
                probs = [jnp.exp(s - m_safe) for s in scores]
                l_sc[h] = alpha * l_sc[h] + sum(pr.sum(axis=-1, keepdims=True) for pr in probs)
                pv = sum(dot(pr.astype(v_buf.dtype), v_buf[slot, t, h])
                         for t, pr in enumerate(probs))
                acc_sc[h] = alpha * acc_sc[h] + pv
                m_sc[h] = m_new
                return carry

            return lax.fori_loop(0, K, head, carry)

        lax.fori_loop(0, blocks, block, 0)

        def finish(h, carry):
            l = l_sc[h]
            has = l > 0
            l_safe = jnp.where(has, l, 1.0)
            o_ref[h] = jnp.where(has, acc_sc[h] / l_safe, 0.0).astype(o_ref.dtype)
            lse_ref[h] = jnp.where(has, m_sc[h] + jnp.log(l_safe), -jnp.inf).T  # lane-major
            return carry

        lax.fori_loop(0, K, finish, 0)

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2, grid=(B, Rp // bq),
        in_specs=[pl.BlockSpec((None, K, bq, H), lambda b, i, *_: (b, 0, i, 0)),
                  pl.BlockSpec((None, bq, 1), lambda b, i, *_: (b, i, 0)),
                  pl.BlockSpec((None, steps, p, page), lambda b, i, *_: (b, 0, 0, 0)),
                  pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=[pl.BlockSpec((None, K, bq, Hv), lambda b, i, *_: (b, 0, i, 0)),
                   pl.BlockSpec((None, K, 1, bq), lambda b, i, *_: (b, 0, 0, i))],
        scratch_shapes=[pltpu.VMEM((2, p, K, page, H), k_pool.dtype),
                        pltpu.VMEM((2, p, K, page, Hv), v_pool.dtype),
                        pltpu.SemaphoreType.DMA((2, 2)),
                        pltpu.VMEM((K, bq, 1), jnp.float32), pltpu.VMEM((K, bq, 1), jnp.float32),
                        pltpu.VMEM((K, bq, Hv), jnp.float32)])
    out, lse = tpu_pallas_call(
        cfg.interpret, kernel, grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((B, K, Rp, Hv), q.dtype),
                   jax.ShapeDtypeStruct((B, K, 1, Rp), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        name="tfjax_paged_attention",
    )(pages, count, rows, row_pos, positions, k_heads, v_heads)
    out = out[:, :, :R].reshape(B, K, T, G, Hv).transpose(0, 2, 1, 3, 4).reshape(B, T, N, Hv)
    lse = lse[:, :, 0, :R].reshape(B, K, T, G).transpose(0, 1, 3, 2).reshape(B, N, T)
    return out, lse


# --------------------------------------------------------------------------- #
# implementation="paged_tpu".
# --------------------------------------------------------------------------- #


def supports(r: AttentionRequest) -> str | None:
    if not r.paged:
        return "reads K/V from pages (tfjax.ops.paged.Paged); this call's k and v are arrays"
    if r.backend == "gpu":
        return ("a Pallas TPU kernel (Mosaic on TPU, interpret mode on CPU); on GPU the "
                "pages are gathered for the other implementations")
    if not isinstance(r.mask, M.Positions):
        got = "no mask" if r.mask is None else f"a {type(r.mask).__name__} mask"
        return (f"takes the cache's Positions mask (tfjax.ops.masks.positions: the position "
                f"each slot holds), got {got}")
    if r.has_alibi or r.has_bias:
        return "takes no additive bias, ALiBi or T5's relative bias"
    if r.paged_scaled:
        return ("reads float pages; an 8-bit K/V cache's (model.kv_quant) pages are "
                "dequantized by the 'paged' implementation or gathered for the others")
    if r.dtype not in ("float32", "bfloat16", "float16"):
        return f"takes float32/bfloat16/float16 queries, got {r.dtype}"
    return None


def _impl(q, k, v, mask, *, bias, alibi, scale, softcap, q_offset, kv_offset, return_lse):
    # bias and ALiBi are refused (`supports`); a Positions mask holds its own positions,
    # which offsets do not move
    del bias, alibi, q_offset, kv_offset
    if k.runs:  # the engine's ragged step: each run's pages walked once for its queries
        out, lse = by_runs(paged_attention_tpu, q, k, v, mask, scale=scale, softcap=softcap)
        return (out, lse) if return_lse else out
    return paged_attention_tpu(q, k, v, mask, scale=scale, softcap=softcap,
                               return_lse=return_lse)


IMPLEMENTATION = Implementation(_impl, supports, partitionable=False, paged=True)
