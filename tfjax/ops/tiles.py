"""What every tiled attention shares (blockwise and the Pallas kernels): tile
arithmetic (`cdiv`, `round_up`, `pad_axis`), the tile tables built from a mask's block
view (`tile_tables` -> `TileTables`: for each query tile the non-EMPTY kv tiles
compacted to the front, their count and their codes; transposed for the dk/dv loop),
and a tile's logits (`logits`: scale, soft-cap, then the bias, ALiBi and T5 terms in
one order). See docs/kernels.md.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tfjax.ops import masks as M

__all__ = ["TileTables", "cdiv", "logit_scaling", "logits", "pad_axis", "round_up", "tile_tables"]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    return cdiv(a, b) * b


def pad_axis(x, axis: int, n: int, value: Any = 0):
    """`x` padded with `value` at the end of `axis` to length `n`."""
    pad = n - x.shape[axis]
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


# --------------------------------------------------------------------------- #
# Tile tables.
# --------------------------------------------------------------------------- #


@dataclasses.dataclass(frozen=True)
class TileTables:
    order: jax.Array  # int32 [Bm, rows, cols]: non-empty column tiles first
    count: jax.Array  # int32 [Bm, rows]
    code: jax.Array  # int32 [Bm, rows, cols]: code of order[..., j]
    steps: int  # grid extent over j: max count when known at trace time, else cols
    batched: bool  # Bm == B > 1 (index tables by the batch program id)


def tile_tables(mask, T, S, bq, bk, *, q_offset=0, kv_offset=0, transpose=False,
                tails=True) -> TileTables:
    """Tables over query-tile rows (or kv-tile rows when `transpose`) of `bq x bk`
    tiles. Evaluated at trace time when the mask and offsets are concrete (then the
    grid extent `steps` is the longest row), else traced (then it is the number of
    column tiles). `tails`: tiles holding padding are PARTIAL."""
    with jax.ensure_compile_time_eval():
        order, count, code = _build_tables(mask, q_offset, kv_offset, T=T, S=S, bq=bq, bk=bk,
                                           transpose=transpose, tails=tails)
        try:
            steps = max(int(np.asarray(count).max()), 1)
        except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
            steps = order.shape[-1]
    return TileTables(order, count, code, steps, batched=order.shape[0] > 1)


def _codes(mask, T, S, bq, bk, q_offset, kv_offset, tails):
    nq, nk = cdiv(T, bq), cdiv(S, bk)
    if mask is None:
        codes = jnp.full((1, nq, nk), M.FULL, jnp.int32)
    else:
        codes = mask.blocks(T, S, bq, bk, q_offset=q_offset, kv_offset=kv_offset).astype(jnp.int32)
    if not tails:
        return codes
    tail = jnp.zeros((nq, nk), bool)
    if T % bq:
        tail = tail.at[-1, :].set(True)
    if S % bk:
        tail = tail.at[:, -1].set(True)
    return jnp.where(tail & (codes == M.FULL), M.PARTIAL, codes)


def _compact(codes):
    nonempty = codes != M.EMPTY
    order = jnp.argsort(~nonempty, axis=-1, stable=True).astype(jnp.int32)
    count = nonempty.sum(-1).astype(jnp.int32)
    cols = codes.shape[-1]
    j = jnp.arange(cols, dtype=jnp.int32)
    last = jnp.take_along_axis(order, jnp.maximum(count - 1, 0)[..., None], axis=-1)
    order = jnp.where(j < count[..., None], order, last)  # repeat: no DMA on skipped steps
    code = jnp.take_along_axis(codes, order, axis=-1)
    return order, count, code


@functools.partial(jax.jit, static_argnames=("T", "S", "bq", "bk", "transpose", "tails"))
def _build_tables(mask, q_offset, kv_offset, *, T, S, bq, bk, transpose, tails):
    codes = _codes(mask, T, S, bq, bk, q_offset, kv_offset, tails)
    if transpose:
        codes = codes.transpose(0, 2, 1)
    return _compact(codes)


# --------------------------------------------------------------------------- #
# A tile's logits.
# --------------------------------------------------------------------------- #


def logit_scaling(H: int, scale, softcap) -> tuple[float, float | None]:
    """(scale, soft-cap) as python floats: the scale defaults to H ** -0.5, a soft-cap
    of 0 or None is none."""
    return float(H ** -0.5 if scale is None else scale), float(softcap) if softcap else None


def logits(s, scale: float, softcap: float | None, bias=None, alibi=None, relative=None):
    """fp32 logits of a tile from its raw scores `s` (q . k, fp32) -> (logits, tanh of
    the soft-cap or None). `bias`: an additive tile (any float dtype); `alibi`: None
    or (slope, q positions, kv positions), broadcastable to the tile; `relative`: T5's
    bias gathered for the tile (fp32). All broadcast against `s`."""
    s = s * scale
    t = None
    if softcap:
        t = jnp.tanh(s / softcap)
        s = softcap * t
    if bias is not None:
        s = s + bias.astype(jnp.float32)
    if alibi is not None:
        slope, qp, kp = alibi
        s = s - slope * jnp.abs(qp - kp).astype(jnp.float32)
    if relative is not None:
        s = s + relative
    return s, t
