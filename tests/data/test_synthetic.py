"""Synthetic tasks: each checked by an independent brute-force reading of the sequence."""

import numpy as np
import pytest

from tfjax.data import synthetic as syn


def _next_token_contract(tokens, targets, mask):
    assert tokens.dtype == np.int32 and targets.dtype == np.int32 and mask.dtype == bool
    assert tokens.shape == targets.shape == mask.shape
    np.testing.assert_array_equal(targets[:, :-1], tokens[:, 1:])
    assert (targets[:, -1] == syn.PAD).all() and not mask[:, -1].any()


@pytest.mark.parametrize("B,T,P,V,Q", [(5, 23, 4, 9, None), (3, 40, 7, 30, 3), (2, 4, 1, 3, 1)])
def test_mqar_brute_force(B, T, P, V, Q):
    tokens, targets, mask = syn.mqar(1, batch=B, seq_len=T, num_pairs=P, vocab_size=V,
                                     num_queries=Q)
    _next_token_contract(tokens, targets, mask)
    K = (V - 1) // 2
    for b in range(B):
        row = [int(x) for x in tokens[b]]
        ctx = {}
        for i in range(P):  # the pairs, read left to right
            k, v = row[2 * i], row[2 * i + 1]
            assert 1 <= k <= K and K < v < V and k not in ctx
            ctx[k] = v
        answers = []
        for t in range(2 * P, T):
            if 1 <= row[t] <= K and (t - 2 * P) % 2 == 0:  # a key in the query region
                answers.append(t)
                assert targets[b, t] == ctx[row[t]]  # recalled by scanning the pairs
        assert sorted(np.flatnonzero(mask[b])) == answers
        assert len(answers) == (Q or P) and len({row[t] for t in answers}) == len(answers)
        blanks = [t for t in range(2 * P, T) if t not in answers and t - 1 not in answers]
        assert all(row[t] == syn.PAD for t in blanks)


@pytest.mark.parametrize("B,T,n,V", [(4, 21, 5, 7), (3, 9, 4, 4), (2, 64, 16, 12)])
def test_selective_copy_brute_force(B, T, n, V):
    tokens, targets, mask = syn.selective_copy(2, batch=B, seq_len=T, num_tokens=n, vocab_size=V)
    _next_token_contract(tokens, targets, mask)
    for b in range(B):
        row = list(tokens[b])
        m = row.index(syn.COPY_MARKER)
        assert row.count(syn.COPY_MARKER) == 1
        data = [x for x in row[:m] if x != syn.BLANK]
        assert len(data) == n and all(x >= syn.COPY_DATA0 for x in data)
        assert list(np.flatnonzero(mask[b])) == list(range(m, m + n))
        assert list(targets[b, m:m + n]) == data


@pytest.mark.parametrize("B,T,V,m", [(6, 10, 5, 1), (4, 31, 9, 3), (3, 8, 3, 3)])
def test_induction_heads_brute_force(B, T, V, m):
    tokens, targets, mask = syn.induction_heads(3, batch=B, seq_len=T, vocab_size=V, prefix_len=m)
    _next_token_contract(tokens, targets, mask)
    firsts = set()
    for b in range(B):
        row = list(tokens[b])
        trig = [i for i, x in enumerate(row) if x == syn.TRIGGER]
        assert len(trig) == 2 and trig[0] + m < trig[1]
        firsts.add(trig[0])
        want = row[trig[0] + 1:trig[0] + 1 + m]  # what followed the first occurrence
        assert list(np.flatnonzero(mask[b])) == list(range(trig[1], trig[1] + m))
        assert list(targets[b, trig[1]:trig[1] + m]) == want
        assert trig[1] + m == T - 1
    assert B < 4 or len(firsts) > 1  # the first occurrence moves


@pytest.mark.parametrize("B,T,V,n", [(5, 30, 20, 5), (3, 4, 14, 1), (4, 17, 40, 3)])
def test_passkey_brute_force(B, T, V, n):
    tokens, targets, mask = syn.passkey(4, batch=B, seq_len=T, vocab_size=V, num_digits=n)
    _next_token_contract(tokens, targets, mask)
    for b in range(B):
        row = list(tokens[b])
        s = row.index(syn.NEEDLE_MARKER)
        q = row.index(syn.QUERY_MARKER)
        assert row.count(syn.NEEDLE_MARKER) == 1 and row.count(syn.QUERY_MARKER) == 1
        key = [x - syn.DIGIT0 for x in row[s + 1:s + 1 + n]]
        assert all(0 <= d <= 9 for d in key) and s + n < q
        others = row[:s] + row[s + 1 + n:q]
        assert all(x >= syn.FILLER0 for x in others)
        assert list(np.flatnonzero(mask[b])) == list(range(q, q + n))
        assert [x - syn.DIGIT0 for x in targets[b, q:q + n]] == key


