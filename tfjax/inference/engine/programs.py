"""The inference engine's jitted programs, one set per model structure (and mesh): the
step of T tokens over all rows or a few (per-row states gathered and put back), the
ragged step (prompt chunks and decode tokens in one list), the reset of admitted rows
and the fork of n samples. Called by `engine.Engine`; see
docs/inference.md ("The engine")."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from tfjax.inference.cache import logical_axes
from tfjax.inference.sampling import sample_rows
from tfjax.parallel.sharding import logical_to_spec, shard

__all__ = ["padded_pairs", "programs"]


@functools.lru_cache(maxsize=8)
def programs(graphdef, mesh=None):
    """The programs of one model structure (and mesh: `shard` constraints are read
    when tracing)."""
    return _Programs(graphdef)


class _Programs:
    """The engine's jitted programs for one model structure."""

    def __init__(self, graphdef):
        self.graphdef = graphdef
        self.reset = jax.jit(lambda *a: placed(*_reset_rows(*a)), donate_argnums=(0, 1, 2))
        self.fork = jax.jit(lambda *a: placed(*_fork(*a)), donate_argnums=(0, 1, 2))

    @functools.lru_cache(maxsize=128)
    def step(self, T: int, R: int, num_logprobs: int, score: bool, narrow: tuple = ()):
        """The step of T tokens for R rows of the cache (`rows` `[R]`, distinct; R 0:
        every row, `rows` None); `score`: also the log-probabilities of `targets`
        `[R, T]` (the next prompt token after each position, -1: none) and whether each
        is the greedy choice. `narrow`: ((paged size, pages), ...): those page tables
        cut to their first `pages` columns (a global cache's rows that hold no more:
        the attention gathers and reads only those). A token -1 is the row's last drawn
        (`last` `[B]`, kept on the device, so a step can be dispatched before the one
        before it is read)."""
        graphdef = self.graphdef
        widths = dict(narrow)

        def run(params, cache, seen, counts, last, rows, tokens, n_new, length, tables,
                sampling, positions, samples, targets):
            model = nnx.merge(graphdef, params)
            whole, slots = cache, jnp.arange(tokens.shape[0]) if rows is None else rows
            tokens = jnp.where(tokens < 0, last[slots][:, None], tokens)
            if R:  # the rows' own states, tables, seen and counts
                axes = logical_axes(cache)
                cache = cache.replace(layers=jax.tree.map(
                    lambda x, names: _rows_of(x, names, rows), cache.layers, axes.layers))
                tables = {s: t[rows] for s, t in tables.items()}
                seen, all_counts, counts = seen[rows], counts, counts[rows]
            tables = {s: t[:, :widths.get(s, t.shape[1])] for s, t in tables.items()}
            cache = cache.replace(length=length, pages=cache.pages.replace(tables=tables))
            logits, cache = model.step(tokens, cache, n_new, all_logits=score)
            scored = None
            if score:
                logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
                at = jnp.maximum(targets, 0)[..., None]
                scored = (jnp.take_along_axis(logp, at, axis=-1)[..., 0],
                          jnp.argmax(logits, axis=-1) == targets)
                at_last = jnp.maximum(n_new - 1, 0)[:, None, None]
                logits = jnp.take_along_axis(logits, at_last, axis=1)
            sampled = sample_rows(logits[:, 0], sampling, positions, seen, counts,
                                  num_logprobs=num_logprobs)
            counts = counts.at[jnp.arange(tokens.shape[0]), sampled.tokens].add(
                samples.astype(jnp.int32))
            last = drawn(last, slots, samples, sampled.tokens)
            if R:  # back into the whole cache: per-row states by row, pools as they are
                cache = whole.replace(layers=jax.tree.map(
                    lambda x, new, names: _set_rows(x, new, names, rows),
                    whole.layers, cache.layers, axes.layers))
                counts = all_counts.at[rows].set(counts)
            cache = cache.replace(pages=whole.pages)  # its shapes as they came, whatever width
            cache, _, counts = placed(cache, None, counts)
            return sampled, scored, cache, counts, shard(last, ("batch",))

        return jax.jit(run, donate_argnums=(1, 3, 4))


    @functools.lru_cache(maxsize=64)
    def ragged(self, R: int, C: int, num_logprobs: int, narrow: tuple = ()):
        """The ragged step: R * C + B tokens, one a row of the model's step (`tokens`,
        their cache rows `slot_of`, `position`s and whether each is `valid`): R runs of
        C prompt tokens of one sequence each (`Paged.runs`: their pages read once), then
        one token for each of the cache's B rows (a decoding row's last; padding for
        the others). The dense layers take them all at once (their weights read once a
        step), the head only rows `picks` `[R + B]` (each run's last real token, then
        each row's), sampled as rows `pick_slots` of the cache. Pools only: no per-row
        state. `narrow` and `last` as `step`'s."""
        graphdef = self.graphdef
        widths = dict(narrow)

        def run(params, cache, seen, counts, last, tokens, slot_of, position, valid, tables,
                sampling, picks, pick_slots, after, samples):
            model = nnx.merge(graphdef, params)
            tokens = jnp.where(tokens < 0, last[slot_of], tokens)
            tables = {s: t[slot_of, :widths.get(s, t.shape[1])] for s, t in tables.items()}
            ragged = cache.replace(length=position,
                                   pages=cache.pages.replace(tables=tables, runs=(R, C)))
            logits, new = model.step(tokens[:, None], ragged, valid.astype(jnp.int32),
                                     logits_at=picks)
            sampled = sample_rows(logits[:, 0], sampling, after, seen[pick_slots],
                                  counts[pick_slots], num_logprobs=num_logprobs)
            counts = counts.at[pick_slots, sampled.tokens].add(samples.astype(jnp.int32))
            cache, _, counts = placed(cache.replace(layers=new.layers), None, counts)
            return sampled, cache, counts, shard(drawn(last, pick_slots, samples, sampled.tokens),
                                                 ("batch",))

        return jax.jit(run, donate_argnums=(1, 3, 4))


