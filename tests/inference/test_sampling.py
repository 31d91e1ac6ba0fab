"""Sampling: top-k / top-p filters against a plain numpy reference; greedy; support."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tfjax.inference.sampling import filter_logits, sample


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


def test_temperature_sampling_matches_distribution():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.2]]))
    draws = jax.vmap(lambda k: sample(k, logits, 1.0))(jax.random.split(jax.random.key(3), 4000))
    freq = np.bincount(np.asarray(draws)[:, 0], minlength=3) / 4000
    np.testing.assert_allclose(freq, [0.5, 0.3, 0.2], atol=0.03)
