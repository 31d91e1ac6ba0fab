"""What the Pallas attention kernels share: frozen `BlockSizes`, a call's sizes and
offsets, its tile tables (`tfjax.ops.tiles`, with the sequence tails PARTIAL), the mask
compiled into kernel operands (`MaskOperands`) plus an in-kernel tile evaluator, the
fp32 dot products of the Mosaic TPU and Triton kernels, and the GPU launch order of
query tiles. A mask kind it does not know is refused by `mask_support` (the "pallas"
implementation then declines the request). See docs/kernels.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from tfjax.ops import masks as M
from tfjax.ops import sparse_masks as SM
from tfjax.ops.target import sharded_outside_a_mesh, traced_platform
from tfjax.ops.tiles import TileTables, pad_axis, tile_tables

__all__ = [
    "AT_LOWERING",
    "BlockSizes",
    "Dims",
    "KernelConfig",
    "MaskOperands",
    "call_tables",
    "dot",
    "dot_nt",
    "dot_tn",
    "heavy_first",
    "mask_support",
    "offsets",
    "reduce_dbias",
    "tpu_interpret",
    "tpu_pallas_call",
    "unsupported_mask",
]


@dataclasses.dataclass(frozen=True)
class Dims:
    """A kernel call's sizes: batch, lengths, heads, head dims (q/k's `H`, v's `Hv`;
    both run padded to one `Hp`), tiles and padded lengths."""

    B: int
    T: int
    S: int
    N: int
    K: int
    H: int
    Hp: int
    bq: int
    bk: int
    Tp: int
    Sp: int
    Hv: int

    @property
    def G(self):
        return self.N // self.K


def heavy_first(i, n: int):
    """The query tile a GPU program of grid index `i` (of `n`) computes: the tiles
    in reverse. Under a causal mask tile i visits i + 1 kv tiles; a GPU starts
    programs in grid order as earlier ones finish, so with increasing order each
    head's heaviest tiles start last and the final wave sets a long tail. In
    reverse, the last programs to start are the lightest (the longest-first
    rule of list scheduling; `experiments/launch_order.py` models the makespan
    of both orders on an H100/H200's SMs). Neutral for masks with even work."""
    return n - 1 - i


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes of the forward, dq and dk/dv kernels (query x key). They are
    clamped to the (padded) sequence lengths; kv tiles must be multiples of 128
    on TPU (lanes), query tiles multiples of 8 (sublanes)."""

    block_q: int = 128
    block_kv: int = 128
    block_q_dq: int = 128
    block_kv_dq: int = 128
    block_q_dkv: int = 128
    block_kv_dkv: int = 128

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int) or v < 8 or v % 8:
                raise ValueError(f"BlockSizes.{f.name} must be a positive multiple of 8, got {v!r}")


def offsets(q_offset, kv_offset):
    """(the offsets as python ints when both are, else None: the tile tables are
    then built at trace time; the `[2]` int32 offsets operand)."""
    static = (q_offset, kv_offset) if all(isinstance(o, int) for o in (q_offset, kv_offset)) \
        else None
    return static, jnp.stack([jnp.asarray(q_offset, jnp.int32), jnp.asarray(kv_offset, jnp.int32)])


def call_tables(mask, d: Dims, static_offsets, offs, transpose=False) -> TileTables:
    """The tile tables of a kernel call at its tiles `d` (from the python-int offsets
    when there are, else from the offsets operand)."""
    qo, ko = static_offsets if static_offsets is not None else (offs[0], offs[1])
    return tile_tables(mask, d.T, d.S, d.bq, d.bk, q_offset=qo, kv_offset=ko, transpose=transpose)


def reduce_dbias(dbias, bias):
    """A kernel's `[B, N, T, S]` fp32 dbias summed over the axes `bias` broadcasts
    (`[B|1, N|1, T, S]`), in bias's dtype."""
    Bb, Nb = bias.shape[:2]
    axes = tuple(a for a, n in ((0, Bb), (1, Nb)) if n == 1 and dbias.shape[a] != 1)
    return dbias.sum(axis=axes, keepdims=True).astype(bias.dtype)


# --------------------------------------------------------------------------- #
# fp32 dot products in the Mosaic TPU and Triton kernels (the Mosaic GPU ones
# issue wgmma themselves).
# --------------------------------------------------------------------------- #


def _precision(a, b):
    # Explicit, so a global jax_default_matmul_precision cannot ask Mosaic for an
    # fp32 contraction of bf16 operands (it refuses); fp32 operands stay exact.
    f32 = a.dtype == jnp.float32 and b.dtype == jnp.float32
    return lax.Precision.HIGHEST if f32 else lax.Precision.DEFAULT


def dot_nt(a, b):
    """a `[m, h]` . b `[n, h]`^T -> `[m, n]` fp32."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=_precision(a, b),
                           preferred_element_type=jnp.float32)


def dot(a, b):
    """a `[m, k]` @ b `[k, n]` -> `[m, n]` fp32."""
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=_precision(a, b),
                           preferred_element_type=jnp.float32)


def dot_tn(a, b):
    """a `[k, m]`^T @ b `[k, n]` -> `[m, n]` fp32."""
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=_precision(a, b),
                           preferred_element_type=jnp.float32)


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """The static part of a Mosaic TPU or Triton kernel call (hashable: the VJP's
    static argument): the logits' scale and soft-cap, the tiles, the interpret
    mode, and the offsets when they are python ints (`offsets`: the tile tables are
    then built at trace time). Each kernel file extends it with its own options."""

    scale: float
    softcap: float | None
    block_sizes: BlockSizes
    interpret: Any
    static_offsets: tuple[int, int] | None


# The interpret mode of a Mosaic TPU kernel call when nothing traced names the target and
# the host is a CPU: the call is staged for both (`lax.platform_dependent`) and lowering
# keeps one.
AT_LOWERING = "at lowering"


def tpu_interpret(q, interpret, where: str):
    """A Mosaic TPU kernel call's interpret mode: `interpret` as given, or for None by
    the target (`tfjax.ops.target.traced_platform`: a `targeting`, the mesh of a
    shard_map or of q's sharding): interpreted for a CPU target, Mosaic for a TPU; with
    no target named on a CPU host, decided when lowering (`AT_LOWERING`), never by the
    host alone. `where` names the caller in the error for a TPU-sharded q outside a
    shard_map."""
    if interpret is not None:
        return interpret
    platform, host = traced_platform(q), jax.default_backend()
    if platform == "tpu" and host != "tpu" and sharded_outside_a_mesh(q):
        raise ValueError(
            f"{where}: q's sharding names a TPU mesh but the call is not inside "
            "a shard_map over it (Mosaic kernels are not partitioned automatically); call "
            "it in one (tfjax.parallel.sharding.use_rules does)")
    return AT_LOWERING if platform is None and host == "cpu" else (platform or host) == "cpu"


def tpu_pallas_call(interpret, kernel, **kw):
    """`pl.pallas_call` in `interpret` mode (`tpu_interpret`); under `AT_LOWERING` the
    Mosaic call for a TPU lowering and the interpreted one for a CPU lowering (any
    other platform is a lowering error: the kernels are TPU kernels)."""
    if interpret != AT_LOWERING:
        return pl.pallas_call(kernel, interpret=interpret, **kw)
    mosaic = pl.pallas_call(kernel, interpret=False, **kw)
    interpreted = pl.pallas_call(kernel, interpret=True, **kw)
    return lambda *args: lax.platform_dependent(*args, tpu=mosaic, cpu=interpreted)


# --------------------------------------------------------------------------- #
# Masks as kernel operands.
# --------------------------------------------------------------------------- #

_POSITIONAL = (M.Causal, M.SlidingWindow, M.ChunkedCausal)


_KNOWN = _POSITIONAL + (M.Padding, M.PrefixLM, M.PrefixBlock, M.Segments, M.Blocks, M.Positions,
                        SM.Longformer, SM.RandomBlocks)


def unsupported_mask(mask, kinds) -> type | None:
    """The first mask class in `mask` (through `&` and `|`) that is none of `kinds`,
    or None."""
    if mask is None or isinstance(mask, kinds):
        return None
    if isinstance(mask, (M.And, M.Or)):
        return unsupported_mask(mask.a, kinds) or unsupported_mask(mask.b, kinds)
    return type(mask)


def mask_support(mask) -> str | None:
    """None when the kernels can evaluate `mask` in a tile, else the reason."""
    kind = unsupported_mask(mask, _KNOWN)
    return kind and f"the pallas kernels cannot evaluate a {kind.__name__} mask in a tile"


class MaskOperands:
    """The mask flattened into kernel operands: per-example scalars (`[B]` int32,
    scalar prefetch) and padded segment ids (`[B, Tp]`, `[B, Sp]` int32; each
    kernel gives them the 3-D layout its tiles need). ALiBi's explicit positions
    (`alibi.q_positions` / `kv_positions`) travel the same way, in the slot
    `alibi_slot` (None when ALiBi uses index positions or is absent), and so do
    those of T5's bias (`relative`, a `RelativeBias`) in `relative_slot`."""

    def __init__(self, mask, B: int, Tp: int, Sp: int, offsets=None, alibi=None,
                 relative=None):
        self.mask = mask
        self.scalars: list[jax.Array] = []
        self.q_segments: list[jax.Array] = []
        self.kv_segments: list[jax.Array] = []
        self._slot: dict[int, int] = {}
        self._offsets = (0, 0) if offsets is None else (offsets[0], offsets[1])
        self._collect(mask, B, Tp, Sp)
        self.alibi_slot = self._positions(alibi, Tp, Sp)
        self.relative_slot = self._positions(relative, Tp, Sp)

    def _positions(self, spec, Tp, Sp):
        """The slot of `spec`'s explicit positions (an Alibi / RelativeBias), or None."""
        if spec is None or spec.q_positions is None:
            return None
        self.q_segments.append(pad_axis(spec.q_positions, 1, Tp))
        self.kv_segments.append(pad_axis(spec.kv_positions, 1, Sp))
        return len(self.q_segments) - 1

    def _collect(self, m, B, Tp, Sp):
        if m is None or isinstance(m, _POSITIONAL + (SM.RandomBlocks,)):
            return
        if isinstance(m, (M.And, M.Or)):
            self._collect(m.a, B, Tp, Sp)
            self._collect(m.b, B, Tp, Sp)
        elif isinstance(m, SM.Longformer):
            # Global flags of the padded positions (offsets may be traced), laid out
            # like segment ids: a [B, Tp] / [B, Sp] operand each, 1 = global.
            self._slot[id(m)] = len(self.q_segments)
            g = m._globals()
            for n, off, out in ((Tp, self._offsets[0], self.q_segments),
                                (Sp, self._offsets[1], self.kv_segments)):
                pos = jnp.arange(n, dtype=jnp.int32) + jnp.asarray(off, jnp.int32)
                flag = (SM.count_in(g, pos, pos) > 0).astype(jnp.int32)
                out.append(jnp.broadcast_to(flag, (B, n)))
        elif isinstance(m, (M.Padding, M.PrefixLM, M.PrefixBlock)):
            x = m.kv_lengths if isinstance(m, M.Padding) else m.prefix_lengths
            self._slot[id(m)] = len(self.scalars)
            self.scalars.append(jnp.broadcast_to(jnp.asarray(x, jnp.int32), (B,)))
        elif isinstance(m, M.Positions):  # -1 pads: a padded key is empty, a padded row sees none
            self._slot[id(m)] = len(self.q_segments)
            self.q_segments.append(pad_axis(jnp.asarray(m.q_positions, jnp.int32), 1, Tp, -1))
            self.kv_segments.append(pad_axis(jnp.asarray(m.kv_positions, jnp.int32), 1, Sp, -1))
        elif isinstance(m, (M.Segments, M.Blocks)):
            self._slot[id(m)] = len(self.q_segments)
            seg = isinstance(m, M.Segments)
            qs = jnp.asarray(m.q_segment_ids if seg else m.q_block_ids, jnp.int32)
            ks = jnp.asarray(m.kv_segment_ids if seg else m.kv_block_ids, jnp.int32)
            qs = jnp.pad(qs, ((0, 0), (0, Tp - qs.shape[1])), constant_values=-1)
            ks = jnp.pad(ks, ((0, 0), (0, Sp - ks.shape[1])), constant_values=-2)
            self.q_segments.append(qs)
            self.kv_segments.append(ks)
        else:
            raise NotImplementedError(mask_support(m))

    @property
    def num_segments(self) -> int:
        return len(self.q_segments)

    def evaluate(self, q_pos, kv_pos, b, scalar_refs, q_seg_vals, kv_seg_vals):
        """bool tile from global positions `q_pos`, `kv_pos` (broadcastable int32
        arrays), the batch index, the scalar refs and the loaded segment tiles
        (`[bq, 1]` and `[1, bk]`, or transposed for the dk/dv kernel)."""
        return self._eval(self.mask, q_pos, kv_pos, b, scalar_refs, q_seg_vals, kv_seg_vals)

    def _eval(self, m, qp, kp, b, sref, qseg, kseg):
        if isinstance(m, M.Causal):
            return kp <= qp
        if isinstance(m, M.SlidingWindow):
            d = qp - kp
            return (d <= m.left) & (d >= -m.right)
        if isinstance(m, M.ChunkedCausal):
            # positions are >= 0 in practice; lax.div truncates like floor there
            return (kp <= qp) & (lax.div(qp, m.chunk) == lax.div(kp, m.chunk))
        if isinstance(m, M.Padding):
            return kp < sref[self._slot[id(m)]][b]
        if isinstance(m, M.PrefixLM):
            return (kp <= qp) | (kp < sref[self._slot[id(m)]][b])
        if isinstance(m, M.PrefixBlock):
            p = sref[self._slot[id(m)]][b]
            return (qp < p) & (kp < p)
        if isinstance(m, M.Segments):
            s = self._slot[id(m)]
            return qseg[s] == kseg[s]
        if isinstance(m, M.Blocks):  # padded queries -1, keys -2: never the same block
            s = self._slot[id(m)]
            return (qseg[s] == kseg[s]) & (qseg[s] >= 0)
        if isinstance(m, M.Positions):
            s = self._slot[id(m)]
            ok = (kseg[s] >= 0) & (kseg[s] <= qseg[s])
            return ok & (qseg[s] - kseg[s] <= m.window) if m.window else ok
        if isinstance(m, SM.Longformer):
            s = self._slot[id(m)]
            return (jnp.abs(qp - kp) <= m.window) | (qseg[s] > 0) | (kseg[s] > 0)
        if isinstance(m, SM.RandomBlocks):
            qb, kb = lax.div(qp, m.block_size), lax.div(kp, m.block_size)
            hit = None
            for r in range(m.num_random_blocks):
                h = _draw_random_block(m.seed, qb, r, m.num_blocks) == kb
                hit = h if hit is None else hit | h
            return hit
        if isinstance(m, M.And):
            return (self._eval(m.a, qp, kp, b, sref, qseg, kseg)
                    & self._eval(m.b, qp, kp, b, sref, qseg, kseg))
        if isinstance(m, M.Or):
            return (self._eval(m.a, qp, kp, b, sref, qseg, kseg)
                    | self._eval(m.b, qp, kp, b, sref, qseg, kseg))
        raise NotImplementedError(mask_support(m))


def _i32(c: int) -> np.int32:
    """A 32-bit constant as the int32 with the same bits."""
    return np.uint32(c & 0xFFFFFFFF).view(np.int32)


def _draw_random_block(seed: int, qb, r: int, num_blocks: int):
    """`sparse_masks.RandomBlocks._draw` in int32 arithmetic only (wrapping multiplies,
    logical shifts, an unsigned remainder from non-negative pieces), which Mosaic
    and Triton lower; bit-identical to the uint32 hash of `sparse_masks._hash32`."""
    srl = lax.shift_right_logical
    x = (jnp.int32(_i32((seed & 0xFFFFFFFF) * 0x9E3779B1)) ^ (qb * _i32(0x85EBCA77))
         ^ jnp.int32(_i32(r * 0xC2B2AE3D)))
    x = x ^ srl(x, jnp.int32(16))
    x = x * _i32(0x7FEB352D)
    x = x ^ srl(x, jnp.int32(15))
    x = x * _i32(0x846CA68B)
    x = x ^ srl(x, jnp.int32(16))
    # unsigned(x) % n == (2 * ((x >>> 1) % n) + (x & 1)) % n, all in [0, 2^31)
    n = jnp.int32(num_blocks)
    return lax.rem(2 * lax.rem(srl(x, jnp.int32(1)), n) + (x & 1), n)
