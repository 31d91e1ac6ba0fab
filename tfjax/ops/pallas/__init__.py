"""Pallas attention kernels (`implementation="pallas"`).

`flash_attention(q, k, v, mask, ...)` dispatches to the TPU (Mosaic) kernels on
TPU and on CPU (interpret mode), and to the GPU (Triton) kernels on GPU; both
evaluate T5's `relative_bias` per tile. Decode-shaped requests are rewritten
first (`decode.py`): GQA query heads packed as rows, and on GPU the keys split
into chunks when the grid is small.
"""

from __future__ import annotations

from tfjax.ops.attention import AUTO_ORDER, AttentionRequest, register_implementation
from tfjax.ops.pallas import decode
from tfjax.ops.pallas.common import BlockSizes, mask_support
from tfjax.ops.reference import Alibi, RelativeBias
from tfjax.ops.pallas.tpu import flash_attention_tpu

__all__ = ["BlockSizes", "flash_attention", "flash_attention_tpu", "supports"]


def flash_attention(q, k, v, mask=None, *, bias=None, scale=None, softcap=None,
                    alibi_slopes=None, alibi_positions=None,
                    relative_bias: RelativeBias | None = None, q_offset=0, kv_offset=0,
                    return_lse=False, block_sizes: BlockSizes | None = None, interpret=None,
                    pack_heads: bool | None = None, kv_splits: int | None = None):
    """Pallas FlashAttention; same semantics as `attention_reference`.

    Decode-shaped requests (`tfjax.ops.pallas.decode`): `pack_heads` runs the G
    query heads of each kv head as the rows of one (each kv head's K/V streamed
    once, not G times); None packs GQA requests with T * G <= 128 whose mask
    indexes by data (a KV cache's `Positions`, segments, padding; no ALiBi or T5
    bias), True insists (a ValueError when it cannot), False never packs.
    `kv_splits` P splits the keys into P chunks run as P times the programs and
    merged by their logsumexps (P must divide S); None splits on GPU when the
    grid is under two programs per SM (`decode.auto_kv_splits`), 1 never."""
    K = k.shape[2]
    G = q.shape[2] // K
    pack = _pack_choice(pack_heads, q, k, mask, alibi_slopes, relative_bias) and G > 1
    if pack:
        q, mask, bias = decode.pack_query(q, K), decode.pack_mask(mask, G), \
            decode.pack_bias(bias, K, G)
    P = _split_choice(kv_splits, q, k, mask, alibi_slopes, alibi_positions, relative_bias,
                      block_sizes, interpret)
    if P > 1:
        q, k, v, mask, bias, alibi_slopes, alibi_positions = decode.split_keys(
            P, q, k, v, mask, bias, alibi_slopes, alibi_positions)
    res = _unpacked(q, k, v, mask, bias=bias, scale=scale, softcap=softcap,
                    alibi_slopes=alibi_slopes, alibi_positions=alibi_positions,
                    relative_bias=relative_bias, q_offset=q_offset, kv_offset=kv_offset,
                    return_lse=return_lse or P > 1, block_sizes=block_sizes, interpret=interpret)
    out, lse = res if (return_lse or P > 1) else (res, None)
    if P > 1:
        out, lse = decode.merge_splits(out, lse, P)
    if pack:
        out, lse = decode.unpack_out(out, G), None if lse is None else decode.unpack_lse(lse, G)
    return (out, lse) if return_lse else out


def _pack_choice(pack_heads, q, k, mask, alibi_slopes, relative_bias) -> bool:
    if pack_heads is None:
        return decode.packable(q.shape, k.shape, mask, alibi_slopes=alibi_slopes,
                               relative_bias=relative_bias)
    if pack_heads:
        reason = decode.unpackable_reason(mask, alibi_slopes=alibi_slopes,
                                          relative_bias=relative_bias)
        if reason:
            raise ValueError(f"flash_attention: pack_heads=True cannot pack this request: {reason}; "
                             "pass pack_heads=None (packs when it can) or False")
    return bool(pack_heads)


