"""Decode state: what a mixer keeps between decode steps, and a step's writes into it.

Every mixer makes its empty state (`init_state`) and its call takes the state and the
step's `Slots` and returns `(y, new_state)`. `Slots` say where each row's new tokens
go; `tfjax.inference.slots` computes them once a step for all layers of one cache
geometry (vLLM's slot mapping), and this module only applies them: a decode step
writes one slot per row then attends over the slots, a prefill attends over the fresh
keys then writes, a chunk attends over `[slots; fresh keys]` then writes; a paged step
(the engine's) writes into the pages, then attends over each row's pages. Recurrent
mixers run their step or their parallel form from the state, per-row lengths keeping
padding out. See docs/layers.md and docs/inference.md.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from tfjax.ops import paged as paged_lib
from tfjax.parallel.sharding import shard

__all__ = ["MODES", "DecodeState", "RecurrentMixer", "Slots", "cached_attention", "decode_state",
           "recurrent_call", "slots_major", "static_field", "write_slots"]

MODES = ("prefill", "decode", "chunk", "paged")


def static_field(**kw):
    """A dataclass field that is pytree metadata (part of the tree's structure)."""
    return dataclasses.field(metadata=dict(static=True), **kw)


def decode_state(cls):
    """`cls` as a frozen dataclass registered as a pytree (fields made with
    `static_field` are metadata)."""
    return jax.tree_util.register_dataclass(dataclasses.dataclass(frozen=True)(cls))


class DecodeState:
    """Base of every mixer's decode state (a `decode_state` dataclass of arrays)."""

    AXES: ClassVar[dict] = {}  # field -> logical axis names (without a stacked "layers" axis)
    # slot i holds position i, so lowering the model's length undoes a step (speculative)
    rewindable: ClassVar[bool] = False
    # slot arrays `[B, S, ...]` (keys, values, latents) that the engine keeps in pages:
    # `init_state(num_pages, page_size)` makes a layer's pool (`tfjax.ops.paged`)
    pageable: ClassVar[bool] = False
    # a pageable state whose attention reads a ragged step's runs of one sequence once
    # (`tfjax.ops.paged.Paged.runs`); else each of a run's tokens gathers its pages
    reads_runs: ClassVar[bool] = False

    def replace(self, **kw):
        return dataclasses.replace(self, **kw)


@decode_state
class Slots:
    """A step's writes for one cache geometry: `new_tokens` `[B]` real new tokens of each
    row; a decode step's `slot` `[B]` (the slot each row writes); a prefill's or a
    chunk's `src` `[B, S]` (the index among the fresh tokens each of the S slots takes)
    and `take` `[B, S]` (whether it takes one, else it keeps what it holds). A paged
    step's (`tfjax.ops.paged`) `index` `[B, T]` (the flat pool index each new token
    goes to, `DROPPED` for padding) and `table` `[B, n]` (each row's pages), `runs`
    its rows' runs of one sequence (`tfjax.ops.paged.Paged`). Recurrent states read
    `new_tokens` and `mode` alone."""

    new_tokens: jax.Array
    slot: jax.Array | None = None
    src: jax.Array | None = None
    take: jax.Array | None = None
    index: jax.Array | None = None
    table: jax.Array | None = None
    mode: str = static_field(default="prefill")  # one of MODES
    runs: tuple = static_field(default=())


def slots_major(x: jax.Array) -> jax.Array:
    """A stored K or V `[B, K, S, H]` as the attention op reads it, `[B, S, K, H]` (and
    back: the swap is its own inverse). A view for XLA: the TPU kernels transpose it
    back to heads-major, which cancels, and XLA's dots take either layout."""
    return jnp.swapaxes(x, 1, 2)


def _per_array(axes, n: int) -> tuple:
    """`axes`: one tuple of names for all `n` arrays, or a tuple of one per array."""
    return tuple(axes) if axes and isinstance(axes[0], tuple) else (axes,) * n


def write_slots(olds, fresh, slots: Slots, axes) -> tuple:
    """Each of `fresh` `[B, T, ...]` written into the matching `olds` `[B, S, ...]` as
    `slots` say, sharded as `axes` (one for all, or one per array)."""
    every = _per_array(axes, len(olds))
    if slots.mode == "decode":
        rows = jnp.arange(olds[0].shape[0])  # K / V in place: `paged.write_entries`
        return tuple(shard(paged_lib.write_entries(o, rows, slots.slot, n[:, 0].astype(o.dtype)),
                           a) for o, n, a in zip(olds, fresh, every))
    out = []
    for o, n, a in zip(olds, fresh, every):
        tail = (1,) * (o.ndim - 2)
        src = slots.src.reshape(*slots.src.shape, *tail)
        take = slots.take.reshape(*slots.take.shape, *tail)
        got = jnp.take_along_axis(n, src, axis=1).astype(o.dtype)
        out.append(shard(jnp.where(take, got, o), a))
    return tuple(out)


def cached_attention(olds, fresh, slots: Slots, axes, attend: Callable):
    """One step of an attention over slot arrays `olds` `[B, S, ...]` with this step's
    `fresh` `[B, T, ...]` (sharded as `axes`: one for all, or one per array): a chunk
    attends over `[slots; fresh]`, then writes; a decode step writes, then attends over
    the slots; a prefill attends over the fresh arrays (the model's own masks), then
    writes. `attend(arrays, cached)` -> the output
    (`cached` False for the prefill). -> (output, the new slot arrays).

    A paged step: `olds` are page pools `[P, page, ...]` (`axes` still name a row's
    `[B, S, ...]`); the fresh entries are written, then `attend` gets each row's
    pages as `tfjax.ops.paged.Paged`."""
    if slots.mode == "paged":  # pages belong to no row
        news = tuple(shard(paged_lib.write(o, slots.index, f), (None,) + tuple(a[1:]))
                     for o, f, a in zip(olds, fresh, _per_array(axes, len(olds))))
        return attend(tuple(paged_lib.Paged(n, slots.table, runs=slots.runs) for n in news),
                      True), news
    if slots.mode == "chunk":
        out = attend(tuple(jnp.concatenate([o, f.astype(o.dtype)], axis=1)
                           for o, f in zip(olds, fresh)), True)
        return out, write_slots(olds, fresh, slots, axes)
    if slots.mode == "decode":
        news = write_slots(olds, fresh, slots, axes)
        return attend(news, True), news
    return attend(fresh, False), write_slots(olds, fresh, slots, axes)


def recurrent_call(mixer, x, state: DecodeState, slots: Slots, positions):
    """A recurrent mixer's step over its state: a decode step (`mixer.step`; rows with no
    new token keep their state) or a prefill / chunk (`mixer.forward` from the state,
    each row's `slots.new_tokens` keeping right padding out of it) -> (y `[B,T,D]`, the
    new state in the state's dtypes, sharded as its `AXES`)."""
    n = slots.new_tokens
    if x.shape[1] == 1:
        y, new = mixer.step(x[:, 0], state)
        y = y[:, None]
        keep = lambda a, b: jnp.where(  # noqa: E731 rows with no new token keep the old
            (n > 0).reshape((-1,) + (1,) * (a.ndim - 1)), a, b.astype(a.dtype))
        new = jax.tree.map(keep, new, state)
    else:
        y, new = mixer.forward(x, state, positions=positions, lengths=n)
    new = state.replace(**{f: shard(getattr(new, f).astype(getattr(state, f).dtype), axes)
                           for f, axes in state.AXES.items()})
    return shard(y, ("batch", "length", "embed")), new


class RecurrentMixer(nnx.Module):
    """Base of the recurrent mixers (Mamba, Mamba-2, Gated DeltaNet, causal linear
    attention): given their `forward(x, state, positions=, lengths=)` and `step(x_t,
    state)`, the block interface, as attention's."""

    def __call__(self, x, *, mask=None, bias=None, positions=None, state=None,
                 slots: Slots | None = None, **_):
        """Causal by construction, so `mask` and `bias` are unused; `positions` mark
        document starts (see `forward`). No `state`: y `[B,T,D]`; a `state` (the
        mixer's `init_state`): `(y, new_state)`, one sequence from the state, or with
        the step's `slots` each row's real new tokens (`recurrent_call`)."""
        if state is not None and slots is not None:
            return recurrent_call(self, x, state, slots, positions)
        y, new = self.forward(x, state, positions=positions)
        y = shard(y, ("batch", "length", "embed"))
        return y if state is None else (y, new)
