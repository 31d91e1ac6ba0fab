"""Choosing the next token from logits: greedy, temperature, top-k, top-p (nucleus).

    next = sample(key, logits, temperature=0.8, top_k=40, top_p=0.95)   # [B] int32

Order as in Hugging Face `generate`: divide by the temperature, keep the top k, then
the smallest set of most likely tokens whose probability reaches top_p (Holtzman et
al. 2020), renormalise, draw. Temperature 0 is greedy (argmax of the raw logits).
Every setting may be a traced scalar (`top_k=0` and `top_p=1` mean off), so one
compiled decode loop serves all of them. Tokens tied with the last kept logit are
kept too (a threshold on values, not a count).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["filter_logits", "sample"]


def filter_logits(logits: jax.Array, top_k=None, top_p=None) -> jax.Array:
    """logits `[..., V]` with -inf outside the top-k / top-p support."""
    logits = logits.astype(jnp.float32)
    if top_k is None and top_p is None:
        return logits
    V = logits.shape[-1]
    ranked = jnp.flip(jnp.sort(logits, axis=-1), axis=-1)  # [..., V] descending
    idx = jnp.arange(V)
    if top_k is not None:
        k = jnp.asarray(top_k, jnp.int32)
        k = jnp.where(k <= 0, V, jnp.minimum(k, V))
        kth = jnp.take_along_axis(ranked, jnp.broadcast_to(k - 1, ranked.shape[:-1])[..., None],
                                  axis=-1)
        logits = jnp.where(logits >= kth, logits, -jnp.inf)
        ranked = jnp.where(idx < k, ranked, -jnp.inf)
    if top_p is not None:
        p = jnp.asarray(top_p, jnp.float32)
        probs = jax.nn.softmax(ranked, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of the more likely tokens
        keep = (before < p) | (idx == 0) | (p >= 1.0)
        n = jnp.sum(keep, axis=-1, keepdims=True)  # a prefix of the ranking
        threshold = jnp.take_along_axis(ranked, n - 1, axis=-1)
        logits = jnp.where(logits >= threshold, logits, -jnp.inf)
    return logits


def sample(key: jax.Array, logits: jax.Array, temperature=0.0, top_k=None,
           top_p=None) -> jax.Array:
    """Next tokens `[B]` int32 from logits `[B, V]` (temperature 0: greedy)."""
    logits = logits.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    t = jnp.asarray(temperature, jnp.float32)
    scaled = logits / jnp.where(t > 0, t, 1.0)
    drawn = jax.random.categorical(key, filter_logits(scaled, top_k, top_p), axis=-1)
    return jnp.where(t > 0, drawn.astype(jnp.int32), greedy)
