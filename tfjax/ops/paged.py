"""Keys and values kept in pages: a pool of fixed-size pages and a page table per row.

`Paged(pool, table)`: `pool` `[P, page, ...]` (one layer's pages; `[P, page, K, H]` for
K or V), `table` `[B, n]` the page ids of each row's logical slots, row b's slot s held
at `pool[table[b, s // page], s % page]`. It stands for the `[B, n * page, ...]` array
it describes (`shape`, `dtype`), and `dot_product_attention` takes one as k and v: an
implementation that reads pages itself gets it as is, any other the gathered array
(`dense`). `write` puts a step's new entries into a pool by flat slot index
(`flat_index`). `paged_attention` (the "paged" implementation, CPU's first for paged
calls) reads the pages in plain JAX. An 8-bit cache's `Paged` (`tfjax.ops.kv_quant`)
has `scale` `[P, page, K]` and stands for the dequantized array. See docs/inference.md.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from tfjax.ops import kv_quant
from tfjax.ops import masks as masks_lib
from tfjax.ops.implementation import AttentionRequest, Implementation
from tfjax.ops.tiles import logit_scaling, logits

__all__ = ["DROPPED", "IMPLEMENTATION", "Paged", "dense", "flat_index", "paged_attention",
           "supports", "write"]

DROPPED = jnp.iinfo(jnp.int32).max  # a flat index past every pool: the write is dropped


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Paged:
    """`[B, n * page, ...]` entries stored as `pool` `[P, page, ...]` and `table` `[B, n]`
    (`scale` `[P, page, K]`: an 8-bit pool's scales, dequantized as read)."""

    pool: jax.Array
    table: jax.Array
    scale: jax.Array | None = None

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
        return self.pool.dtype if self.scale is None else self.scale.dtype

    def dense(self) -> jax.Array:
        """The gathered `[B, n * page, ...]` array (what the table describes). A K or V
        pool `[P, page, K, H]` is read heads-major, as `write` writes it: the swaps
        cancel against the stored layout, so XLA gathers the rows' pages from the
        stored pool (a gather from the view transposed the whole pool every step)."""
        if self.pool.ndim == 4:
            rows = jnp.take(jnp.swapaxes(self.pool, 1, 2), self.table, axis=0)  # [B,n,K,pg,H]
            rows = jnp.swapaxes(rows, 2, 3).reshape(self.shape)
        else:
            rows = jnp.take(self.pool, self.table, axis=0).reshape(self.shape)
        if self.scale is None:
            return rows
        scales = jnp.take(self.scale, self.table, axis=0).reshape(self.shape[:-1])
        return kv_quant.dequantize(rows, scales, self.scale.dtype)


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


def paged_attention(q, k: Paged, v: Paged, mask: masks_lib.Mask | None = None, *, scale=None,
                    softcap=None, q_offset=0, kv_offset=0, return_lse: bool = False):
    """q `[B,T,N,H]` over `Paged` k and v (pools `[P, page, K, H]`, `[P, page, K, Hv]`,
    one table `[B, n]`) under `mask` -> out `[B,T,N,Hv]` (and lse `[B,N,T]` fp32): the
    reference's attention on the arrays the pages stand for, fully masked rows zero.

    For XLA on CPU: each row's pages are gathered from the heads-major pools as the
    cache stores them, a page a contiguous `[K, page, H]` slice (gathering `dense`'s
    `[B, S, K, H]`, which the dots then want heads-major again, moved every element
    twice), and the T queries are not padded to a tile (blockwise pads a decode step's
    one query to 8): one einsum for the logits, one for the output."""
    B, T, N, H = q.shape
    _, page, K, _ = k.pool.shape
    n = k.table.shape[1]
    G, Hv = N // K, v.pool.shape[-1]
    scale, softcap = logit_scaling(H, scale, softcap)
    def pages(x):  # [B, n, K, page, H]: ids are valid pages
        rows = jnp.take(jnp.swapaxes(x.pool, 1, 2), x.table, axis=0, mode="clip")
        if x.scale is None:
            return rows
        scales = jnp.take(jnp.swapaxes(x.scale, 1, 2), x.table, axis=0, mode="clip")
        return kv_quant.dequantize(rows, scales, q.dtype)  # an 8-bit pool, read

    s = jnp.einsum("btkgh,bnksh->bkgtns", q.reshape(B, T, K, G, H), pages(k),
                   preferred_element_type=jnp.float32)
    s, _ = logits(s, scale, softcap)
    allowed = masks_lib.dense(mask, T, n * page, q_offset=q_offset, kv_offset=kv_offset)
    s = jnp.where(allowed.reshape(-1, 1, 1, T, n, page), s, -jnp.inf)
    row_max = jnp.max(s, axis=(4, 5), keepdims=True)
    row_max = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    p = jnp.exp(s - row_max)
    denom = jnp.sum(p, axis=(4, 5))  # [B, K, G, T]
    out = jnp.einsum("bkgtns,bnksh->btkgh", p, pages(v), preferred_element_type=jnp.float32)
    scale_out = jnp.moveaxis(jnp.where(denom > 0, denom, 1.0), 3, 1)[..., None]  # [B,T,K,G,1]
    out = (out / scale_out).reshape(B, T, N, Hv).astype(q.dtype)
    if not return_lse:
        return out
    safe = jnp.where(denom > 0, denom, 1.0)
    lse = jnp.where(denom > 0, jnp.log(safe) + row_max[..., 0, 0], -jnp.inf)
    return out, lse.reshape(B, N, T)


def supports(r: AttentionRequest) -> str | None:
    if not r.paged:
        return "reads K/V from pages (tfjax.ops.paged.Paged); this call's k and v are arrays"
    if r.has_alibi or r.has_bias:
        return ("takes no additive bias, ALiBi or T5's relative bias (the other "
                "implementations take them on the gathered pages)")
    if len(r.k_shape) != 4:
        return f"reads K/V pools of [P, page, K, H] pages, got k of shape {r.k_shape}"
    return None


def _impl(q, k, v, mask, *, bias, alibi, scale, softcap, q_offset, kv_offset, return_lse):
    del bias, alibi  # refused by `supports`
    return paged_attention(q, k, v, mask, scale=scale, softcap=softcap, q_offset=q_offset,
                           kv_offset=kv_offset, return_lse=return_lse)


IMPLEMENTATION = Implementation(_impl, supports, paged=True)
