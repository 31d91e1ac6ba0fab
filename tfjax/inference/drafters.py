"""Draft proposers for speculative decoding (`tfjax.inference.speculative`).

    MtpDrafter(num_draft=D)                  # the model's multi-token prediction modules
    NgramDrafter(num_draft=D, max_ngram=3)   # prompt lookup (Saxena 2023)

After each verification, `draft` writes D tokens after each row's last committed
token p into the sequence buffer (positions p + 1 .. p + D) and returns their draft
distribution q `[B, D, V]` when sampling, or None: greedy, or prompt lookup's point
mass on each proposal. `rewind` cuts a drafter's own caches back to what the
committed tokens determine. See docs/inference.md.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from tfjax.inference.cache import check_rewindable, rewind

__all__ = ["MtpDrafter", "NgramDrafter", "put_rows", "take_rows"]


def take_rows(x, idx):
    """x `[B, L, ...]`, idx `[B, T]` -> `[B, T, ...]` (indices clipped to the buffer)."""
    idx = jnp.clip(idx, 0, x.shape[1] - 1)
    return jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)


def put_rows(x, idx, values, where):
    """Row b: x[b, idx[b, j]] = values[b, j] where `where[b, j]`."""
    rows = jnp.arange(x.shape[0])[:, None]
    idx = jnp.where(where, idx, x.shape[1])  # out of range: dropped
    return x.at[rows, idx].set(values.astype(x.dtype), mode="drop")


@dataclasses.dataclass(frozen=True)
class MtpDrafter:
    """DeepSeek-V3's multi-token prediction modules (`model.mtp`, the first `num_draft`)
    chained: module k drafts token p + k from module k-1's state at position p - 1 and
    the embedding of token p + k - 1. Each module keeps its own K/V cache; the drafts
    are drawn by `choose` (greedy: argmax; sampling: from the processed q)."""

    num_draft: int
    reads_hidden: ClassVar[bool] = True  # module 1 reads the decoder's last hidden states

    def init_caches(self, model, batch: int, size: int) -> tuple:
        caches = tuple(model.mtp[k].init_cache(batch, size) for k in range(self.num_draft))
        for c in caches:
            check_rewindable(c, "an MTP module's layer")
        return caches

    def draft(self, model, caches, seq, hbuf, p, active, T: int, choose):
        """Module k over its missing positions [f, p) (a chunk of T >= p - f),
        drafting token p + k from position p - 1."""
        f = caches[0].length
        pos = f[:, None] + jnp.arange(T)[None, :]
        n = jnp.where(active, p - f, 0)
        last = jnp.maximum(n - 1, 0)[:, None, None]
        h, new, qs = model.head_input(take_rows(hbuf, pos)), [], []  # h^0: after the final norm
        for k, (module, c) in enumerate(zip(model.mtp, caches), start=1):
            e = model.embed(take_rows(seq, pos + k), pos + k)
            h, c = module.step(h, e, c, n, rel_bias=model.rel_bias)
            h = module.norm(h)
            new.append(c)
            at_last = jnp.take_along_axis(h, last, axis=1)
            d, q = choose(model.head(at_last)[:, 0], p, k)  # the draft at p + k
            qs.append(q)
            seq = put_rows(seq, (p + k)[:, None], d[:, None], active[:, None])
        q = None if qs[0] is None else jnp.stack(qs, axis=1)
        return tuple(new), seq, q

    def rewind(self, caches, p, new_p, active):
        """Each module's cache back to the positions whose inputs were all committed
        tokens: min(new_p - D, p)."""
        f = caches[0].length
        keep = jnp.where(active, jnp.maximum(jnp.minimum(new_p - self.num_draft, p), 0), f)
        return tuple(rewind(c, keep) for c in caches)


@dataclasses.dataclass(frozen=True)
class NgramDrafter:
    """Prompt lookup (Saxena 2023; transformers' `prompt_lookup_num_tokens`): the D
    tokens that followed the most recent earlier occurrence of the row's last n tokens
    (n from `max_ngram` down to 1), continued periodically where that occurrence's
    continuation reaches the end of the sequence; none found: the last token repeated.
    No model and no cache: any model whose decoder caches rewind can use it."""

    num_draft: int
    max_ngram: int = 3
    reads_hidden: ClassVar[bool] = False

    def init_caches(self, model, batch: int, size: int) -> tuple:
        return ()

    def propose(self, seq, p):
        """seq `[B, L]` whose row b holds its sequence so far in [0, p[b]] -> `[B, D]`."""
        B, L = seq.shape
        s = jnp.arange(L)[None, :]  # where a match would start
        end = p - 1  # not found: period 1 after position p - 1, the last token repeated
        found = jnp.zeros((B,), bool)
        for n in range(self.max_ngram, 0, -1):
            match = s + n <= p[:, None]  # [s, s + n - 1] ends before p
            for i in range(n):
                suffix_i = take_rows(seq, (p - n + 1 + i)[:, None])  # [B, 1]
                match &= take_rows(seq, jnp.broadcast_to(s + i, (B, L))) == suffix_i
            latest = jnp.max(jnp.where(match, s, -1), axis=1)  # the most recent
            hit = ~found & (latest >= 0)
            end = jnp.where(hit, latest + n - 1, end)
            found |= hit
        period = p - end  # >= 1: its continuation is periodic past p
        j = jnp.arange(self.num_draft)[None, :]
        return take_rows(seq, end[:, None] + 1 + j % period[:, None])

    def draft(self, model, caches, seq, hbuf, p, active, T: int, choose):
        d = self.propose(seq, p)
        steps = jnp.arange(1, self.num_draft + 1)[None, :]
        return caches, put_rows(seq, p[:, None] + steps, d, active[:, None]), None

    def rewind(self, caches, p, new_p, active):
        return caches
