"""Shared by the generation tests: greedy decoding by full recomputation, the
reference that cached generation must equal token for token."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx


def recompute_greedy(model, prompt, lengths, n, *, prefix_lm=False):
    """Greedy decoding by running the whole model at every step (no cache): a
    fixed-shape buffer, logits read at each row's last position. A prefix-LM model
    sees each row's prompt as its bidirectional prefix."""
    prompt, lengths = np.asarray(prompt), np.asarray(lengths)
    B, T = prompt.shape
    buf = np.zeros((B, T + n), np.int32)
    buf[:, :T] = prompt
    if prefix_lm:
        f = nnx.jit(lambda m, t, p: m(t, prefix_lengths=p))
    else:
        f = nnx.jit(lambda m, t, p: m(t))
    cur, rows, out = lengths.copy(), np.arange(B), []
    for _ in range(n):
        logits = np.asarray(f(model, jnp.asarray(buf), jnp.asarray(lengths)))
        nxt = logits[rows, cur - 1].argmax(-1)
        buf[rows, cur] = nxt
        cur += 1
        out.append(nxt)
    return np.stack(out, 1)
