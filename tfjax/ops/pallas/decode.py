"""Decode-shaped requests: query heads packed into rows, keys split across programs.

Packing: with GQA the G query heads of a kv head become rows of one query, q
`[B, T, N, H]` -> `[B, T*G, K, H]` (row `t*G + g` is token t of head `k*G + g`), so each
kv head's K/V is streamed once, not G times (`pack_query`, `pack_mask`, `unpack_out`,
`unpack_lse`; by default for T*G <= `PACK_ROWS`). Splitting (Flash-Decoding): keys
`[B, S, K, H]` -> `[B*P, S/P, K, H]`, the P partial results merged by their
logsumexps, exact for gradients too (`split_keys`, `merge_splits`, `auto_kv_splits`).
`unpackable_reason` / `unsplittable_reason` say what cannot be rewritten.
See docs/kernels.md.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from tfjax.ops import masks as M

__all__ = ["PACK_ROWS", "SPLIT_MIN_KEYS", "packable", "unpackable_reason", "unsplittable_reason",
           "auto_kv_splits", "pack_mask", "pack_query", "pack_bias", "unpack_out", "unpack_lse",
           "split_keys", "merge_splits"]

# Pack while T * G fits one query tile of the kernels' default tiles.
PACK_ROWS = 128
# Keys per chunk at least when splitting by default (a chunk is 8 of the GPU
# kernels' 64-key tiles: below that the merge's reads weigh against the kernel's).
SPLIT_MIN_KEYS = 512


def _data_indexed(m) -> bool:
    if m is None or isinstance(m, (M.Positions, M.Segments, M.Padding)):
        return True
    if isinstance(m, (M.And, M.Or)):
        return _data_indexed(m.a) and _data_indexed(m.b)
    return False


def _mask_reason(mask) -> str | None:
    if _data_indexed(mask):
        return None
    return (f"a {type(mask).__name__} mask reads positions from the row and key indices (masks "
            "that index by data do: Positions, Segments, Padding)")


# --------------------------------------------------------------------------- #
# Packing the query heads of a kv head.
# --------------------------------------------------------------------------- #


def unpackable_reason(mask, *, alibi_slopes=None, relative_bias=None) -> str | None:
    """None when the query heads of this request can be packed, else why not."""
    if alibi_slopes is not None:
        return "ALiBi's slopes are per query head"
    if relative_bias is not None:
        return "T5's bias table is per query head"
    return _mask_reason(mask)


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
    raise ValueError(f"pack_mask: {_mask_reason(m)}")


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


# --------------------------------------------------------------------------- #
# Splitting the keys into chunks folded into the batch.
# --------------------------------------------------------------------------- #


def unsplittable_reason(mask, *, alibi_slopes=None, alibi_positions=None,
                        relative_bias=None) -> str | None:
    """None when this request's keys can be split into chunks, else why not."""
    if relative_bias is not None:
        return "T5's bias reads key positions from the key index"
    if alibi_slopes is not None and (alibi_positions is None or alibi_positions[1] is None):
        return "ALiBi at index positions reads key positions from the key index (pass " \
               "alibi_positions)"
    return _mask_reason(mask)


def auto_kv_splits(B: int, heads: int, T: int, S: int, block_q: int, sms: int) -> int:
    """Chunks that give a grid of B x heads x ceil(T / bq) programs two per SM
    (at most S / SPLIT_MIN_KEYS chunks, a divisor of S; 1: no split)."""
    bq = max(16, min(block_q, 1 << max(T - 1, 0).bit_length()))
    programs = B * heads * -(-T // bq)
    if programs >= 2 * sms:
        return 1
    P = min(-(-2 * sms // programs), S // SPLIT_MIN_KEYS)
    while P > 1 and S % P:
        P -= 1
    return max(P, 1)


def _batch(x, B: int):
    x = jnp.asarray(x)
    return jnp.broadcast_to(x, (B, *x.shape[1:]))


def _cut(x, B: int, P: int):
    """Per-key `[B|1, S, ...]` -> `[B*P, S/P, ...]` (row b*P + c: chunk c of row b)."""
    x = _batch(x, B)
    return x.reshape(B * P, x.shape[1] // P, *x.shape[2:])


def _rows(x, B: int, P: int):
    """Per-example `[B|1, ...]` -> `[B*P, ...]` (each row repeated for its chunks)."""
    return jnp.repeat(_batch(x, B), P, axis=0)


def _split_mask(m, B: int, P: int, L: int):
    if m is None:
        return None
    if isinstance(m, M.Positions):
        return type(m)(_rows(m.q_positions, B, P), _cut(m.kv_positions, B, P), m.window)
    if isinstance(m, M.Segments):
        return M.Segments(_rows(m.q_segment_ids, B, P), _cut(m.kv_segment_ids, B, P))
    if isinstance(m, M.Padding):  # key j of chunk c is key c*L + j: c*L fewer remain
        left = _batch(m.kv_lengths, B)[:, None] - L * jnp.arange(P, dtype=jnp.int32)
        return M.Padding(left.reshape(B * P))
    if isinstance(m, (M.And, M.Or)):
        return type(m)(_split_mask(m.a, B, P, L), _split_mask(m.b, B, P, L))
    raise ValueError(f"split_keys: {_mask_reason(m)}")


def split_keys(P: int, q, k, v, mask, bias, alibi_slopes, alibi_positions):
    """Fold P chunks of the keys into the batch: (q, k, v, mask, bias, slopes,
    positions) with batch B*P and S/P keys (S % P == 0)."""
    B, S = k.shape[:2]
    L = S // P
    if bias is not None:  # [B|1, N|1, T, S] -> [B*P, N|1, T, S/P]
        b = _batch(bias, B)
        bias = b.reshape(*b.shape[:3], P, L).transpose(0, 3, 1, 2, 4).reshape(B * P, *b.shape[1:3], L)
    if alibi_slopes is not None and jnp.ndim(alibi_slopes) == 2:
        alibi_slopes = _rows(alibi_slopes, B, P)
    if alibi_positions is not None:
        qp, kp = alibi_positions
        alibi_positions = (None if qp is None else _rows(qp, B, P), _cut(kp, B, P))
    return (_rows(q, B, P), _cut(k, B, P), _cut(v, B, P), _split_mask(mask, B, P, L), bias,
            alibi_slopes, alibi_positions)


def merge_splits(out, lse, P: int):
    """Merge the chunks' normalised outputs `[B*P, T, N, H]` and logsumexps
    `[B*P, N, T]` (fp32) into `[B, T, N, H]` (out's dtype) and `[B, N, T]`. Rows no
    chunk lets see a key get zeros and -inf."""
    BP, T, N, H = out.shape
    B = BP // P
    lse = lse.reshape(B, P, N, T)
    m = lax.stop_gradient(lse.max(axis=1, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp(lse - m)  # [B, P, N, T]; 0 for a chunk with no visible key
    total = w.sum(axis=1)  # [B, N, T]
    seen = total > 0
    safe = jnp.where(seen, total, 1.0)
    w = w / safe[:, None]
    o = jnp.einsum("BPNT,BPTNH->BTNH", w, out.reshape(B, P, T, N, H).astype(jnp.float32))
    lse_out = jnp.where(seen, m[:, 0] + jnp.log(safe), -jnp.inf)
    return o.astype(out.dtype), lse_out
