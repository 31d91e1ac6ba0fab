"""Pallas attention kernels (`implementation="pallas"`).

`flash_attention(q, k, v, mask, ...)` dispatches to the TPU (Mosaic) kernels on
TPU and on CPU (interpret mode), and to the GPU (Triton) kernels on GPU; both
evaluate T5's `relative_bias` per tile.
"""

from __future__ import annotations

from tfjax.ops.attention import AUTO_ORDER, AttentionRequest, register_implementation
from tfjax.ops.pallas import packing
from tfjax.ops.pallas.common import BlockSizes, mask_support
from tfjax.ops.reference import Alibi, RelativeBias
from tfjax.ops.pallas.tpu import flash_attention_tpu

__all__ = ["BlockSizes", "flash_attention", "flash_attention_tpu", "supports"]


def flash_attention(q, k, v, mask=None, *, bias=None, scale=None, softcap=None,
                    alibi_slopes=None, alibi_positions=None,
                    relative_bias: RelativeBias | None = None, q_offset=0, kv_offset=0,
                    return_lse=False, block_sizes: BlockSizes | None = None, interpret=None,
                    pack_heads: bool | None = None):
    """Pallas FlashAttention; same semantics as `attention_reference`.

    `pack_heads`: run the G query heads of each kv head as the rows of one
    (`tfjax.ops.pallas.packing`: each kv head's K/V streamed once, not G times).
    None packs decode-shaped requests (T * G <= 128) whose mask allows it (a KV
    cache's `Positions`, segments, padding; no ALiBi or T5 bias); True insists
    (a ValueError when it cannot); False never packs."""
    if pack_heads is None:
        pack_heads = packing.packable(q.shape, k.shape, mask, alibi_slopes=alibi_slopes,
                                      relative_bias=relative_bias)
    elif pack_heads:
        reason = packing.unpackable_reason(mask, alibi_slopes=alibi_slopes,
                                           relative_bias=relative_bias)
        if reason:
            raise ValueError(f"flash_attention: pack_heads=True cannot pack this request: {reason}; "
                             "pass pack_heads=None (packs when it can) or False")
    K = k.shape[2]
    G = q.shape[2] // K
    if pack_heads and G > 1:
        res = flash_attention(packing.pack_query(q, K), k, v, packing.pack_mask(mask, G),
                              bias=packing.pack_bias(bias, K, G), scale=scale, softcap=softcap,
                              q_offset=q_offset, kv_offset=kv_offset, return_lse=return_lse,
                              block_sizes=block_sizes, interpret=interpret, pack_heads=False)
        if return_lse:
            return packing.unpack_out(res[0], G), packing.unpack_lse(res[1], G)
        return packing.unpack_out(res, G)
    return _unpacked(q, k, v, mask, bias=bias, scale=scale, softcap=softcap,
                     alibi_slopes=alibi_slopes, alibi_positions=alibi_positions,
                     relative_bias=relative_bias, q_offset=q_offset, kv_offset=kv_offset,
                     return_lse=return_lse, block_sizes=block_sizes, interpret=interpret)


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


def _impl(q, k, v, mask, *, bias, alibi, relative_bias, scale, softcap, q_offset, kv_offset,
          return_lse):
    return flash_attention(q, k, v, mask, bias=bias, scale=scale, softcap=softcap,
                           relative_bias=relative_bias, q_offset=q_offset, kv_offset=kv_offset,
                           return_lse=return_lse, **Alibi.kwargs(alibi))


# On GPU, cuDNN (plain causal requests) comes first whichever module registers first.
_GPU_RANK = 1 if "cudnn" in AUTO_ORDER.get("gpu", []) else 0
register_implementation("pallas", _impl, supports, auto={"tpu": 0, "gpu": _GPU_RANK},
                        relative_bias=True, partitionable=False)
