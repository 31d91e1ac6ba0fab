"""FlashAttention for TPU in Pallas (Mosaic): forward, dq and dk/dv kernels.

FlashAttention-2 (Dao 2023) tiled for the TPU's VMEM. `flash_attention_tpu(q, k, v,
mask, ...)`: q `[B,T,N,H]`, k/v `[B,S,K,H]` -> out `[B,T,N,H]` (and lse `[B,N,T]`
fp32), the semantics of `attention_reference`; `flash_attention_tpu_backward` gives one
(q block, kv block) pair's gradients from the final out and lse. The grid walks only
the non-empty kv tiles (scalar-prefetched tile tables), the mask is evaluated only in
PARTIAL tiles, GQA is native, ALiBi and T5's bias are formed per tile, and the
backward recomputes the probabilities (dq and dk/dv kernels, no atomics).
`DEFAULT_BLOCK_SIZES` are the tiles. Interpreted on CPU. See docs/kernels.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tfjax.ops import masks as M
from tfjax.ops.reference import (Alibi, RelativeBias, check_relative_bias, constant_bucket,
                                  make_alibi, relative_position_bucket, relative_tile_ranges)
from tfjax.ops.pallas.common import (BlockSizes, Dims, KernelConfig, MaskOperands, call_tables,
                                     dot, dot_nt, offsets, reduce_dbias, tpu_interpret,
                                     tpu_pallas_call)
from tfjax.ops.tiles import logit_scaling, logits, pad_axis, round_up
from tfjax.ops.vjp import attention_vjp, backward_rows

__all__ = ["DEFAULT_BLOCK_SIZES", "SMEM_BYTES", "flash_attention_tpu", "flash_attention_tpu_backward",
           "table_bytes"]

LANES = 128
# Large tiles amortise the per grid step cost; [512, 512] fp32 logits are 1 MiB of VMEM.
DEFAULT_BLOCK_SIZES = BlockSizes(block_q=512, block_kv=512, block_q_dq=256, block_kv_dq=512,
                                 block_q_dkv=512, block_kv_dkv=256)


def _compiler_params(*semantics: str):
    # Renamed TPUCompilerParams -> CompilerParams in 2025; names of semantics moved too.
    cls = getattr(pltpu, "CompilerParams", None) or pltpu.TPUCompilerParams
    consts = {"parallel": getattr(pltpu, "PARALLEL", "parallel"),
              "arbitrary": getattr(pltpu, "ARBITRARY", "arbitrary")}
    return cls(dimension_semantics=tuple(consts[s] for s in semantics))


def _vmem(shape, dtype):
    return pltpu.VMEM(shape, dtype)


@dataclasses.dataclass(frozen=True)
class _Config(KernelConfig):
    grad_dtype: Any = None  # dq/dk/dv dtype; None: the input dtypes
    keys_on_lanes: bool | None = None  # undifferentiated forward's K/V tiles (_inference_forward)


def _config(q, scale, softcap, q_offset, kv_offset, block_sizes, interpret, grad_dtype=None,
            keys_on_lanes=None):
    """The kernels' static config and the `[2]` int32 offsets operand; python-int
    offsets build the tile tables at trace time. `interpret=None`: by the target
    (`tfjax.ops.pallas.common.tpu_interpret`)."""
    interpret = tpu_interpret(q, interpret, "flash_attention_tpu")
    H = q.shape[-1]
    static, offs = offsets(q_offset, kv_offset)
    cfg = _Config(*logit_scaling(H, scale, softcap), block_sizes or DEFAULT_BLOCK_SIZES,
                  interpret, static, grad_dtype, keys_on_lanes)
    return cfg, offs


def flash_attention_tpu(q, k, v, mask=None, *, bias=None, scale=None, softcap=None,
                        alibi_slopes=None, alibi_positions=None,
                        relative_bias: RelativeBias | None = None, q_offset=0, kv_offset=0,
                        return_lse=False, block_sizes: BlockSizes | None = None,
                        interpret: Any = None, keys_on_lanes: bool | None = None):
    """q `[B,T,N,H]`, k/v `[B,S,K,H]` -> out `[B,T,N,H]` (and lse `[B,N,T]` fp32).
    `relative_bias`: T5's bias per tile (its table differentiable).

    `interpret=None` interprets for a CPU target and compiles with Mosaic for a TPU
    (the target as `_config` decides it). `keys_on_lanes`: how an undifferentiated
    call reads K/V (`_inference_forward`; None: by head dim, True below 128); a
    differentiated call always reads the row tiles its backward kernels share."""
    cfg, offs = _config(q, scale, softcap, q_offset, kv_offset, block_sizes, interpret,
                        keys_on_lanes=keys_on_lanes)
    B, T, N = q.shape[:3]
    alibi = make_alibi(alibi_slopes, alibi_positions, B, N, T, k.shape[1])
    rel = check_relative_bias(relative_bias, B, N, T, k.shape[1])
    out, lse = _flash(cfg, q, k, v, mask, bias, alibi, rel, offs)
    return (out, lse) if return_lse else out


def flash_attention_tpu_backward(q, k, v, mask, out, lse, dout, *, scale=None, softcap=None,
                                 alibi_slopes=None, alibi_positions=None,
                                 relative_bias: RelativeBias | None = None, q_offset=0,
                                 kv_offset=0, block_sizes: BlockSizes | None = None,
                                 interpret: Any = None, grad_dtype=jnp.float32):
    """The dq and dk/dv kernels for one (q block, kv block) pair, given the *final*
    output `out` `[B,T,N,H]` and logsumexp `lse` `[B,N,T]` of these queries (which
    may span more keys than `k`/`v`: ring attention passes the result merged over
    all blocks). Probabilities are recomputed per tile as `exp(logits - lse)`, so
    the result is this block's exact contribution to the full gradient. No bias
    (ALiBi slopes and T5's `relative_bias` are taken).
    -> dq `[B,T,N,H]`, dk, dv `[B,S,K,H]` in `grad_dtype` (fp32 by default, for
    accumulation across blocks), and with `relative_bias` the table's gradient
    `[nb, N]` fp32 (this block's contribution)."""
    cfg, offs = _config(q, scale, softcap, q_offset, kv_offset, block_sizes, interpret,
                        grad_dtype)
    do, lse, delta = backward_rows(out, lse, dout, q.dtype)
    B, T, N = q.shape[:3]
    alibi = make_alibi(alibi_slopes, alibi_positions, B, N, T, k.shape[1])
    rel = check_relative_bias(relative_bias, B, N, T, k.shape[1])
    dq, dtable = _backward_dq(cfg, q, k, v, mask, None, alibi, rel, offs, do, lse, delta)
    dk, dv, _ = _backward_dkv(cfg, q, k, v, mask, None, alibi, rel, offs, do, lse, delta)
    return (dq, dk, dv) if rel is None else (dq, dk, dv, dtable)


# --------------------------------------------------------------------------- #
# Layout helpers.
# --------------------------------------------------------------------------- #


def _query_tile(block_q: int, T: int) -> int:
    """The query tile: the whole sequence (8-row padded) when it fits in `block_q`,
    else `block_q` rounded up to 128: query positions run along lanes in the
    statistics' and segment ids' blocks (`[1, bq]`), which Mosaic takes when the
    block is a multiple of 128 or the whole padded axis."""
    whole = round_up(T, 8)
    return whole if whole <= block_q else round_up(block_q, LANES)


def _dims(q, k, v, block_q, block_kv) -> Dims:
    B, T, N, H = q.shape
    S, K, Hv = k.shape[1], k.shape[2], v.shape[-1]
    bq = _query_tile(block_q, T)
    bk = min(block_kv, round_up(S, LANES))
    # one head dim for q/k and v, the wider (the other zero-padded); not padded to 128
    # lanes: the blocks span the whole head axis, which Mosaic takes at any width
    return Dims(B, T, S, N, K, H, max(H, Hv), bq, bk, round_up(T, bq), round_up(S, bk), Hv)


def _heads_major(x, n, Hp):
    """[B, L, N, H] -> [B, N, n, Hp] zero-padded."""
    return pad_axis(pad_axis(x.transpose(0, 2, 1, 3), 2, n), 3, Hp)


def _sequence_minor(x, n, Hp):
    """[B, L, N, H] -> [B, N, Hp, n] zero-padded: the sequence along lanes."""
    return pad_axis(pad_axis(x.transpose(0, 2, 3, 1), 3, n), 2, Hp)


def _bias_operand(bias, d):
    if bias is None:
        return None
    return pad_axis(pad_axis(bias, 2, d.Tp), 3, d.Sp)


def _iota(shape, dim):
    return lax.broadcasted_iota(jnp.int32, shape, dim)


def _local(q_tile, kv_tile, d, kv_major=False):
    """In-sequence positions of a tile's rows and columns, `[bq, bk]` int32 each
    (`[bk, bq]` when `kv_major`, the dk/dv kernel's layout)."""
    shape, qdim = ((d.bk, d.bq), 1) if kv_major else ((d.bq, d.bk), 0)
    return q_tile * d.bq + _iota(shape, qdim), kv_tile * d.bk + _iota(shape, 1 - qdim)


def _alibi(alibi_ref, b, head, q_tile, kv_tile, d, offs_ref, mops, qseg, kseg, kv_major=False):
    """The `tiles.logits` ALiBi argument of a tile (slope, q positions, kv positions,
    broadcastable to the tile), or None without slopes."""
    if alibi_ref is None:
        return None
    slope = alibi_ref[(b if alibi_ref.shape[0] > d.N else 0) * d.N + head]
    if mops.alibi_slot is not None:  # explicit positions: their tiles, like segment ids
        return slope, qseg[mops.alibi_slot][...], kseg[mops.alibi_slot][...]
    q_loc, kv_loc = _local(q_tile, kv_tile, d, kv_major)
    return slope, q_loc + offs_ref[0], kv_loc + offs_ref[1]


def _relative(rel_ref, rel, b, q_tile, kv_tile, d, offs_ref, mops, qseg, kseg, ranges,
              kv_major=False):
    """T5's bias of a tile, fp32, its int32 buckets (both `[bq, bk]`, or `[bk, bq]`
    when `kv_major`) and the bucket they all share or -1 (`constant_bucket`: then
    no entry is bucketed), or (None, None, None) without it. `rel`: the static
    `RelativeBias` (bucketing); `rel_ref`: the head's table row `[1, nbp]`;
    `ranges`: the scalar refs of `relative_tile_ranges` (explicit positions)."""
    if rel_ref is None:
        return None, None, None
    shape = (d.bk, d.bq) if kv_major else (d.bq, d.bk)
    const = constant_bucket(rel, d.bq, d.bk, b, q_tile, kv_tile, offs_ref, ranges)

    def varying():
        if mops.relative_slot is not None:  # explicit positions: their tiles
            qp, kp = qseg[mops.relative_slot][...], kseg[mops.relative_slot][...]
        else:
            q_loc, kv_loc = _local(q_tile, kv_tile, d, kv_major)
            qp, kp = q_loc + offs_ref[0], kv_loc + offs_ref[1]
        buckets = relative_position_bucket(kp - qp, bidirectional=rel.bidirectional,
                                           num_buckets=rel.num_buckets,
                                           max_distance=rel.max_distance)
        return jnp.broadcast_to(buckets, shape)

    buckets = lax.cond(const >= 0, lambda: jnp.full(shape, const, jnp.int32), varying)
    return _gather_lanes(rel_ref[...], buckets, rel.num_buckets), buckets, const


def _gather_lanes(row, idx, n_valid):
    """`row[0, idx]`: row `[1, nbp]` fp32 (nbp a multiple of 128), idx `[r, c]` int32
    in [0, n_valid): a lane gather (`take_along_axis`, Mosaic's dynamic gather) per
    128-lane piece of the row and of idx. A tile narrower than 128 lanes or not a
    multiple (the dk/dv kernel's query tile of a short sequence) selects per entry."""
    if idx.shape[1] % LANES:
        out = jnp.broadcast_to(row[:, :1], idx.shape)
        for n in range(1, n_valid):
            out = jnp.where(idx == n, row[:, n:n + 1], out)
        return out
    out = None
    for t in range(row.shape[1] // LANES):
        src = jnp.broadcast_to(row[:, t * LANES:(t + 1) * LANES], (idx.shape[0], LANES))
        local = idx if row.shape[1] == LANES else jnp.clip(idx - t * LANES, 0, LANES - 1)
        got = jnp.concatenate(
            [jnp.take_along_axis(src, local[:, c * LANES:(c + 1) * LANES], axis=1,
                                 mode="promise_in_bounds")
             for c in range(idx.shape[1] // LANES)], axis=1)
        out = got if out is None else jnp.where(idx >= t * LANES, got, out)
    return out


def _relative_operand(rel: RelativeBias, head_of):
    """The table `[nb, N]` as `[N, 1, nbp]` fp32 rows (nbp: nb rounded up to 128
    lanes) and their spec (the row of head `head_of(*grid indices)`)."""
    nbp = round_up(rel.num_buckets, LANES)
    rows = pad_axis(rel.table.astype(jnp.float32).T, 1, nbp)[:, None, :]
    return rows, pl.BlockSpec((None, 1, nbp), lambda *ix: (head_of(*ix), 0, 0))


def _fold_lanes(x):
    """`[r, c]` with c a multiple of 128 -> `[r, 128]`, the sum of its lane tiles."""
    out = x[:, :LANES]
    for c in range(1, x.shape[1] // LANES):
        out = out + x[:, c * LANES:(c + 1) * LANES]
    return out


def _alibi_operand(alibi: Alibi):
    """The slopes `[B|1, N]` as a flat fp32 SMEM operand, and its spec."""
    return alibi.slopes.reshape(-1), pl.BlockSpec(memory_space=pltpu.SMEM)


@dataclasses.dataclass(frozen=True)
class _Call:
    """What a kernel call derives from its tiles `d`: the tile tables, the mask's
    operands and T5's per-tile position ranges (scalar operands after the mask's)."""

    d: Dims
    tab: Any  # tiles.TileTables
    mops: MaskOperands
    ranges: list

    @property
    def ns(self) -> int:  # scalar-prefetch operands after the tables and the offsets
        return len(self.mops.scalars) + len(self.ranges)

    def rb(self, b):
        """The table row of batch program `b`."""
        return b if self.tab.batched else 0


def _call(cfg, q, k, v, mask, alibi, rel, offs, block_q, block_kv, transpose=False) -> _Call:
    d = _dims(q, k, v, block_q, block_kv)
    return _Call(d, call_tables(mask, d, cfg.static_offsets, offs, transpose),
                 MaskOperands(mask, d.B, d.Tp, d.Sp, offs, alibi, rel),
                 relative_tile_ranges(rel, d.bq, d.bk, d.Tp, d.Sp))


def _position_operands(in_specs, operands, alibi, rel, head_of):
    """Append ALiBi's slopes (SMEM) and T5's table rows (the row of head
    `head_of(*grid indices)`), in the kernels' operand order."""
    if alibi is not None:
        slopes, spec = _alibi_operand(alibi)
        in_specs.append(spec)
        operands.append(slopes)
    if rel is not None:
        rows, spec = _relative_operand(rel, head_of)
        in_specs.append(spec)
        operands.append(rows)


def _row_inputs(c: _Call, q, k, v, bias, alibi, rel, extra=(), kv_lanes=False):
    """In-specs and operands of a query-row grid (B, N, nq, steps: the forward and
    dq kernels): q's tile, the table's K/V tiles (`[bk, Hp]`; `kv_lanes`: `[Hp, bk]`
    of `[B, K, Hp, Sp]`), the bias tile, ALiBi's slopes, T5's table row, `extra`
    ((spec, operand) pairs: dq's dO, lse and delta rows), the segment tiles."""
    d, rb = c.d, c.rb
    row = lambda b, h, i, j, *_: (b, h, i, 0)
    if kv_lanes:
        kv_spec = pl.BlockSpec((None, None, d.Hp, d.bk), lambda b, h, i, j, order, *_: (
            b, h // d.G, 0, _column(order[rb(b), i, j])))
        kv_operand = _sequence_minor
    else:
        kv_spec = pl.BlockSpec((None, None, d.bk, d.Hp), lambda b, h, i, j, order, *_: (
            b, h // d.G, _column(order[rb(b), i, j]), 0))
        kv_operand = _heads_major
    in_specs = [pl.BlockSpec((None, None, d.bq, d.Hp), row), kv_spec, kv_spec]
    operands = [_heads_major(q, d.Tp, d.Hp), kv_operand(k, d.Sp, d.Hp),
                kv_operand(v, d.Sp, d.Hp)]
    if bias is not None:
        Bb, Nb = bias.shape[:2]
        in_specs.append(pl.BlockSpec(
            (None, None, d.bq, d.bk),
            lambda b, h, i, j, order, *_: (b if Bb > 1 else 0, h if Nb > 1 else 0, i,
                                           _column(order[rb(b), i, j]))))
        operands.append(_bias_operand(bias, d))
    _position_operands(in_specs, operands, alibi, rel, lambda b, h, *_: h)
    for spec, x in extra:
        in_specs.append(spec)
        operands.append(x)
    for qs in c.mops.q_segments:  # lane-major; the kernel keeps a column copy per tile
        in_specs.append(pl.BlockSpec((None, 1, d.bq), lambda b, h, i, j, *_: (b, 0, i)))
        operands.append(qs[:, None, :])
    for ks in c.mops.kv_segments:
        in_specs.append(pl.BlockSpec((None, 1, d.bk),
                                     lambda b, h, i, j, order, *_: (b, 0, _column(order[rb(b), i, j]))))
        operands.append(ks[:, None, :])
    return in_specs, operands


_COLUMN_BITS = 16  # a packed tile entry: its column tile in the low bits, its code above
SMEM_BYTES = 1 << 20  # scalar memory per TPU core (v4, v5e, v5p, v6e)


def _packed(tab) -> jax.Array:
    """The tile table as one int32 array, `column | code << 16`: half the scalar memory
    of `order` and `code` apart (at 128k tokens the two filled a TPU core's SMEM)."""
    if tab.order.shape[-1] >= 1 << _COLUMN_BITS:
        raise ValueError(f"pallas (TPU): {tab.order.shape[-1]} column tiles do not fit the "
                         f"packed tile table (< {1 << _COLUMN_BITS}); raise the block sizes")
    return tab.order | (tab.code << _COLUMN_BITS)


def _column(entry):
    return entry & ((1 << _COLUMN_BITS) - 1)


def _code(entry):
    return entry >> _COLUMN_BITS


def table_bytes(T: int, S: int, rows: int = 1,
                block_sizes: BlockSizes = DEFAULT_BLOCK_SIZES) -> int:
    """The most scalar-memory bytes a kernel's packed tile table and counts take for T
    queries, S keys and `rows` tables (a mask with per-example data: the batch): the
    forward's, dq's or dk/dv's (transposed), whichever is largest."""
    bs = block_sizes
    grids = ((T, S, _query_tile(bs.block_q, T), bs.block_kv),
             (T, S, _query_tile(bs.block_q_dq, T), bs.block_kv_dq),
             (S, T, bs.block_kv_dkv, _query_tile(bs.block_q_dkv, T)))
    return max(4 * rows * -(-n // br) * (-(-m // bc) + 1) for n, m, br, bc in grids)


def _split_refs(refs, n_scalars, has_bias, has_alibi, has_rel, n_seg, n_extra_in, n_out,
                n_scratch):
    it = iter(refs)
    take = lambda n: [next(it) for _ in range(n)]
    order, count, offs = take(3)  # order: the packed tile table (`_packed`)
    sref = take(n_scalars)
    q_ref, k_ref, v_ref = take(3)
    bias_ref = next(it) if has_bias else None
    alibi_ref = next(it) if has_alibi else None
    rel_ref = next(it) if has_rel else None
    extra = take(n_extra_in)
    qseg, kseg = take(n_seg), take(n_seg)
    outs = take(n_out)
    scratch = take(n_scratch)
    columns = take(n_seg)  # the column copies of the lane-major segment tiles
    return (order, count, offs, sref, q_ref, k_ref, v_ref, (bias_ref, alibi_ref, rel_ref),
            extra, (qseg, columns), kseg, outs, scratch)


def _columns(rows, columns):
    """Copy lane-major tiles `[1, n]` into their column scratch `[n, 1]` (once per
    tile of the sequence axis they run along: a lane-to-sublane transpose)."""
    for row, col in zip(rows, columns):
        col[...] = row[...].T


def _column_scratch(operands, n):
    """VMEM scratch `[n, 1]` for each `[B, 1, L]` lane-major operand."""
    return [_vmem((n, 1), x.dtype) for x in operands]


def _masked(s, q_tile, kv_tile, d, mask, mops, offs_ref, b, sref, qseg, kseg, *, kv_major=False):
    """Tile `s` with the disallowed entries at -inf: sequence tails and, when there is
    a mask, the mask at global positions. `kv_major`: `s` is [bk, bq] (dk/dv kernel)."""
    q_loc, kv_loc = _local(q_tile, kv_tile, d, kv_major)
    ok = (q_loc < d.T) & (kv_loc < d.S)
    if mask is not None:
        ok = ok & mops.evaluate(q_loc + offs_ref[0], kv_loc + offs_ref[1], b, sref,
                                [x[...] for x in qseg], [x[...] for x in kseg])
    return jnp.where(ok, s, -jnp.inf)


# --------------------------------------------------------------------------- #
# Forward kernel: grid (B, N, nq, steps).
# --------------------------------------------------------------------------- #


def _forward(cfg, q, k, v, mask, bias, alibi, rel, offs, kv_lanes=False):
    """(out `[B, T, N, H]`, lse `[B, N, T]`); `kv_lanes`: read K/V tiles with the keys
    along lanes (`_row_inputs`)."""
    c = _call(cfg, q, k, v, mask, alibi, rel, offs, cfg.block_sizes.block_q,
              cfg.block_sizes.block_kv)
    d, tab, mops, ranges, rb = c.d, c.tab, c.mops, c.ranges, c.rb
    bq, ns, nseg, has_bias = d.bq, c.ns, mops.num_segments, bias is not None
    has_alibi, has_rel = alibi is not None, rel is not None

    def kernel(*refs):
        (order, count, offs_ref, sref, q_ref, k_ref, v_ref, (bias_ref, alibi_ref, rel_ref),
         _, (qrows, qseg), kseg, (o_ref, lse_ref), (m_sc, l_sc, acc_sc)) = _split_refs(
            refs, ns, has_bias, has_alibi, has_rel, nseg, 0, 2, 3)
        b, h, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2), pl.program_id(3)
        r = rb(b)

        @pl.when(j == 0)
        def _init():
            _columns(qrows, qseg)
            m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
            l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
            acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

        @pl.when(j < count[r, i])
        def _step():
            kj = _column(order[r, i, j])
            rel_tile, _, _ = _relative(rel_ref, rel, b, i, kj, d, offs_ref, mops, qseg, kseg,
                                       sref[len(mops.scalars):])
            qk = dot(q_ref[...], k_ref[...]) if kv_lanes else dot_nt(q_ref[...], k_ref[...])
            s, _ = logits(qk, cfg.scale, cfg.softcap,
                          bias_ref[...] if has_bias else None,
                          _alibi(alibi_ref, b, h, i, kj, d, offs_ref, mops, qseg, kseg), rel_tile)

            def apply_mask(s):
                return _masked(s, i, kj, d, mask, mops, offs_ref, b, sref, qseg, kseg)

            s = lax.cond(_code(order[r, i, j]) == M.PARTIAL, apply_mask, lambda s: s, s)
            m_prev, l_prev = m_sc[...], l_sc[...]  # [bq, 1]
            m_new = jnp.maximum(m_prev, s.max(axis=-1, keepdims=True))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            p = jnp.exp(s - m_safe)
            alpha = jnp.exp(m_prev - m_safe)
            l_sc[...] = alpha * l_prev + p.sum(axis=-1, keepdims=True)
            pv = (dot_nt if kv_lanes else dot)(p.astype(v_ref.dtype), v_ref[...])
            acc_sc[...] = alpha * acc_sc[...] + pv
            m_sc[...] = m_new

        @pl.when(j == tab.steps - 1)
        def _finish():
            l = l_sc[...]
            has = l > 0
            l_safe = jnp.where(has, l, 1.0)
            o_ref[...] = jnp.where(has, acc_sc[...] / l_safe, 0.0).astype(o_ref.dtype)
            lse_ref[...] = jnp.where(has, m_sc[...] + jnp.log(l_safe), -jnp.inf).T  # lane-major

    in_specs, operands = _row_inputs(c, q, k, v, bias, alibi, rel, kv_lanes=kv_lanes)
    out_specs = [pl.BlockSpec((None, None, bq, d.Hp), lambda b, h, i, j, *_: (b, h, i, 0)),
                 pl.BlockSpec((None, None, 1, bq), lambda b, h, i, j, *_: (b, h, 0, i))]
    out_shape = [jax.ShapeDtypeStruct((d.B, d.N, d.Tp, d.Hp), q.dtype),
                 jax.ShapeDtypeStruct((d.B, d.N, 1, d.Tp), jnp.float32)]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3 + ns, grid=(d.B, d.N, d.Tp // bq, tab.steps),
        in_specs=in_specs, out_specs=out_specs,
        scratch_shapes=[_vmem((bq, 1), jnp.float32), _vmem((bq, 1), jnp.float32),
                        _vmem((bq, d.Hp), jnp.float32),
                        *_column_scratch(mops.q_segments, bq)])
    out, lse = tpu_pallas_call(
        cfg.interpret, kernel, grid_spec=grid_spec, out_shape=out_shape,
        compiler_params=_compiler_params("parallel", "parallel", "parallel", "arbitrary"),
        name="tfjax_flash_fwd",
    )(_packed(tab), tab.count, offs, *mops.scalars, *ranges, *operands)
    out = out[:, :, :d.T, :d.Hv].transpose(0, 2, 1, 3)
    return out, lse[:, :, 0, :d.T]


# --------------------------------------------------------------------------- #
# dq kernel: grid (B, N, nq, steps), the forward's tables.
# --------------------------------------------------------------------------- #


def _backward_dq(cfg, q, k, v, mask, bias, alibi, rel, offs, do, lse, delta):
    """dq, and T5's table gradient `[nb, N]` fp32 (None without `rel`)."""
    c = _call(cfg, q, k, v, mask, alibi, rel, offs, cfg.block_sizes.block_q_dq,
              cfg.block_sizes.block_kv_dq)
    d, tab, mops, ranges, rb = c.d, c.tab, c.mops, c.ranges, c.rb
    bq, ns, nseg, has_bias = d.bq, c.ns, mops.num_segments, bias is not None
    has_alibi, has_rel = alibi is not None, rel is not None
    if has_rel:
        nbp = round_up(rel.num_buckets, 8)

    def kernel(*refs):
        (order, count, offs_ref, sref, q_ref, k_ref, v_ref, (bias_ref, alibi_ref, rel_ref),
         (do_ref, lse_row, delta_row), (qrows, qseg), kseg, outs, (acc_sc, lse_ref, delta_ref)
         ) = _split_refs(refs, ns, has_bias, has_alibi, has_rel, nseg, 3, 2 if has_rel else 1, 3)
        dq_ref = outs[0]
        b, h, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2), pl.program_id(3)
        r = rb(b)

        @pl.when(j == 0)
        def _init():
            _columns((lse_row, delta_row, *qrows), (lse_ref, delta_ref, *qseg))
            acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

        if has_rel:  # one [nbp, 128] accumulator per (b, h), over all tiles of the head
            dtable_ref = outs[1]

            @pl.when((i == 0) & (j == 0))
            def _init_table():
                dtable_ref[...] = jnp.zeros(dtable_ref.shape, jnp.float32)

        @pl.when(j < count[r, i])
        def _step():
            kj = _column(order[r, i, j])
            kk = k_ref[...]
            rel_tile, buckets, const = _relative(rel_ref, rel, b, i, kj, d, offs_ref, mops, qseg,
                                                 kseg, sref[len(mops.scalars):])
            s, t = logits(dot_nt(q_ref[...], kk), cfg.scale, cfg.softcap,
                          bias_ref[...] if has_bias else None,
                          _alibi(alibi_ref, b, h, i, kj, d, offs_ref, mops, qseg, kseg), rel_tile)

            def apply_mask(s):
                return _masked(s, i, kj, d, mask, mops, offs_ref, b, sref, qseg, kseg)

            s = lax.cond(_code(order[r, i, j]) == M.PARTIAL, apply_mask, lambda s: s, s)
            p = jnp.exp(s - lse_ref[...])  # [bq, bk]; lse of fully masked rows is 0 here
            dp = dot_nt(do_ref[...], v_ref[...])
            ds = p * (dp - delta_ref[...])
            if has_rel:  # dL/dlogits (after the soft-cap) summed per bucket
                @pl.when(const >= 0)
                def _one_bucket():  # a tile far from the diagonal: one sum
                    total = _fold_lanes(ds.sum(axis=0, keepdims=True))
                    dtable_ref[...] += jnp.where(_iota(dtable_ref.shape, 0) == const, total, 0.0)

                @pl.when(const < 0)
                def _every_bucket():
                    for n in range(rel.num_buckets):
                        col = jnp.where(buckets == n, ds, 0.0).sum(axis=0, keepdims=True)
                        dtable_ref[n:n + 1, :] += _fold_lanes(col)
            if t is not None:
                ds = ds * (1.0 - t * t)
            acc_sc[...] += dot((ds * cfg.scale).astype(kk.dtype), kk)

        @pl.when(j == tab.steps - 1)
        def _finish():
            dq_ref[...] = acc_sc[...].astype(dq_ref.dtype)

    row = lambda b, h, i, j, *_: (b, h, i, 0)
    lane_row = lambda b, h, i, j, *_: (b, h, 0, i)  # lse, delta: query positions on lanes
    in_specs, operands = _row_inputs(c, q, k, v, bias, alibi, rel, extra=[
        (pl.BlockSpec((None, None, bq, d.Hp), row), _heads_major(do, d.Tp, d.Hp)),
        (pl.BlockSpec((None, None, 1, bq), lane_row), pad_axis(lse, 2, d.Tp)[:, :, None, :]),
        (pl.BlockSpec((None, None, 1, bq), lane_row), pad_axis(delta, 2, d.Tp)[:, :, None, :])])
    out_specs = [pl.BlockSpec((None, None, bq, d.Hp), row)]
    out_shape = [jax.ShapeDtypeStruct((d.B, d.N, d.Tp, d.Hp), cfg.grad_dtype or q.dtype)]
    if has_rel:  # accumulated over the query tiles too, which then run in order
        out_specs.append(pl.BlockSpec((None, None, nbp, LANES),
                                      lambda b, h, i, j, *_: (b, h, 0, 0)))
        out_shape.append(jax.ShapeDtypeStruct((d.B, d.N, nbp, LANES), jnp.float32))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3 + ns, grid=(d.B, d.N, d.Tp // bq, tab.steps),
        in_specs=in_specs, out_specs=out_specs,
        scratch_shapes=[_vmem((bq, d.Hp), jnp.float32), _vmem((bq, 1), jnp.float32),
                        _vmem((bq, 1), jnp.float32), *_column_scratch(mops.q_segments, bq)])
    outs = tpu_pallas_call(
        cfg.interpret, kernel, grid_spec=grid_spec, out_shape=out_shape, name="tfjax_flash_dq",
        compiler_params=_compiler_params("parallel", "parallel",
                                         "arbitrary" if has_rel else "parallel", "arbitrary"),
    )(_packed(tab), tab.count, offs, *mops.scalars, *ranges, *operands)
    dq = outs[0][:, :, :d.T, :d.H].transpose(0, 2, 1, 3)
    dtable = None
    if has_rel:  # [B, N, nbp, 128] -> [nb, N]
        dtable = outs[1][:, :, :rel.num_buckets].sum(axis=(0, 3)).T
    return dq, dtable


# --------------------------------------------------------------------------- #
# dk/dv kernel: grid (B, K, nk, G, steps), transposed tables; logits as [bk, bq].
# --------------------------------------------------------------------------- #


def _backward_dkv(cfg, q, k, v, mask, bias, alibi, rel, offs, do, lse, delta):
    bs = cfg.block_sizes
    # query positions run along lanes here (`_query_tile`)
    c = _call(cfg, q, k, v, mask, alibi, rel, offs, bs.block_q_dkv, bs.block_kv_dkv,
              transpose=True)
    d, tab, mops, ranges, rb = c.d, c.tab, c.mops, c.ranges, c.rb
    G, bq, bk = d.G, d.bq, d.bk
    ns, nseg, has_bias = c.ns, mops.num_segments, bias is not None
    n_out = 3 if has_bias else 2
    has_alibi, has_rel = alibi is not None, rel is not None

    def kernel(*refs):
        (order, count, offs_ref, sref, q_ref, k_ref, v_ref, (bias_ref, alibi_ref, rel_ref),
         extra, (qseg, kseg), krows, outs, (dk_sc, dv_sc)) = _split_refs(  # kseg: krows' columns
            refs, ns, has_bias, has_alibi, has_rel, nseg, 4 if has_bias else 3, n_out, 2)
        do_ref, lse_ref, delta_ref = extra[:3]
        dk_ref, dv_ref = outs[:2]
        dbias_ref = outs[2] if has_bias else None
        b, kh, kj = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        g, j = pl.program_id(3), pl.program_id(4)
        r = rb(b)

        @pl.when((g == 0) & (j == 0))
        def _init():
            _columns(krows, kseg)
            dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
            dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

        if has_bias:
            @pl.when(count[r, kj] == 0)
            def _zero_bias():  # the block this kv tile points at holds no visible entry
                dbias_ref[...] = jnp.zeros(dbias_ref.shape, dbias_ref.dtype)

        @pl.when(j < count[r, kj])
        def _step():
            qi = _column(order[r, kj, j])
            qq, kk, vv, dd = q_ref[...], k_ref[...], v_ref[...], do_ref[...]
            rel_tile, _, _ = _relative(rel_ref, rel, b, qi, kj, d, offs_ref, mops, qseg, kseg,
                                       sref[len(mops.scalars):], kv_major=True)
            s, t = logits(dot_nt(kk, qq), cfg.scale, cfg.softcap,
                          bias_ref[...].T if has_bias else None,  # [bk, bq]
                          _alibi(alibi_ref, b, kh * G + g, qi, kj, d, offs_ref, mops, qseg,
                                 kseg, kv_major=True), rel_tile)

            def apply_mask(s):
                return _masked(s, qi, kj, d, mask, mops, offs_ref, b, sref, qseg, kseg,
                               kv_major=True)

            s = lax.cond(_code(order[r, kj, j]) == M.PARTIAL, apply_mask, lambda s: s, s)
            p = jnp.exp(s - lse_ref[...])  # [bk, bq]
            dv_sc[...] += dot(p.astype(dd.dtype), dd)
            dp = dot_nt(vv, dd)
            ds = p * (dp - delta_ref[...])
            if has_bias:
                dbias_ref[...] = ds.T.astype(dbias_ref.dtype)
            if t is not None:
                ds = ds * (1.0 - t * t)
            dk_sc[...] += dot((ds * cfg.scale).astype(qq.dtype), qq)

        @pl.when((g == G - 1) & (j == tab.steps - 1))
        def _finish():
            dk_ref[...] = dk_sc[...].astype(dk_ref.dtype)
            dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)

    q_idx = lambda b, kh, kj, g, j, order, *_: (b, kh * G + g, _column(order[rb(b), kj, j]), 0)
    kv_row = lambda b, kh, kj, g, j, *_: (b, kh, kj, 0)
    lse_idx = lambda b, kh, kj, g, j, order, *_: (b, kh * G + g, 0, _column(order[rb(b), kj, j]))
    in_specs = [pl.BlockSpec((None, None, bq, d.Hp), q_idx),
                pl.BlockSpec((None, None, bk, d.Hp), kv_row),
                pl.BlockSpec((None, None, bk, d.Hp), kv_row)]
    operands = [_heads_major(q, d.Tp, d.Hp), _heads_major(k, d.Sp, d.Hp),
                _heads_major(v, d.Sp, d.Hp)]
    if has_bias:
        Bb, Nb = bias.shape[:2]
        in_specs.append(pl.BlockSpec(
            (None, None, bq, bk),
            lambda b, kh, kj, g, j, order, *_: (b if Bb > 1 else 0, kh * G + g if Nb > 1 else 0,
                                                _column(order[rb(b), kj, j]), kj)))
        operands.append(_bias_operand(bias, d))
    _position_operands(in_specs, operands, alibi, rel, lambda b, kh, kj, g, *_: kh * G + g)
    in_specs += [pl.BlockSpec((None, None, bq, d.Hp), q_idx),
                 pl.BlockSpec((None, None, 1, bq), lse_idx),
                 pl.BlockSpec((None, None, 1, bq), lse_idx)]
    operands += [_heads_major(do, d.Tp, d.Hp), pad_axis(lse, 2, d.Tp)[:, :, None, :],
                 pad_axis(delta, 2, d.Tp)[:, :, None, :]]
    io_aliases = {}
    if has_bias:  # zero-initialised dbias, aliased to the output: EMPTY tiles stay 0
        in_specs.append(pl.BlockSpec(memory_space=pl.ANY))
        operands.append(jnp.zeros((d.B, d.N, d.Tp, d.Sp), jnp.float32))
        io_aliases = {3 + ns + len(operands) - 1: 2}
    for qs in mops.q_segments:
        in_specs.append(pl.BlockSpec(
            (None, 1, bq), lambda b, kh, kj, g, j, order, *_: (b, 0, _column(order[rb(b), kj, j]))))
        operands.append(qs[:, None, :])
    for ks in mops.kv_segments:  # lane-major; the kernel keeps a column copy per kv tile
        in_specs.append(pl.BlockSpec((None, 1, bk), lambda b, kh, kj, g, j, *_: (b, 0, kj)))
        operands.append(ks[:, None, :])
    out_specs = [pl.BlockSpec((None, None, bk, d.Hp), kv_row),
                 pl.BlockSpec((None, None, bk, d.Hp), kv_row)]
    out_shape = [jax.ShapeDtypeStruct((d.B, d.K, d.Sp, d.Hp), cfg.grad_dtype or k.dtype),
                 jax.ShapeDtypeStruct((d.B, d.K, d.Sp, d.Hp), cfg.grad_dtype or v.dtype)]
    if has_bias:
        out_specs.append(pl.BlockSpec(
            (None, None, bq, bk),
            lambda b, kh, kj, g, j, order, *_: (b, kh * G + g, _column(order[rb(b), kj, j]), kj)))
        out_shape.append(jax.ShapeDtypeStruct((d.B, d.N, d.Tp, d.Sp), jnp.float32))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3 + ns, grid=(d.B, d.K, d.Sp // bk, G, tab.steps),
        in_specs=in_specs, out_specs=out_specs,
        scratch_shapes=[_vmem((bk, d.Hp), jnp.float32), _vmem((bk, d.Hp), jnp.float32),
                        *_column_scratch(mops.kv_segments, bk)])
    outs = tpu_pallas_call(
        cfg.interpret, kernel, grid_spec=grid_spec, out_shape=out_shape,
        input_output_aliases=io_aliases, name="tfjax_flash_dkv",
        compiler_params=_compiler_params("parallel", "parallel", "parallel", "arbitrary",
                                         "arbitrary"),
    )(_packed(tab), tab.count, offs, *mops.scalars, *ranges, *operands)
    dk = outs[0][:, :, :d.S, :d.H].transpose(0, 2, 1, 3)
    dv = outs[1][:, :, :d.S, :d.Hv].transpose(0, 2, 1, 3)
    dbias = None
    if has_bias:
        dbias = reduce_dbias(outs[2][:, :, :d.T, :d.S], bias)
    return dk, dv, dbias


# --------------------------------------------------------------------------- #
# The VJP (`tfjax.ops.vjp`'s shell).
# --------------------------------------------------------------------------- #


def _backward(cfg, q, k, v, mask, bias, alibi, rel, offs, out, lse, dout, dlse):
    do, lse, delta = backward_rows(out, lse, dout, q.dtype, dlse)
    dq, dtable = _backward_dq(cfg, q, k, v, mask, bias, alibi, rel, offs, do, lse, delta)
    dk, dv, dbias = _backward_dkv(cfg, q, k, v, mask, bias, alibi, rel, offs, do, lse, delta)
    return dq, dk, dv, dbias, dtable


def _inference_forward(cfg, q, k, v, mask, bias, alibi, rel, offs):
    """The forward of an undifferentiated call (prefill, decode steps): at head dims
    under 128 lanes, K/V tiles with the keys along lanes. A `[.., S, 64]` array is
    kept by the TPU with S on the lanes (no padding of 64 to 128), a KV cache passed
    between decode steps among them, so the kernel reads it where it lies; the
    differentiated forward keeps the row tiles its backward kernels share."""
    lanes = cfg.keys_on_lanes
    if lanes is None:
        lanes = max(k.shape[-1], v.shape[-1]) < LANES
    return _forward(cfg, q, k, v, mask, bias, alibi, rel, offs, kv_lanes=lanes)


_flash = attention_vjp(_inference_forward, _backward, forward_for_grad=_forward)