def test_passkey_depth():
    T, n = 40, 4
    C = T - n - 1
    tok, _, _ = syn.passkey(0, batch=3, seq_len=T, vocab_size=20, num_digits=n,
                            depth=np.array([0.0, 0.5, 1.0]))
    starts = [list(r).index(syn.NEEDLE_MARKER) for r in tok]
    assert starts == [0, round(0.5 * (C - n - 1)), C - n - 1]  # 1.0: right before the query
    tok, _, _ = syn.passkey(0, batch=2, seq_len=T, vocab_size=20, num_digits=n, depth=0.25)
    assert [list(r).index(syn.NEEDLE_MARKER) for r in tok] == [round(0.25 * (C - n - 1))] * 2


@pytest.mark.parametrize("d", [1, 5])
def test_delayed_copy(d):
    tokens, targets, mask = syn.delayed_copy(0, batch=3, seq_len=12, distance=d, vocab_size=6)
    for b in range(3):
        for t in range(12):
            assert mask[b, t] == (t >= d)
            if t >= d:
                assert targets[b, t] == tokens[b, t - d]
    assert tokens.min() >= 1 and tokens.max() <= 5


_KW = {
    "mqar": dict(batch=4, seq_len=32, num_pairs=4, vocab_size=20),
    "selective_copy": dict(batch=4, seq_len=32, num_tokens=4, vocab_size=10),
    "induction_heads": dict(batch=4, seq_len=32, vocab_size=10, prefix_len=2),
    "passkey": dict(batch=4, seq_len=32, vocab_size=20),
    "delayed_copy": dict(batch=4, seq_len=32, distance=3, vocab_size=10),
}


@pytest.mark.parametrize("name", sorted(_KW))
def test_seeded(name):
    f = syn.TASKS[name]
    a, b, c = f(7, **_KW[name]), f(7, **_KW[name]), f(8, **_KW[name])
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(a[0], c[0])
    g = f(np.random.default_rng(7), **_KW[name])  # a Generator is accepted too
    np.testing.assert_array_equal(g[0], a[0])


@pytest.mark.parametrize("call,match", [
    (lambda: syn.mqar(0, batch=1, seq_len=64, num_pairs=5, vocab_size=10), "vocab_size=10 too small for num_pairs=5.*>= 11"),
    (lambda: syn.mqar(0, batch=1, seq_len=15, num_pairs=4, vocab_size=20), "seq_len=15 too short.*>= 16"),
    (lambda: syn.mqar(0, batch=1, seq_len=64, num_pairs=4, vocab_size=20, num_queries=5), "num_queries=5"),
    (lambda: syn.mqar(0, batch=0, seq_len=64, num_pairs=4, vocab_size=20), "batch must be"),
    (lambda: syn.selective_copy(0, batch=1, seq_len=8, num_tokens=4, vocab_size=9), "seq_len=8.*>= 9"),
    (lambda: syn.selective_copy(0, batch=1, seq_len=9, num_tokens=4, vocab_size=3), "vocab_size=3"),
    (lambda: syn.induction_heads(0, batch=1, seq_len=5, vocab_size=9, prefix_len=2), "seq_len=5.*prefix_len=2"),
    (lambda: syn.induction_heads(0, batch=1, seq_len=9, vocab_size=2), "vocab_size=2"),
    (lambda: syn.passkey(0, batch=1, seq_len=11, vocab_size=20, num_digits=5), "seq_len=11.*>= 12"),
    (lambda: syn.passkey(0, batch=1, seq_len=40, vocab_size=13), "vocab_size=13.*>= 14"),
    (lambda: syn.passkey(0, batch=2, seq_len=40, vocab_size=20, depth=1.5), "depth must lie in"),
    (lambda: syn.passkey(0, batch=2, seq_len=40, vocab_size=20, depth=[0.1, 0.2, 0.3]), "depth must be"),
    (lambda: syn.delayed_copy(0, batch=1, seq_len=5, distance=5, vocab_size=9), "distance=5"),
    (lambda: syn.delayed_copy(0, batch=1, seq_len=9, distance=2.5, vocab_size=9), "distance must be an integer"),
])
def test_errors_name_the_parameter(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_masked_accuracy():
    targets = np.array([[1, 2, 3], [0, 1, 2]])
    mask = np.array([[True, False, True], [False, True, True]])
    logits = np.eye(4)[np.array([[1, 0, 0], [3, 1, 3]])]  # right, (unmasked), wrong; -, right, wrong
    assert syn.masked_accuracy(logits, targets, mask) == 0.5
