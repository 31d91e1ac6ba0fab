"""Lazy attention masks: which (query, key) pairs may attend, as objects, not arrays.

A `Mask` gives a dense view (`mask.dense(T, S)`: bool `[B|1, T, S]`) and a block view
(`mask.blocks(T, S, bq, bk)`: int8 `[B|1, ceil(T/bq), ceil(S/bk)]` of EMPTY, PARTIAL,
FULL) without building the `T x S` array, and evaluates itself on a tile's indices
(`mask.evaluate`). Every view takes global offsets (`q_offset`, `kv_offset`); masks
combine with `&` and `|` and are pytrees. Constructors: `causal`, `sliding_window`,
`chunked_causal`, `padding`, `segments`, `blocks`, `prefix_lm`, `positions`; `combine`,
`windowed`; sparse patterns in `tfjax.ops.sparse_masks`. Fully masked rows give zeros
everywhere. See docs/attention.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

__all__ = [
    "EMPTY", "PARTIAL", "FULL",
    "Mask", "Causal", "SlidingWindow", "ChunkedCausal", "Padding", "Segments", "PrefixLM",
    "PrefixBlock", "Blocks", "Positions", "UNBOUNDED", "And", "Or",
    "causal", "sliding_window", "chunked_causal", "padding", "segments", "blocks", "prefix_lm",
    "positions",
    "check_lengths", "dense", "combine", "windowed",
]

EMPTY, PARTIAL, FULL = 0, 1, 2  # block view codes


def _static(**kw):
    return dataclasses.field(metadata=dict(static=True), **kw)


def _pytree(cls):
    cls = dataclasses.dataclass(frozen=True, eq=False)(cls)
    return jax.tree_util.register_dataclass(cls)


def _index(n: int, offset) -> jax.Array:
    return jnp.arange(n, dtype=jnp.int32) + jnp.asarray(offset, jnp.int32)


def _tile_ranges(n: int, block: int, offset) -> tuple[jax.Array, jax.Array]:
    """First and last global position of each tile (the last tile may be short)."""
    starts = jnp.arange(0, n, block, dtype=jnp.int32)
    ends = jnp.minimum(starts + block, n) - 1
    off = jnp.asarray(offset, jnp.int32)
    return starts + off, ends + off


def _code(full, empty) -> jax.Array:
    return jnp.where(empty, EMPTY, jnp.where(full, FULL, PARTIAL)).astype(jnp.int8)


class Mask:
    """Base class. Subclasses implement `_allowed` and `_tiles`."""

    # -- views ----------------------------------------------------------------
    def dense(self, q_len: int, kv_len: int, *, q_offset=0, kv_offset=0) -> jax.Array:
        """bool `[B|1, T, S]`: True where query i may attend to key j."""
        q = jnp.arange(q_len, dtype=jnp.int32)
        k = jnp.arange(kv_len, dtype=jnp.int32)
        return self.evaluate(q, k, q_offset=q_offset, kv_offset=kv_offset)

    def evaluate(self, q_idx: jax.Array, kv_idx: jax.Array, *, q_offset=0, kv_offset=0) -> jax.Array:
        """bool `[B|1, len(q_idx), len(kv_idx)]` for local query/key indices
        (global position = index + offset). Tiled code calls this per tile."""
        q_idx = jnp.asarray(q_idx, jnp.int32)
        kv_idx = jnp.asarray(kv_idx, jnp.int32)
        out = self._allowed(q_idx[:, None], kv_idx[None, :],
                            jnp.asarray(q_offset, jnp.int32), jnp.asarray(kv_offset, jnp.int32))
        out = jnp.asarray(out, bool)
        if out.ndim == 2:
            out = out[None]
        return jnp.broadcast_to(out, (out.shape[0], q_idx.shape[0], kv_idx.shape[0]))

    def blocks(self, q_len: int, kv_len: int, block_q: int, block_kv: int, *,
               q_offset=0, kv_offset=0) -> jax.Array:
        """int8 `[B|1, ceil(T/bq), ceil(S/bk)]` of EMPTY / PARTIAL / FULL per tile.

        Conservative: a tile reported EMPTY or FULL is exactly that; PARTIAL may
        (rarely, for combined masks) be empty or full. Tail tiles cover only the
        real positions.
        """
        qs, qe = _tile_ranges(q_len, block_q, q_offset)
        ks, ke = _tile_ranges(kv_len, block_kv, kv_offset)
        full, empty = self._tiles(qs[:, None], qe[:, None], ks[None, :], ke[None, :],
                                  q_len=q_len, kv_len=kv_len, block_q=block_q, block_kv=block_kv)
        code = _code(jnp.asarray(full), jnp.asarray(empty))
        if code.ndim == 2:
            code = code[None]
        return jnp.broadcast_to(code, (code.shape[0], qs.shape[0], ks.shape[0]))

    # -- combination ----------------------------------------------------------
    def __and__(self, other: "Mask | None") -> "Mask":
        return self if other is None else And(self, other)

    def __rand__(self, other: "Mask | None") -> "Mask":
        return self if other is None else And(other, self)

    def __or__(self, other: "Mask") -> "Mask":
        return Or(self, other)

    # -- to implement ---------------------------------------------------------
    def _allowed(self, q_idx, kv_idx, q_off, kv_off) -> jax.Array:  # [T,1], [1,S] local
        raise NotImplementedError

    def _tiles(self, qs, qe, ks, ke, **sizes) -> tuple[Any, Any]:
        """(full, empty) bool arrays `[B|1, nq, nk]` or `[nq, nk]` from tile ranges of
        global positions qs..qe (`[nq,1]`) and ks..ke (`[1,nk]`)."""
        raise NotImplementedError

    @property
    def batch_size(self) -> int | None:
        """The batch size the mask's data fixes, or None when it broadcasts."""
        return None

    def token_arrays(self) -> list[tuple[str, str, jax.Array]]:
        """Per-token data, (field, "q" | "kv", array): the fields `q_*` / `kv_*` of
        shape `[B, T|S]` (segment ids, positions), of this mask and those it combines."""
        out = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Mask):
                out += value.token_arrays()
            elif f.name.startswith(("q_", "kv_")) and jnp.ndim(value) == 2:
                out.append((f.name, f.name.split("_")[0], value))
        return out