def drawn(last, slots, samples, tokens):
    """`last` `[B]` (each row's last drawn token, what a step takes for a token given as
    -1) with `tokens` put at rows `slots` where `samples` (a row's other picks are not)."""
    return last.at[jnp.where(samples, slots, last.shape[0])].set(tokens, mode="drop")


def _rows_of(x, names, rows):
    """Rows `rows` of a per-row state (a leaf with a batch axis); other leaves whole."""
    axis = _row_axis(names)
    return x if axis is None else jnp.take(x, rows, axis=axis)


def _set_rows(x, new, names, rows):
    """`x` with rows `rows` from `new` (a per-row state), or `new` (a pool)."""
    axis = _row_axis(names)
    if axis is None:
        return new
    moved = jnp.moveaxis(x, axis, 0)
    return jnp.moveaxis(moved.at[rows].set(jnp.moveaxis(new, axis, 0)), 0, axis)


def _row_axis(names) -> int | None:
    return names.index("batch") if "batch" in names else None


def placed(cache, seen, counts):
    """The engine's state constrained to the shardings its logical axes map to under
    the active rules (none without a mesh): every program returns it so, and the engine
    places it so at the start, so no program compiles again for a new input sharding."""
    axes = logical_axes(cache)
    cache = jax.tree.map(lambda x, names: x if x is None else shard(x, names), cache, axes,
                         is_leaf=lambda x: x is None)
    rows = lambda x: None if x is None else shard(x, ("batch", None))  # noqa: E731
    return cache, rows(seen), rows(counts)


def state_shardings(cache, mesh, rules) -> tuple:
    """The shardings `placed` gives the engine's state (cache, seen, counts; and the
    steps give `last`) on `mesh` under `rules`: where the engine puts it at the start,
    whatever devices it was made on."""
    on = lambda names: NamedSharding(mesh, logical_to_spec(names, rules))  # noqa: E731
    cache_shardings = jax.tree.map(lambda x, names: None if x is None else on(names), cache,
                                   logical_axes(cache), is_leaf=lambda x: x is None)
    return cache_shardings, on(("batch", None)), on(("batch", None)), on(("batch",))


def _reset_rows(cache, seen, counts, fresh, prompts):
    """Zero the per-row states of rows `fresh` `[B]`; their seen tokens are `prompts`
    `[B, L]` (-1: none), their counts zero."""
    axes = logical_axes(cache)

    def clear(x, names):
        axis = _row_axis(names)
        if axis is None:
            return x
        shape = [1] * x.ndim
        shape[axis] = x.shape[axis]
        return jnp.where(fresh.reshape(shape), jnp.zeros_like(x), x)

    layers = jax.tree.map(clear, cache.layers, axes.layers)
    B, V = seen.shape
    marks = jnp.zeros((B, V), bool).at[jnp.arange(B)[:, None],
                                       jnp.where(prompts >= 0, prompts, V)].set(True, mode="drop")
    seen = jnp.where(fresh[:, None], marks, seen)
    counts = jnp.where(fresh[:, None], 0, counts)
    return cache.replace(layers=layers), seen, counts


def _fork(cache, seen, counts, page_pairs: dict, row_pairs):
    """Copy pages (`page_pairs`: {pool page count: [M, 2] (src, dst)}) in every pool of
    that many pages, and rows (`row_pairs` `[R, 2]`) of every per-row state."""
    axes = logical_axes(cache)
    src, dst = row_pairs[:, 0], row_pairs[:, 1]

    def copy(x, names):
        axis = _row_axis(names)
        if axis is not None:
            return _copy_along(x, axis, src, dst)
        lead = sum(1 for n in names if n == "layers")
        pairs = page_pairs.get(x.shape[lead]) if x.ndim > lead else None
        if pairs is None:
            return x
        return _copy_along(x, lead, pairs[:, 0], pairs[:, 1])

    layers = jax.tree.map(copy, cache.layers, axes.layers)
    return (cache.replace(layers=layers), _copy_along(seen, 0, src, dst),
            _copy_along(counts, 0, src, dst))


def _copy_along(x, axis: int, src, dst):
    moved = jnp.moveaxis(x, axis, 0)
    return jnp.moveaxis(moved.at[dst].set(moved[src]), 0, axis)


def padded_pairs(pairs, n: int) -> np.ndarray:
    """The fork's `[n, 2]` int32 (src, dst) pairs, padded with (0, 0) (a copy of page or
    row 0 onto itself), so that one shape serves any number of pairs up to `n`."""
    a = np.zeros((max(n, len(pairs)), 2), np.int32)
    if pairs:
        a[:len(pairs)] = pairs
    return a
