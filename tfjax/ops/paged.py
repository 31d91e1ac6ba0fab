"""Keys and values kept in pages: a pool of fixed-size pages and a page table per row.

`Paged(pool, table)`: `pool` `[P, page, ...]` (one layer's pages; `[P, page, K, H]` for
K or V), `table` `[B, n]` the page ids of each row's logical slots, row b's slot s held
at `pool[table[b, s // page], s % page]`. It stands for the `[B, n * page, ...]` array
it describes (`shape`, `dtype`), and `dot_product_attention` takes one as k and v: an
implementation that reads pages itself gets it as is, any other the gathered array
(`dense`). `write` puts a step's new entries into a pool by flat slot index
(`flat_index`). See docs/inference.md ("The engine").
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

__all__ = ["DROPPED", "Paged", "dense", "flat_index", "write"]

DROPPED = jnp.iinfo(jnp.int32).max  # a flat index past every pool: the write is dropped


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Paged:
    """`[B, n * page, ...]` entries stored as `pool` `[P, page, ...]` and `table` `[B, n]`."""

    pool: jax.Array
    table: jax.Array

    @property
    def page_size(self) -> int:
        return self.pool.shape[1]

    @property
    def shape(self) -> tuple[int, ...]:
        B, n = self.table.shape
        return (B, n * self.page_size, *self.pool.shape[2:])

    @property
    def ndim(self) -> int:
        return self.pool.ndim

    @property
    def dtype(self):
        return self.pool.dtype

    def dense(self) -> jax.Array:
        """The gathered `[B, n * page, ...]` array (what the table describes). A K or V
        pool `[P, page, K, H]` is read heads-major, as `write` writes it: the swaps
        cancel against the stored layout, so XLA gathers the rows' pages from the
        stored pool (a gather from the view transposed the whole pool every step)."""
        if self.pool.ndim == 4:
            rows = jnp.take(jnp.swapaxes(self.pool, 1, 2), self.table, axis=0)  # [B,n,K,pg,H]
            return jnp.swapaxes(rows, 2, 3).reshape(self.shape)
        return jnp.take(self.pool, self.table, axis=0).reshape(self.shape)


def dense(x):
    """`x` itself, or a `Paged`'s gathered array."""
    return x.dense() if isinstance(x, Paged) else x


def flat_index(table: jax.Array, slots: jax.Array, page_size: int,
               valid: jax.Array | None = None) -> jax.Array:
    """Flat pool indices `[B, T]` (page id * page_size + offset) of logical `slots`
    `[B, T]` of the rows of `table` `[B, n]`; `DROPPED` where not `valid`."""
    page = jnp.take_along_axis(table, slots // page_size, axis=1)
    index = page * page_size + slots % page_size
    return index if valid is None else jnp.where(valid, index, DROPPED)


def write(pool: jax.Array, index: jax.Array, new: jax.Array) -> jax.Array:
    """`pool` `[P, page, ...]` with `new` `[B, T, ...]` written at flat `index` `[B, T]`
    (`DROPPED` entries are not written). A K or V pool `[P, page, K, H]` is written
    heads-major, `[P, K, page, H]`: it is a view of the pages as the KV cache stores
    them, so the swaps cancel and XLA scatters into the stored pages in place (a
    flat scatter into the view made it copy both pools, twice, every step)."""
    page = pool.shape[1]
    flat = index.reshape(-1)
    pages, offsets = flat // page, flat % page  # DROPPED // page is past every pool
    new = new.reshape(-1, *new.shape[2:]).astype(pool.dtype)
    if pool.ndim == 4:
        heads = jnp.swapaxes(pool, 1, 2).at[pages, :, offsets].set(new, mode="drop")
        return jnp.swapaxes(heads, 1, 2)
    return pool.at[pages, offsets].set(new, mode="drop")
