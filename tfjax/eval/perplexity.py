"""Scoring token sequences with a causal LM: per-token log-probabilities on a mesh,
context windows, and the corpus numbers (NLL per token, perplexity, bits per byte).

    scorer = Scorer(model, mesh=mesh, rules=rules, batch_size=8)
    logp, greedy = scorer(tokens, targets)                # [B, T] each, numpy
    result = evaluate(scorer, sequences, context=2048)     # {"tokens", "nll", ...}

A sequence of n tokens contributes its n - 1 next-token predictions; one longer than
`context` is split into `windows` (disjoint, or overlapping by `stride`), every target
scored once. Rows are data-parallel over the mesh's batch axes and padded to one shape
(one compiled program); sums are accumulated in float64 on the host. See docs/evaluation.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding

from tfjax.config import DEFAULT_RULES
from tfjax.parallel.mesh import batch_axes_size
from tfjax.parallel.rules import logical_rules, tree_shardings
from tfjax.parallel.sharding import logical_to_spec, use_rules
from tfjax.train.losses import bits_per_byte

__all__ = ["Scorer", "evaluate", "summarize", "windows"]


class Scorer:
    """Per-token log-probabilities `log p(targets | tokens)` and greedy matches of a
    decoder LM, jitted once per `[B, T]` shape, rows split over the mesh's batch axes.

    `model`: a decoder-only tfjax model (`model(tokens) -> logits [B, T, V]`); with a
    `mesh`, its state is placed on the mesh (`rules`: `MeshConfig.rules` rows)."""

    def __init__(self, model, *, mesh=None, rules=DEFAULT_RULES, batch_size: int = 8):
        arch = getattr(model.config, "arch", "decoder")
        if arch != "decoder":
            raise ValueError(f"model: a {arch} model; perplexity is computed for decoder-only "
                             f"(causal) LMs")
        if batch_size < 1:
            raise ValueError(f"--batch_size must be >= 1, got {batch_size}")
        self.vocab_size = int(model.config.vocab_size)
        self.mesh, self.rules = mesh, logical_rules(rules)
        model.eval()
        graphdef, state = nnx.split(model)
        self.rows = None
        if mesh is not None:
            state = jax.device_put(state, tree_shardings(state, mesh, self.rules))
            self.rows = NamedSharding(mesh, logical_to_spec(("batch", None), self.rules))
            per = batch_axes_size(mesh, rules)
            batch_size = -(-batch_size // per) * per
        self.batch_size = batch_size
        self.state = state

        def logprobs(state, tokens, targets):
            m = nnx.merge(graphdef, state)
            logits = m(tokens).astype(jnp.float32)  # [B, T, V]
            nll = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
            return -nll, jnp.argmax(logits, axis=-1) == targets

        self._fn = jax.jit(logprobs)

    def __call__(self, tokens: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """tokens, targets `[B, T]` int (B a multiple of the batch-axis size) ->
        (log p(target) float32 `[B, T]`, target is the argmax `[B, T]`)."""
        tokens, targets = (np.asarray(a, np.int32) for a in (tokens, targets))
        if self.mesh is None:
            logp, greedy = self._fn(self.state, tokens, targets)
        else:
            tokens, targets = (jax.device_put(a, self.rows) for a in (tokens, targets))
            with use_rules(self.mesh, self.rules):
                logp, greedy = self._fn(self.state, tokens, targets)
        return np.asarray(logp), np.asarray(greedy)


def windows(n: int, context: int, stride: int | None = None) -> list[tuple[int, int, int]]:
    """The windows of an `n`-token sequence: `(start, stop, first)` = input tokens
    `[start, stop)` (at most `context`), targets `[start + 1, stop + 1)`, of which
    those from offset `first` on are scored. Together they score targets 1 .. n-1
    once each; `stride` (default `context`) is how far each window starts after the
    previous one (docs/evaluation.md)."""
    stride = context if stride is None else stride
    if context < 1 or not 1 <= stride <= context:
        raise ValueError(f"--stride must be in [1, context={context}], got {stride}")
    out, start, scored = [], 0, 1  # scored: the first target not yet scored
    while scored < n:
        stop = min(start + context, n - 1)
        out.append((start, stop, scored - start - 1))
        scored = stop + 1
        start += stride
    return out


def evaluate(scorer: Scorer, sequences: Sequence[np.ndarray], *, context: int,
             stride: int | None = None, progress: Callable[[int, int, float], None] | None = None
             ) -> dict:
    """Score every target of `sequences` (int id arrays) in windows of at most
    `context` tokens -> {"tokens", "nll_sum", "windows", "per_sequence"} (per_sequence:
    each sequence's summed NLL, nats). `progress(done, total, mean nll)` after each
    batch (windows done of total)."""
    jobs = [(i, w) for i, seq in enumerate(sequences) for w in windows(len(seq), context, stride)]
    if not jobs:
        raise ValueError("--data: nothing to score: every sequence has fewer than 2 tokens")
    longest = max(stop - start for _, (start, stop, _) in jobs)
    T = min(context, -(-longest // 8) * 8)
    B = scorer.batch_size
    per_sequence = np.zeros(len(sequences), np.float64)
    nll_sum, count = 0.0, 0
    for b in range(0, len(jobs), B):
        chunk = jobs[b:b + B]
        tokens = np.zeros((B, T), np.int32)
        targets = np.zeros((B, T), np.int32)
        mask = np.zeros((B, T), bool)
        for r, (i, (start, stop, first)) in enumerate(chunk):
            seq = sequences[i]
            tokens[r, :stop - start] = seq[start:stop]
            targets[r, :stop - start] = seq[start + 1:stop + 1]
            mask[r, first:stop - start] = True
        logp, _ = scorer(tokens, targets)
        row_nll = -np.where(mask, logp, 0.0).astype(np.float64).sum(axis=1)
        for r, (i, _) in enumerate(chunk):
            per_sequence[i] += row_nll[r]
        nll_sum += float(row_nll.sum())
        count += int(mask.sum())
        if progress is not None:
            progress(min(b + B, len(jobs)), len(jobs), nll_sum / count)
    return dict(tokens=count, nll_sum=nll_sum, windows=len(jobs), per_sequence=per_sequence)


def summarize(nll_sum: float, tokens: int, num_bytes: int | None = None) -> dict:
    """{"tokens", "nll" (mean nats per token), "perplexity", ["bytes", "bits_per_byte"]}."""
    nll = nll_sum / tokens
    out = dict(tokens=int(tokens), nll=nll, perplexity=math.exp(min(nll, 700.0)))
    if num_bytes is not None:
        out.update(bytes=int(num_bytes), bits_per_byte=bits_per_byte(nll_sum, num_bytes))
    return out
