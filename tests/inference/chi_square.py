"""Shared by the sampling tests: does a sampler draw from a distribution? Scipy's
chi-square goodness-of-fit test of counts against exact probabilities."""

from __future__ import annotations

import numpy as np
from scipy import stats


def chi_square_pvalue(observed, probs, *, min_expected: float = 5.0) -> float:
    """p-value of `observed` counts against `probs` (any shape, summing to 1). A count
    where the probability is 0 fails at once; the cells expected fewer than
    `min_expected` times are pooled into one, as the test's approximation needs."""
    observed = np.asarray(observed, np.float64).ravel()
    probs = np.asarray(probs, np.float64).ravel()
    probs = probs / probs.sum()
    outside = observed[probs == 0].sum()
    assert outside == 0, f"{outside:.0f} draws where the probability is 0"
    n = observed.sum()
    big = probs * n >= min_expected
    obs, exp = list(observed[big]), list(probs[big] * n)
    if (~big & (probs > 0)).any():
        obs.append(observed[~big].sum())
        exp.append(probs[~big].sum() * n)
    assert len(obs) >= 2, "too few draws for a chi-square test"
    exp = np.array(exp) * (n / np.sum(exp))  # the sums agree to the last bit
    return float(stats.chisquare(obs, exp).pvalue)
