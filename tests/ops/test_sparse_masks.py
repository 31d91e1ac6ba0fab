"""Longformer and BigBird masks: the dense view against the definition, the block
view exact wherever it says EMPTY or FULL, and the tiled attention using them."""

import itertools

import jax
import numpy as np
import pytest

from tfjax.ops import dot_product_attention, masks
from tfjax.ops import sparse_masks as SM
from tfjax.ops.masks import EMPTY, FULL


def longformer_def(T, S, window, globals_, qo=0, ko=0):
    out = np.zeros((T, S), bool)
    for i, j in itertools.product(range(T), range(S)):
        p, q = i + qo, j + ko
        out[i, j] = abs(p - q) <= window or p in globals_ or q in globals_
    return out


def check_blocks(mask, T, S, bq, bk, qo=0, ko=0):
    dense, blocks = jax.jit(lambda m: (m.dense(T, S, q_offset=qo, kv_offset=ko),
                                       m.blocks(T, S, bq, bk, q_offset=qo, kv_offset=ko)))(mask)
    dense, blocks = np.asarray(dense)[0], np.asarray(blocks)[0]
    assert blocks.shape == (-(-T // bq), -(-S // bk))
    n_empty = n_full = 0
    for a, b in np.ndindex(*blocks.shape):
        tile = dense[a * bq:(a + 1) * bq, b * bk:(b + 1) * bk]
        if blocks[a, b] == EMPTY:
            assert not tile.any(), (a, b)
            n_empty += 1
        elif blocks[a, b] == FULL:
            assert tile.all(), (a, b)
            n_full += 1
    return n_empty, n_full


@pytest.mark.parametrize("window,globals_,qo,ko", [
    (2, (0,), 0, 0), (3, (0, 5, 6, 17), 0, 0), (1, (), 4, 0), (4, (3, 20), 8, 8)])
def test_longformer_dense_matches_definition(window, globals_, qo, ko):
    T, S = 13, 21
    m = SM.longformer(window, globals_)
    np.testing.assert_array_equal(m.dense(T, S, q_offset=qo, kv_offset=ko)[0],
                                  longformer_def(T, S, window, set(globals_), qo, ko))


@pytest.mark.parametrize("bq,bk,qo", [(4, 4, 0), (3, 5, 0), (8, 4, 16), (2, 2, 5)])
def test_longformer_blocks_exact(bq, bk, qo):
    m = SM.longformer(3, (0, 1, 2, 3, 30))
    n_empty, n_full = check_blocks(m, 37, 41, bq, bk, qo=qo, ko=0)
    assert n_empty > 0 and n_full > 0, "the test must exercise both codes"


def test_longformer_global_rows_and_columns_are_full():
    m = SM.longformer(1, (0, 9))
    d = np.asarray(m.dense(12, 12))[0]
    assert d[0].all() and d[:, 0].all() and d[9].all() and d[:, 9].all()
    assert not d[5, 2]


def test_bigbird_pattern():
    T, bs, R = 64, 4, 2
    m = SM.bigbird(2, 3, R, bs, seed=7, seq_len=T)
    d = np.asarray(m.dense(T, T))[0]
    np.testing.assert_array_less(0, d.sum(-1))
    base = longformer_def(T, T, 2, set(range(3)))
    extra = d & ~base
    assert (d | base == d).all(), "bigbird includes its longformer part"
    rnd = np.asarray(SM.RandomBlocks(R, bs, T // bs, 7).dense(T, T))[0]
    np.testing.assert_array_equal(d, base | rnd)
    assert extra.any()
    for qb in range(T // bs):  # same key blocks for every query of a block, 1..R of them
        rows = rnd[qb * bs:(qb + 1) * bs]
        assert (rows == rows[0]).all()
        kblocks = rows[0].reshape(T // bs, bs)
        assert (kblocks.all(1) | ~kblocks.any(1)).all(), "whole key blocks"
        assert 1 <= kblocks.all(1).sum() <= R
    other = np.asarray(SM.bigbird(2, 3, R, bs, seed=8, seq_len=T).dense(T, T))[0]
    assert (other != d).any(), "the seed changes the random blocks"
    again = np.asarray(SM.bigbird(2, 3, R, bs, seed=7, seq_len=T).dense(T, T))[0]
    np.testing.assert_array_equal(again, d)


@pytest.mark.parametrize("bq,bk,qo", [(4, 4, 0), (8, 8, 0), (3, 5, 0), (4, 8, 12)])
def test_bigbird_blocks_exact(bq, bk, qo):
    m = SM.bigbird(2, 2, 2, 4, seed=3, seq_len=64)
    n_empty, _ = check_blocks(m, 37, 64, bq, bk, qo=qo)
    assert n_empty > 0


def test_bigbird_random_blocks_are_full_tiles_at_block_size():
    m = SM.RandomBlocks(2, 4, 16, seed=1)
    _, n_full = check_blocks(m, 64, 64, 4, 4)
    assert n_full >= 16  # every query block has at least one drawn key block


def test_tiled_attention_with_sparse_masks():
    B, T, N, K, H = 1, 40, 2, 1, 8
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (B, T, N, H))
    k = jax.random.normal(ks[1], (B, T, K, H))
    v = jax.random.normal(ks[2], (B, T, K, H))
    for mask in (masks.causal() & SM.longformer(3, (0, 17)),
                 SM.bigbird(3, 2, 2, 8, seed=1, seq_len=T)):
        want = dot_product_attention(q, k, v, mask, implementation="reference")
        got = jax.jit(lambda q, k, v, m: dot_product_attention(q, k, v, m,
                                                               implementation="blockwise"))(q, k, v, mask)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_invalid_arguments_are_errors():
    with pytest.raises(ValueError, match="window"):
        SM.longformer(-1)
    with pytest.raises(ValueError, match="seq_len"):
        SM.bigbird(2, 1, 2, 4, seed=0)
