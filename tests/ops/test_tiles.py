"""What the tiled implementations share (`tfjax.ops.tiles`): the tile tables of a
mask's block view (compacted rows, repeated indices past the count, tails PARTIAL
for the kernels and untouched for blockwise, built at trace time or in the graph),
the padding arithmetic, and a tile's logits."""

import jax
import jax.numpy as jnp
import numpy as np

from tfjax.ops import masks as M
from tfjax.ops.tiles import cdiv, logits, pad_axis, round_up, tile_tables


def test_tile_tables_compact_nonempty_tiles_first():
    mask = M.causal()
    tab = tile_tables(mask, 40, 40, 8, 8)  # 5 x 5, T % 8 == 0
    np.testing.assert_array_equal(tab.count[0], [1, 2, 3, 4, 5])
    assert tab.steps == 5 and not tab.batched
    np.testing.assert_array_equal(tab.order[0, 1], [0, 1, 1, 1, 1])  # repeats the last index
    np.testing.assert_array_equal(tab.code[0, 1, :2], [M.FULL, M.PARTIAL])
    tab_t = tile_tables(mask, 40, 40, 8, 8, transpose=True)
    np.testing.assert_array_equal(tab_t.count[0], [5, 4, 3, 2, 1])
    np.testing.assert_array_equal(tab_t.order[0, 3, :2], [3, 4])
    # a tail tile is never FULL: the kernel must mask the padding
    tail = tile_tables(None, 20, 20, 8, 8)
    np.testing.assert_array_equal(tail.code[0, 0], [M.FULL, M.FULL, M.PARTIAL])
    np.testing.assert_array_equal(tail.code[0, 2], [M.PARTIAL] * 3)
    window = tile_tables(M.sliding_window(8), 1024, 1024, 128, 128)
    assert window.steps == 2  # the grid walks 2 kv tiles per query tile, not 8


def test_tails_mark_only_full_tail_tiles_partial():
    """`tails=False` (blockwise, which bounds every tile itself) keeps the block
    view's codes; the default marks the FULL tiles holding a query or key tail
    PARTIAL and changes nothing else (order and count included)."""
    mask = M.causal()
    plain = tile_tables(mask, 100, 90, 16, 32, tails=False)
    marked = tile_tables(mask, 100, 90, 16, 32)
    np.testing.assert_array_equal(plain.order, marked.order)
    np.testing.assert_array_equal(plain.count, marked.count)
    codes = np.asarray(mask.blocks(100, 90, 16, 32))  # [1, 7, 3]
    want = np.take_along_axis(codes, np.asarray(plain.order), -1)
    np.testing.assert_array_equal(plain.code, want)
    col = np.asarray(plain.order)
    tail = (np.arange(7)[None, :, None] == 6) | (col == 2)  # last query row, last key column
    changed = np.asarray(plain.code) != np.asarray(marked.code)
    np.testing.assert_array_equal(changed, tail & (want == M.FULL))
    assert changed.any()
    np.testing.assert_array_equal(np.asarray(marked.code)[changed], M.PARTIAL)


def test_tables_from_traced_offsets_walk_every_column():
    """With offsets known only at run time the tables are computed in the graph and
    the grid extent is every column tile; the values equal the trace-time tables."""
    mask = M.causal() & M.sliding_window(40)
    static = tile_tables(mask, 64, 256, 16, 32, q_offset=100)
    steps = []

    @jax.jit
    def traced(qo):
        tab = tile_tables(mask, 64, 256, 16, 32, q_offset=qo)
        steps.append(tab.steps)
        return tab.order, tab.count, tab.code

    for a, b in zip(traced(jnp.int32(100)), (static.order, static.count, static.code)):
        np.testing.assert_array_equal(a, b)
    assert steps == [8] and static.steps == 3


def test_padding_arithmetic():
    assert [cdiv(n, 8) for n in (1, 8, 9)] == [1, 1, 2]
    assert [round_up(n, 128) for n in (1, 128, 129)] == [128, 128, 256]
    x = jnp.ones((2, 3))
    np.testing.assert_array_equal(pad_axis(x, 1, 5, -1), [[1, 1, 1, -1, -1]] * 2)
    assert pad_axis(x, 0, 2) is x


def test_logits_scale_softcap_then_bias_alibi_t5_in_that_order():
    """Scale, soft-cap (its tanh returned for the backward), then the bias, ALiBi's
    `-slope * |q_pos - kv_pos|` and T5's term, each broadcast to the tile."""
    rng = np.random.default_rng(0)
    s = jnp.asarray(rng.normal(size=(2, 4, 8)) * 10, jnp.float32)  # [K|G, bq, bk]
    bias = jnp.asarray(rng.normal(size=(1, 4, 8)), jnp.bfloat16)
    slope, qp, kp = jnp.array([[[0.5]], [[0.25]]]), jnp.arange(4)[:, None], jnp.arange(8)[None]
    rel = jnp.asarray(rng.normal(size=(2, 4, 8)), jnp.float32)
    got, t = logits(s, 0.3, 5.0, bias, (slope, qp, kp), rel)
    want_t = np.tanh(np.asarray(s) * 0.3 / 5.0)
    want = (5.0 * want_t + np.asarray(bias, np.float32)
            - np.asarray(slope) * np.abs(np.asarray(qp) - np.asarray(kp)) + np.asarray(rel))
    np.testing.assert_allclose(t, want_t, rtol=1e-6)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert got.dtype == jnp.float32
    plain, none = logits(s, 0.3, None)
    assert none is None
    np.testing.assert_allclose(plain, np.asarray(s) * 0.3, rtol=1e-6)
