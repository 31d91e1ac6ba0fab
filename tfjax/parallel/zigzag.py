"""Zig-zag layout: the load balance of causal ring attention.

The sequence is cut into 2n chunks and device i holds chunks i and 2n-1-i
(`zigzag_order(n)`: `[0, 2n-1, 1, 2n-2, ...]`), so every device does the same causal
work. `zigzag` / `unzigzag` reorder a global array along an axis; `relayout_local` is
the same move inside `shard_map` (half-chunk `ppermute`s, no gather); `zigzag_data(n)`
is the trace context saying the batch is already in zig-zag order (read through
`zigzag_data_devices()`); `ZIGZAG_MODES` are the values of `model.attention.zigzag`.
See docs/long_context.md.
"""

from __future__ import annotations

import contextlib
import threading

import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["ZIGZAG_MODES", "relayout_local", "unzigzag", "zigzag", "zigzag_data",
           "zigzag_data_devices", "zigzag_order"]

ZIGZAG_MODES = ("data", "layer", "none")


def zigzag_order(n: int) -> np.ndarray:
    """The chunk order of zig-zag layout over n devices: [0, 2n-1, 1, 2n-2, ...]."""
    return np.asarray([c for i in range(n) for c in (i, 2 * n - 1 - i)], np.int32)


def _reorder_chunks(x, order, axis):
    axis = axis % x.ndim
    L, m = x.shape[axis], len(order)
    if L % m:
        raise ValueError(f"zigzag: length {L} of axis {axis} is not divisible by {m} chunks")
    xs = x.reshape(*x.shape[:axis], m, L // m, *x.shape[axis + 1:])
    xs = jnp.take(xs, jnp.asarray(order), axis=axis)
    return xs.reshape(x.shape)


def zigzag(x, n: int, axis: int = 1):
    """Natural order -> zig-zag order along `axis` (split into 2n chunks; the i-th
    contiguous 1/n of the result holds chunks i and 2n-1-i)."""
    return _reorder_chunks(x, zigzag_order(n), axis)


def unzigzag(x, n: int, axis: int = 1):
    """Inverse of `zigzag`."""
    return _reorder_chunks(x, np.argsort(zigzag_order(n)).astype(np.int32), axis)


def _chunk_of(layout: str, n: int, d: int, h: int) -> int:
    """The global chunk (of 2n) that half h of device d holds in a layout."""
    if layout == "natural":
        return 2 * d + h
    return d if h == 0 else 2 * n - 1 - d


def relayout_local(x, n: int, axis_name, src: str, dst: str):
    """Inside shard_map over `axis_name` (n devices): move the two local halves (axis
    1) of `x` from layout `src` to `dst` ("natural" / "zigzag") with four half-size
    `ppermute`s, no gather."""
    i = lax.axis_index(axis_name)
    c = x.shape[1] // 2
    halves = (x[:, :c], x[:, c:])
    where = {_chunk_of(src, n, d, h): (d, h) for d in range(n) for h in range(2)}
    out = []
    for s in range(2):
        # dest slot s of device e needs chunk _chunk_of(dst, n, e, s), now at where[...].
        need = [where[_chunk_of(dst, n, e, s)] for e in range(n)]
        recv = []
        for h in range(2):
            pairs = [(d, e) for e, (d, hh) in enumerate(need) if hh == h]
            recv.append(lax.ppermute(halves[h], axis_name, pairs) if pairs
                        else jnp.zeros_like(halves[h]))
        from_half = jnp.asarray([hh for _, hh in need], jnp.int32)[i]
        out.append(jnp.where(from_half == 0, recv[0], recv[1]))
    return jnp.concatenate(out, axis=1)


class _DataLayout(threading.local):
    devices: int = 0  # > 0: the traced step's per-token arrays are in zig-zag order


_DATA_LAYOUT = _DataLayout()


@contextlib.contextmanager
def zigzag_data(n: int):
    """Declare, while tracing a step, that every per-token array of its batch (tokens,
    targets, positions, segment ids, loss weights) was put in zig-zag order over the
    n devices of the sequence axis (`zigzag(x, n, axis=1)`, done by the trainer on the
    host). `context_parallel_attention` then runs the ring with `natural_order=False`
    (no per-layer re-layout) and refuses any attention it cannot evaluate on global
    natural positions. Only the trainer's train/eval steps activate it."""
    saved = _DATA_LAYOUT.devices
    _DATA_LAYOUT.devices = int(n)
    try:
        yield
    finally:
        _DATA_LAYOUT.devices = saved


def zigzag_data_devices() -> int:
    """n when tracing under `zigzag_data(n)`, else 0."""
    return _DATA_LAYOUT.devices
