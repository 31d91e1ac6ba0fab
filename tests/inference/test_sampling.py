"""Sampling: top-k / top-p filters against a plain numpy reference; greedy; support;
per-request sampling (`sample_rows`): every setting per row against a numpy reference,
its draws, its keys (a request's tokens whatever its batch) and its settings' errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from chi_square import chi_square_pvalue

from tfjax.inference.sampling import (CANDIDATES, SamplingParams, check_settings, filter_logits,
                                      processed_logits, sample, sample_rows, token_counts)


def reference_support(logits, top_k=None, top_p=None):
    """Indices a sampler may draw: the top-k, then the smallest most-likely set of
    mass >= top_p (renormalised after top-k)."""
    order = list(np.argsort(-logits))
    if top_k:
        order = order[:top_k]
    if top_p is not None:
        z = logits[order] - logits[order].max()
        p = np.exp(z) / np.exp(z).sum()
        kept, mass = [], 0.0
        for i, pi in zip(order, p):
            kept.append(i)
            mass += pi
            if mass >= top_p:
                break
        order = kept
    return {int(i) for i in order}


@pytest.mark.parametrize("top_k,top_p", [(1, None), (5, None), (None, 0.5), (None, 0.9),
                                         (8, 0.7), (None, 1.0), (0, None), (100, None)])
def test_filter_matches_reference(top_k, top_p):
    logits = np.asarray(jax.random.normal(jax.random.key(0), (4, 37)) * 2.0)
    out = np.asarray(filter_logits(jnp.asarray(logits), top_k, top_p))
    for row, got in zip(logits, out):
        want = reference_support(row, top_k, top_p)
        assert set(np.flatnonzero(np.isfinite(got)).tolist()) == want
        np.testing.assert_allclose(got[list(want)], row[list(want)], rtol=1e-6)


def test_sample_greedy_and_support():
    logits = jax.random.normal(jax.random.key(1), (3, 50)) * 3.0
    np.testing.assert_array_equal(sample(jax.random.key(0), logits, 0.0),
                                  np.argmax(np.asarray(logits), -1))
    draws = jax.vmap(lambda k: sample(k, logits, 1.0, 4, 0.8))(
        jax.random.split(jax.random.key(2), 400))  # [400, 3]
    draws = np.asarray(draws)
    for b in range(3):
        support = reference_support(np.asarray(logits[b]), 4, 0.8)
        assert set(draws[:, b].tolist()) <= support
        assert len(set(draws[:, b].tolist())) == len(support) or len(support) == 1
    # reproducible with a key
    a = sample(jax.random.key(7), logits, 0.7, None, None)
    np.testing.assert_array_equal(a, sample(jax.random.key(7), logits, 0.7, None, None))


def test_sample_sorts_and_draws_only_inside_the_branches_that_need_them():
    """`generate`'s settings are traced (one program for all): a greedy step, or one
    with top-k / top-p off, must not pay the [B, V] sort nor the draw: they sit in
    `cond` branches, not at the top level."""
    logits = jnp.zeros((2, 16))
    jaxpr = jax.make_jaxpr(sample)(jax.random.key(0), logits, jnp.float32(0),
                                   jnp.int32(0), jnp.float32(1)).jaxpr
    top = {e.primitive.name for e in jaxpr.eqns}
    assert "cond" in top and not top & {"sort", "random_bits", "threefry2x32"}, top
    logits = jax.random.normal(jax.random.key(1), (3, 50))  # off: the same draws as unfiltered
    for t, k, p in [(0.7, 0, 1.0), (0.7, 4, 1.0), (0.7, 0, 0.8)]:
        got = sample(jax.random.key(5), logits, jnp.float32(t), jnp.int32(k), jnp.float32(p))
        want = jax.random.categorical(jax.random.key(5), filter_logits(
            logits / t, k if k else None, p if p < 1 else None), axis=-1)
        np.testing.assert_array_equal(got, want)


def test_temperature_sampling_matches_distribution():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.2]]))
    draws = jax.vmap(lambda k: sample(k, logits, 1.0))(jax.random.split(jax.random.key(3), 4000))
    freq = np.bincount(np.asarray(draws)[:, 0], minlength=3) / 4000
    np.testing.assert_allclose(freq, [0.5, 0.3, 0.2], atol=0.03)


# --------------------------------------------------------------------------- #
# Per-request sampling (sample_rows) against a plain numpy reference.
# --------------------------------------------------------------------------- #

def reference_rows(logits, settings, seen, counts):
    """(penalised, processed) logits of one row, in numpy: repetition penalty over
    seen tokens, presence / frequency over output counts, temperature, top-k (ties
    kept), top-p over the top k renormalised (ties with the last kept kept), min-p."""
    s = {**dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0,
                presence_penalty=0.0, frequency_penalty=0.0), **settings}
    x = logits.astype(np.float32)
    r = np.float32(s["repetition_penalty"])
    x = np.where(seen | (counts > 0), np.where(x > 0, x / r, x * r), x)
    x = (x - np.float32(s["presence_penalty"]) * (counts > 0)
         - np.float32(s["frequency_penalty"]) * counts).astype(np.float32)
    penalised = x
    if s["temperature"] > 0:
        x = x / np.float32(s["temperature"])
    V = x.shape[0]
    ranked = np.sort(x)[::-1]
    k = s["top_k"] if 0 < s["top_k"] <= V else V
    keep = x >= ranked[k - 1]
    if s["top_p"] < 1.0:
        top = ranked[:k]
        p = np.exp(top - top.max())
        p /= p.sum()
        before = np.cumsum(p) - p
        last = max(i for i in range(k) if i == 0 or before[i] < s["top_p"])
        keep &= x >= top[last]
    probs = np.where(keep, np.exp(x - x[keep].max()), 0.0)
    probs /= probs.sum()
    keep &= probs >= s["min_p"] * probs.max()
    return penalised, np.where(keep, x, -np.inf)


V_ODD = 37  # not a power of two
ROWS = [  # every row different; padding (None) last
    dict(temperature=0.0, repetition_penalty=1.7),                 # greedy, penalised
    dict(temperature=0.7, top_k=5, presence_penalty=0.9, frequency_penalty=0.4, seed=1),
    dict(temperature=1.3, top_p=0.6, min_p=0.05, repetition_penalty=1.5, seed=2),
    dict(temperature=1.0, top_k=1, seed=3),                        # all but the top filtered
    dict(temperature=0.5, top_k=3, seed=4),                        # ties at the k-th logit
    dict(temperature=2.0, min_p=1.0, seed=5),                      # min-p keeps the top only
    dict(temperature=3.0, min_p=0.3, seed=7),                      # min-p after temperature
    dict(temperature=2.5, top_p=0.5, top_k=8, min_p=0.2, frequency_penalty=-0.5,  # all
         presence_penalty=-1.0, repetition_penalty=0.8, seed=6),
    None,
]


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    B = len(ROWS)
    logits = (rng.normal(size=(B, V_ODD)) * 2.0).astype(np.float32)
    logits[4, [3, 9, 20, 30]] = logits[4].max() + 1.0  # four tied at the top, top_k=3
    logits[:, 7] = -3.0  # a seen token with negative logits: multiplied by the penalty
    seen = rng.random((B, V_ODD)) < 0.2
    seen[:, 7] = True
    counts = rng.integers(0, 3, (B, V_ODD)) * (rng.random((B, V_ODD)) < 0.3)
    return logits, seen, counts.astype(np.int32)


UNFILTERED = [0, 5, 6, 8]  # the rows without top-k or top-p: a batch of them sorts nothing


@pytest.mark.parametrize("rows", [list(range(len(ROWS))), UNFILTERED], ids=["all", "unfiltered"])
def test_processed_logits_match_the_numpy_reference(rows):
    logits, seen, counts = (x[rows] for x in _batch())
    settings = [ROWS[b] or dict(temperature=0.0) for b in rows]
    assert (rows != UNFILTERED) == any(s.get("top_k") or s.get("top_p") for s in settings)
    got = np.asarray(jax.jit(processed_logits)(logits, SamplingParams.of(settings), seen, counts))
    for i, b in enumerate(rows):
        _, want = reference_rows(logits[i], settings[i], seen[i], counts[i])
        if settings[i]["temperature"] == 0:
            continue  # greedy rows draw nothing
        np.testing.assert_array_equal(np.isfinite(got[i]), np.isfinite(want), err_msg=f"row {b}")
        np.testing.assert_allclose(got[i][np.isfinite(want)], want[np.isfinite(want)], rtol=1e-6,
                                   err_msg=f"row {b}")
    count = dict(zip(rows, np.isfinite(got).sum(-1)))
    assert count[5] == 1 and count.get(3, 1) == 1  # all but the top filtered
    assert count.get(4, 4) == 4  # the ties at the k-th logit stay


@pytest.mark.parametrize("top_k,top_p", [(1, None), (9, None), (CANDIDATES, 0.8), (9, 0.3)])
def test_a_small_top_k_ranks_its_candidates_as_the_whole_ranking_does(top_k, top_p):
    """`filter_logits(candidates=C)` (lax.top_k's C largest, no sort) keeps what the
    whole ranking keeps when top_k is in 1..C: the same tokens, ties at the k-th too."""
    logits = np.array(jax.random.normal(jax.random.key(4), (3, 5 * CANDIDATES)) * 2.0)
    logits[1, [5, 50, 70]] = np.sort(logits[1])[::-1][top_k - 1]  # ties at the k-th logit
    got = filter_logits(jnp.asarray(logits), top_k, top_p, candidates=CANDIDATES)
    np.testing.assert_array_equal(got, filter_logits(jnp.asarray(logits), top_k, top_p))
    for row, g in zip(logits, np.asarray(got)):
        assert set(np.flatnonzero(np.isfinite(g)).tolist()) >= reference_support(row, top_k,
                                                                                   top_p)


def test_rows_rank_candidates_or_the_whole_vocabulary_each_by_its_own_settings():
    """A vocabulary wider than CANDIDATES: rows with top-k 1..CANDIDATES take the
    candidates, top-p alone and a larger top-k the whole ranking, a row without
    filters neither; each equals the numpy reference, and a row's processed logits do
    not change with the rows beside it."""
    V = 4 * CANDIDATES
    settings = [dict(temperature=0.9, top_k=CANDIDATES, top_p=0.95, seed=1),
                dict(temperature=0.9, top_k=CANDIDATES + 1, seed=2),
                dict(temperature=1.1, top_p=0.7, seed=3),
                dict(temperature=0.8, top_k=3, seed=4),
                dict(temperature=1.0, seed=5)]
    rng = np.random.default_rng(1)
    logits = (rng.normal(size=(len(settings), V)) * 3.0).astype(np.float32)
    seen, counts = np.zeros(logits.shape, bool), np.zeros(logits.shape, np.int32)
    run = jax.jit(processed_logits)
    got = np.asarray(run(logits, SamplingParams.of(settings), seen, counts))
    for b, row in enumerate(settings):
        want = reference_rows(logits[b], row, seen[b], counts[b])[1]
        np.testing.assert_array_equal(np.isfinite(got[b]), np.isfinite(want), err_msg=f"row {b}")
        np.testing.assert_allclose(got[b][np.isfinite(want)], want[np.isfinite(want)],
                                   rtol=1e-6)
        alone = run(logits[b:b + 1], SamplingParams.of([row]), seen[:1], counts[:1])
        np.testing.assert_array_equal(alone[0], got[b])


def test_sample_rows_tokens_and_logprobs():
    logits, seen, counts = _batch()
    params = SamplingParams.of(ROWS)
    run = jax.jit(sample_rows, static_argnames="num_logprobs")
    out = run(logits, params, jnp.arange(len(ROWS)) + 5, seen, counts, num_logprobs=4)
    raw = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    for b, settings in enumerate(ROWS):
        settings = settings or dict(temperature=0.0)
        penalised, processed = reference_rows(logits[b], settings, seen[b], counts[b])
        t = int(out.tokens[b])
        if settings["temperature"] == 0:  # the argmax of the penalised logits, not the raw
            assert t == int(np.argmax(penalised)), b
        else:
            assert np.isfinite(processed[t]), (b, t)
        np.testing.assert_allclose(out.logprobs[b], raw[b, t], rtol=1e-6)
        np.testing.assert_array_equal(out.top_ids[b], np.argsort(-raw[b], kind="stable")[:4])
        np.testing.assert_allclose(out.top_logprobs[b], np.sort(raw[b])[::-1][:4], rtol=1e-6)
    assert out.tokens.dtype == jnp.int32 and out.top_ids.shape == (len(ROWS), 4)
    plain = run(logits, params, jnp.arange(len(ROWS)) + 5, seen, counts)
    assert plain.top_ids is None and plain.top_logprobs is None
    np.testing.assert_array_equal(plain.tokens, out.tokens)


def test_greedy_rows_take_the_penalised_argmax():
    logits = np.array([[2.0, 1.9, -1.0, -1.2]], np.float32)
    seen = np.array([[True, False, False, False]])
    counts = np.array([[0, 0, 0, 0]], np.int32)
    out = sample_rows(logits, SamplingParams.of([dict(temperature=0, repetition_penalty=1.2)]),
                      jnp.zeros(1, jnp.int32), seen, counts)
    assert int(out.tokens[0]) == 1  # 2.0 / 1.2 < 1.9
    counts = np.array([[0, 0, 0, 1]], np.int32)  # an output token with a negative logit
    params = SamplingParams.of([dict(temperature=0, repetition_penalty=2.0)])
    logits = np.array([[-1.0, -1.5, -9.0, -0.6]], np.float32)
    out = sample_rows(logits, params, jnp.zeros(1, jnp.int32), np.zeros((1, 4), bool), counts)
    assert int(out.tokens[0]) == 0  # -0.6 * 2 = -1.2 < -1.0


@pytest.mark.parametrize("row", [1, 2, 6, 7])
def test_sample_rows_draws_the_processed_distribution(row):
    """4000 draws of one row's settings (one position each, so fresh keys) against
    softmax of the reference's processed logits."""
    logits, seen, counts = _batch()
    n = 4000
    params = SamplingParams.of([ROWS[row]] * n)
    rep = lambda x: np.broadcast_to(x[row], (n,) + x.shape[1:])  # noqa: E731
    out = jax.jit(sample_rows)(rep(logits), params, jnp.arange(n), rep(seen), rep(counts))
    _, processed = reference_rows(logits[row], ROWS[row], seen[row], counts[row])
    probs = np.exp(processed.astype(np.float64) - processed.max())
    observed = np.bincount(np.asarray(out.tokens), minlength=V_ODD)
    assert chi_square_pvalue(observed, probs) > 1e-3


def test_a_request_draws_the_same_tokens_in_any_batch():
    """Row b's key is a function of (seed[b], positions[b]) only: the same request
    alone, or at another row of a batch of other requests, gets the same token."""
    rng = np.random.default_rng(3)
    V, B = 29, 64
    mine = dict(temperature=1.1, top_p=0.9, seed=1234)
    logits = rng.normal(size=(V,)).astype(np.float32) * 0.3  # flat: draws vary
    run = jax.jit(sample_rows)

    def draw(rows, positions):
        return np.asarray(run(np.broadcast_to(logits, (len(rows), V)), SamplingParams.of(rows),
                              np.asarray(positions, np.int32), np.zeros((len(rows), V), bool),
                              np.zeros((len(rows), V), np.int32)).tokens)

    alone = draw([mine], [17])[0]
    others = [dict(temperature=0.7, top_k=3, seed=5), None, dict(temperature=0),
              dict(temperature=1.1, top_p=0.9, seed=1235)]
    for where in (0, 5, B - 1):
        rows = [others[i % len(others)] for i in range(B)]
        rows[where] = mine
        positions = rng.integers(0, 100, B)
        positions[where] = 17
        assert draw(rows, positions)[where] == alone, where
    # ... and the key depends on both: other positions or seeds draw other tokens
    by_position = draw([mine] * B, np.arange(B))
    by_seed = draw([dict(mine, seed=s) for s in range(B)], np.full(B, 17))
    assert len(set(by_position.tolist())) > 5 and len(set(by_seed.tolist())) > 5


def test_one_program_serves_every_mix_of_settings():
    traces = []

    @jax.jit
    def run(logits, params, positions, seen, counts):
        traces.append(1)
        return sample_rows(logits, params, positions, seen, counts).tokens

    logits, seen, counts = _batch()
    B = len(ROWS)
    run(logits, SamplingParams.of(ROWS), jnp.arange(B), seen, counts)
    run(logits, SamplingParams.of(ROWS[::-1]), jnp.arange(B), seen, counts)
    run(logits, SamplingParams.padding(B), jnp.arange(B), seen, counts)
    run(logits, SamplingParams.of([dict(seed=2**32 - 1), dict(seed=-7)], rows=B),
        jnp.arange(B), seen, counts)
    assert len(traces) == 1


def test_sampling_params_of_requests():
    p = SamplingParams.of([dict(temperature=0.5, top_k=4, seed=-1), None, {}], rows=5)
    assert jax.tree.leaves(p)[0].shape == (5,)
    np.testing.assert_array_equal(p.temperature, np.float32([0.5, 0, 1, 0, 0]))  # padding: 0
    np.testing.assert_array_equal(p.top_k, [4, 0, 0, 0, 0])
    assert p.seed.dtype == np.uint32 and p.seed[0] == 2**32 - 1 and p.seed[1] == 0
    assert p.top_k.dtype == np.int32 and p.temperature.dtype == np.float32
    # a request without a seed gets a fresh one; explicit None is a default too
    seeds = {int(SamplingParams.of([dict(seed=None)]).seed[0]) for _ in range(4)}
    assert len(seeds) > 1
    assert check_settings(dict(top_p=None))["top_p"] == 1.0
    assert SamplingParams.padding(3).temperature.tolist() == [0, 0, 0]
    with pytest.raises(ValueError, match="rows=1 is fewer than the 2 requests"):
        SamplingParams.of([{}, {}], rows=1)
    with pytest.raises(ValueError, match="request 0: sampling settings must be a dict"):
        SamplingParams.of([0.5])


@pytest.mark.parametrize("settings,message", [
    (dict(temperature=-0.1), r"^temperature must be a finite number >= 0 \(0 = greedy\), got -0.1"),
    (dict(temperature=float("inf")), "temperature must be a finite number >= 0"),
    (dict(top_p=0.0), r"^top_p must be in \(0, 1\] \(1 = off\), got 0.0"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(top_p=float("nan")), r"top_p must be in \(0, 1\] \(1 = off\), got nan"),
    (dict(min_p=-0.1), r"^min_p must be in \[0, 1\] \(0 = off\)"),
    (dict(min_p=1.01), r"min_p must be in \[0, 1\]"),
    (dict(top_k=-1), r"^top_k must be an integer >= 0 \(0 = off\), got -1"),
    (dict(top_k=2.5), "top_k must be an integer, got 2.5"),
    (dict(top_k=True), "top_k must be an integer, got True"),
    (dict(repetition_penalty=0.0), r"^repetition_penalty must be a finite number > 0 \(1 = off\)"),
    (dict(repetition_penalty=-1), "repetition_penalty must be a finite number > 0"),
    (dict(presence_penalty=2.5), r"^presence_penalty must be in \[-2, 2\]"),
    (dict(frequency_penalty=-3), r"^frequency_penalty must be in \[-2, 2\]"),
    (dict(seed=2**32), r"^seed must be an integer in \[-2\*\*31, 2\*\*32\)"),
    (dict(seed="x"), "seed must be an integer, got 'x'"),
    (dict(temperature="hot"), "temperature must be a number, got 'hot'"),
    (dict(topk=3), "unknown sampling setting 'topk'; known: temperature, top_k, top_p"),
])
def test_bad_settings_are_one_line_errors(settings, message):
    with pytest.raises(ValueError, match=message) as e:
        check_settings(settings)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"\(request 1\)"):
        SamplingParams.of([{}, settings])


def test_token_counts():
    tokens = jnp.array([[1, 2, 1, 0], [3, 3, 3, 3]])
    np.testing.assert_array_equal(token_counts(tokens, 5), [[1, 2, 1, 0, 0], [0, 0, 0, 4, 0]])
    np.testing.assert_array_equal(token_counts(tokens, 5, jnp.array([2, 0])),
                                  [[0, 1, 1, 0, 0], [0, 0, 0, 0, 0]])
