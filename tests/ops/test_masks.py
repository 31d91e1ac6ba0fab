"""Each mask's dense view against its definition, written as a Python loop."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tfjax.ops import masks as M

T, S = 7, 9


def loop_dense(rule, B, T, S, q_offset=0, kv_offset=0):
    out = np.zeros((B, T, S), bool)
    for b, i, j in itertools.product(range(B), range(T), range(S)):
        out[b, i, j] = rule(b, i, j, i + q_offset, j + kv_offset)
    return out


SEG_Q = np.array([[1, 1, 1, 2, 2, 3, 3], [5, 5, 5, 5, 5, 5, 5]])
SEG_KV = np.array([[1, 1, 2, 2, 2, 3, 3, 3, 4], [5, 5, 5, 6, 6, 6, 6, 6, 6]])
POS_Q = np.array([[3, 4, 5, 6, 7, 8, 9], [-1, 0, 1, 20, 21, 22, 23]])  # -1: a padding query
POS_KV = np.array([[0, 1, 2, 3, 4, 5, -1, -1, -1], [18, 19, 20, 21, -1, 15, 16, 17, 2]])  # a ring
LENS = np.array([4, 9])
PREFIX = np.array([3, 0])
BLOCK_Q = np.array([[-1, 0, 0, 0, 0, -1, 1], [-1, -1, 0, 0, -1, -1, -1]])  # images in a text
BLOCK_KV = np.array([[-1, 0, 0, 0, 0, -1, 1, 1, -1], [-1, -1, 0, 0, -1, -1, -1, -1, -1]])

CASES = {
    "causal": (M.causal(), lambda b, i, j, p, q: q <= p),
    "window_left": (M.sliding_window(2), lambda b, i, j, p, q: 0 <= p - q <= 2),
    "window_both": (M.sliding_window(1, 2), lambda b, i, j, p, q: -2 <= p - q <= 1),
    "chunked": (M.chunked_causal(3), lambda b, i, j, p, q: q <= p and p // 3 == q // 3),
    "padding": (M.padding(LENS), lambda b, i, j, p, q: q < LENS[b]),
    "segments": (M.segments(SEG_Q, SEG_KV), lambda b, i, j, p, q: SEG_Q[b, i] == SEG_KV[b, j]),
    "prefix": (M.prefix_lm(PREFIX), lambda b, i, j, p, q: q <= p or q < PREFIX[b]),
    "causal&segments": (M.causal() & M.segments(SEG_Q, SEG_KV),
                        lambda b, i, j, p, q: q <= p and SEG_Q[b, i] == SEG_KV[b, j]),
    "window|prefix": (M.sliding_window(0, 1) | M.prefix_lm(PREFIX),
                      lambda b, i, j, p, q: -1 <= p - q <= 0 or q <= p or q < PREFIX[b]),
    "prefix_block": (M.PrefixBlock(PREFIX), lambda b, i, j, p, q: p < PREFIX[b] and q < PREFIX[b]),
    # a sliding layer of a prefix-LM: the window, except inside the prefix (HF's Gemma VLMs)
    "windowed(prefix&padding)": (
        M.windowed(M.prefix_lm(PREFIX) & M.padding(LENS), 1),
        lambda b, i, j, p, q: q < LENS[b] and (0 <= p - q <= 1 or max(p, q) < PREFIX[b])),
    "windowed(causal)": (M.windowed(M.causal(), 1), lambda b, i, j, p, q: 0 <= p - q <= 1),
    "blocks": (M.blocks(BLOCK_Q, BLOCK_KV),
               lambda b, i, j, p, q: BLOCK_Q[b, i] == BLOCK_KV[b, j] >= 0),
    # Gemma 3's sliding layer: the window bounds only how far back a query looks
    "windowed(causal|blocks)": (
        M.windowed(M.causal() | M.blocks(BLOCK_Q, BLOCK_KV), 1),
        lambda b, i, j, p, q: p - q <= 1 and (q <= p or BLOCK_Q[b, i] == BLOCK_KV[b, j] >= 0)),
    "causal&padding&window": (M.causal() & M.padding(LENS) & M.sliding_window(3),
                              lambda b, i, j, p, q: q <= p and q < LENS[b] and p - q <= 3),
    # explicit positions, indexed locally (offsets change nothing)
    "positions": (M.positions(POS_Q, POS_KV),
                  lambda b, i, j, p, q: 0 <= POS_KV[b, j] <= POS_Q[b, i]),
    "positions_window": (M.positions(POS_Q, POS_KV, window=2),
                         lambda b, i, j, p, q: 0 <= POS_KV[b, j] <= POS_Q[b, i] <= POS_KV[b, j] + 2),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("offsets", [(0, 0), (5, 2)])
def test_dense_matches_definition(name, offsets):
    mask, rule = CASES[name]
    qo, ko = offsets
    got = np.asarray(mask.dense(T, S, q_offset=qo, kv_offset=ko))
    want = loop_dense(rule, 2, T, S, qo, ko)
    np.testing.assert_array_equal(np.broadcast_to(got, want.shape), want)


def test_dense_under_jit_with_traced_offsets():
    mask = M.causal() & M.segments(SEG_Q, SEG_KV)
    f = jax.jit(lambda m, qo: m.dense(T, S, q_offset=qo))
    want = loop_dense(CASES["causal&segments"][1], 2, T, S, 4, 0)
    np.testing.assert_array_equal(np.asarray(f(mask, 4)), want)


def test_evaluate_on_index_subsets():
    mask = CASES["causal&segments"][0]
    q_idx, kv_idx = jnp.array([1, 4, 6]), jnp.array([0, 2, 8])
    got = np.asarray(mask.evaluate(q_idx, kv_idx))
    full = np.asarray(mask.dense(T, S))
    np.testing.assert_array_equal(got, full[:, [1, 4, 6]][:, :, [0, 2, 8]])


def test_none_combines_and_dense_of_none():
    assert M.combine(None, None) is None
    c = M.causal()
    assert M.combine(None, c) is c
    assert np.asarray(M.dense(None, 2, 3)).all()


@pytest.mark.parametrize("bad", [
    lambda: M.sliding_window(-1),
    lambda: M.chunked_causal(0),
    lambda: M.padding(np.ones((2, 2))),
    lambda: M.segments(np.ones((2, 3)), np.ones((3, 3))),
    lambda: M.prefix_lm(np.ones((2, 2))),
    lambda: M.positions(np.ones((2, 3)), np.ones((3, 3))),
    lambda: M.positions(np.ones((2, 3)), window=-1),
])
def test_bad_arguments_raise(bad):
    with pytest.raises(ValueError):
        bad()
