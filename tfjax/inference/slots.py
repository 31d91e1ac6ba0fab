"""Slot arithmetic: which position each cache slot holds, and where a step's new tokens
go (the `tfjax.nn.state.Slots` every layer of one cache geometry applies).

Position p of a row is stored in slot `p % size`: a global layer has `size = max_len`
(slot = position), a sliding window of W keys a rolling buffer of W + 1 slots. After
`length` tokens, slot s holds position `p - ((p - s) mod size)`, p = length - 1
(negative: empty). A step's slots are computed once for all layers, as vLLM's slot
mapping is: a decode step writes slot `(length - 1) % size`; a prefill or a chunk
writes, per row, those of its new tokens among the last `size` positions (a gather,
so right padding never overwrites real entries of a rolling buffer). See
docs/inference.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tfjax.nn.state import MODES, Slots

__all__ = ["slot_positions", "step_slots"]


def slot_positions(length: jax.Array, size: int) -> jax.Array:
    """`[B, size]`: the position each slot holds once `length` `[B]` tokens were
    written at slot `position % size` (-1: empty)."""
    p = length.astype(jnp.int32)[:, None] - 1
    s = jnp.arange(size, dtype=jnp.int32)[None, :]
    pos = p - jnp.mod(p - s, size)
    return jnp.where(pos >= 0, pos, -1)


def step_slots(start: jax.Array, length: jax.Array, T: int, size: int | None,
               mode: str) -> Slots:
    """The `Slots` of a step of T new tokens (`mode`: "prefill", "decode" or "chunk")
    that takes each row from `start` `[B]` tokens (the position of its first new
    token) to `length` `[B]`, for a cache of `size` slots (None: a recurrent state)."""
    if mode not in MODES:
        raise ValueError(f"step_slots: mode {mode!r}; allowed: {', '.join(MODES)}")
    new_tokens = jnp.clip(length - start.astype(jnp.int32), 0, T)
    if size is None:
        return Slots(new_tokens, mode=mode)
    if mode == "decode":
        return Slots(new_tokens, slot=jnp.mod(length.astype(jnp.int32) - 1, size), mode=mode)
    pos = slot_positions(length, size)  # [B, size]
    rel = pos - start.astype(jnp.int32)[:, None]  # index among the new tokens
    return Slots(new_tokens, src=jnp.clip(rel, 0, T - 1), take=(pos >= 0) & (rel >= 0),
                 mode=mode)
