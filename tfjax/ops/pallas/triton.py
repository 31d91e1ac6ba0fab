"""FlashAttention for GPU in Pallas (Triton lowering): forward, dq and dk/dv.

`flash_attention_triton(q, k, v, mask, ...)`: q `[B,T,N,H]`, k/v `[B,S,K,H]` -> out
`[B,T,N,H]` (and lse `[B,N,T]` fp32), the algorithm and tile tables of `mosaic_tpu.py`
shaped for Triton, in this layout: one program per (query tile, batch, head) over only
its non-empty kv tiles, native GQA, ALiBi and T5's bias per tile, dq and dk/dv kernels
without atomics. Warps and stages per kernel come from `triton_launch.json`
(`triton_launch`; `TritonConfig` overrides). The forward or backward may be the Mosaic
GPU kernels' (`forward=` / `backward="hopper"`). Interpreted on CPU.
See docs/kernels.md.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import json
import types
from typing import Any, Mapping

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from tfjax.ops import masks as M
from tfjax.ops.reference import (RelativeBias, check_relative_bias, constant_bucket, make_alibi,
                                  relative_position_bucket, relative_tile_ranges)
from tfjax.ops.pallas.common import (BlockSizes, Dims, KernelConfig, MaskOperands, call_tables,
                                     dot, dot_nt, dot_tn, heavy_first, offsets, reduce_dbias)
from tfjax.ops.pallas.mosaic_gpu import flash_forward_hopper
from tfjax.ops.pallas.mosaic_gpu_backward import flash_backward_hopper
from tfjax.ops.tiles import logit_scaling, logits, pad_axis, round_up
from tfjax.ops.vjp import attention_vjp, backward_rows

__all__ = ["LAUNCH", "TritonConfig", "default_block_sizes", "flash_attention_triton",
           "launch_features", "padded_head_dim", "supports", "triton_launch"]


def _triton_params(num_warps, num_stages):
    try:
        from jax.experimental.pallas import triton as plgpu
        return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    except (ImportError, AttributeError):  # pragma: no cover - older jax
        return None


def launch_features(mops, has_bias: bool, alibi, rel, softcap) -> str:
    """The feature class `triton_launch` reads: "t5" with T5's bias per tile;
    "masked" with any other per-tile extra (segment or position operands, ALiBi,
    soft-capping, a bias array), which hold more registers; else "plain" (index
    masks: causal, windows, chunks, prefixes, padding)."""
    if rel is not None:
        return "t5"
    if mops.num_segments or has_bias or alibi is not None or softcap:
        return "masked"
    return "plain"


def _launch(cfg, kernel: str, d, features: str):
    """Triton compiler params of `kernel` at the tiles it really runs (`Dims`)."""
    launch = cfg.triton.launch(kernel) if cfg.triton is not None else \
        triton_launch(kernel, d.Hp, d.bq, d.bk, features)
    return _triton_params(*launch)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def padded_head_dim(H: int) -> int:
    """The head dim the kernels run at: a power of two, at least 16 (Triton's)."""
    return max(16, _pow2(H))


def supports(r) -> str | None:
    H = max(r.q_shape[-1], r.value_head_dim)
    if H > 256:
        return f"the Triton kernels take head dims up to 256, got {H}"
    return None


def default_block_sizes(H: int) -> BlockSizes:
    """FlashAttention-2's Triton choices: 128 x 64 forward tiles while a [128, H]
    query tile fits shared memory beside double-buffered K/V, else 64 x 64; 64 x 64
    dq and dk/dv tiles, except dk/dv at head dims above 128: 32 x 32, the only
    tiles at which ptxas keeps its dK/dV accumulators in registers (64 x 64 spills
    at 4 and 8 warps: experiments/results/attention_gpu_ptxas_20261130.md)."""
    wide = _pow2(H) > 128
    bq, bkv_dkv = (64, 32) if wide else (128, 64)
    return BlockSizes(block_q=bq, block_kv=64, block_q_dq=64, block_kv_dq=64,
                      block_q_dkv=bkv_dkv, block_kv_dkv=bkv_dkv)


@dataclasses.dataclass(frozen=True)
class TritonConfig:
    """Launch parameters of the Triton kernels, to override `triton_launch`'s
    choice: warps per program (`num_warps`, 32 threads each; a power of 2) and
    software-pipelining stages of the kv loop (`num_stages`), for the forward, dq
    (`*_dq`) and dk/dv (`*_dkv`) kernels."""

    num_warps: int = 4
    num_stages: int = 3
    num_warps_dq: int = 4
    num_stages_dq: int = 2
    num_warps_dkv: int = 4
    num_stages_dkv: int = 2

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            ok = v in (1, 2, 4, 8, 16) if f.name.startswith("num_warps") else \
                isinstance(v, int) and 1 <= v <= 8
            if not ok:
                allowed = "1, 2, 4, 8 or 16" if f.name.startswith("num_warps") else "1 to 8"
                raise ValueError(f"TritonConfig.{f.name} must be {allowed}, got {v!r}")

    def launch(self, kernel: str) -> tuple[int, int]:
        return {"fwd": (self.num_warps, self.num_stages),
                "dq": (self.num_warps_dq, self.num_stages_dq),
                "dkv": (self.num_warps_dkv, self.num_stages_dkv)}[kernel]


def _read_launch() -> Mapping[tuple[str, str, int, int, int], tuple[int, int]]:
    data = json.loads(importlib.resources.files(__package__).joinpath("triton_launch.json")
                      .read_text())
    assert data["columns"] == ["features", "kernel", "H", "bq", "bk", "warps", "stages"], data
    return types.MappingProxyType({tuple(r[:5]): tuple(r[5:]) for r in data["launches"]})


# (features, kernel, padded head dim, query tile, key tile) -> (warps, stages), features
# as `launch_features` classes a call: triton_launch.json beside this module, written by
# `experiments/gpu_registers.py --write-launch` from ptxas's report for an H200
# (sm_90a, compiled without a GPU), the measurement it names. The rule (`choose`
# there): among the launches that compile, those at which ptxas spills no registers,
# the most resident programs per SM, then fewer warps, then more stages; where every
# launch spills, the fewest spilled bytes. Registers, not time.
LAUNCH = _read_launch()


def triton_launch(kernel: str, Hp: int, bq: int, bk: int,
                  features: str = "plain") -> tuple[int, int]:
    """(warps, stages) of Triton kernel "fwd", "dq" or "dkv" at padded head dim `Hp`
    with `bq` x `bk` tiles for a call of feature class `features` ("plain",
    "masked", "t5": `launch_features`): the measured choice (`LAUNCH`; head dims
    below 64 and tiles below 32 take those of 64 and 32, which need no more
    registers), else Triton's usual 4 warps with 3 (forward) or 2 stages."""
    key = (kernel, max(64, Hp), max(32, bq), max(32, bk))
    return LAUNCH.get((features, *key), LAUNCH.get(("plain", *key),
                                                   (4, 3 if kernel == "fwd" else 2)))


@dataclasses.dataclass(frozen=True)
class _Config(KernelConfig):
    forward: str = "triton"  # or "hopper"
    hopper: Any = None  # hopper.HopperConfig
    backward: str = "triton"  # or "hopper"
    hopper_backward: Any = None  # mosaic_gpu_backward.HopperBackwardConfig
    triton: TritonConfig | None = None  # None: `triton_launch`'s choice per kernel


def flash_attention_triton(q, k, v, mask=None, *, bias=None, scale=None, softcap=None,
                           alibi_slopes=None, alibi_positions=None,
                           relative_bias: RelativeBias | None = None, q_offset=0, kv_offset=0,
                           return_lse=False, block_sizes: BlockSizes | None = None,
                           interpret: Any = False, forward: str = "triton", hopper_config=None,
                           backward: str = "triton", hopper_backward_config=None,
                           triton_config: TritonConfig | None = None):
    """The GPU kernels as a plan chose them (`tfjax.ops.pallas.plan`): q `[B,T,N,H]`,
    k/v `[B,S,K,H]` -> out `[B,T,N,H]` (and lse `[B,N,T]` fp32). `forward`: "triton"
    or "hopper" (the Mosaic GPU forward of `mosaic_gpu.py`, `hopper_config` its
    tiles); `backward`: the same for the dq and dk/dv kernels (`mosaic_gpu_backward.py`,
    `hopper_backward_config`); either backward takes the residuals of either
    forward. `relative_bias`: T5's bias per tile (Triton only). `triton_config`: the
    Triton kernels' warps and pipeline stages (None: `triton_launch`'s choice for
    each kernel's tiles). `interpret`: Pallas' GPU interpret mode (CPU)."""
    H = q.shape[-1]
    static, offs = offsets(q_offset, kv_offset)
    bs = block_sizes or default_block_sizes(H)
    B, T, N = q.shape[:3]
    alibi = make_alibi(alibi_slopes, alibi_positions, B, N, T, k.shape[1])
    rel = check_relative_bias(relative_bias, B, N, T, k.shape[1])
    cfg = _Config(*logit_scaling(H, scale, softcap), bs, interpret, static, forward,
                  hopper_config, backward, hopper_backward_config, triton_config)
    out, lse = _flash(cfg, q, k, v, mask, bias, alibi, rel, offs)
    return (out, lse) if return_lse else out


def _dims(q, k, v, block_q, block_kv):
    B, T, N, H = q.shape
    S, K, Hv = k.shape[1], k.shape[2], v.shape[-1]
    bq = max(16, min(_pow2(block_q), _pow2(T)))
    bk = max(16, min(_pow2(block_kv), _pow2(S)))
    return Dims(B, T, S, N, K, H, padded_head_dim(max(H, Hv)), bq, bk, round_up(T, bq),
                round_up(S, bk), Hv)


def _pad_seq_head(x, n, Hp):
    return pad_axis(pad_axis(x, 1, n), 3, Hp)


def _allowed(d, mask, mops, code, q_loc, kv_loc, offs_ref, b, sref, qseg, kseg):
    """[bq, bk] from local positions [bq, 1] and [1, bk]."""
    ok = (q_loc < d.T) & (kv_loc < d.S)
    if mask is not None:
        m = mops.evaluate(q_loc + offs_ref[0], kv_loc + offs_ref[1], b, sref, qseg, kseg)
        ok = ok & ((code != M.PARTIAL) | m)
    return ok


def _alibi_slope(alibi_ref, d, b, h):
    """The slope of head `h` of example `b` from the flat `[B|1 * N]` slopes, or None."""
    if alibi_ref is None:
        return None
    return alibi_ref[(b if alibi_ref.shape[0] > d.N else 0) * d.N + h]


def _alibi_tile(slope, mops, q_loc, kv_loc, qseg_v, kseg_v, offs_ref):
    """`tiles.logits`' ALiBi argument: the positions' tiles (`alibi_positions`, in the
    segment slot `mops.alibi_slot`) or the global index positions."""
    if slope is None:
        return None
    if mops.alibi_slot is not None:
        return slope, qseg_v[mops.alibi_slot], kseg_v[mops.alibi_slot]
    return slope, q_loc + offs_ref[0], kv_loc + offs_ref[1]


def _relative_tile(rel, rel_ref, d, b, h, q_tile, kv_tile, ranges, mops, q_loc, kv_loc, qseg_v,
                   kseg_v, offs_ref):
    """T5's bias `[bq, bk]` fp32 of head `h`, its int32 buckets and the bucket they
    all share or -1 (`constant_bucket`: then no entry is bucketed), or (None, None,
    None): the buckets of the positions' tiles (slot `mops.relative_slot`) or of
    the global index positions, gathered from the flat `[nb * N]` table `rel_ref`.
    `ranges`: `relative_tile_ranges`' refs (explicit positions)."""
    if rel is None:
        return None, None, None
    const = constant_bucket(rel, d.bq, d.bk, b, q_tile, kv_tile, offs_ref, ranges)

    def varying():
        if mops.relative_slot is not None:
            qp, kp = qseg_v[mops.relative_slot], kseg_v[mops.relative_slot]
        else:
            qp, kp = q_loc + offs_ref[0], kv_loc + offs_ref[1]
        buckets = relative_position_bucket(kp - qp, bidirectional=rel.bidirectional,
                                           num_buckets=rel.num_buckets,
                                           max_distance=rel.max_distance)
        return jnp.broadcast_to(buckets, (d.bq, d.bk))

    buckets = lax.cond(const >= 0, lambda: jnp.full((d.bq, d.bk), const, jnp.int32), varying)
    return rel_ref[buckets * d.N + h], buckets, const


def _n_ranges(rel) -> int:
    return 4 if rel is not None and rel.q_positions is not None else 0


def _common_operands(mask, bias, alibi, rel, d, q, k, v, offs):
    mops = MaskOperands(mask, d.B, d.Tp, d.Sp, offs, alibi, rel)
    bias_op = None if bias is None else pad_axis(pad_axis(bias, 2, d.Tp), 3, d.Sp)
    return mops, bias_op, _pad_seq_head(q, d.Tp, d.Hp), _pad_seq_head(k, d.Sp, d.Hp), \
        _pad_seq_head(v, d.Sp, d.Hp)


# --------------------------------------------------------------------------- #
# Forward and dq: grid (nq, B, N).
# --------------------------------------------------------------------------- #


def _split_refs(refs, mops, has_bias, has_alibi, rel, n_extra, aliased=False):
    """A kernel's refs in operand order: (tables and offsets, the mask's scalars, T5's
    position ranges, q/k/v, (bias, ALiBi's slopes, T5's table), the `n_extra`
    backward inputs, q and kv segment tiles, outputs); `aliased`: skips the zeros
    aliased to dbias."""
    it = iter(refs)
    take = lambda n: [next(it) for _ in range(n)]
    head, sref, ranges, qkv = take(4), take(len(mops.scalars)), take(_n_ranges(rel)), take(3)
    extras = tuple(next(it) if has else None for has in (has_bias, has_alibi, rel is not None))
    extra = take(n_extra)
    if aliased:
        next(it)
    nseg = mops.num_segments
    return head, sref, ranges, qkv, extras, extra, take(nseg), take(nseg), list(it)


def _position_operands(in_specs, operands, alibi, rel):
    """Append ALiBi's flat slopes and T5's flat `[nb * N]` table (whole arrays)."""
    if alibi is not None:
        in_specs.append(pl.no_block_spec)
        operands.append(alibi.slopes.reshape(-1))
    if rel is not None:
        in_specs.append(pl.no_block_spec)
        operands.append(rel.table.astype(jnp.float32).reshape(-1))


def _row_kernel(cfg, d, mask, mops, tab, has_bias, has_alibi, rel, backward, *refs):
    ((order, count, code, offs_ref), sref, ranges, (q_ref, k_ref, v_ref),
     (bias_ref, alibi_ref, rel_ref), extra, qseg, kseg, outs) = _split_refs(
        refs, mops, has_bias, has_alibi, rel, 3 if backward else 0)
    if backward:
        do_ref, lse_ref, delta_ref = extra
    i, b, h = heavy_first(pl.program_id(0), d.Tp // d.bq), pl.program_id(1), pl.program_id(2)
    r = b if tab.batched else 0
    bq, bk = d.bq, d.bk
    q = q_ref[...]
    q_loc = (i * bq + jnp.arange(bq, dtype=jnp.int32))[:, None]
    slope = _alibi_slope(alibi_ref, d, b, h)
    qseg_v = [x[...][:, None] for x in qseg]
    if backward:
        do = do_ref[...]
        lse = lse_ref[...][:, None]
        delta = delta_ref[...][:, None]

    def tile(j):
        kj = order[r, i, j]
        sl = pl.ds(kj * bk, bk)
        kv_loc = (kj * bk + jnp.arange(bk, dtype=jnp.int32))[None, :]
        kseg_v = [x[sl][None, :] for x in kseg]
        rel_t, buckets, const = _relative_tile(rel, rel_ref, d, b, h, i, kj, ranges, mops, q_loc,
                                               kv_loc, qseg_v, kseg_v, offs_ref)
        s, t = logits(dot_nt(q, k_ref[sl, :]), cfg.scale, cfg.softcap,
                      bias_ref[pl.ds(i * bq, bq), sl] if has_bias else None,
                      _alibi_tile(slope, mops, q_loc, kv_loc, qseg_v, kseg_v, offs_ref), rel_t)
        ok = _allowed(d, mask, mops, code[r, i, j], q_loc, kv_loc, offs_ref, b, sref, qseg_v,
                      kseg_v)
        return kj, sl, jnp.where(ok, s, -jnp.inf), t, (buckets, const)

    if not backward:
        def body(j, carry):
            acc, m, l = carry
            _, sl, s, _, _ = tile(j)
            m_new = jnp.maximum(m, s.max(axis=-1))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            p = jnp.exp(s - m_safe[:, None])
            alpha = jnp.exp(m - m_safe)
            v = v_ref[sl, :]
            acc = alpha[:, None] * acc + dot(p.astype(v.dtype), v)
            return acc, m_new, alpha * l + p.sum(axis=-1)

        init = (jnp.zeros((bq, d.Hp), jnp.float32), jnp.full((bq,), -jnp.inf, jnp.float32),
                jnp.zeros((bq,), jnp.float32))
        acc, m, l = lax.fori_loop(0, count[r, i], body, init)
        has = l > 0
        l_safe = jnp.where(has, l, 1.0)
        o_ref, lse_out = outs
        o_ref[...] = jnp.where(has[:, None], acc / l_safe[:, None], 0.0).astype(o_ref.dtype)
        lse_out[...] = jnp.where(has, m + jnp.log(l_safe), -jnp.inf)
        return

    def body(j, carry):
        dq, dtable = carry
        _, sl, s, t, (buckets, const) = tile(j)
        p = jnp.exp(s - lse)
        v = v_ref[sl, :]
        ds = p * (dot_nt(do, v) - delta)
        if rel is not None:  # dL/dlogits (after the soft-cap) summed per bucket
            ids = jnp.arange(dtable.shape[0], dtype=jnp.int32)

            def every_bucket(dtable):
                for n in range(rel.num_buckets):
                    total = jnp.where(buckets == n, ds, 0.0).sum()
                    dtable = dtable + jnp.where(ids == n, total, 0.0)
                return dtable

            # a tile far from the diagonal: one sum
            dtable = lax.cond(const >= 0, lambda x: x + jnp.where(ids == const, ds.sum(), 0.0),
                              every_bucket, dtable)
        if t is not None:
            ds = ds * (1.0 - t * t)
        kk = k_ref[sl, :]
        return dq + dot((ds * cfg.scale).astype(kk.dtype), kk), dtable

    nbp = 16 if rel is None else max(16, _pow2(rel.num_buckets))
    dq, dtable = lax.fori_loop(0, count[r, i], body, (jnp.zeros((bq, d.Hp), jnp.float32),
                                                      jnp.zeros((nbp,), jnp.float32)))
    outs[0][...] = dq.astype(outs[0].dtype)
    if rel is not None:
        outs[1][...] = dtable


def _row_call(cfg, q, k, v, mask, bias, alibi, rel, offs, backward, do=None, lse=None,
              delta=None):
    bs = cfg.block_sizes
    tiles = (bs.block_q_dq, bs.block_kv_dq) if backward else (bs.block_q, bs.block_kv)
    d = _dims(q, k, v, *tiles)
    G, bq = d.G, d.bq
    qi = lambda i: heavy_first(i, d.Tp // bq)  # grid index -> query tile (heaviest first)
    tab = call_tables(mask, d, cfg.static_offsets, offs)
    mops, bias_op, qp, kp, vp = _common_operands(mask, bias, alibi, rel, d, q, k, v, offs)
    has_bias = bias is not None
    full = pl.no_block_spec  # whole array in the kernel (tables, per-example scalars)
    ranges = relative_tile_ranges(rel, d.bq, d.bk, d.Tp, d.Sp)
    in_specs = [full] * (4 + len(mops.scalars) + len(ranges))
    operands = [tab.order, tab.count, tab.code, offs, *mops.scalars, *ranges]
    in_specs += [pl.BlockSpec((None, bq, None, d.Hp), lambda i, b, h: (b, qi(i), h, 0)),
                 pl.BlockSpec((None, d.Sp, None, d.Hp), lambda i, b, h: (b, 0, h // G, 0)),
                 pl.BlockSpec((None, d.Sp, None, d.Hp), lambda i, b, h: (b, 0, h // G, 0))]
    operands += [qp, kp, vp]
    if has_bias:
        Bb, Nb = bias.shape[:2]
        in_specs.append(pl.BlockSpec((None, None, d.Tp, d.Sp), lambda i, b, h: (
            b if Bb > 1 else 0, h if Nb > 1 else 0, 0, 0)))
        operands.append(bias_op)
    _position_operands(in_specs, operands, alibi, rel)
    if backward:
        in_specs += [pl.BlockSpec((None, bq, None, d.Hp), lambda i, b, h: (b, qi(i), h, 0)),
                     pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, qi(i))),
                     pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, qi(i)))]
        operands += [_pad_seq_head(do, d.Tp, d.Hp), pad_axis(lse, 2, d.Tp),
                     pad_axis(delta, 2, d.Tp)]
    for qs in mops.q_segments:
        in_specs.append(pl.BlockSpec((None, bq), lambda i, b, h: (b, qi(i))))
        operands.append(qs)
    for ks in mops.kv_segments:
        in_specs.append(pl.BlockSpec((None, d.Sp), lambda i, b, h: (b, 0)))
        operands.append(ks)
    row = pl.BlockSpec((None, bq, None, d.Hp), lambda i, b, h: (b, qi(i), h, 0))
    if backward:
        out_specs, out_shape = [row], [jax.ShapeDtypeStruct((d.B, d.Tp, d.N, d.Hp), q.dtype)]
        if rel is not None:  # per query tile: [nbp] partial sums
            nbp = max(16, _pow2(rel.num_buckets))
            out_specs.append(pl.BlockSpec((None, None, None, nbp),
                                          lambda i, b, h: (b, h, qi(i), 0)))
            out_shape.append(jax.ShapeDtypeStruct((d.B, d.N, d.Tp // bq, nbp), jnp.float32))
    else:
        out_specs = [row, pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, qi(i)))]
        out_shape = [jax.ShapeDtypeStruct((d.B, d.Tp, d.N, d.Hp), q.dtype),
                     jax.ShapeDtypeStruct((d.B, d.N, d.Tp), jnp.float32)]
    kernel = functools.partial(_row_kernel, cfg, d, mask, mops, tab, has_bias, alibi is not None,
                               rel, backward)
    outs = pl.pallas_call(
        kernel, grid=(d.Tp // bq, d.B, d.N), in_specs=in_specs, out_specs=out_specs,
        out_shape=out_shape, interpret=cfg.interpret,
        compiler_params=_launch(cfg, "dq" if backward else "fwd", d, launch_features(
            mops, has_bias, alibi, rel, cfg.softcap)),
        name="tfjax_flash_dq_gpu" if backward else "tfjax_flash_fwd_gpu",
    )(*operands)
    if backward:  # dq, and T5's table gradient [nb, N]
        dtable = None if rel is None else outs[1].sum(axis=(0, 2))[:, :rel.num_buckets].T
        return outs[0][:, :d.T, :, :d.H], dtable
    return outs[0][:, :d.T, :, :d.Hv], outs[1][:, :, :d.T]


# --------------------------------------------------------------------------- #
# dk/dv: grid (nk, B, K), loops over g and the kv tile's query tiles.
# --------------------------------------------------------------------------- #


def _dkv_kernel(cfg, d, mask, mops, tab, has_bias, has_alibi, rel, *refs):
    ((order, count, code, offs_ref), sref, ranges, (q_ref, k_ref, v_ref),
     (bias_ref, alibi_ref, rel_ref), (do_ref, lse_ref, delta_ref), qseg, kseg, outs) = \
        _split_refs(refs, mops, has_bias, has_alibi, rel, 3, aliased=has_bias)
    dk_ref, dv_ref = outs[:2]
    dbias_ref = outs[2] if has_bias else None
    kj, b, kh = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    r = b if tab.batched else 0
    bq, bk, G = d.bq, d.bk, d.G
    kk, vv = k_ref[...], v_ref[...]
    kv_loc = (kj * bk + jnp.arange(bk, dtype=jnp.int32))[None, :]
    kseg_v = [x[...][None, :] for x in kseg]
    Bb, Nb = (bias_ref.shape[0], bias_ref.shape[1]) if has_bias else (1, 1)

    def head(g, carry):
        h = kh * G + g
        slope = _alibi_slope(alibi_ref, d, b, h)

        def body(j, carry):
            dk, dv = carry
            qi = order[r, kj, j]
            sl = pl.ds(qi * bq, bq)
            q, do = q_ref[sl, h, :], do_ref[sl, h, :]
            bias_t = None
            if has_bias:
                bias_t = bias_ref[b if Bb > 1 else 0, h if Nb > 1 else 0, sl, pl.ds(kj * bk, bk)]
            q_loc = (qi * bq + jnp.arange(bq, dtype=jnp.int32))[:, None]
            qseg_v = [x[sl][:, None] for x in qseg]
            rel_t, _, _ = _relative_tile(rel, rel_ref, d, b, h, qi, kj, ranges, mops, q_loc,
                                         kv_loc, qseg_v, kseg_v, offs_ref)
            s, t = logits(dot_nt(q, kk), cfg.scale, cfg.softcap, bias_t,
                          _alibi_tile(slope, mops, q_loc, kv_loc, qseg_v, kseg_v, offs_ref),
                          rel_t)
            ok = _allowed(d, mask, mops, code[r, kj, j], q_loc, kv_loc, offs_ref, b, sref,
                          qseg_v, kseg_v)
            p = jnp.where(ok, jnp.exp(s - lse_ref[h, sl][:, None]), 0.0)  # [bq, bk]
            dv = dv + dot_tn(p.astype(do.dtype), do)
            ds = p * (dot_nt(do, vv) - delta_ref[h, sl][:, None])
            if has_bias:
                dbias_ref[b, h, sl, pl.ds(kj * bk, bk)] = ds
            if t is not None:
                ds = ds * (1.0 - t * t)
            dk = dk + dot_tn((ds * cfg.scale).astype(q.dtype), q)
            return dk, dv

        return lax.fori_loop(0, count[r, kj], body, carry)

    zeros = jnp.zeros((bk, d.Hp), jnp.float32)
    dk, dv = lax.fori_loop(0, G, head, (zeros, zeros))
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dkv_call(cfg, q, k, v, mask, bias, alibi, rel, offs, do, lse, delta):
    bs = cfg.block_sizes
    d = _dims(q, k, v, bs.block_q_dkv, bs.block_kv_dkv)
    bk = d.bk
    tab = call_tables(mask, d, cfg.static_offsets, offs, transpose=True)
    mops, bias_op, qp, kp, vp = _common_operands(mask, bias, alibi, rel, d, q, k, v, offs)
    has_bias = bias is not None
    full = pl.no_block_spec
    ranges = relative_tile_ranges(rel, d.bq, d.bk, d.Tp, d.Sp)
    in_specs = [full] * (4 + len(mops.scalars) + len(ranges))
    operands = [tab.order, tab.count, tab.code, offs, *mops.scalars, *ranges]
    kv_blk = pl.BlockSpec((None, bk, None, d.Hp), lambda j, b, kh: (b, j, kh, 0))
    all_q = pl.BlockSpec((None, d.Tp, d.N, d.Hp), lambda j, b, kh: (b, 0, 0, 0))
    in_specs += [all_q, kv_blk, kv_blk]
    operands += [qp, kp, vp]
    if has_bias:
        in_specs.append(full)
        operands.append(bias_op)
    _position_operands(in_specs, operands, alibi, rel)
    stats = pl.BlockSpec((None, d.N, d.Tp), lambda j, b, kh: (b, 0, 0))
    in_specs += [all_q, stats, stats]
    operands += [_pad_seq_head(do, d.Tp, d.Hp), pad_axis(lse, 2, d.Tp), pad_axis(delta, 2, d.Tp)]
    aliases = {}
    if has_bias:
        in_specs.append(full)
        operands.append(jnp.zeros((d.B, d.N, d.Tp, d.Sp), jnp.float32))
        aliases = {len(operands) - 1: 2}
    for qs in mops.q_segments:
        in_specs.append(pl.BlockSpec((None, d.Tp), lambda j, b, kh: (b, 0)))
        operands.append(qs)
    for ks in mops.kv_segments:
        in_specs.append(pl.BlockSpec((None, bk), lambda j, b, kh: (b, j)))
        operands.append(ks)
    out_specs = [kv_blk, kv_blk]
    out_shape = [jax.ShapeDtypeStruct((d.B, d.Sp, d.K, d.Hp), k.dtype),
                 jax.ShapeDtypeStruct((d.B, d.Sp, d.K, d.Hp), v.dtype)]
    if has_bias:
        out_specs.append(full)
        out_shape.append(jax.ShapeDtypeStruct((d.B, d.N, d.Tp, d.Sp), jnp.float32))
    kernel = functools.partial(_dkv_kernel, cfg, d, mask, mops, tab, has_bias, alibi is not None,
                               rel)
    outs = pl.pallas_call(
        kernel, grid=(d.Sp // bk, d.B, d.K), in_specs=in_specs, out_specs=out_specs,
        out_shape=out_shape, interpret=cfg.interpret, input_output_aliases=aliases,
        compiler_params=_launch(cfg, "dkv", d, launch_features(mops, has_bias, alibi, rel,
                                                               cfg.softcap)),
        name="tfjax_flash_dkv_gpu",
    )(*operands)
    dk, dv = outs[0][:, :d.S, :, :d.H], outs[1][:, :d.S, :, :d.Hv]
    dbias = None
    if has_bias:
        dbias = reduce_dbias(outs[2][:, :, :d.T, :d.S], bias)
    return dk, dv, dbias


# --------------------------------------------------------------------------- #
# The VJP (`tfjax.ops.vjp`'s shell): the Triton or the Mosaic GPU kernels, each
# backward from either forward's residuals.
# --------------------------------------------------------------------------- #


def _forward(cfg, q, k, v, mask, bias, alibi, rel, offs):
    if cfg.forward == "hopper":
        qo, ko = cfg.static_offsets if cfg.static_offsets is not None else (offs[0], offs[1])
        return flash_forward_hopper(q, k, v, mask, scale=cfg.scale, softcap=cfg.softcap,
                                    q_offset=qo, kv_offset=ko, config=cfg.hopper,
                                    interpret=cfg.interpret, alibi=alibi)
    return _row_call(cfg, q, k, v, mask, bias, alibi, rel, offs, backward=False)


def _backward(cfg, q, k, v, mask, bias, alibi, rel, offs, out, lse, dout, dlse):
    do, lse, delta = backward_rows(out, lse, dout, q.dtype, dlse)
    if cfg.backward == "hopper":  # no bias, no T5 bias (`mosaic_gpu_backward.supports`)
        qo, ko = cfg.static_offsets if cfg.static_offsets is not None else (offs[0], offs[1])
        dq, dk, dv = flash_backward_hopper(q, k, v, do, lse, delta, mask, scale=cfg.scale,
                                           softcap=cfg.softcap, q_offset=qo, kv_offset=ko,
                                           config=cfg.hopper_backward, interpret=cfg.interpret,
                                           alibi=alibi)
        return dq, dk, dv, None, None
    dq, dtable = _row_call(cfg, q, k, v, mask, bias, alibi, rel, offs, backward=True, do=do,
                           lse=lse, delta=delta)
    dk, dv, dbias = _dkv_call(cfg, q, k, v, mask, bias, alibi, rel, offs, do, lse, delta)
    return dq, dk, dv, dbias, dtable


_flash = attention_vjp(_forward, _backward)
