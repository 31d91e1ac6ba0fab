"""Shared by the paged attention tests: a paged KV cache after a step, built as the
model's step builds it (the step's new keys written into the pools at
`tfjax.ops.paged.flat_index` by `write`), beside the logical `[B, S, K, H]` arrays it
stands for, computed here in numpy from the pages and slots directly, and the cache's
`Positions` mask (the integrator's convention: query t of row b at position
`old[b] + t`, padding queries too; slot s holds `slot_positions`'s position, -1 empty)."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from tfjax.ops import AttentionRequest
from tfjax.ops import masks as M
from tfjax.ops import paged as paged_lib
from tfjax.ops.paged import Paged


@dataclasses.dataclass(frozen=True)
class PagedCase:
    """Rows of `old[b]` cached tokens taking `new[b]` (0..T) new ones in a step of T
    query tokens; `n` pages of `page` slots per row. `window` 0: each row's slots hold
    positions 0.. (a global cache, old + new <= n * page); > 0: a ring (slot =
    position % (n * page)) under a sliding window. `share`: rows 0 and 1 share their
    first `share` pages (a common prefix: full pages below both rows' old lengths)."""

    name: str
    T: int
    heads: tuple[int, int]
    H: int
    page: int
    n: int
    old: tuple[int, ...]
    new: tuple[int, ...]
    Hv: int | None = None
    window: int = 0
    share: int = 0
    softcap: float | None = None
    sinks: bool = False
    dtype: str = "float32"

    @property
    def B(self) -> int:
        return len(self.old)

    @property
    def S(self) -> int:
        return self.n * self.page


def slot_positions(length: np.ndarray, size: int) -> np.ndarray:
    """`[B, size]`: the position slot s holds after `length[b]` tokens were written at
    slot `position % size` (the latest such position), -1 when none was."""
    s = np.arange(size)[None, :]
    last = length[:, None] - 1
    pos = last - (last - s) % size
    return np.where(pos >= 0, pos, -1).astype(np.int32)


class Built(NamedTuple):
    """What `build` returns: the step's queries, the cache (k, v `Paged`, the mask),
    the logical arrays it stands for, the sinks (or None), the K and V pools as written
    here by hand (`[P, page, K, H]`, numpy), the step's flat indices and the K pool
    and keys before the step."""

    q: jax.Array
    k: Paged
    v: Paged
    mask: M.Mask
    k_dense: jax.Array
    v_dense: jax.Array
    sinks: jax.Array | None
    k_pool: np.ndarray
    v_pool: np.ndarray
    index: jax.Array  # the step's flat indices `[B, T]` (DROPPED for padding)
    k_before: np.ndarray  # the K pool before the step
    k_new: np.ndarray  # the step's keys `[B, T, K, H]` (padding tokens' too)


def build(c: PagedCase, seed: int = 0) -> Built:
    """The cache after the step's writes, and the arrays it stands for."""
    B, T, S, page, n = c.B, c.T, c.S, c.page, c.n
    N, K = c.heads
    Hv = c.Hv or c.H
    old, new = np.asarray(c.old), np.asarray(c.new)
    assert (new <= T).all() and (c.window or (old + new <= S).all()), c
    assert c.share * page <= min(old[:2], default=0) if c.share else True, c
    rng = np.random.default_rng(seed)
    P = B * n + 3  # some pages belong to no row
    perm = rng.permutation(P)
    table = perm[:B * n].reshape(B, n).astype(np.int32)
    if c.share:
        table[1, :c.share] = table[0, :c.share]
    dtype = jnp.dtype(c.dtype)
    rand = lambda *shape: rng.normal(size=shape).astype(dtype)  # noqa: E731
    k_pool, v_pool = rand(P, page, K, c.H), rand(P, page, K, Hv)  # stale slots everywhere
    k_new, v_new = rand(B, T, K, c.H), rand(B, T, K, Hv)
    q = rand(B, T, N, c.H)
    k_before = k_pool.copy()
    # the model's path: flat indices, then the scatter (padding tokens dropped)
    positions = old[:, None] + np.arange(T)[None, :]
    valid = np.arange(T)[None, :] < new[:, None]
    index = paged_lib.flat_index(jnp.asarray(table), jnp.asarray(positions % S), page,
                                 jnp.asarray(valid))
    k_paged = paged_lib.write(jnp.asarray(k_pool), index, jnp.asarray(k_new))
    v_paged = paged_lib.write(jnp.asarray(v_pool), index, jnp.asarray(v_new))
    # the same writes here, page and offset by hand
    for b in range(B):
        for t in range(new[b]):
            slot = positions[b, t] % S
            k_pool[table[b, slot // page], slot % page] = k_new[b, t]
            v_pool[table[b, slot // page], slot % page] = v_new[b, t]
    k_dense = k_pool[table].reshape(B, S, K, c.H)
    v_dense = v_pool[table].reshape(B, S, K, Hv)
    mask = M.positions(positions.astype(np.int32), slot_positions(old + new, S), window=c.window)
    sinks = None
    if c.sinks:
        sinks = jnp.asarray(np.linspace(-1.0, 3.0, N), jnp.float32)
    return Built(jnp.asarray(q), Paged(k_paged, jnp.asarray(table)),
                 Paged(v_paged, jnp.asarray(table)), mask, jnp.asarray(k_dense),
                 jnp.asarray(v_dense), sinks, k_pool, v_pool, index, k_before, k_new)


def paged_request(c: PagedCase, mask, backend: str, **extras) -> AttentionRequest:
    """The request `dot_product_attention` makes of case `c` on `backend`."""
    N, K = c.heads
    return AttentionRequest(
        q_shape=(c.B, c.T, N, c.H), k_shape=(c.B, c.S, K, c.H), dtype=c.dtype, backend=backend,
        mask=mask, has_bias=False, softcap=c.softcap, offsets=False, return_lse=False,
        v_head_dim=c.Hv or c.H, has_sinks=c.sinks, paged=True, **extras)
