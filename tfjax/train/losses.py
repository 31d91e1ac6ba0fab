"""Masked next-token cross-entropy with optional z-loss, as sums.

`cross_entropy_sums(logits, targets, mask)`: logits `[B, T, V]`, targets and mask
`[B, T]` (mask 0 for padding and for each document's first token, so no gradient
crosses a document boundary) -> the sums nll, z, tokens and bytes, not means, so
microbatches and evaluation batches weight every token equally.
`chunked_cross_entropy_sums` gives the same sums from the final hidden states `[B, T, D]`
and the output head without holding the `[B, T, V]` logits; `token_log_probs` the
per-token log-probabilities the same way (preference losses). See docs/training.md
("The loss").
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from tfjax.parallel.sharding import shard_count

__all__ = ["bits_per_byte", "chunked_cross_entropy_sums", "cross_entropy_sums",
           "token_log_probs"]

LN2 = math.log(2.0)


def _token_terms(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """logits [..., V] -> (log Z, the target's logit), float32 [...]."""
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), -1)[..., 0]
    return lse, target_logit


def _sums(lse, target_logit, mask, target_bytes) -> dict[str, jax.Array]:
    mask = mask.astype(jnp.float32)
    nll = (lse - target_logit) * mask
    out = dict(nll=nll.sum(), z=(jnp.square(lse) * mask).sum(), tokens=mask.sum())
    out["bytes"] = (target_bytes.astype(jnp.float32) * mask).sum() if target_bytes is not None \
        else out["tokens"]
    return out


def cross_entropy_sums(logits: jax.Array, targets: jax.Array, mask: jax.Array,
                       target_bytes: jax.Array | None = None) -> dict[str, jax.Array]:
    """logits [B,T,V], targets/mask [B,T] -> sums over the counted tokens.

    Returns nll (sum of -log p(target)), z (sum of log(Z)^2, PaLM's z-loss term),
    tokens (number of counted targets) and bytes (UTF-8 bytes those targets stand
    for; 0 for special tokens), all float32 scalars.
    """
    return _sums(*_token_terms(logits, targets), mask, target_bytes)


def chunked_cross_entropy_sums(head: Callable[[jax.Array], jax.Array], x: jax.Array,
                               targets: jax.Array, mask: jax.Array,
                               target_bytes: jax.Array | None = None, *,
                               chunk: int) -> dict[str, jax.Array]:
    """`cross_entropy_sums(head(x), targets, mask, target_bytes)` with the logits of
    at most `chunk` positions of each row alive at once on a device (docs/training.md).

    head: final hidden states `[B, c, D]` -> logits `[B, c, V]` (any c; row-wise, as
    an output projection is). x `[B, T, D]`; targets, mask, target_bytes `[B, T]`.
    T <= chunk (or chunk <= 0) calls `head(x)` once, the plain formula. T not a
    multiple of the chunk count is padded with masked positions.
    """
    B, T = targets.shape
    n = _chunk_count(T, chunk)
    if n <= 1:
        return cross_entropy_sums(head(x), targets, mask, target_bytes)
    return _sums(*_chunked_terms(head, x, targets, n), mask, target_bytes)


def _chunk_count(T: int, chunk: int) -> int:
    """Chunks of T positions with at most `chunk` of a row's positions on each device:
    a row's sequence shards (the active rules' "length") each hold T / shards
    positions, so a chunk spans chunk x shards of them. Fewer chunks, fewer trips of
    the scan: each trip reduces the head's gradient over the devices once."""
    return -(-T // (chunk * shard_count("length"))) if chunk > 0 else 1


def _chunked_terms(head, x, targets, n: int) -> tuple[jax.Array, jax.Array]:
    """(log Z, the target's logit) `[B, T]` of `head(x)`, n chunks of positions at a time,
    each chunk's logits recomputed in the backward."""
    B, T = targets.shape
    c = -(-T // n)  # positions per chunk
    pad = n * c - T
    if pad:
        x = jnp.pad(x, ((0, 0), (0, pad), (0, 0)))
        targets = jnp.pad(targets, ((0, 0), (0, pad)))
    # chunk j: positions i * n + j, i < c  ->  [n, B, c, ...]
    xs = x.reshape(B, c, n, x.shape[-1]).transpose(2, 0, 1, 3)
    ts = targets.reshape(B, c, n).transpose(2, 0, 1)

    # the backward recomputes a chunk's logits instead of saving them
    @functools.partial(jax.checkpoint, prevent_cse=False)
    def terms(xc, tc):
        return _token_terms(head(xc), tc)

    _, (lse, target_logit) = jax.lax.scan(lambda carry, xt: (carry, terms(*xt)), None, (xs, ts))

    def unchunk(y):  # [n, B, c] -> [B, T]
        return y.transpose(1, 2, 0).reshape(B, n * c)[:, :T]

    return unchunk(lse), unchunk(target_logit)


def token_log_probs(head: Callable[[jax.Array], jax.Array], x: jax.Array, targets: jax.Array,
                    *, chunk: int = 0) -> jax.Array:
    """log p(target) `[B, T]` (float32) of the logits `head(x)`, at most `chunk`
    positions of a row at a time as `chunked_cross_entropy_sums` (0: all at once)."""
    n = _chunk_count(targets.shape[1], chunk)
    lse, target_logit = (_token_terms(head(x), targets) if n <= 1
                         else _chunked_terms(head, x, targets, n))
    return target_logit - lse


def bits_per_byte(nll_sum, num_bytes):
    """Total nats over the targets / ln 2 / the bytes they encode (special tokens such
    as end-of-document cost bits but encode no bytes, as a file's end costs gzip)."""
    return nll_sum / LN2 / max(float(num_bytes), 1.0)
