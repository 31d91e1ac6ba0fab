"""Keys and values kept in pages: a pool of fixed-size pages and a page table per row.

`Paged(pool, table)`: `pool` `[P, page, ...]` (one layer's pages; `[P, page, K, H]` for
K or V), `table` `[B, n]` the page ids of each row's logical slots, row b's slot s held
at `pool[table[b, s // page], s % page]`. It stands for the `[B, n * page, ...]` array it
describes, and `dot_product_attention` takes one as k and v: an implementation that
reads pages gets it as is, any other the gathered array (`dense`). `write` puts a step's
new entries into a pool by flat slot index (`flat_index`). `paged_attention` (the
"paged" implementation, CPU's first for paged calls) reads the pages in plain JAX, runs
of one sequence (`runs`, the engine's ragged step) together. An 8-bit cache's `Paged`
(`tfjax.ops.kv_quant`) has `scale` `[P, page, K]`. See docs/inference.md.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from tfjax.ops import kv_quant
from tfjax.ops import masks as masks_lib
from tfjax.ops.implementation import AttentionRequest, Implementation
from tfjax.ops.tiles import logit_scaling, logits

__all__ = ["DROPPED", "IMPLEMENTATION", "Paged", "by_runs", "dense", "flat_index",
           "paged_attention", "split_runs", "supports", "write", "write_entries"]

DROPPED = jnp.iinfo(jnp.int32).max  # a flat index past every pool: the write is dropped


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Paged:
    """`[B, n * page, ...]` entries stored as `pool` `[P, page, ...]` and `table` `[B, n]`
    (`scale` `[P, page, K]`: an 8-bit pool's scales, dequantized as read)."""

    pool: jax.Array
    table: jax.Array
    scale: jax.Array | None = None
    # (R, C): rows [0, R*C) are R runs of C rows of one sequence (equal table rows, one
    # query each); `paged_attention` reads each run's pages once, its C queries together
    runs: tuple = dataclasses.field(default=(), metadata=dict(static=True))

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
    (`DROPPED` entries are not written), in place (`write_entries`)."""
    page = pool.shape[1]
    flat = index.reshape(-1)
    pages, offsets = flat // page, flat % page  # DROPPED // page is past every pool
    new = new.reshape(-1, *new.shape[2:]).astype(pool.dtype)
    return write_entries(pool, pages, offsets, new, mode="drop")


def write_entries(x: jax.Array, first: jax.Array, second: jax.Array, new: jax.Array,
                  **kw) -> jax.Array:
    """`x` `[A, S, ...]` with `new[n]` at `x[first[n], second[n]]` (`kw`: `.at[].set`'s).
    A 4-D `x` (K or V: a pool `[P, page, K, H]`, a cache's slots `[B, S, K, H]`) is
    written with axes 1 and 2 swapped and back: it is a view of the heads-major array
    the cache stores, so the swaps cancel and XLA scatters into it in place (a scatter
    into the view made XLA:CPU copy each K and V out and back, every step)."""
    if x.ndim == 4:
        return jnp.swapaxes(jnp.swapaxes(x, 1, 2).at[first, :, second].set(new, **kw), 1, 2)
    return x.at[first, second].set(new, **kw)


def paged_attention(q, k: Paged, v: Paged, mask: masks_lib.Mask | None = None, *, scale=None,
                    softcap=None, q_offset=0, kv_offset=0, return_lse: bool = False):
    """q `[B,T,N,H]` over `Paged` k and v (pools `[P, page, K, H]`, `[P, page, K, Hv]`,
    one table `[B, n]`) under `mask` -> out `[B,T,N,Hv]` (and lse `[B,N,T]` fp32): the
    reference's attention on the arrays the pages stand for, fully masked rows zero.
    With `runs` (R, C) (T is 1), the first R * C rows are attended as R rows of C
    queries over their run's pages (gathered once), the rest as rows of one query.

    For XLA on CPU, the pages are gathered in the layout both dots take as they are:
    `[B, K, n, page, H]`, one `[page, H]` block per (row, kv head, page) from the
    heads-major pool seen as `[P * K, page, H]` (a free reshape of how the cache
    stores it), so no relayout follows the gather (gathering `[B, n, K, page, H]`
    and letting the dots move K forward copied every gathered element again, a
    third of the decode step's time). The logits are keys x queries (`[.., S, G*T]`:
    the keys the dot's left operand, rows over S and H minor, as XLA:CPU's dot
    wants them); the query heads of a kv head and the T queries are one dimension,
    and T is not padded to a tile (blockwise pads a decode step's one query to 8)."""
    B, T, N, H = q.shape
    S = k.table.shape[1] * k.pool.shape[1]
    allowed = masks_lib.dense(mask, T, S, q_offset=q_offset, kv_offset=kv_offset)  # [B|1,T,S]
    kw = dict(scale=scale, softcap=softcap)
    if not k.runs:
        out, lse = _attend(q, k.pool, v.pool, k.scale, v.scale, k.table, allowed, **kw)
        return (out, lse) if return_lse else out
    R, C = k.runs
    if T != 1 or R * C > B:
        raise ValueError(f"paged_attention: runs {k.runs} need one query a row and at least "
                         f"{R * C} rows, got q of shape {q.shape}")
    allowed = jnp.broadcast_to(allowed, (B, 1, S))  # per query: any mask
    first, rest = slice(0, R * C), slice(R * C, B)
    out, lse = _joined(
        _attend(q[first].reshape(R, C, N, H), k.pool, v.pool, k.scale, v.scale,
                k.table[:R * C:C], allowed[first].reshape(R, C, S), **kw),
        _attend(q[rest], k.pool, v.pool, k.scale, v.scale, k.table[rest], allowed[rest], **kw))
    return (out, lse) if return_lse else out


def _attend(q, k_pool, v_pool, k_scale, v_scale, table, allowed, *, scale, softcap):
    """`paged_attention` of q `[B,T,N,H]` over the pages of `table` `[B, n]` under the
    dense mask `allowed` `[B|1, T, S]` -> (out `[B,T,N,Hv]`, lse `[B,N,T]`)."""
    B, T, N, H = q.shape
    _, page, K, _ = k_pool.shape
    n = table.shape[1]
    G, Hv = N // K, v_pool.shape[-1]
    S = n * page
    scale, softcap = logit_scaling(H, scale, softcap)
    blocks = (table[:, None, :] * K + jnp.arange(K, dtype=table.dtype)[None, :, None])

    def pages(pool, pool_scale, dtype):  # [B, K, S, H]: ids are valid pages
        flat = jnp.swapaxes(pool, 1, 2).reshape(-1, page, pool.shape[-1])
        rows = jnp.take(flat, blocks, axis=0, mode="clip").reshape(B, K, S, -1)
        if pool_scale is None:
            return rows.astype(dtype)
        scales = jnp.swapaxes(pool_scale, 1, 2).reshape(-1, page)  # an 8-bit pool, read
        scales = jnp.take(scales, blocks, axis=0, mode="clip").reshape(B, K, S)
        return kv_quant.dequantize(rows, scales, dtype)

    k_dtype = k_pool.dtype if k_scale is None else k_scale.dtype
    dtype = jnp.promote_types(q.dtype, k_dtype)  # as an einsum of the two would compute
    queries = jnp.moveaxis(q.reshape(B, T, K, G, H), 1, 3).reshape(B, K, G * T, H)
    s = jax.lax.dot_general(pages(k_pool, k_scale, dtype), queries.astype(dtype),
                            (((3,), (3,)), ((0, 1), (0, 1))),
                            preferred_element_type=jnp.float32)  # [B, K, S, G*T]
    s = s.reshape(B, K, S, G, T)
    s, _ = logits(s, scale, softcap)
    s = jnp.where(jnp.swapaxes(allowed, 1, 2)[:, None, :, None, :], s, -jnp.inf)
    row_max = jnp.max(s, axis=2, keepdims=True)  # [B, K, 1, G, T]
    row_max = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    p = jnp.exp(s - row_max)
    denom = jnp.sum(p, axis=2)  # [B, K, G, T]
    p = jnp.moveaxis(p, 2, -1).reshape(B, K, G * T, S)  # the weights the left operand
    out = jax.lax.dot_general(p, pages(v_pool, v_scale, p.dtype),
                              (((3,), (2,)), ((0, 1), (0, 1))),
                              preferred_element_type=jnp.float32)  # [B, K, G*T, Hv]
    out = jnp.moveaxis(out.reshape(B, K, G, T, Hv), 3, 1)  # [B, T, K, G, Hv]
    scale_out = jnp.moveaxis(jnp.where(denom > 0, denom, 1.0), 3, 1)[..., None]  # [B,T,K,G,1]
    out = (out / scale_out).reshape(B, T, N, Hv).astype(q.dtype)
    safe = jnp.where(denom > 0, denom, 1.0)
    lse = jnp.where(denom > 0, jnp.log(safe) + row_max[:, :, 0], -jnp.inf)
    return out, lse.reshape(B, N, T)


def split_runs(x: Paged, mask: masks_lib.Positions) -> tuple:
    """A ragged call's two parts (`x.runs` (R, C), one query a row), each (its query
    rows, a slice; `x` on their table rows; their mask): the runs, read as R rows of C
    queries over their run's table row and the slot positions of its last row (the
    longest: slots past a query's position are masked by it); then the single rows."""
    R, C = x.runs
    first, rest = slice(0, R * C), slice(R * C, x.table.shape[0])
    q_pos, kv_pos, window = mask.q_positions, mask.kv_positions, mask.window
    runs = (first, dataclasses.replace(x, table=x.table[0:R * C:C], runs=()),
            masks_lib.positions(q_pos[first].reshape(R, C), kv_pos[C - 1:R * C:C],
                                window=window))
    single = (rest, dataclasses.replace(x, table=x.table[rest], runs=()),
              masks_lib.positions(q_pos[rest], kv_pos[rest], window=window))
    return runs, single


def by_runs(attend, q, k: Paged, v: Paged, mask: masks_lib.Positions, **kw):
    """A ragged call (`k.runs` (R, C), one query a row) as two calls of `attend(q, k, v,
    mask, return_lse=True, **kw)` -> (out, lse) on plain `Paged`, one for each part of
    `split_runs`: the runs as R rows of C queries, then the single rows."""
    R, C = k.runs
    (first, k_runs, runs_mask), (rest, k_single, single_mask) = split_runs(k, mask)
    on = lambda part: dataclasses.replace(v, table=part.table, runs=())  # noqa: E731
    runs = attend(q[first].reshape(R, C, *q.shape[2:]), k_runs, on(k_runs), runs_mask,
                  return_lse=True, **kw)
    single = attend(q[rest], k_single, on(k_single), single_mask, return_lse=True, **kw)
    return _joined(runs, single)


def _joined(runs, single):
    """(out, lse) of a ragged call from its runs' `[R, C, ...]` and single rows'."""
    (out1, lse1), (out2, lse2) = runs, single
    R, C = out1.shape[:2]
    out = jnp.concatenate([out1.reshape(R * C, 1, *out1.shape[2:]), out2])
    lse1 = jnp.swapaxes(lse1, 1, 2).reshape(R * C, -1, 1)  # [R, N, C] -> a row per query
    return out, jnp.concatenate([lse1, lse2])


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
