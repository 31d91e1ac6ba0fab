"""Masked next-token cross-entropy with optional z-loss.

The loss of a batch is the mean over *target tokens that count*: `mask` is 0 for
padding and for the first token of every document in a packed row (its "previous
token" belongs to another document), so no gradient crosses a document boundary.
Sums (not means) are returned so gradient accumulation over microbatches and
evaluation over many batches weight every token equally.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

__all__ = ["bits_per_byte", "cross_entropy_sums"]

LN2 = math.log(2.0)


def cross_entropy_sums(logits: jax.Array, targets: jax.Array, mask: jax.Array,
                       target_bytes: jax.Array | None = None) -> dict[str, jax.Array]:
    """logits [B,T,V], targets/mask [B,T] -> sums over the counted tokens.

    Returns nll (sum of -log p(target)), z (sum of log(Z)^2, PaLM's z-loss term),
    tokens (number of counted targets) and bytes (UTF-8 bytes those targets stand
    for; 0 for special tokens), all float32 scalars.
    """
    logits = logits.astype(jnp.float32)
    mask = mask.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)  # [B, T]
    target_logit = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), -1)[..., 0]
    nll = (lse - target_logit) * mask
    out = dict(nll=nll.sum(), z=(jnp.square(lse) * mask).sum(), tokens=mask.sum())
    out["bytes"] = (target_bytes.astype(jnp.float32) * mask).sum() if target_bytes is not None \
        else out["tokens"]
    return out


def bits_per_byte(nll_sum, num_bytes):
    """Total nats over the targets / ln 2 / the bytes they encode (special tokens such
    as end-of-document cost bits but encode no bytes, as a file's end costs gzip)."""
    return nll_sum / LN2 / max(float(num_bytes), 1.0)
