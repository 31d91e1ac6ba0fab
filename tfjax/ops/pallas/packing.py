"""Decode-shaped requests: the G query heads of a kv head packed into one head's rows.

A flash kernel's program holds one query head's tile of `bq` rows and streams its
kv head's K/V through it. With GQA a decode step (T = 1, or a few speculative
tokens) fills one row of that tile per query head, and each of the G query heads
of a kv head streams the same K/V again: G times the reads of the cache, the
quantity that bounds decoding. Packed, the G heads become rows of one kv head's
query: q `[B, T, N, H]` -> `[B, T*G, K, H]` (row `t*G + g` is token t of head
`k*G + g`), so each kv head's K/V is streamed once, for T*G rows (the layout of
decode kernels such as FlashInfer's and jax's ragged paged attention).

Only masks that index queries by data can follow the rows (their per-query arrays
are repeated G times): `Positions` (a KV cache's mask), `Segments`, key-only
`Padding`, and `&` / `|` of those. A positional mask (causal, windows by index)
reads the row index as the query position, and ALiBi's slopes and T5's table are
per query head, so requests with them are not packed (they run as they are).
"""

from __future__ import annotations

import jax.numpy as jnp

from tfjax.ops import masks as M

__all__ = ["PACK_ROWS", "packable", "unpackable_reason", "pack_mask", "pack_query", "pack_bias", "unpack_out",
           "unpack_lse"]

# Pack while T * G fits one query tile of the kernels' default tiles.
PACK_ROWS = 128


def _mask_packable(m) -> bool:
    if m is None or isinstance(m, (M.Positions, M.Segments, M.Padding)):
        return True
    if isinstance(m, (M.And, M.Or)):
        return _mask_packable(m.a) and _mask_packable(m.b)
    return False


def unpackable_reason(mask, *, alibi_slopes=None, relative_bias=None) -> str | None:
    """None when the query heads of this request can be packed, else why not."""
    if alibi_slopes is not None:
        return "ALiBi's slopes are per query head"
    if relative_bias is not None:
        return "T5's bias table is per query head"
    if not _mask_packable(mask):
        return (f"a {type(mask).__name__} mask reads query positions from the row index (masks "
                "that index queries by data pack: Positions, Segments, Padding)")
    return None


def packable(q_shape, k_shape, mask, *, alibi_slopes=None, relative_bias=None) -> bool:
    """Whether `flash_attention` packs this request's query heads by default: GQA
    (G > 1), T * G <= PACK_ROWS, and `unpackable_reason` is None."""
    T, N = q_shape[1], q_shape[2]
    G = N // k_shape[2]
    return G > 1 and T * G <= PACK_ROWS and unpackable_reason(
        mask, alibi_slopes=alibi_slopes, relative_bias=relative_bias) is None


def pack_mask(m, G: int):
    """The mask of the packed rows: per-query arrays repeated G times."""
    if m is None or isinstance(m, M.Padding):
        return m
    if isinstance(m, M.Positions):
        return type(m)(jnp.repeat(m.q_positions, G, axis=1), m.kv_positions, m.window)
    if isinstance(m, M.Segments):
        return M.Segments(jnp.repeat(m.q_segment_ids, G, axis=1), m.kv_segment_ids)
    if isinstance(m, (M.And, M.Or)):
        return type(m)(pack_mask(m.a, G), pack_mask(m.b, G))
    raise ValueError(f"pack_mask: a {type(m).__name__} mask cannot follow packed query heads")


def pack_query(q, K: int):
    """`[B, T, N, H]` -> `[B, T*G, K, H]`, row t*G + g from head k*G + g."""
    B, T, N, H = q.shape
    G = N // K
    return q.reshape(B, T, K, G, H).transpose(0, 1, 3, 2, 4).reshape(B, T * G, K, H)


def pack_bias(bias, K: int, G: int):
    """`[B|1, N|1, T, S]` -> `[B|1, K|1, T*G, S]`."""
    if bias is None:
        return None
    Bb, Nb, T, S = bias.shape
    if Nb == 1:
        return jnp.repeat(bias, G, axis=2)
    return bias.reshape(Bb, K, G, T, S).transpose(0, 1, 3, 2, 4).reshape(Bb, K, T * G, S)


def unpack_out(out, G: int):
    """`[B, T*G, K, H]` -> `[B, T, N, H]`."""
    B, TG, K, H = out.shape
    T = TG // G
    return out.reshape(B, T, G, K, H).transpose(0, 1, 3, 2, 4).reshape(B, T, K * G, H)


def unpack_lse(lse, G: int):
    """`[B, K, T*G]` -> `[B, N, T]`."""
    B, K, TG = lse.shape
    T = TG // G
    return lse.reshape(B, K, T, G).transpose(0, 1, 3, 2).reshape(B, K * G, T)
