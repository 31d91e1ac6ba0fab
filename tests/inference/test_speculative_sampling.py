"""Exact speculative sampling (tfjax.inference.speculative) and prompt lookup
(tfjax.inference.drafters): the acceptance rule on hand-made distributions, the
n-gram proposals, greedy prompt lookup equal to greedy `generate`, and a chi-square
test that speculative sampling with either drafter draws the first tokens from the
model's own distribution (after temperature, top-k, top-p)."""

import jax.numpy as jnp
import numpy as np
import pytest
from chi_square import chi_square_pvalue

from tfjax import models
from tfjax.config import model_config
from tfjax.inference import generate
from tfjax.inference.drafters import NgramDrafter
from tfjax.inference.sampling import sampling_probs
from tfjax.inference.speculative import accept_drafts, speculative_generate

V = 11
PROMPT = np.array([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 0, 10], np.int32)  # every token
# One layer, two MTP modules, weights spread enough that p and q differ.
TINY = dict(arch="decoder", vocab_size=V, d_model=16, num_layers=1, num_heads=2, num_kv_heads=1,
            d_ff=32, max_len=32, init_std=0.3, mtp_depth=2)


@pytest.fixture(scope="module")
def model():
    return models.build(model_config(TINY))


def test_accept_drafts_rule():
    p = np.array([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [0.2, 0.2, 0.6]])  # [D + 1, V]
    q = np.array([[0.25, 0.25, 0.5], [0.1, 0.8, 0.1]])  # [D, V]
    rows = [  # drafts, u, point mass?, accepted, the next token's distribution
        ([0, 1], [0.99, 0.7], False, 2, p[2]),          # p/q = 2, then 0.75 > u: all, p_D
        ([0, 1], [0.0, 0.8], False, 1, [0, 0, 1]),      # 0.75 <= u: max(0, p_1 - q_1)
        ([2, 1], [0.5, 0.0], False, 0, np.array([0.25, 0.05, 0]) / 0.3),  # p/q = 0.4 <= u
        ([1, 1], [0.25, 0.9], True, 1, np.array([0.1, 0, 0.3]) / 0.4),   # q a point mass
        ([1, 2], [0.29, 0.29], True, 2, p[2]),
    ]
    B = len(rows)
    P = np.broadcast_to(p, (B,) + p.shape).astype(np.float32)
    for point in (False, True):
        pick = [r for r in rows if r[2] == point]
        drafts = jnp.array([r[0] for r in pick])
        u = jnp.array([r[1] for r in pick], jnp.float32)
        Q = None if point else jnp.broadcast_to(q, (len(pick),) + q.shape).astype(jnp.float32)
        a, after = accept_drafts(jnp.asarray(P[:len(pick)]), drafts, Q, u)
        np.testing.assert_array_equal(a, [r[3] for r in pick])
        np.testing.assert_allclose(after, np.array([r[4] for r in pick]), rtol=1e-6, atol=1e-7)


def test_prompt_lookup_proposals():
    rows = [  # the sequence so far (index p is the last token), the 4 proposals
        ([1, 2, 3, 4, 9, 9, 1, 2, 3], [4, 9, 9, 1]),     # its last 3 tokens at 0
        ([5, 6, 7, 5, 6, 8, 0, 5, 6], [8, 0, 5, 6]),     # (5, 6): the most recent, at 3
        ([1, 2, 3, 9, 2, 3, 8, 1, 2, 3], [9, 2, 3, 8]),  # the longest n before a later n=2
        ([7, 7, 7], [7, 7, 7, 7]),                       # period 1
        ([1, 2, 1, 2, 1], [2, 1, 2, 1]),                 # continued periodically past p
        ([4, 5, 6], [6, 6, 6, 6]),                       # none: the last token repeated
        ([1], [1, 1, 1, 1]),                             # one token
    ]
    L = 16
    seq = np.full((len(rows), L), 2, np.int32)  # stale tokens after p: never matched
    for b, (tokens, _) in enumerate(rows):
        seq[b, :len(tokens)] = tokens
    p = jnp.array([len(tokens) - 1 for tokens, _ in rows])
    got = NgramDrafter(num_draft=4, max_ngram=3).propose(jnp.asarray(seq), p)
    np.testing.assert_array_equal(got, [want for _, want in rows])
    got = NgramDrafter(num_draft=2, max_ngram=1).propose(jnp.asarray(seq), p)
    np.testing.assert_array_equal(got[2], [8, 1])  # n = 1 only: the latest 3, at 5


