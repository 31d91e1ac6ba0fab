"""The block view of every mask against its dense view: a tile reported EMPTY has
no visible entry, FULL has no hidden one, and for the primitive masks PARTIAL is
exact (it holds both). Tails (T, S not multiples of the tile), offsets,
combinations, and tables that never build T x S (a 128k mask stays cheap)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tfjax.ops import masks as M

B = 2


def _segments(T, S, seed):
    rng = np.random.default_rng(seed)
    q = np.sort(rng.integers(0, 4, (B, T)), axis=1)
    kv = np.sort(rng.integers(0, 4, (B, S)), axis=1)
    return M.segments(q, kv)


def _blocks(T, S):
    """Images in a text: runs of block ids 0, 1 among -1s (the keys' runs as the queries')."""
    def ids(n):
        out = np.full((B, n), -1)
        out[0, 2:n // 2], out[0, n // 2 + 3:n - 1], out[1, 1:4] = 0, 1, 0
        return out
    return M.blocks(ids(T), ids(S))


def _positions(T, S, window=0):
    """A KV cache's mask: row 0 a linear cache (slot = position, the last third
    empty), row 1 a ring buffer (rotated slots, some empty); queries at later
    positions than most keys."""
    kv0 = np.where(np.arange(S) < S - S // 3, np.arange(S), -1)
    kv1 = np.roll(np.arange(S) + 2, S // 3)
    kv1[::5] = -1
    q = np.stack([np.arange(T) + S // 2, np.arange(T) + 3])
    return M.positions(q, np.stack([kv0, kv1]), window=window)


def _masks(T, S):
    return {
        "causal": M.causal(),
        "window_left": M.sliding_window(5),
        "window_left_right": M.sliding_window(3, 7),
        "chunked": M.chunked_causal(6),
        "padding": M.padding(np.array([0, S // 2 + 1])),
        "prefix": M.prefix_lm(np.array([3, T // 2 + 2])),
        "prefix_block": M.PrefixBlock(np.array([3, T // 2 + 2])),
        "blocks": _blocks(T, S),
        "segments": _segments(T, S, 0),
        "positions": _positions(T, S),
        "positions_window": _positions(T, S, window=4),
    }


PRIMITIVE = ["causal", "window_left", "window_left_right", "chunked", "padding", "prefix",
             "prefix_block", "blocks", "segments", "positions", "positions_window"]


def _check(mask, T, S, bq, bk, qo, ko, exact):
    views = jax.jit(lambda m: (m.dense(T, S, q_offset=qo, kv_offset=ko),
                               m.blocks(T, S, bq, bk, q_offset=qo, kv_offset=ko)))
    dense, blocks = (np.asarray(x) for x in views(mask))  # one compile, not one per op
    nq, nk = -(-T // bq), -(-S // bk)
    assert blocks.shape[1:] == (nq, nk) and blocks.shape[0] in (1, B)
    assert blocks.dtype == np.int8
    dense = np.broadcast_to(dense, (B, T, S))
    blocks = np.broadcast_to(blocks, (B, nq, nk))
    for b in range(B):
        for i in range(nq):
            for j in range(nk):
                tile = dense[b, i * bq:(i + 1) * bq, j * bk:(j + 1) * bk]
                code = blocks[b, i, j]
                where = (f"b={b} tile=({i},{j}) code={code} T={T} S={S} bq={bq} bk={bk} "
                         f"off={qo},{ko}")
                if code == M.EMPTY:
                    assert not tile.any(), where
                elif code == M.FULL:
                    assert tile.all(), where
                else:
                    assert code == M.PARTIAL, where
                    if exact:
                        assert tile.any() and not tile.all(), where


GEOMETRY = [  # T, S, bq, bk, q_offset, kv_offset
    (16, 16, 4, 4, 0, 0),
    (13, 19, 4, 8, 0, 0),  # tails on both axes
    (10, 23, 8, 3, 5, 0),  # query chunk of a longer sequence
    (17, 9, 5, 4, 0, 7),  # keys start later (ring attention step)
    (7, 30, 3, 7, 20, 2),
]


@pytest.mark.parametrize("name", PRIMITIVE)
@pytest.mark.parametrize("geometry", GEOMETRY, ids=lambda g: "T{}S{}b{}x{}o{},{}".format(*g))
def test_primitive_block_view_is_exact(name, geometry):
    T, S, bq, bk, qo, ko = geometry
    # chunked causal: a tile may straddle chunks; a windowed Positions tile's keys
    # may fall between its queries' windows; block ids are not sorted (a tile's -1s
    # between two blocks): only conservativeness is promised there
    _check(_masks(T, S)[name], T, S, bq, bk, qo, ko,
           exact=name not in ("chunked", "positions_window", "blocks"))


COMBOS = {
    "causal&segments": lambda m: m["causal"] & m["segments"],
    "window&padding": lambda m: m["window_left_right"] & m["padding"],
    "prefix|window": lambda m: m["prefix"] | m["window_left"],
    "chunked&segments|causal": lambda m: (m["chunked"] & m["segments"]) | m["causal"],
    "padding&prefix&window": lambda m: m["padding"] & m["prefix"] & m["window_left"],
    "positions&segments": lambda m: m["positions"] & m["segments"],
    "windowed(padding&prefix)": lambda m: M.windowed(m["padding"] & m["prefix"], 5),
    "windowed(causal|blocks)": lambda m: M.windowed(m["causal"] | m["blocks"], 5),
}


@pytest.mark.parametrize("combo", sorted(COMBOS))
def test_combined_block_view_is_conservative(combo):
    for T, S, bq, bk, qo, ko in GEOMETRY:
        _check(COMBOS[combo](_masks(T, S)), T, S, bq, bk, qo, ko, exact=False)


def test_chunked_tiles_inside_one_chunk_are_exact():
    _check(M.chunked_causal(8), 32, 32, 4, 4, 0, 0, exact=True)


def test_block_view_under_jit_with_traced_offsets():
    mask = M.causal() & M.sliding_window(6)
    f = jax.jit(lambda qo, ko: mask.blocks(20, 24, 4, 8, q_offset=qo, kv_offset=ko))
    np.testing.assert_array_equal(f(jnp.int32(8), jnp.int32(3)),
                                  mask.blocks(20, 24, 4, 8, q_offset=8, kv_offset=3))


@pytest.mark.xla_optimized  # compiled memory
def test_block_view_is_cheap_at_128k():
    T = 128 * 1024
    mask = M.causal() & M.sliding_window(4096)
    lowered = jax.jit(lambda: mask.blocks(T, T, 512, 512)).lower()
    temp = lowered.compile().memory_analysis().temp_size_in_bytes
    assert temp < 16 * 1024 * 1024  # a dense T x T bool would be 16 GiB
    blocks = np.asarray(mask.blocks(T, T, 512, 512))
    assert (blocks != M.EMPTY).sum() <= 256 * 10  # ~9 tiles per row, not 256
