"""Sparse attention patterns as lazy masks: Longformer's local window with global
positions (`longformer`) and BigBird's window, globals and seeded random key blocks
(`bigbird`). They combine with the masks of `tfjax.ops.masks` (`&`, `|`) and give the
same dense and block views. See docs/attention.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from tfjax.ops.masks import Mask, _pytree, _static

__all__ = ["Longformer", "RandomBlocks", "bigbird", "count_in", "longformer"]


def count_in(sorted_positions: np.ndarray, lo, hi) -> jax.Array:
    """How many of the static sorted positions lie in [lo, hi] (elementwise)."""
    if not sorted_positions.size:
        return jnp.zeros(jnp.broadcast_shapes(jnp.shape(lo), jnp.shape(hi)), jnp.int32)
    g = jnp.asarray(sorted_positions, jnp.int32)
    return (jnp.searchsorted(g, hi, side="right") - jnp.searchsorted(g, lo, side="left")).astype(jnp.int32)


@_pytree
class Longformer(Mask):
    """Longformer (Beltagy et al. 2020): a symmetric local window of `window` keys on
    each side (|i - j| <= window), plus global positions that attend to every key and
    are attended by every query. Combine with `causal()` for a decoder.

    Block view: a tile is FULL when the window covers it or all its queries (or all its
    keys) are global; EMPTY when the window misses it and it holds no global position.
    """

    window: int = _static()
    global_positions: tuple[int, ...] = _static(default=())

    def __post_init__(self):
        if self.window < 0:
            raise ValueError(f"longformer: window must be >= 0, got {self.window}")
        g = self.global_positions
        if any(p < 0 for p in g) or list(g) != sorted(set(g)):
            raise ValueError(f"longformer: global_positions must be distinct, sorted and >= 0, "
                             f"got {g}")

    def _globals(self) -> np.ndarray:
        return np.asarray(self.global_positions, np.int32)

    def _allowed(self, q, k, qo, ko):
        qp, kp = q + qo, k + ko
        g = self._globals()
        return (jnp.abs(qp - kp) <= self.window) | (count_in(g, qp, qp) > 0) | \
            (count_in(g, kp, kp) > 0)

    def _tiles(self, qs, qe, ks, ke, **_):
        w, g = self.window, self._globals()
        n_q, n_k = count_in(g, qs, qe), count_in(g, ks, ke)  # [nq,1], [1,nk]
        full = ((ks >= qe - w) & (ke <= qs + w)) | (n_q == qe - qs + 1) | (n_k == ke - ks + 1)
        empty = ((ke < qs - w) | (ks > qe + w)) & (n_q == 0) & (n_k == 0)
        return full, empty


def _hash32(seed: int, a: jax.Array, b: jax.Array) -> jax.Array:
    """A 32-bit integer hash of (seed, a, b) (murmur3's finaliser), as uint32."""
    u = jnp.uint32
    x = (u(seed & 0xFFFFFFFF) * u(0x9E3779B1)) ^ (a.astype(u) * u(0x85EBCA77)) ^ \
        (b.astype(u) * u(0xC2B2AE3D))
    x = (x ^ (x >> 16)) * u(0x7FEB352D)
    x = (x ^ (x >> 15)) * u(0x846CA68B)
    return x ^ (x >> 16)


@_pytree
class RandomBlocks(Mask):
    """BigBird's random attention (Zaheer et al. 2020): positions are grouped into
    blocks of `block_size`; the queries of block qb see the keys of
    `num_random_blocks` key blocks drawn by a seeded hash of (seed, qb, r) from the
    `num_blocks` blocks of the sequence (draws may repeat, so a query block sees
    between 1 and num_random_blocks distinct blocks). Lazily evaluated: no table.

    Block view: exact EMPTY by enumerating the (static number of) query blocks a tile
    spans; FULL when the tile lies in one query block and one drawn key block.
    """

    num_random_blocks: int = _static()
    block_size: int = _static()
    num_blocks: int = _static()
    seed: int = _static(default=0)

    def __post_init__(self):
        for name in ("num_random_blocks", "block_size", "num_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"bigbird: {name} must be >= 1, got {getattr(self, name)}")

    def _draw(self, qb, r):
        return (_hash32(self.seed, qb, jnp.asarray(r, jnp.int32)) %
                jnp.uint32(self.num_blocks)).astype(jnp.int32)

    def _hit(self, qb, kb_lo, kb_hi):
        hit = jnp.zeros(jnp.broadcast_shapes(qb.shape, kb_lo.shape, kb_hi.shape), bool)
        for r in range(self.num_random_blocks):
            kb = self._draw(qb, r)
            hit = hit | ((kb >= kb_lo) & (kb <= kb_hi))
        return hit

    def _allowed(self, q, k, qo, ko):
        bs = self.block_size
        kb = (k + ko) // bs
        return self._hit((q + qo) // bs, kb, kb)

    def _tiles(self, qs, qe, ks, ke, *, block_q, **_):
        bs = self.block_size
        qb0, qb1, kb0, kb1 = qs // bs, qe // bs, ks // bs, ke // bs
        any_hit = jnp.zeros(jnp.broadcast_shapes(qs.shape, ks.shape), bool)
        for j in range(-(-block_q // bs) + 1):  # every query block the tile can span
            qb = qb0 + j
            any_hit = any_hit | ((qb <= qb1) & self._hit(qb, kb0, kb1))
        full = (qb0 == qb1) & (kb0 == kb1) & self._hit(qb0, kb0, kb0)
        return full, ~any_hit


def longformer(window: int, global_positions=()) -> Mask:
    """Local window of `window` keys on each side plus global positions (a sequence of
    ints) that see and are seen by everything. Tiled kernels touch O(T*window + T*G)."""
    g = tuple(sorted({int(p) for p in np.asarray(global_positions, np.int64).ravel()}))
    return Longformer(int(window), g)


def bigbird(window: int, num_global: int, num_random_blocks: int, block_size: int,
            seed: int = 0, *, seq_len: int | None = None) -> Mask:
    """BigBird (Zaheer et al. 2020): `longformer(window, range(num_global))` (a local
    window of `window` keys on each side, the first `num_global` positions global) or
    `num_random_blocks` seeded random key blocks of `block_size` per query block.

    `seq_len` (the global sequence length; needed when num_random_blocks > 0) fixes the
    range the random blocks are drawn from, so every device of a ring sees the same
    pattern. Use tiles of `block_size` (or multiples) in kernels for exact FULL tiles.
    """
    for name, v, least in (("window", window, 0), ("num_global", num_global, 0),
                           ("num_random_blocks", num_random_blocks, 0),
                           ("block_size", block_size, 1)):
        if v < least:
            raise ValueError(f"bigbird: {name} must be >= {least}, got {v}")
    mask: Mask = Longformer(int(window), tuple(range(int(num_global))))
    if num_random_blocks:
        if not seq_len or seq_len < 1:
            raise ValueError("bigbird: pass seq_len (the global sequence length) to draw "
                             "random blocks from")
        mask = mask | RandomBlocks(int(num_random_blocks), int(block_size),
                                   -(-int(seq_len) // int(block_size)), int(seed))
    return mask