# --------------------------------------------------------------------------- #
# Positional masks (no data).
# --------------------------------------------------------------------------- #


@_pytree
class Causal(Mask):
    """Key j visible to query i iff pos(j) <= pos(i)."""

    def _allowed(self, q, k, qo, ko):
        return k + ko <= q + qo

    def _tiles(self, qs, qe, ks, ke, **_):
        return ke <= qs, ks > qe


@_pytree
class SlidingWindow(Mask):
    """Query at p sees keys at [p - left, p + right]: `left` keys before it, itself,
    and `right` keys after it (right > 0 for bidirectional local attention)."""

    left: int = _static()
    right: int = _static(default=0)

    def __post_init__(self):
        if self.left < 0 or self.right < 0:
            raise ValueError(f"sliding_window: left and right must be >= 0, got left={self.left}, "
                             f"right={self.right}")

    def _allowed(self, q, k, qo, ko):
        d = (q + qo) - (k + ko)
        return (d <= self.left) & (d >= -self.right)

    def _tiles(self, qs, qe, ks, ke, **_):
        full = (ks >= qe - self.left) & (ke <= qs + self.right)
        empty = (ke < qs - self.left) | (ks > qe + self.right)
        return full, empty


@_pytree
class ChunkedCausal(Mask):
    """Causal within fixed chunks of `chunk` positions (Llama 4 local layers)."""

    chunk: int = _static()

    def __post_init__(self):
        if self.chunk < 1:
            raise ValueError(f"chunked_causal: chunk must be >= 1, got {self.chunk}")

    def _allowed(self, q, k, qo, ko):
        qp, kp = q + qo, k + ko
        return (kp <= qp) & (qp // self.chunk == kp // self.chunk)

    def _tiles(self, qs, qe, ks, ke, **_):
        c = self.chunk
        one_chunk = (qs // c == qe // c) & (ks // c == ke // c) & (qs // c == ks // c)
        full = (ke <= qs) & one_chunk
        empty = (ks > qe) | (ke // c < qs // c) | (ks // c > qe // c)
        return full, empty


# --------------------------------------------------------------------------- #
# Data-dependent masks.
# --------------------------------------------------------------------------- #


@_pytree
class Padding(Mask):
    """Keys at global positions >= kv_lengths[b] are padding and never visible."""

    kv_lengths: jax.Array  # [B] int

    def _allowed(self, q, k, qo, ko):
        return (k + ko)[None] < self.kv_lengths.astype(jnp.int32)[:, None, None]

    def _tiles(self, qs, qe, ks, ke, **_):
        n = self.kv_lengths.astype(jnp.int32)[:, None, None]
        full = jnp.broadcast_to(ke[None] < n, (n.shape[0], qs.shape[0], ks.shape[1]))
        empty = jnp.broadcast_to(ks[None] >= n, full.shape)
        return full, empty

    @property
    def batch_size(self):
        return self.kv_lengths.shape[0]


@_pytree
class PrefixLM(Mask):
    """Prefix-LM (T5 / UniLM): keys in the first prefix_lengths[b] positions are
    visible to every query; the rest is causal."""

    prefix_lengths: jax.Array  # [B] int

    def _allowed(self, q, k, qo, ko):
        p = self.prefix_lengths.astype(jnp.int32)[:, None, None]
        kp = (k + ko)[None]
        return (kp <= (q + qo)[None]) | (kp < p)

    def _tiles(self, qs, qe, ks, ke, **_):
        p = self.prefix_lengths.astype(jnp.int32)[:, None, None]
        full = (ke <= qs)[None] | (ke[None] < p)
        empty = (ks > qe)[None] & (ks[None] >= p)
        return full, empty

    @property
    def batch_size(self):
        return self.prefix_lengths.shape[0]


@_pytree
class PrefixBlock(Mask):
    """Queries and keys both in the first prefix_lengths[b] positions see each other
    (the prefix of a prefix-LM as one bidirectional block; nothing outside it)."""

    prefix_lengths: jax.Array  # [B] int

    def _allowed(self, q, k, qo, ko):
        p = self.prefix_lengths.astype(jnp.int32)[:, None, None]
        return ((q + qo)[None] < p) & ((k + ko)[None] < p)

    def _tiles(self, qs, qe, ks, ke, **_):
        p = self.prefix_lengths.astype(jnp.int32)[:, None, None]
        full = (qe[None] < p) & (ke[None] < p)
        empty = (qs[None] >= p) | (ks[None] >= p)
        return full, empty

    @property
    def batch_size(self):
        return self.prefix_lengths.shape[0]


@_pytree
class Segments(Mask):
    """Packed sequences: query i sees key j iff their segment ids are equal."""

    q_segment_ids: jax.Array  # [B, T] int, indexed by local position
    kv_segment_ids: jax.Array  # [B, S] int

    def _allowed(self, q, k, qo, ko):
        qs = jnp.take(self.q_segment_ids, q[:, 0], axis=1)  # [B, T]
        ks = jnp.take(self.kv_segment_ids, k[0, :], axis=1)  # [B, S]
        return qs[:, :, None] == ks[:, None, :]

    def _tiles(self, qs, qe, ks, ke, *, q_len, kv_len, block_q, block_kv):
        qmin, qmax = _tile_min_max(self.q_segment_ids, q_len, block_q)  # [B, nq]
        kmin, kmax = _tile_min_max(self.kv_segment_ids, kv_len, block_kv)  # [B, nk]
        qmin, qmax = qmin[:, :, None], qmax[:, :, None]
        kmin, kmax = kmin[:, None, :], kmax[:, None, :]
        full = (qmin == qmax) & (kmin == kmax) & (qmin == kmin)
        empty = (qmax < kmin) | (qmin > kmax)
        return full, empty

    @property
    def batch_size(self):
        return self.q_segment_ids.shape[0]


@_pytree
class Blocks(Mask):
    """Bidirectional blocks: query i sees key j iff both are in the same block (an id
    >= 0; -1: in none). An image's tokens in a causal text (Gemma 3), or-ed with the
    causal mask; transformers' `blockwise_overlay`. Indexed by local position."""

    q_block_ids: jax.Array  # [B, T] int
    kv_block_ids: jax.Array  # [B, S] int

    def _allowed(self, q, k, qo, ko):
        qb = jnp.take(self.q_block_ids, q[:, 0], axis=1)  # [B, T]
        kb = jnp.take(self.kv_block_ids, k[0, :], axis=1)  # [B, S]
        return (qb[:, :, None] == kb[:, None, :]) & (qb[:, :, None] >= 0)

    def _tiles(self, qs, qe, ks, ke, *, q_len, kv_len, block_q, block_kv):
        qmin, qmax = _tile_min_max(self.q_block_ids, q_len, block_q)  # [B, nq]
        kmin, kmax = _tile_min_max(self.kv_block_ids, kv_len, block_kv)  # [B, nk]
        qmin, qmax = qmin[:, :, None], qmax[:, :, None]
        kmin, kmax = kmin[:, None, :], kmax[:, None, :]
        full = (qmin == qmax) & (kmin == kmax) & (qmin == kmin) & (qmin >= 0)
        empty = (qmax < kmin) | (qmin > kmax) | (qmax < 0) | (kmax < 0)
        return full, empty

    @property
    def batch_size(self):
        return self.q_block_ids.shape[0]


@_pytree
class Positions(Mask):
    """Causal attention over explicit per-token positions: the query at
    `q_positions[b, t]` sees the key at `kv_positions[b, s]` iff that key holds a
    position (>= 0; negative marks an empty cache slot or padding) no later than
    the query's and, with `window` W > 0, at most W before it (Mistral's window).
    What a KV cache attends with (`tfjax.inference.slots`): slots in any order,
    a ring buffer's included. Indexed by local position, like `Segments`; its
    block view bounds each tile by the min / max of its positions."""

    q_positions: jax.Array  # [B, T] int
    kv_positions: jax.Array  # [B, S] int, negative: nothing there
    window: int = _static(default=0)

    def _allowed(self, q, k, qo, ko):
        qp = jnp.take(self.q_positions, q[:, 0], axis=1)[:, :, None]  # [B, T, 1]
        kp = jnp.take(self.kv_positions, k[0, :], axis=1)[:, None, :]  # [B, 1, S]
        ok = (kp >= 0) & (kp <= qp)
        if self.window:
            ok = ok & (qp - kp <= self.window)
        return ok

    def _tiles(self, qs, qe, ks, ke, *, q_len, kv_len, block_q, block_kv):
        qmin, qmax = _tile_min_max(self.q_positions, q_len, block_q)  # [B, nq]
        kmin, kmax = _tile_min_max(self.kv_positions, kv_len, block_kv)  # [B, nk]
        big = jnp.iinfo(jnp.int32).max  # the earliest key that holds a position
        kfirst, _ = _tile_min_max(jnp.where(self.kv_positions >= 0, self.kv_positions, big),
                                  kv_len, block_kv)
        qmin, qmax = qmin[:, :, None], qmax[:, :, None]
        kmin, kmax, kfirst = kmin[:, None, :], kmax[:, None, :], kfirst[:, None, :]
        full = (kmin >= 0) & (kmax <= qmin)
        empty = (kmax < 0) | (kfirst > qmax)
        if self.window:
            full = full & (qmax - kmin <= self.window)
            empty = empty | (qmin - kmax > self.window)
        return full, empty

    @property
    def batch_size(self):
        return self.q_positions.shape[0]


def _tile_min_max(ids: jax.Array, n: int, block: int) -> tuple[jax.Array, jax.Array]:
    ids = ids[:, :n].astype(jnp.int32)
    pad = (-n) % block
    if pad:  # repeat the last id: it changes no min or max
        ids = jnp.concatenate([ids, jnp.repeat(ids[:, -1:], pad, axis=1)], axis=1)
    tiles = ids.reshape(ids.shape[0], -1, block)
    return tiles.min(-1), tiles.max(-1)


# --------------------------------------------------------------------------- #
# Combinations.
# --------------------------------------------------------------------------- #


@_pytree
class And(Mask):
    a: Mask
    b: Mask

    def _allowed(self, q, k, qo, ko):
        return _batched(self.a._allowed(q, k, qo, ko)) & _batched(self.b._allowed(q, k, qo, ko))

    def _tiles(self, qs, qe, ks, ke, **sizes):
        fa, ea = (_batched(x) for x in self.a._tiles(qs, qe, ks, ke, **sizes))
        fb, eb = (_batched(x) for x in self.b._tiles(qs, qe, ks, ke, **sizes))
        return fa & fb, ea | eb

    @property
    def batch_size(self):
        return self.a.batch_size or self.b.batch_size


@_pytree
class Or(Mask):
    a: Mask
    b: Mask

    def _allowed(self, q, k, qo, ko):
        return _batched(self.a._allowed(q, k, qo, ko)) | _batched(self.b._allowed(q, k, qo, ko))

    def _tiles(self, qs, qe, ks, ke, **sizes):
        fa, ea = (_batched(x) for x in self.a._tiles(qs, qe, ks, ke, **sizes))
        fb, eb = (_batched(x) for x in self.b._tiles(qs, qe, ks, ke, **sizes))
        return fa | fb, ea & eb

    @property
    def batch_size(self):
        return self.a.batch_size or self.b.batch_size


def _batched(x) -> jax.Array:
    x = jnp.asarray(x)
    return x if x.ndim == 3 else x[None]


# --------------------------------------------------------------------------- #
# Constructors (the public names).
# --------------------------------------------------------------------------- #


def causal() -> Mask:
    return Causal()


def sliding_window(left: int, right: int = 0) -> Mask:
    """A query sees `left` keys before it plus itself (as Mistral's window), and
    `right` keys after it. Work and memory of tiled kernels are O(T * (left + right))."""
    return SlidingWindow(int(left), int(right))


def chunked_causal(chunk: int) -> Mask:
    return ChunkedCausal(int(chunk))


def padding(kv_lengths) -> Mask:
    """Keys at positions >= kv_lengths[b] (`[B]`) are padding."""
    kv_lengths = jnp.asarray(kv_lengths, jnp.int32)
    if kv_lengths.ndim != 1:
        raise ValueError(f"padding: kv_lengths must be [B], got shape {kv_lengths.shape}")
    return Padding(kv_lengths)


def blocks(q_block_ids, kv_block_ids=None) -> Mask:
    """Bidirectional blocks (`[B, T]`, `[B, S]` ids; -1: no block): `causal() | blocks(ids)`
    is Gemma 3's mask of images in a text."""
    q_block_ids = jnp.asarray(q_block_ids, jnp.int32)
    kv_block_ids = q_block_ids if kv_block_ids is None else jnp.asarray(kv_block_ids, jnp.int32)
    if q_block_ids.ndim != 2 or kv_block_ids.ndim != 2:
        raise ValueError(f"blocks: block ids must be [B, T] and [B, S], got shapes "
                         f"{q_block_ids.shape} and {kv_block_ids.shape}")
    return Blocks(q_block_ids, kv_block_ids)


def segments(q_segment_ids, kv_segment_ids=None) -> Mask:
    """Same-segment attention; kv ids default to the query ids (self-attention)."""
    q = jnp.asarray(q_segment_ids, jnp.int32)
    kv = q if kv_segment_ids is None else jnp.asarray(kv_segment_ids, jnp.int32)
    if q.ndim != 2 or kv.ndim != 2 or q.shape[0] != kv.shape[0]:
        raise ValueError(f"segments: segment ids must be [B, T] and [B, S] with the same B, got "
                         f"{q.shape} and {kv.shape}")
    return Segments(q, kv)


def positions(q_positions, kv_positions=None, *, window: int = 0) -> Mask:
    """Causal over explicit positions (`[B, T]`, `[B, S]`; kv defaults to the
    query's): a query sees the keys whose position is >= 0 and <= its own (and,
    with `window` > 0, at most `window` before it). Negative kv positions are
    empty (a cache's unused slots, padding); a query with a negative position
    sees nothing."""
    q = jnp.asarray(q_positions, jnp.int32)
    kv = q if kv_positions is None else jnp.asarray(kv_positions, jnp.int32)
    if q.ndim != 2 or kv.ndim != 2 or q.shape[0] != kv.shape[0]:
        raise ValueError(f"positions: q_positions and kv_positions must be [B, T] and [B, S] with "
                         f"the same B, got {q.shape} and {kv.shape}")
    if int(window) < 0:
        raise ValueError(f"positions: window must be >= 0 (0: no window), got {window}")
    return Positions(q, kv, int(window))


def prefix_lm(prefix_lengths) -> Mask:
    """Bidirectional over the first prefix_lengths[b] (`[B]`) positions, causal after."""
    prefix_lengths = jnp.asarray(prefix_lengths, jnp.int32)
    if prefix_lengths.ndim != 1:
        raise ValueError(f"prefix_lm: prefix_lengths must be [B], got shape {prefix_lengths.shape}")
    return PrefixLM(prefix_lengths)


def windowed(base: Mask | None, left: int, right: int = 0) -> Mask:
    """A sliding layer's mask: `base & sliding_window(left, right)`, as transformers'
    Gemma-family vision-language models mask theirs where `base` lets a query see
    keys after it: a prefix-LM's prefix stays whole whatever the window (PaliGemma 2:
    `base & (window | the prefix block)`); an image's `Blocks` keep the keys after the
    query (Gemma 3: the window bounds only how far back a query looks)."""
    prefix = _find(base, PrefixLM)
    if prefix is not None:
        return combine(base, sliding_window(left, right) | PrefixBlock(prefix.prefix_lengths))
    if _find(base, Blocks) is not None:
        right = UNBOUNDED
    return combine(base, sliding_window(left, right))


UNBOUNDED = 2 ** 30  # a window side that bounds nothing (positions stay far below it)


def _find(mask: Mask | None, cls: type) -> Mask | None:
    """The first `cls` mask among `mask` and the masks it combines (`&`, `|`)."""
    if isinstance(mask, cls):
        return mask
    if isinstance(mask, (And, Or)):
        return _find(mask.a, cls) or _find(mask.b, cls)
    return None


def combine(*masks: Mask | None) -> Mask | None:
    """`&` of the masks that are not None (None when all are)."""
    out = None
    for m in masks:
        if m is not None:
            out = m if out is None else out & m
    return out


def check_lengths(mask: Mask | None, q_len: int, kv_len: int, caller: str) -> None:
    """Raise unless each per-token array of `mask` is as long as the queries / keys."""
    for name, side, array in mask.token_arrays() if mask is not None else ():
        want, what = (q_len, "queries (T)") if side == "q" else (kv_len, "keys (S)")
        if array.shape[-1] != want:
            raise ValueError(f"{caller}: the mask's {name} has length {array.shape[-1]} but the "
                             f"{what} have length {want}; give {name} as [B, {want}]")


def dense(mask: Mask | None, q_len: int, kv_len: int, *, q_offset=0, kv_offset=0) -> jax.Array:
    """Dense view of an optional mask (None: everything visible), `[B|1, T, S]`."""
    if mask is None:
        return jnp.ones((1, q_len, kv_len), bool)
    return mask.dense(q_len, kv_len, q_offset=q_offset, kv_offset=kv_offset)