def test_prompt_lookup_greedy_equals_generate():
    """Without MTP modules: prompt lookup needs none."""
    model = models.build(model_config({**TINY, "mtp_depth": 0}))
    prompt = np.stack([PROMPT[:9], PROMPT[3:12], PROMPT[5:14]])
    lengths = jnp.array([9, 4, 7])
    ref = generate(model, prompt, max_new_tokens=12, prompt_lengths=lengths, eos_id=10)
    out, stats = speculative_generate(model, prompt, max_new_tokens=12, prompt_lengths=lengths,
                                      eos_id=10, drafter="ngram", num_draft=3)
    np.testing.assert_array_equal(out, ref)
    assert stats["proposed"] > 0 and 0 <= stats["acceptance"] <= 1


N_TOKENS = 3  # the tokens compared: the prefill's, then drafts, residual draws, bonus


@pytest.fixture(scope="module")
def continuation_logits(model):
    """`[V] * (n - 1) + [n, V]`: the logits of step j after PROMPT + t_1 .. t_{n-1}, for
    every continuation, from one full forward (no cache)."""
    n = N_TOKENS
    grid = np.indices((V,) * (n - 1)).reshape(n - 1, -1).T  # every t_1 .. t_{n-1}
    tokens = np.concatenate([np.broadcast_to(PROMPT, (len(grid), len(PROMPT))), grid], 1)
    logits = model(jnp.asarray(tokens, jnp.int32))[:, len(PROMPT) - 1:]
    return np.asarray(logits).reshape((V,) * (n - 1) + (n, V))


def exact_joint(logits, temperature, top_k=None, top_p=None):
    """P(t_1 .. t_n | PROMPT) `[V] * n`, each step's distribution as `sample` processes it."""
    n = logits.shape[-2]
    probs = np.asarray(sampling_probs(jnp.asarray(logits), temperature, top_k, top_p),
                       np.float64)
    joint = np.ones((V,) * n)
    for j in range(n):  # step j's distribution depends on t_1 .. t_j only (causal)
        pj = probs[(slice(None),) * j + (0,) * (n - 1 - j) + (j,)]
        joint = joint * pj.reshape(pj.shape + (1,) * (n - 1 - j))
    return joint


@pytest.mark.parametrize("drafter,kw", [
    ("mtp", dict(temperature=0.9, top_k=3)),                  # two chained drafts
    ("ngram", dict(temperature=1.5, top_p=0.8, num_draft=1)),  # and the bonus token
], ids=["mtp-top_k", "ngram-top_p"])
def test_speculative_sampling_draws_the_models_distribution(model, continuation_logits,
                                                           drafter, kw):
    """4000 rows of one prompt, 3 tokens each: the first from the prefill, the others
    accepted drafts, residual draws or bonus tokens; their joint counts against the
    exact probabilities."""
    N, n = 4000, N_TOKENS
    prompt = np.broadcast_to(PROMPT, (N, len(PROMPT)))
    out, stats = speculative_generate(model, prompt, max_new_tokens=n, drafter=drafter,
                                      seed=1, **kw)
    assert 0.05 < stats["acceptance"] < 0.95, stats  # both accepted and rejected drafts
    counts = np.bincount(np.ravel_multi_index(np.asarray(out).T, (V,) * n), minlength=V ** n)
    joint = exact_joint(continuation_logits, kw["temperature"], kw.get("top_k"), kw.get("top_p"))
    assert chi_square_pvalue(counts, joint) > 1e-3
    again, _ = speculative_generate(model, prompt, max_new_tokens=n, drafter=drafter, seed=1,
                                    **kw)
    np.testing.assert_array_equal(again, out)  # a seed reproduces the draws
    other, _ = speculative_generate(model, prompt, max_new_tokens=n, drafter=drafter, seed=2,
                                    **kw)
    assert not np.array_equal(other, out)


def test_bad_arguments_are_refused(model):
    prompt = jnp.zeros((1, 4), jnp.int32)
    cases = [
        (dict(drafter="medusa"), "drafter must be 'mtp' .* or 'ngram' .*, got 'medusa'"),
        (dict(num_draft=3), r"num_draft must be in \[1, model.mtp_depth=2\]"),
        (dict(num_draft=0), r"num_draft must be in \[1, model.mtp_depth=2\]"),
        (dict(max_ngram=2), "max_ngram is the n-gram drafter's"),
        (dict(drafter="ngram", num_draft=0), "num_draft must be an integer >= 1, got 0"),
        (dict(drafter="ngram", max_ngram=0), "max_ngram must be an integer >= 1, got 0"),
        (dict(temperature=-1.0), r"temperature must be >= 0 \(0 = greedy\)"),
        (dict(temperature=float("nan")), "temperature must be >= 0"),
        (dict(top_k=-2), "top_k must be >= 0"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    ]
    for kw, message in cases:
        with pytest.raises(ValueError, match=message):
            speculative_generate(model, prompt, max_new_tokens=2, **kw)
    no_mtp = models.build(model_config({**TINY, "mtp_depth": 0}))
    with pytest.raises(ValueError, match="mtp_depth >= 1.*drafter='ngram' needs none"):
        speculative_generate(no_mtp, prompt, max_new_tokens=2)
