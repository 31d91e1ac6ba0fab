"""Property-based checks (hypothesis) on random shapes: every mask's block view
against its dense view, and blockwise attention (forward and gradients) against the
materialising reference, over random lengths off the tile size, offsets, GQA
ratios, mask combinations and fully masked rows. Examples are derandomised (the
same draws every run) and kept few: each new shape is one compilation."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tfjax.ops import masks as M
from tfjax.ops.blockwise import blockwise_attention
from tfjax.ops.reference import attention_reference

PROPERTIES = settings(max_examples=12, deadline=None, derandomize=True, database=None,
                      suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@st.composite
def mask_and_lengths(draw, max_len=40):
    """(mask, T, S, B, q_offset, kv_offset): a primitive or combined mask of any kind."""
    B = draw(st.integers(1, 2))
    T, S = draw(st.integers(1, max_len)), draw(st.integers(1, max_len))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    kinds = {
        "causal": lambda: M.causal(),
        "window": lambda: M.sliding_window(int(rng.integers(0, 9)), int(rng.integers(0, 4))),
        "chunked": lambda: M.chunked_causal(int(rng.integers(1, 12))),
        "padding": lambda: M.padding(rng.integers(0, S + 1, B)),
        "prefix": lambda: M.prefix_lm(rng.integers(0, T + 1, B)),
        "segments": lambda: M.segments(np.sort(rng.integers(0, 3, (B, T)), 1),
                                       np.sort(rng.integers(0, 3, (B, S)), 1)),
        "positions": lambda: M.positions(rng.integers(-1, T + S, (B, T)),
                                         rng.integers(-1, T + S, (B, S)),
                                         window=int(rng.integers(0, 6))),
    }
    names = draw(st.lists(st.sampled_from(sorted(kinds)), min_size=1, max_size=2))
    mask = kinds[names[0]]()
    if len(names) == 2:
        mask = mask & kinds[names[1]]() if draw(st.booleans()) else mask | kinds[names[1]]()
    offsets = draw(st.sampled_from([(0, 0), (0, 0), (T, 0), (3, 7)]))
    return mask, T, S, B, *offsets


@PROPERTIES
@given(mask_and_lengths(), st.sampled_from([(4, 4), (8, 16), (16, 8)]))
def test_block_view_is_conservative_for_random_masks(case, tiles):
    """A tile reported EMPTY holds no visible pair, FULL no hidden one."""
    mask, T, S, B, qo, ko = case
    bq, bk = tiles
    views = jax.jit(lambda m: (m.dense(T, S, q_offset=qo, kv_offset=ko),
                               m.blocks(T, S, bq, bk, q_offset=qo, kv_offset=ko)))
    dense, blocks = (np.asarray(x) for x in views(mask))  # one compilation per example
    dense = np.broadcast_to(dense, (B, T, S))
    blocks = np.broadcast_to(blocks, (B, -(-T // bq), -(-S // bk)))
    for i in range(blocks.shape[1]):
        for j in range(blocks.shape[2]):
            tile = dense[:, i * bq:(i + 1) * bq, j * bk:(j + 1) * bk]
            code = blocks[:, i, j]
            assert not tile[code == M.EMPTY].any()
            assert tile[code == M.FULL].all()


@settings(PROPERTIES, max_examples=6)
@given(mask_and_lengths(max_len=24), st.sampled_from([(2, 2), (4, 2), (4, 1), (3, 1)]),
       st.sampled_from([8, 16]), st.integers(0, 2**16))
def test_blockwise_equals_the_reference_on_random_shapes(case, heads, head_dim, seed):
    """Forward and gradients of q, k, v, on tiles of 8 (lengths rarely multiples of
    them); rows with no visible key give zeros in both (never NaN)."""
    mask, T, S, B, qo, ko = case
    N, K = heads
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (B, T, N, head_dim))
    k = jax.random.normal(keys[1], (B, S, K, head_dim))
    v = jax.random.normal(keys[2], (B, S, K, head_dim))
    ct = jax.random.normal(keys[3], (B, T, N, head_dim))

    def out_and_grads(attend):
        def loss(q, k, v):
            return (attend(q, k, v, mask, q_offset=qo, kv_offset=ko) * ct).sum()
        return attend(q, k, v, mask, q_offset=qo, kv_offset=ko), jax.grad(loss, (0, 1, 2))(q, k, v)

    tiled = jax.jit(lambda *a: out_and_grads(
        lambda *b, **kw: blockwise_attention(*b, block_q=8, block_kv=8, **kw)))
    got = tiled(q, k, v)
    want = out_and_grads(attention_reference)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert np.isfinite(np.asarray(g)).all()
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5, rtol=2e-5)
    visible = np.broadcast_to(np.asarray(mask.dense(T, S, q_offset=qo, kv_offset=ko)),
                              (B, T, S)).any(-1)
    np.testing.assert_array_equal(np.asarray(got[0])[~visible], 0.0)