def _split_choice(kv_splits, q, k, mask, alibi_slopes, alibi_positions, relative_bias,
                  block_sizes, interpret) -> int:
    from tfjax.parallel.sharding import target_platform

    B, T, N, H = q.shape
    S = k.shape[1]
    reason = decode.unsplittable_reason(mask, alibi_slopes=alibi_slopes,
                                        alibi_positions=alibi_positions,
                                        relative_bias=relative_bias)
    if kv_splits is None:
        if interpret or target_platform() != "gpu" or reason:
            return 1
        from tfjax.ops.pallas.gpu import _default_block_sizes, sm_count
        bq = (block_sizes or _default_block_sizes(H)).block_q
        return decode.auto_kv_splits(B, N, T, S, bq, sm_count())
    if isinstance(kv_splits, bool) or not isinstance(kv_splits, int) or kv_splits < 1 \
            or S % kv_splits:
        raise ValueError(f"flash_attention: kv_splits must be a positive divisor of the key "
                         f"length S={S} (or None), got {kv_splits!r}")
    if kv_splits > 1 and reason:
        raise ValueError(f"flash_attention: kv_splits={kv_splits} cannot split this request: "
                         f"{reason}; pass kv_splits=None or 1")
    return kv_splits


def _unpacked(q, k, v, mask, *, bias, scale, softcap, alibi_slopes, alibi_positions,
              relative_bias, q_offset, kv_offset, return_lse, block_sizes, interpret):
    from tfjax.parallel.sharding import target_platform

    if target_platform() == "gpu" and not interpret:
        from tfjax.ops.pallas.gpu import flash_attention_gpu
        return flash_attention_gpu(q, k, v, mask, bias=bias, scale=scale, softcap=softcap,
                                   alibi_slopes=alibi_slopes, alibi_positions=alibi_positions,
                                   relative_bias=relative_bias,
                                   q_offset=q_offset,
                                   kv_offset=kv_offset, return_lse=return_lse,
                                   block_sizes=block_sizes)
    return flash_attention_tpu(q, k, v, mask, bias=bias, scale=scale, softcap=softcap,
                               alibi_slopes=alibi_slopes, alibi_positions=alibi_positions,
                               relative_bias=relative_bias, q_offset=q_offset, kv_offset=kv_offset,
                               return_lse=return_lse, block_sizes=block_sizes,
                               interpret=interpret)


def supports(r: AttentionRequest) -> str | None:
    reason = mask_support(r.mask)
    if reason:
        return reason
    if r.dtype not in ("float32", "bfloat16", "float16"):
        return f"the pallas kernels take float32/bfloat16/float16 inputs, got {r.dtype}"
    if r.backend == "gpu":
        from tfjax.ops.pallas.gpu import supports as gpu_supports
        return gpu_supports(r)
    return None


def defer(r: AttentionRequest) -> str | None:
    """Why "auto" should try xla before the kernels for this request, or None.
    On TPU the kernels read K/V heads-major, so every call first relays out (and
    pads) the whole K/V: for a decode step over a KV cache that copy outweighs
    the step (experiments/results/attention_cache_tpu_aot_20261130.md: 128 MiB of
    temporaries per call for a 32k-slot cache, xla 0.2). xla reads the cache once
    but writes [B, N, T, S] logits, so the copy costs more while T * G < H
    (`4 N T` vs `4 K H` bytes per key); a chunked prefill of 512 tokens is the
    other way round (xla 2 GiB of temporaries, the kernels 136 MiB)."""
    if r.backend != "tpu":
        return None
    T, N, H = r.q_shape[1], r.q_shape[2], r.q_shape[3]
    G = N // r.k_shape[2]
    if T * G < H:
        return (f"decode-shaped on TPU (T*G = {T * G} < H = {H}): the kernels' heads-major "
                "relayout copies all of K/V per call")
    return None


def _impl(q, k, v, mask, *, bias, alibi, relative_bias, scale, softcap, q_offset, kv_offset,
          return_lse):
    return flash_attention(q, k, v, mask, bias=bias, scale=scale, softcap=softcap,
                           relative_bias=relative_bias, q_offset=q_offset, kv_offset=kv_offset,
                           return_lse=return_lse, **Alibi.kwargs(alibi))


# On GPU, cuDNN (plain causal requests) comes first whichever module registers first.
_GPU_RANK = 1 if "cudnn" in AUTO_ORDER.get("gpu", []) else 0
register_implementation("pallas", _impl, supports, auto={"tpu": 0, "gpu": _GPU_RANK},
                        relative_bias=True, partitionable=False, defer=defer)
