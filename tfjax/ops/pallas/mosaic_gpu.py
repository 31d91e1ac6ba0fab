"""FlashAttention forward for Hopper GPUs in Pallas Mosaic GPU (TMA + wgmma).

`flash_forward_hopper(q, k, v, mask, ...)`: q `[B,T,N,H]`, k/v `[B,S,K,H]` (fp16/bf16)
-> (out `[B,T,N,H]`, lse `[B,N,T]` fp32), what the Triton forward computes, on the
sm_90 hardware the Triton lowering does not reach: K/V tiles stream by TMA into a ring
of `stages` shared-memory slots, both matmuls are wgmma with fp32 accumulators, and
the CTA is warp-specialised as in FlashAttention-3 (`HopperConfig`; the ring,
`pipelined`, is shared with `mosaic_gpu_backward.py`). Native GQA, empty tiles skipped.
`supports`: 16-bit inputs, no additive bias, head dim <= 256, the positional, segment,
padding and prefix masks. See docs/kernels.md.
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
from tfjax.ops.pallas.common import MaskOperands, heavy_first, offsets, unsupported_mask
from tfjax.ops.pallas.interpret_compat import gpu_interpret_params, load
from tfjax.ops.tiles import pad_axis, round_up, tile_tables

__all__ = ["SMEM_BYTES", "HopperConfig", "flash_forward_hopper", "mma", "pipeline_smem",
           "pipelined", "store", "supports"]

SMEM_BYTES = 227 * 1024  # per CTA on sm_90
_SMEM_ALIGN = 1024  # Mosaic GPU starts each shared-memory scratch buffer at a 1 KiB boundary
_MBARRIER_BYTES = 8


def pipeline_smem(C: int, stages: int, fixed, ring, extra=(), barriers: int = 0) -> int:
    """Bytes of shared memory a `_pipelined` kernel gets from Mosaic GPU: each
    buffer (byte sizes: `fixed` with their C axis, `ring` with their stages axis,
    `extra` scratch) rounded up to 1 KiB, plus its mbarriers (the pipeline's and
    `barriers` more). Checked against Mosaic GPU's own count in the tests; the
    kernels raise with it before lowering rather than fail inside Mosaic."""
    n_barriers = C * max(len(fixed), 1) + max(len(ring), 1) * stages + stages + barriers
    return sum(round_up(n, _SMEM_ALIGN) for n in (*fixed, *ring, *extra)) \
        + _MBARRIER_BYTES * n_barriers


_ALLOWED_MASKS = (M.Causal, M.SlidingWindow, M.ChunkedCausal, M.Padding, M.PrefixLM,
                  M.PrefixBlock, M.Segments, M.Blocks, M.Positions)


def _mask_reason(mask) -> str | None:
    kind = unsupported_mask(mask, _ALLOWED_MASKS)
    return kind and f"the Hopper kernel does not evaluate {kind.__name__} masks"


def supports(q_dtype, H: int, mask, has_bias: bool) -> str | None:
    """None when the Hopper forward computes this request, else why not."""
    if jnp.dtype(q_dtype) not in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)):
        return f"the Hopper kernel takes float16/bfloat16 (wgmma operands), got {jnp.dtype(q_dtype)}"
    if has_bias:
        return "the Hopper kernel takes no additive bias"
    if H > 256:
        return f"the Hopper kernel takes head dims up to 256, got {H}"
    return _mask_reason(mask)


@dataclasses.dataclass(frozen=True)
class HopperConfig:
    """Tiles of the Hopper forward: `block_q` query rows per warpgroup (64, the
    wgmma M), `block_kv` keys per step, `stages` K/V tiles in flight,
    `compute_warpgroups` consumers (2 with a producer, or 1 alone) and
    `pingpong`: the two consumers take turns on the tensor cores (one's softmax
    overlaps the other's matmuls), FlashAttention-3's inter-warpgroup schedule;
    `overlap`: each consumer issues step t's Q K^T and step t-1's P V together
    and computes step t's softmax while P V runs, FlashAttention-3's
    intra-warpgroup schedule (needs stages >= 2; replaces ping-pong here).
    `order`: which programs the GPU starts first. "head" (default): head by head,
    each head's query tiles heaviest first (`common.heavy_first`), so programs
    running side by side share that head's K/V in L2; "lpt": every head's last
    query tile, then every head's one before it, ..., longest first across heads
    (nearer the ideal makespan under a causal mask, experiments/launch_order.py,
    at the cost of that L2 reuse; `bench_attention.py tune` times both)."""

    block_q: int = 64
    block_kv: int = 128
    stages: int = 2
    compute_warpgroups: int = 2
    pingpong: bool | None = None  # None: on with two consumer warpgroups (and no overlap)
    overlap: bool = False
    order: str = "head"

    @classmethod
    def default(cls, H: int) -> "HopperConfig":
        """128-key tiles while double-buffered K/V fit shared memory beside the
        query tile (head dims up to 128), else 64 (ptxas's registers and spills at
        these tiles: experiments/results/attention_gpu_ptxas_20261130.md)."""
        return cls(block_kv=128 if round_up(H, 64) <= 128 else 64)

    def smem_bytes(self, H: int, itemsize: int = 2, slots: int = 0) -> int:
        """Shared memory of the forward kernel as Mosaic GPU allocates it (see
        `pipeline_smem`): the consumers' query tiles, `stages` K and V tiles,
        the logsumexp staging; `slots`: per-position int32 operands (segment ids,
        explicit ALiBi positions), a fixed query tile and a ring of kv tiles each."""
        Hp, C, bq, bk, st = round_up(H, 64), self.compute_warpgroups, self.block_q, \
            self.block_kv, self.stages
        return pipeline_smem(C, st, fixed=[C * bq * Hp * itemsize] + [C * bq * 4] * slots,
                             ring=[st * bk * Hp * itemsize] * 2 + [st * bk * 4] * slots,
                             extra=[C * bq * 4], barriers=1)

    def __post_init__(self):
        if self.block_q != 64:
            raise ValueError(f"HopperConfig.block_q must be 64 (one wgmma M), got {self.block_q}")
        if self.block_kv % 64 or not 64 <= self.block_kv <= 256:
            raise ValueError(f"HopperConfig.block_kv must be 64, 128, 192 or 256, got {self.block_kv}")
        if self.stages < 1:
            raise ValueError(f"HopperConfig.stages must be >= 1, got {self.stages}")
        if self.overlap and self.stages < 2:
            raise ValueError("HopperConfig.overlap keeps step t's K and step t-1's V in shared "
                             f"memory at once: it needs stages >= 2, got {self.stages}")
        if self.overlap and self.pingpong:
            raise ValueError("HopperConfig.overlap and pingpong are two schedules of the matmuls; "
                             "pass pingpong=None (or False) with overlap=True")
        if self.pingpong is True and self.compute_warpgroups != 2:
            raise ValueError("HopperConfig.pingpong alternates two consumer warpgroups: it needs "
                             f"compute_warpgroups=2, got {self.compute_warpgroups}")
        if self.order not in ("head", "lpt"):
            raise ValueError(f"HopperConfig.order must be 'head' or 'lpt', got {self.order!r}")
        if self.compute_warpgroups not in (1, 2):
            raise ValueError("HopperConfig.compute_warpgroups must be 1 (no warp specialisation) "
                             f"or 2 (two consumers and a producer), got {self.compute_warpgroups}")


class _Ring:
    """A consumer's view of the ring of step tiles (see `_pipelined`): the slot
    of step t holds its tiles; `wait(x, t)` waits for buffer x of step t,
    `release(t)` hands the slot of step t back (once every wgmma reading it has
    completed) for the tiles of step t + stages, and `loop(body, carry)` runs
    `body(t, carry)` for t < n, releasing each step's slot when its body returns."""

    def __init__(self, smem, bars, stages, n, release):
        self.smem, self.bars, self.stages, self.n, self._release = smem, bars, stages, n, release

    def slot(self, t):
        return lax.rem(t, jnp.int32(self.stages))

    def at(self, x, t):
        return self.smem[x].at[self.slot(t)]

    def wait(self, x, t):
        from jax.experimental.pallas import mosaic_gpu as plgpu

        plgpu.barrier_wait(self.bars.at[x * self.stages + self.slot(t)])

    def release(self, t):
        self._release(t, self.slot(t))

    def loop(self, body, carry):
        def step(t, carry):
            carry = body(t, carry)
            self.release(t)  # the body read its results: its wgmmas are done
            return carry

        return lax.fori_loop(0, self.n, step, carry)


def mma(a, b, shape, acc=None, *, interpret=False):
    """acc + a @ b on the tensor cores (a: shared memory or registers, b: shared
    memory; fp32). Compiled, the accumulator is updated in place
    (`run_state` + `ACC.init`); the GPU interpreter lacks run_state, so there
    the product goes to a fresh accumulator and is added."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if acc is not None and not interpret:
        def update(acc_ref):
            plgpu.wgmma(acc_ref, a, b)

        return pl.run_state(update)(plgpu.ACC.init(acc))

    def fresh(acc_ref):
        plgpu.wgmma(acc_ref, a, b)
        return acc_ref[...]

    out = pl.run_scoped(fresh, plgpu.ACC(shape, jnp.float32))
    return out if acc is None else acc + out


def pipelined(*, C, stages, n, fixed, ring, consume, extra=()):
    """The warp-specialised pipeline of the forward and backward kernels, called
    inside the kernel.

    `fixed`: [(src(w) -> gmem view, SMEM spec with a leading C axis)], each
    consumer's own tiles, copied once; `ring`: [(src(t) -> gmem view, SMEM spec
    with a leading `stages` axis)], the tiles of loop step t; `n`: the number of
    steps (traced); `extra`: more scratch (SMEM or barriers), handed to
    `consume(w, fixed_refs, ring, *extra_refs)`, the consumer warpgroup w,
    given its fixed tiles (already waited for) and the `_Ring` of step tiles.
    Every step's slot must be waited for (each buffer) and released once."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    producer = C > 1
    nf, nr = len(fixed), len(ring)

    def scoped(fixed_smem, ring_smem, fixed_bars, ring_bars, free_bars, *extra_refs):
        def fetch(t, slot):
            for x, (src, _) in enumerate(ring):
                plgpu.copy_gmem_to_smem(src(t), ring_smem[x].at[slot],
                                        ring_bars.at[x * stages + slot])

        def prologue():
            for s in range(stages):
                pl.when(s < n)(functools.partial(fetch, s, s))

        def compute(w):
            for x, (src, _) in enumerate(fixed):
                plgpu.copy_gmem_to_smem(src(w), fixed_smem[x].at[w], fixed_bars.at[w * nf + x])
            if not producer:
                prologue()
            for x in range(nf):
                plgpu.barrier_wait(fixed_bars.at[w * nf + x])

            def release(t, slot):
                if producer:
                    plgpu.barrier_arrive(free_bars.at[slot])
                else:
                    pl.when(t + stages < n)(lambda: fetch(t + stages, slot))

            ring_view = _Ring(ring_smem, ring_bars, stages, n, release)
            consume(w, [r.at[w] for r in fixed_smem], ring_view, *extra_refs)

        if not producer:
            compute(0)
            return
        w = lax.axis_index("wg")

        @pl.when(w < C)
        def _():
            plgpu.set_max_registers(232, action="increase")
            compute(w)

        @pl.when(w == C)
        def _():
            plgpu.set_max_registers(40, action="decrease")
            prologue()

            @pl.loop(stages, jnp.maximum(n, stages))
            def _(t):
                slot = lax.rem(t, jnp.int32(stages))
                plgpu.barrier_wait(free_bars.at[slot])  # every consumer is done with t - stages
                fetch(t, slot)

            @pl.loop(jnp.maximum(n - stages, 0), n)  # observe the last phases (the interpreter
            def _(t):                                 # checks every phase is observed)
                plgpu.barrier_wait(free_bars.at[lax.rem(t, jnp.int32(stages))])

    scratch = ([spec for _, spec in fixed], [spec for _, spec in ring],
               plgpu.Barrier(num_barriers=C * max(nf, 1)),
               plgpu.Barrier(num_barriers=max(nr, 1) * stages),
               plgpu.Barrier(num_arrivals=C, num_barriers=stages), *extra)
    if producer:
        pl.run_scoped(scoped, *scratch, collective_axes="wg")
    else:
        pl.run_scoped(scoped, *scratch)


