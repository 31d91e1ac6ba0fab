"""FlashAttention backward for Hopper GPUs in Pallas Mosaic GPU (TMA + wgmma).

`flash_backward_hopper`: a dq kernel (one CTA per query tile, head and batch row) and a
dk/dv kernel (one per kv tile, kv head and batch row, over the G query heads: native
GQA), like the Triton backward and without atomics, warp-specialised as the forward
(`HopperBackwardConfig`). It takes the residuals (output, logsumexp) of either
forward. `supports`: the forward's scope and head dims up to 128.
See docs/kernels.md.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from tfjax.ops import masks as M
from tfjax.ops.pallas import mosaic_gpu as hopper
from tfjax.ops.pallas.common import MaskOperands, heavy_first, offsets
from tfjax.ops.pallas.interpret_compat import gpu_interpret_params, load
from tfjax.ops.tiles import pad_axis, round_up, tile_tables

__all__ = ["HopperBackwardConfig", "flash_backward_hopper", "supports"]

_ROWS = 64  # rows of a consumer warpgroup (the wgmma M)


def supports(q_dtype, H: int, mask, has_bias: bool) -> str | None:
    """None when the Hopper backward computes this request, else why not."""
    reason = hopper.supports(q_dtype, H, mask, has_bias)
    if reason is None and round_up(H, 64) > 128:
        reason = ("the Hopper backward keeps dK and dV ([64, H] fp32 each) in registers: "
                  f"head dims up to 128, got {H}")
    return reason


@dataclasses.dataclass(frozen=True)
class HopperBackwardConfig:
    """Tiles of the Hopper backward: `block_kv_dq` keys per step of the dq kernel,
    `block_q_dkv` query rows per step of the dk/dv kernel (each consumer
    warpgroup owns 64 rows of its CTA's tile in both), `stages` tiles in flight,
    `compute_warpgroups` consumers (2 with a producer, or 1 alone)."""

    block_kv_dq: int = 64
    block_q_dkv: int = 64
    stages: int = 2
    compute_warpgroups: int = 2

    def __post_init__(self):
        for name in ("block_kv_dq", "block_q_dkv"):
            n = getattr(self, name)
            if n not in (64, 128):
                raise ValueError(f"HopperBackwardConfig.{name} must be 64 or 128, got {n}")
        if self.stages < 1:
            raise ValueError(f"HopperBackwardConfig.stages must be >= 1, got {self.stages}")
        if self.compute_warpgroups not in (1, 2):
            raise ValueError("HopperBackwardConfig.compute_warpgroups must be 1 or 2, got "
                             f"{self.compute_warpgroups}")

    def smem_bytes(self, H: int, itemsize: int = 2, slots: int = 0) -> int:
        """The larger of the two kernels' shared memory as Mosaic GPU allocates it
        (`hopper.pipeline_smem`). dq: fixed q, dO tiles and their logsumexp and
        delta rows, a ring of K and V tiles; dk/dv: fixed K and V tiles, a ring of
        q, dO tiles and their rows. `slots`: per-position int32 operands (segment
        ids, explicit ALiBi positions), fixed and in the ring."""
        Hp, C, st = round_up(H, 64), self.compute_warpgroups, self.stages
        tile, row = C * _ROWS * Hp * itemsize, C * _ROWS * 4
        bk, bq = self.block_kv_dq, self.block_q_dkv
        dq = hopper.pipeline_smem(C, st, fixed=[tile, tile, row, row] + [row] * slots,
                                  ring=[st * bk * Hp * itemsize] * 2 + [st * bk * 4] * slots)
        dkv = hopper.pipeline_smem(C, st, fixed=[tile, tile] + [row] * slots,
                                   ring=[st * bq * Hp * itemsize] * 2 + [st * bq * 4] * 2
                                   + [st * bq * 4] * slots)
        return max(dq, dkv)


_mma = hopper.mma  # acc + a @ b on the tensor cores, in place when compiled


def flash_backward_hopper(q, k, v, do, lse, delta, mask, *, scale: float, softcap: float | None,
                          q_offset=0, kv_offset=0, config: HopperBackwardConfig | None = None,
                          interpret: Any = False, alibi=None):
    """q/do `[B,T,N,H]`, k/v `[B,S,K,H]` (fp16/bf16), lse and delta `[B,N,T]` fp32
    (lse of fully masked rows finite, e.g. 0; delta = rowsum(dO * O) - dlse) ->
    (dq, dk, dv) in the dtypes of q, k, v. `alibi`: None or a checked
    `tfjax.ops.Alibi` (the forward's)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    reason = supports(q.dtype, q.shape[-1], mask, False)
    if reason:
        raise ValueError(reason)
    if not (q.dtype == k.dtype == v.dtype == do.dtype):
        raise ValueError(f"q, k, v, do must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}, "
                         f"{do.dtype}")
    cfg = config or HopperBackwardConfig()
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    C = cfg.compute_warpgroups
    bc = C * _ROWS  # rows of a CTA: query rows (dq), key rows (dk/dv)
    bk, bq = cfg.block_kv_dq, cfg.block_q_dkv
    Tp, Sp, Hp = round_up(T, math.lcm(bc, bq)), round_up(S, math.lcm(bc, bk)), round_up(H, 64)
    offs = offsets(q_offset, kv_offset)[1]
    mops = MaskOperands(mask, B, Tp, Sp, offs, alibi)
    ns, nseg = len(mops.scalars), mops.num_segments
    smem = cfg.smem_bytes(H, q.dtype.itemsize, slots=nseg)
    if smem > hopper.SMEM_BYTES:
        raise ValueError(
            f"HopperBackwardConfig(block_kv_dq={cfg.block_kv_dq}, block_q_dkv={cfg.block_q_dkv}, "
            f"stages={cfg.stages}) needs up to {smem / 1024:.1f} KiB of shared memory at head "
            f"dim {H}" + (f" with {nseg} segment/position operand(s)" if nseg else "")
            + f" (Hopper has {hopper.SMEM_BYTES // 1024} KiB): lower the blocks or stages")
    dtype = q.dtype
    pad_qh = lambda x, n: pad_axis(pad_axis(x, 1, n), 3, Hp)
    qp, dop, kp, vp = pad_qh(q, Tp), pad_qh(do, Tp), pad_qh(k, Sp), pad_qh(v, Sp)
    lse2 = pad_axis(lse.astype(jnp.float32) * math.log2(math.e), 2, Tp)  # base 2
    deltap = pad_axis(delta.astype(jnp.float32), 2, Tp)
    interp = gpu_interpret_params(interpret)
    log2e = math.log2(math.e)
    wgmma_layout = plgpu.Layout.WGMMA
    row_layout, col_layout = wgmma_layout.reduce(1), wgmma_layout.reduce(0)
    swz = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    smem = lambda shape, dt=dtype, t=swz: plgpu.SMEM(shape, dt, transforms=t)
    vec = lambda shape, dt=jnp.float32: plgpu.SMEM(shape, dt)
    mma = functools.partial(_mma, interpret=interp is not None)
    T_ = lambda ref: plgpu.transpose_ref(ref, (1, 0))
    zeros = lambda shape: plgpu.layout_cast(jnp.zeros(shape, jnp.float32), wgmma_layout)
    iota = lambda shape, d: plgpu.broadcasted_iota(jnp.int32, shape, d, layout=wgmma_layout)
    # ALiBi's positions: [n] vectors broadcast to the tile (a broadcast reuses the
    # vector's registers; a 2-D iota holds one per element)
    vec_iota = lambda n, layout: plgpu.broadcasted_iota(jnp.int32, (n,), 0, layout=layout)

    def logits(a, b, shape, partial, masked):
        """Scaled (soft-capped) a @ b, masked where the tile is PARTIAL; and the
        soft-cap's derivative 1 - tanh^2 (None without a soft-cap), tanh formed
        again from the capped logits after the mask's branch rather than kept
        across it (masked logits, -inf, clip to -1 and give 0)."""
        s = mma(a, b, shape) * scale
        if softcap:
            s = softcap * jnp.tanh(s / softcap)
        s = lax.cond(partial, masked, lambda s: s, s)
        return s, None if not softcap else 1.0 - jnp.square(jnp.clip(s / softcap, -1.0, 1.0))

    def capped(p, dcap):
        """P times the soft-cap's derivative (dS = that * (dP - delta)), formed
        before dP so that the derivative's tile is not live beside dP: in the dk/dv
        kernel, beside dK and dV, that spilled 80 B per thread at H = 128 with a
        soft-cap alone, 260 B with every extra (experiments/gpu_registers.py)."""
        return p if dcap is None else p * dcap

    def allowed(q_loc, kv_loc, b, offs_ref, sref, q_seg, kv_seg):
        ok = (q_loc < T) & (kv_loc < S)
        if mask is not None:
            ok = ok & mops.evaluate(q_loc + offs_ref[0], kv_loc + offs_ref[1], b, sref, q_seg,
                                    kv_seg)
        return ok

    def split_refs(refs, n_in):
        """(tables + offsets, scalars, inputs, q segments, kv segments, ALiBi's flat
        slopes or None, outputs)."""
        it = iter(refs)
        take = lambda n: [next(it) for _ in range(n)]
        head = take(4)
        return (head, take(ns), take(n_in), take(nseg), take(nseg),
                next(it) if alibi is not None else None, list(it))

    def alibi_term(slopes_ref, b, head, q_pos, kv_pos):
        """-slope * |q_pos - kv_pos| (positions broadcast to the tile)."""
        slope = slopes_ref[(b if alibi.slopes.shape[0] > 1 else 0) * N + head]
        return -slope * jnp.abs(q_pos - kv_pos).astype(jnp.float32)

    # ------------------------------------------------------------------ dq
    tab = tile_tables(mask, T, S, bc, bk, q_offset=q_offset, kv_offset=kv_offset)

    def dq_kernel(*refs):
        (order, count, code, offs_ref), sref, ins, qseg_ref, kseg_ref, slopes_ref, (dq_ref,) = \
            split_refs(refs, 6)
        q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = ins
        b, h = lax.axis_index("batch"), lax.axis_index("heads")
        i = heavy_first(lax.axis_index("q"), tab.order.shape[1])  # query tile: heaviest first
        r = b if tab.batched else 0
        kvh = lax.div(h, jnp.int32(G))
        row0 = lambda w: i * bc + w * _ROWS
        rows = lambda w: pl.ds(row0(w), _ROWS)
        fixed = [(lambda w: q_ref.at[b, rows(w), h], smem((C, _ROWS, Hp))),
                 (lambda w: do_ref.at[b, rows(w), h], smem((C, _ROWS, Hp))),
                 (lambda w: lse_ref.at[b, h, rows(w)], vec((C, _ROWS))),
                 (lambda w: delta_ref.at[b, h, rows(w)], vec((C, _ROWS)))]
        fixed += [(lambda w, x=x: qseg_ref[x].at[b, rows(w)], vec((C, _ROWS), jnp.int32))
                  for x in range(nseg)]
        kv_tile = lambda t: pl.ds(order[r, i, t] * bk, bk)
        ring = [(lambda t: k_ref.at[b, kv_tile(t), kvh], smem((stages_dq, bk, Hp))),
                (lambda t: v_ref.at[b, kv_tile(t), kvh], smem((stages_dq, bk, Hp)))]
        ring += [(lambda t, x=x: kseg_ref[x].at[b, kv_tile(t)], vec((stages_dq, bk), jnp.int32))
                 for x in range(nseg)]

        def consume(w, fixed_refs, ring):
            q_s, do_s, lse_s, delta_s, *qseg_s = fixed_refs
            shape = (_ROWS, bk)
            row = lambda v: lax.broadcast_in_dim(v, shape, [0])
            lse_r, delta_r = load(lse_s, row_layout), load(delta_s, row_layout)

            def masked(s, kj, t):  # positions and segment ids only in PARTIAL tiles
                q_seg = [row(load(x, row_layout)) for x in qseg_s]
                kv_seg = [lax.broadcast_in_dim(load(ring.at(2 + x, t), col_layout), shape, [1])
                          for x in range(nseg)]
                ok = allowed(iota(shape, 0) + row0(w), iota(shape, 1) + kj * bk, b, offs_ref,
                             sref, q_seg, kv_seg)
                return jnp.where(ok, s, -jnp.inf)

            def body(t, dq):
                kj = order[r, i, t]
                k_s, v_s = ring.at(0, t), ring.at(1, t)
                ring.wait(0, t)
                for x in range(nseg):
                    ring.wait(2 + x, t)
                s, dcap = logits(q_s, T_(k_s), shape, code[r, i, t] == M.PARTIAL,
                               lambda s: masked(s, kj, t))
                if alibi is not None:  # every tile (masked entries stay -inf)
                    if mops.alibi_slot is not None:  # explicit positions, like segment ids
                        x = mops.alibi_slot
                        q_pos = row(load(qseg_s[x], row_layout))
                        kv_pos = lax.broadcast_in_dim(load(ring.at(2 + x, t), col_layout),
                                                      shape, [1])
                    else:
                        q_pos = row(vec_iota(_ROWS, row_layout) + (row0(w) + offs_ref[0]))
                        kv_pos = lax.broadcast_in_dim(
                            vec_iota(bk, col_layout) + (kj * bk + offs_ref[1]), shape, [1])
                    s = s + alibi_term(slopes_ref, b, h, q_pos, kv_pos)
                p = capped(jnp.exp2(s * log2e - row(lse_r)), dcap)
                ring.wait(1, t)
                dp = mma(do_s, T_(v_s), shape)
                ds = p * (dp - row(delta_r))
                return mma(ds.astype(dtype), k_s, (_ROWS, Hp), dq)

            dq = ring.loop(body, zeros((_ROWS, Hp)))
            hopper.store((dq * scale, q_s, dq_ref.at[b, rows(w), h]))

        hopper.pipelined(C=C, stages=stages_dq, n=count[r, i], fixed=fixed, ring=ring,
                          consume=consume)

    # ------------------------------------------------------------------ dk/dv
    tab_t = tile_tables(mask, T, S, bq, bc, q_offset=q_offset, kv_offset=kv_offset,
                        transpose=True)

    def dkv_kernel(*refs):
        (order, count, code, offs_ref), sref, ins, qseg_ref, kseg_ref, slopes_ref, \
            (dk_ref, dv_ref) = split_refs(refs, 6)
        q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = ins
        b, i, kh = lax.axis_index("batch"), lax.axis_index("kv"), lax.axis_index("heads")
        r = b if tab_t.batched else 0
        nq = count[r, i]
        row0 = lambda w: i * bc + w * _ROWS
        rows = lambda w: pl.ds(row0(w), _ROWS)
        fixed = [(lambda w: k_ref.at[b, rows(w), kh], smem((C, _ROWS, Hp))),
                 (lambda w: v_ref.at[b, rows(w), kh], smem((C, _ROWS, Hp)))]
        fixed += [(lambda w, x=x: kseg_ref[x].at[b, rows(w)], vec((C, _ROWS), jnp.int32))
                  for x in range(nseg)]

        def at(t):  # step t: query head kh * G + t // nq, query tile order[.., t % nq]
            g, j = lax.div(t, nq), lax.rem(t, nq)
            return kh * G + g, pl.ds(order[r, i, j] * bq, bq), j

        ring = [(lambda t: q_ref.at[b, at(t)[1], at(t)[0]], smem((stages_dkv, bq, Hp))),
                (lambda t: do_ref.at[b, at(t)[1], at(t)[0]], smem((stages_dkv, bq, Hp))),
                (lambda t: lse_ref.at[b, at(t)[0], at(t)[1]], vec((stages_dkv, bq))),
                (lambda t: delta_ref.at[b, at(t)[0], at(t)[1]], vec((stages_dkv, bq)))]
        ring += [(lambda t, x=x: qseg_ref[x].at[b, at(t)[1]], vec((stages_dkv, bq), jnp.int32))
                 for x in range(nseg)]

        def consume(w, fixed_refs, ring):
            k_s, v_s, *kseg_s = fixed_refs
            shape = (_ROWS, bq)  # transposed tiles: key rows, query columns
            col = lambda ref: lax.broadcast_in_dim(load(ref, col_layout), shape, [1])

            def masked(s, qi, t):  # positions and segment ids only in PARTIAL tiles
                kv_seg = [lax.broadcast_in_dim(load(x, row_layout), shape, [0]) for x in kseg_s]
                q_seg = [col(ring.at(4 + x, t)) for x in range(nseg)]
                ok = allowed(iota(shape, 1) + qi * bq, iota(shape, 0) + row0(w), b, offs_ref,
                             sref, q_seg, kv_seg)
                return jnp.where(ok, s, -jnp.inf)

            def body(t, carry):
                dk, dv = carry
                head, _, j = at(t)
                qi = order[r, i, j]
                q_s, do_s, lse_s, delta_s = (ring.at(x, t) for x in range(4))
                ring.wait(0, t)
                for x in range(nseg):
                    ring.wait(4 + x, t)
                s, dcap = logits(k_s, T_(q_s), shape, code[r, i, j] == M.PARTIAL,
                               lambda s: masked(s, qi, t))
                if alibi is not None:  # transposed: key rows, query columns
                    if mops.alibi_slot is not None:
                        x = mops.alibi_slot
                        kv_pos = lax.broadcast_in_dim(load(kseg_s[x], row_layout), shape, [0])
                        q_pos = col(ring.at(4 + x, t))
                    else:
                        kv_pos = lax.broadcast_in_dim(
                            vec_iota(_ROWS, row_layout) + (row0(w) + offs_ref[1]), shape, [0])
                        q_pos = lax.broadcast_in_dim(
                            vec_iota(bq, col_layout) + (qi * bq + offs_ref[0]), shape, [1])
                    s = s + alibi_term(slopes_ref, b, head, q_pos, kv_pos)
                ring.wait(2, t)
                p = jnp.exp2(s * log2e - col(lse_s))
                p16, p = p.astype(dtype), capped(p, dcap)  # dcap's tile dies here
                ring.wait(1, t)
                dv = mma(p16, do_s, (_ROWS, Hp), dv)
                dp = mma(v_s, T_(do_s), shape)
                ring.wait(3, t)
                ds = p * (dp - col(delta_s))
                dk = mma(ds.astype(dtype), q_s, (_ROWS, Hp), dk)
                return dk, dv

            dk, dv = ring.loop(body, (zeros((_ROWS, Hp)), zeros((_ROWS, Hp))))
            hopper.store((dk * scale, k_s, dk_ref.at[b, rows(w), kh]),
                          (dv, v_s, dv_ref.at[b, rows(w), kh]))

        hopper.pipelined(C=C, stages=stages_dkv, n=G * nq, fixed=fixed, ring=ring,
                          consume=consume)

    stages_dq = max(1, min(cfg.stages, Sp // bk))
    stages_dkv = max(1, min(cfg.stages, G * (Tp // bq)))
    threads = {"num_threads": C + 1, "thread_name": "wg"} if C > 1 else {}
    params = plgpu.CompilerParams(approx_math=True)
    ins = [offs, *mops.scalars, qp, kp, vp, dop, lse2, deltap, *mops.q_segments,
           *mops.kv_segments]
    if alibi is not None:
        ins.append(alibi.slopes.astype(jnp.float32).reshape(-1))
    dq = plgpu.kernel(
        dq_kernel, out_type=jax.ShapeDtypeStruct((B, Tp, N, Hp), dtype),
        grid=(N, tab.order.shape[1], B), grid_names=("heads", "q", "batch"), **threads,
        compiler_params=params, interpret=interp if interp is not None else False,
    )(tab.order, tab.count, tab.code, *ins)
    dk, dv = plgpu.kernel(
        dkv_kernel, out_type=[jax.ShapeDtypeStruct((B, Sp, K, Hp), dtype)] * 2,
        grid=(K, tab_t.order.shape[1], B), grid_names=("heads", "kv", "batch"), **threads,
        compiler_params=params, interpret=interp if interp is not None else False,
    )(tab_t.order, tab_t.count, tab_t.code, *ins)
    return dq[:, :T, :, :H], dk[:, :S, :, :H], dv[:, :S, :, :H]