def store(*outs):
    """Write register tiles to global memory through shared memory: each of
    `outs` is (value, smem ref, gmem view)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    for value, smem, _ in outs:
        smem[...] = value.astype(smem.dtype)
    plgpu.commit_smem()
    for _, smem, gmem in outs:
        plgpu.copy_smem_to_gmem(smem, gmem)
    plgpu.wait_smem_to_gmem(0)


def flash_forward_hopper(q, k, v, mask, *, scale: float, softcap: float | None, q_offset=0,
                         kv_offset=0, config: HopperConfig | None = None, interpret: Any = False,
                         alibi=None):
    """q `[B,T,N,H]`, k/v `[B,S,K,H]` (fp16/bf16) -> (out `[B,T,N,H]`, lse `[B,N,T]` fp32).
    Fully masked rows give zeros and lse = -inf, like the other kernels. `alibi`: None
    or a checked `tfjax.ops.Alibi` (`make_alibi`): `-slope * |q_pos - kv_pos|` is
    added in every visited tile, from the wgmma-layout iota plus the offsets or from
    the explicit positions, copied like segment ids."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    reason = supports(q.dtype, q.shape[-1], mask, False)
    if reason:
        raise ValueError(reason)
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    cfg = config or HopperConfig.default(q.shape[-1])
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    C = cfg.compute_warpgroups
    bq, bk = cfg.block_q, cfg.block_kv
    bc = C * bq  # query rows of a CTA (its row of the tile table)
    Tp, Sp, Hp = round_up(T, bc), round_up(S, bk), round_up(H, 64)
    tab = tile_tables(mask, T, S, bc, bk, q_offset=q_offset, kv_offset=kv_offset)
    offs = offsets(q_offset, kv_offset)[1]
    mops = MaskOperands(mask, B, Tp, Sp, offs, alibi)
    smem = cfg.smem_bytes(H, q.dtype.itemsize, slots=mops.num_segments)
    if smem > SMEM_BYTES:
        raise ValueError(
            f"HopperConfig(block_kv={cfg.block_kv}, stages={cfg.stages}) needs "
            f"{smem / 1024:.1f} KiB of shared memory at head dim {H}"
            + (f" with {mops.num_segments} segment/position operand(s)" if mops.num_segments
               else "") + f" (Hopper has {SMEM_BYTES // 1024} KiB): lower block_kv or stages")
    stages = max(1, min(cfg.stages, Sp // bk))
    dtype = q.dtype
    qp = pad_axis(pad_axis(q, 1, Tp), 3, Hp)
    kp = pad_axis(pad_axis(k, 1, Sp), 3, Hp)
    vp = pad_axis(pad_axis(v, 1, Sp), 3, Hp)
    ns, nseg = len(mops.scalars), mops.num_segments
    interp = gpu_interpret_params(interpret)
    wgmma_layout = plgpu.Layout.WGMMA
    row_layout, col_layout = wgmma_layout.reduce(1), wgmma_layout.reduce(0)
    log2e = math.log2(math.e)
    producer = C > 1  # warp specialisation: a third warpgroup only issues the K/V copies
    pingpong = (C == 2 and not cfg.overlap) if cfg.pingpong is None else cfg.pingpong
    swz = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

    def kernel(*refs):
        it = iter(refs)
        take = lambda n: [next(it) for _ in range(n)]
        order, count, code, offs_ref = take(4)
        sref = take(ns)
        q_ref, k_ref, v_ref = take(3)
        qseg_ref, kseg_ref = take(nseg), take(nseg)
        slopes_ref = next(it) if alibi is not None else None  # flat [B|1 * N] fp32
        out_ref, lse_ref = take(2)
        b, h = lax.axis_index("batch"), lax.axis_index("heads")
        i = heavy_first(lax.axis_index("q"), Tp // bc)  # query tile: heaviest first
        r = b if tab.batched else 0
        kvh = lax.div(h, jnp.int32(G))
        row0 = lambda w: i * bc + w * bq  # a warpgroup's first query row
        rows = lambda w: pl.ds(row0(w), bq)
        fixed = [(lambda w: q_ref.at[b, rows(w), h],
                  plgpu.SMEM((C, bq, Hp), dtype, transforms=swz))]
        fixed += [(lambda w, x=x: qseg_ref[x].at[b, rows(w)], plgpu.SMEM((C, bq), jnp.int32))
                  for x in range(nseg)]
        kv_tile = lambda t: pl.ds(order[r, i, t] * bk, bk)
        kv_smem = plgpu.SMEM((stages, bk, Hp), dtype, transforms=swz)
        ring = [(lambda t: k_ref.at[b, kv_tile(t), kvh], kv_smem),
                (lambda t: v_ref.at[b, kv_tile(t), kvh], kv_smem)]
        ring += [(lambda t, x=x: kseg_ref[x].at[b, kv_tile(t)],
                  plgpu.SMEM((stages, bk), jnp.int32)) for x in range(nseg)]

        def consume(w, fixed_refs, ring, lse_smem, sched_bar):
            q_tile, *qseg_s = fixed_refs

            def sync():
                plgpu.barrier_arrive(sched_bar)
                plgpu.barrier_wait(sched_bar)

            def masked(s, kj, t):
                # Positions and segment ids are formed here, in PARTIAL tiles only,
                # rather than held in registers across the loop.
                iota = lambda d: plgpu.broadcasted_iota(jnp.int32, (bq, bk), d, layout=wgmma_layout)
                q_loc, kv_loc = iota(0) + row0(w), iota(1) + kj * bk
                ok = (q_loc < T) & (kv_loc < S)
                if mask is not None:
                    q_seg = [lax.broadcast_in_dim(load(x, row_layout), (bq, bk), [0])
                             for x in qseg_s]
                    kv_seg = [lax.broadcast_in_dim(load(ring.at(2 + x, t), col_layout),
                                                   (bq, bk), [1]) for x in range(nseg)]
                    ok = ok & mops.evaluate(q_loc + offs_ref[0], kv_loc + offs_ref[1], b, sref,
                                            q_seg, kv_seg)
                return jnp.where(ok, s, -jnp.inf)

            def wait_k(t):
                ring.wait(0, t)
                for x in range(nseg):
                    ring.wait(2 + x, t)

            def alibi_term(kj, t):
                """-slope * |q_pos - kv_pos| of step t's tile (every tile)."""
                sb = b if alibi.slopes.shape[0] > 1 else 0
                slope = slopes_ref[sb * N + h]
                if mops.alibi_slot is not None:  # explicit positions, copied like segments
                    x = mops.alibi_slot
                    q_pos = lax.broadcast_in_dim(load(qseg_s[x], row_layout), (bq, bk), [0])
                    kv_pos = lax.broadcast_in_dim(load(ring.at(2 + x, t), col_layout),
                                                  (bq, bk), [1])
                else:
                    iota = lambda d: plgpu.broadcasted_iota(jnp.int32, (bq, bk), d,
                                                            layout=wgmma_layout)
                    q_pos = iota(0) + row0(w) + offs_ref[0]
                    kv_pos = iota(1) + kj * bk + offs_ref[1]
                return -slope * jnp.abs(q_pos - kv_pos).astype(jnp.float32)

            def scores(s, t):
                """Scaled, soft-capped, ALiBi-biased, masked (PARTIAL tiles) logits of
                step t."""
                s = s * scale
                if softcap:
                    s = softcap * jnp.tanh(s / softcap)
                kj = order[r, i, t]
                s = lax.cond(code[r, i, t] == M.PARTIAL, lambda s: masked(s, kj, t),
                             lambda s: s, s)
                if alibi is not None:
                    # after the mask (masked logits stay -inf): the term's positions
                    # are then not live across the branch, which at H = 128 with a
                    # window, documents and ALiBi spilled 360 B per thread
                    s = s + alibi_term(kj, t)
                return s

            def softmax(s, m_i, l_i):
                """Online softmax in base 2 (exp2 is the SFU instruction)."""
                m_new = jnp.maximum(m_i, s.max(axis=1) * log2e)
                m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
                p = jnp.exp2(s * log2e - lax.broadcast_in_dim(m_safe, s.shape, [0]))
                alpha = jnp.exp2(m_i - m_safe)
                return p, m_new, alpha, l_i * alpha + p.sum(axis=1)

            def finish(acc, m_i, l_i):
                has = l_i > 0
                l_safe = jnp.where(has, l_i, 1.0)
                out = acc * lax.broadcast_in_dim(1.0 / l_safe, acc.shape, [0])
                lse = jnp.where(has, (m_i + jnp.log2(l_safe)) / log2e, -jnp.inf)
                store((out, q_tile, out_ref.at[b, rows(w), h]),
                       (lse, lse_smem.at[w], lse_ref.at[b, h, rows(w)]))

            def body(t, carry):
                acc, m_i, l_i = carry
                k_s, v_s = ring.at(0, t), ring.at(1, t)
                wait_k(t)

                def qk(acc_ref):
                    plgpu.wgmma(acc_ref, q_tile, plgpu.transpose_ref(k_s, (1, 0)))
                    if pingpong:
                        sync()  # the other warpgroup's softmax runs while this wgmma does
                    return acc_ref[...]

                s = scores(pl.run_scoped(qk, plgpu.ACC((bq, bk), jnp.float32)), t)
                p, m_new, alpha, l_i = softmax(s, m_i, l_i)
                if pingpong:
                    plgpu.barrier_arrive(sched_bar)  # softmax done
                ring.wait(1, t)
                if pingpong:
                    plgpu.barrier_wait(sched_bar)  # the tensor cores are free
                # P V accumulates into the rescaled output itself (the wgmma's
                # accumulator starts from it, `mma`): no second [bq, H] fp32 tile
                # in registers (with one, ptxas spilled 828 B per thread at H = 256).
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                acc = mma(p.astype(dtype), v_s, (bq, Hp), acc, interpret=interp is not None)
                return acc, m_new, l_i

            acc = plgpu.layout_cast(jnp.zeros((bq, Hp), jnp.float32), wgmma_layout)
            m_i = plgpu.layout_cast(jnp.full((bq,), -jnp.inf, jnp.float32), row_layout)
            l_i = plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), row_layout)
            if not cfg.overlap:
                if pingpong:
                    pl.when(w == 1)(sync)  # warpgroup 0 issues its first matmul first
                acc, m_i, l_i = ring.loop(body, (acc, m_i, l_i))
                if pingpong:
                    pl.when(w == 0)(sync)
                finish(acc, m_i, l_i)
                return

            # FlashAttention-3's intra-warpgroup overlap: step t issues S_t = Q K_t^T
            # and O_{t-1} = P_{t-1} V_{t-1} back to back and computes the softmax of
            # S_t while the second matmul runs; the slot of step t - 1 goes back
            # after it. `acc` holds O up to step t - 2, scaled to the running max of
            # step t - 1.
            def overlapped(t, carry):
                acc, p_prev, m_i, l_i = carry
                k_s, v_prev = ring.at(0, t), ring.at(1, t - 1)
                wait_k(t)
                ring.wait(1, t - 1)

                def both(s_ref, o_ref):
                    plgpu.wgmma(s_ref, q_tile, plgpu.transpose_ref(k_s, (1, 0)))
                    plgpu.wgmma(o_ref, p_prev, v_prev)
                    s = scores(plgpu.wgmma_accumulator_load(s_ref, wait_n=1), t)
                    p, m_new, alpha, l_new = softmax(s, m_i, l_i)
                    return p.astype(dtype), m_new, alpha, l_new

                if interp is None:
                    # P_{t-1} V_{t-1} accumulates into `acc` itself (as in `mma`), and
                    # the softmax's results leave the run_state body as discharged
                    # state: no second [bq, H] fp32 tile (with one, ptxas spilled
                    # 332 B per thread at H = 128)
                    def in_place(refs):
                        o_ref, *outs = refs
                        res = pl.run_scoped(lambda s_ref: both(s_ref, o_ref),
                                            plgpu.ACC((bq, bk), jnp.float32))
                        for ref, x in zip(outs, res):
                            ref[...] = x

                    acc, p, m_new, alpha, l_new = pl.run_state(in_place)(
                        (plgpu.ACC.init(acc), p_prev, m_i, m_i, l_i))
                else:  # the GPU interpreter has no run_state: a fresh accumulator
                    def fresh(s_ref, o_ref):
                        return (*both(s_ref, o_ref), o_ref[...])

                    p, m_new, alpha, l_new, o = pl.run_scoped(
                        fresh, plgpu.ACC((bq, bk), jnp.float32), plgpu.ACC((bq, Hp), jnp.float32))
                    acc = acc + o
                ring.release(t - 1)
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                return acc, p, m_new, l_new

            n = ring.n

            @pl.when(n > 0)
            def _():
                wait_k(0)
                s = scores(mma(q_tile, plgpu.transpose_ref(ring.at(0, 0), (1, 0)), (bq, bk)), 0)
                p, m0, _, l0 = softmax(s, m_i, l_i)
                acc_, p_last, m_last, l_last = lax.fori_loop(
                    1, n, overlapped, (acc, p.astype(dtype), m0, l0))
                ring.wait(1, n - 1)
                acc_ = mma(p_last, ring.at(1, n - 1), (bq, Hp), acc_, interpret=interp is not None)
                ring.release(n - 1)
                finish(acc_, m_last, l_last)

            pl.when(n == 0)(lambda: finish(acc, m_i, l_i))

        pipelined(C=C, stages=stages, n=count[r, i], fixed=fixed, ring=ring, consume=consume,
                   extra=(plgpu.SMEM((C, bq), jnp.float32), plgpu.Barrier(num_arrivals=C)))

    operands = [tab.order, tab.count, tab.code, offs, *mops.scalars, qp, kp, vp,
                *mops.q_segments, *mops.kv_segments]
    if alibi is not None:
        operands.append(alibi.slopes.astype(jnp.float32).reshape(-1))
    out, lse = plgpu.kernel(
        kernel,
        out_type=[jax.ShapeDtypeStruct((B, Tp, N, Hp), dtype),
                   jax.ShapeDtypeStruct((B, N, Tp), jnp.float32)],
        # The last grid axis varies fastest in launch order (Mosaic GPU maps it to
        # CUDA's x); "q" holds query tiles heaviest first (`heavy_first`).
        **(dict(grid=(N, Tp // bc, B), grid_names=("heads", "q", "batch"))
           if cfg.order == "head" else
           dict(grid=(Tp // bc, N, B), grid_names=("q", "heads", "batch"))),
        **({"num_threads": C + 1, "thread_name": "wg"} if producer else {}),
        # The softmax's row reductions stay inside each warp (the wgmma layout
        # splits rows across warps), so none needs the 2 KiB of cross-warp scratch
        # Mosaic GPU reserves per kernel by default.
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0),
        interpret=interp if interp is not None else False,
    )(*operands)
    return out[:, :T, :, :H], lse[:, :, :T]
