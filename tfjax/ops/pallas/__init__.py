"""Pallas attention kernels (`implementation="pallas"`): one family, one plan.

`flash_attention(q, k, v, mask, ...)` (q `[B,T,N,H]`, k/v `[B,S,K,H]`) has the
semantics of `attention_reference` and runs the way `plan(...)` decides: the Mosaic
TPU kernels on TPU (interpreted on CPU); on GPU the Triton kernels or, on sm_90 where
they serve the request, the Mosaic GPU ones; decode-shaped requests packed and split
(`decode.py`). `flash_attention_gpu` runs the GPU kernels whatever the target, with
the forward / backward choice exposed. `IMPLEMENTATION` is the family's record (not
partitionable: custom calls XLA cannot split). See docs/kernels.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tfjax.ops import target
from tfjax.ops.implementation import AttentionRequest, Implementation
from tfjax.ops.pallas import decode, mosaic_gpu, mosaic_gpu_backward, mosaic_tpu, triton
from tfjax.ops.pallas.common import BlockSizes, mask_support
from tfjax.ops.pallas.mosaic_tpu import flash_attention_tpu
from tfjax.ops.reference import Alibi, RelativeBias

__all__ = ["BlockSizes", "IMPLEMENTATION", "Plan", "flash_attention",
           "flash_attention_gpu", "flash_attention_tpu", "plan", "supports"]


@dataclasses.dataclass(frozen=True)
class Plan:
    """How the family runs one request (`plan`)."""

    kernels: str  # "mosaic_tpu" (mosaic_tpu.py; interpret mode on CPU) or "triton" (triton.py)
    forward: str | None = None  # with "triton": "triton" or "hopper" (Mosaic GPU)
    backward: str | None = None  # the dq and dk/dv kernels, likewise
    pack_heads: bool = False  # the G query heads of a kv head run as its rows
    kv_splits: int = 1  # the keys run as this many chunks, merged by their logsumexps


def plan(q, k, v, mask=None, *, bias=None, alibi_slopes=None, alibi_positions=None,
         relative_bias=None, block_sizes: BlockSizes | None = None, interpret=None,
         pack_heads: bool | None = None, kv_splits: int | None = None, forward: str = "auto",
         backward: str = "auto", kernels: str | None = None) -> Plan:
    """The family's whole decision for a request (q, k, v: arrays or
    ShapeDtypeStructs); the arguments are `flash_attention`'s and
    `flash_attention_gpu`'s. `kernels`: None picks by the target platform
    (`tfjax.ops.target`): "triton" on GPU unless interpreting, else "mosaic_tpu";
    "triton" insists (`flash_attention_gpu`). A ValueError names a choice the
    request cannot take and what to pass instead."""
    if kernels is None:
        kernels = "triton" if target.target_platform() == "gpu" and not interpret else "mosaic_tpu"
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    pack = _pack_heads(pack_heads, q.shape, k.shape, mask, alibi_slopes, relative_bias) and G > 1
    if pack:  # the rows and heads the kernels then see
        T, N = T * G, K
    splits = _kv_splits(kv_splits, B, N, T, S, H, mask, alibi_slopes, alibi_positions,
                        relative_bias, block_sizes, auto=kernels == "triton" and not interpret)
    if kernels != "triton":
        return Plan(kernels, pack_heads=pack, kv_splits=splits)
    facts = (q, k, v, mask, bias is not None, relative_bias is not None, interpret)
    return Plan(kernels, _gpu_kernel("forward", forward, *facts),
                _gpu_kernel("backward", backward, *facts), pack, splits)


def _pack_heads(pack_heads, q_shape, k_shape, mask, alibi_slopes, relative_bias) -> bool:
    if pack_heads is None:
        return decode.packable(q_shape, k_shape, mask, alibi_slopes=alibi_slopes,
                               relative_bias=relative_bias)
    if pack_heads:
        reason = decode.unpackable_reason(mask, alibi_slopes=alibi_slopes,
                                          relative_bias=relative_bias)
        if reason:
            raise ValueError(f"flash_attention: pack_heads=True cannot pack this request: {reason}; "
                             "pass pack_heads=None (packs when it can) or False")
    return bool(pack_heads)


def _kv_splits(kv_splits, B, N, T, S, H, mask, alibi_slopes, alibi_positions, relative_bias,
               block_sizes, *, auto: bool) -> int:
    """`auto`: None may split (compiled GPU kernels: `decode.auto_kv_splits`)."""
    reason = decode.unsplittable_reason(mask, alibi_slopes=alibi_slopes,
                                        alibi_positions=alibi_positions,
                                        relative_bias=relative_bias)
    if kv_splits is None:
        if not auto or reason:
            return 1
        bq = (block_sizes or triton.default_block_sizes(H)).block_q
        return decode.auto_kv_splits(B, N, T, S, bq, target.sm_count())
    if isinstance(kv_splits, bool) or not isinstance(kv_splits, int) or kv_splits < 1 \
            or S % kv_splits:
        raise ValueError(f"flash_attention: kv_splits must be a positive divisor of the key "
                         f"length S={S} (or None), got {kv_splits!r}")
    if kv_splits > 1 and reason:
        raise ValueError(f"flash_attention: kv_splits={kv_splits} cannot split this request: "
                         f"{reason}; pass kv_splits=None or 1")
    return kv_splits


_GPU_CHOICES = ("auto", "triton", "hopper")


def _gpu_kernel(which, choice, q, k, v, mask, has_bias, relative, interpret) -> str:
    """"hopper" or "triton" for the forward (or the backward): "auto" takes the Mosaic
    GPU kernel on sm_90 (`target.is_hopper`) when compiled and it supports the request."""
    if choice not in _GPU_CHOICES:
        raise ValueError(f"flash_attention_gpu: {which} must be one of {_GPU_CHOICES}, got "
                         f"{choice!r}")
    supports = mosaic_gpu.supports if which == "forward" else mosaic_gpu_backward.supports
    reason = supports(q.dtype, q.shape[-1], mask, has_bias)
    if reason is None and relative:
        reason = "the Hopper kernels take no relative_bias (T5's bias; the Triton kernels do)"
    if reason is None and v.shape[-1] != q.shape[-1]:
        reason = (f"the Hopper kernels take v's head dim equal to q/k's, got {v.shape[-1]} vs "
                  f"{q.shape[-1]} (the Triton kernels take both)")
    if reason is None and not q.dtype == k.dtype == v.dtype:
        reason = f"the Hopper kernel takes one dtype for q, k, v, got {q.dtype}, {k.dtype}, {v.dtype}"
    if choice == "hopper":
        if reason:
            raise ValueError(f"flash_attention_gpu({which}='hopper'): {reason}; pass "
                             f"{which}='triton' (or 'auto') for this request")
        return "hopper"
    if choice == "auto" and not interpret and reason is None and target.is_hopper():
        return "hopper"
    return "triton"


# --------------------------------------------------------------------------- #
# Running a plan.
# --------------------------------------------------------------------------- #


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
    grid is under two programs per SM (`decode.auto_kv_splits`), 1 never.
    `interpret`: None interprets on a CPU target (the TPU kernels)."""
    how = plan(q, k, v, mask, bias=bias, alibi_slopes=alibi_slopes,
               alibi_positions=alibi_positions, relative_bias=relative_bias,
               block_sizes=block_sizes, interpret=interpret, pack_heads=pack_heads,
               kv_splits=kv_splits)
    return _run(how, q, k, v, mask, bias=bias, scale=scale, softcap=softcap,
                alibi_slopes=alibi_slopes, alibi_positions=alibi_positions,
                relative_bias=relative_bias, q_offset=q_offset, kv_offset=kv_offset,
                return_lse=return_lse, block_sizes=block_sizes, interpret=interpret)


def flash_attention_gpu(q, k, v, mask=None, *, bias=None, scale=None, softcap=None,
                        alibi_slopes=None, alibi_positions=None,
                        relative_bias: RelativeBias | None = None, q_offset=0, kv_offset=0,
                        return_lse=False, block_sizes: BlockSizes | None = None,
                        interpret: Any = False, forward: str = "auto", hopper_config=None,
                        backward: str = "auto", hopper_backward_config=None,
                        triton_config: triton.TritonConfig | None = None):
    """The GPU kernels, whatever the target: q `[B,T,N,H]`, k/v `[B,S,K,H]` -> out
    `[B,T,N,H]` (and lse `[B,N,T]` fp32); no packing or splitting.
    `relative_bias`: T5's bias per tile (its table differentiable; Triton only).

    `forward`: "auto" runs the Hopper (Mosaic GPU) forward on sm_90 GPUs when it
    supports the request (16-bit, no bias, see `mosaic_gpu.supports`), else the
    Triton one; "hopper" insists (and runs it in GPU interpret mode when
    `interpret`); "triton" never uses it. `hopper_config`: its tiles.
    `backward`, `hopper_backward_config`: the same choice for the dq and dk/dv
    kernels (`mosaic_gpu_backward.supports`: also head dims up to 128). `triton_config`:
    the Triton kernels' warps and pipeline stages (None: `triton.triton_launch`'s
    choice for each kernel's tiles)."""
    how = plan(q, k, v, mask, bias=bias, alibi_slopes=alibi_slopes,
               alibi_positions=alibi_positions, relative_bias=relative_bias,
               block_sizes=block_sizes, interpret=interpret, pack_heads=False, kv_splits=1,
               forward=forward, backward=backward, kernels="triton")
    return _run(how, q, k, v, mask, bias=bias, scale=scale, softcap=softcap,
                alibi_slopes=alibi_slopes, alibi_positions=alibi_positions,
                relative_bias=relative_bias, q_offset=q_offset, kv_offset=kv_offset,
                return_lse=return_lse, block_sizes=block_sizes, interpret=interpret,
                hopper_config=hopper_config, hopper_backward_config=hopper_backward_config,
                triton_config=triton_config)


def _run(how: Plan, q, k, v, mask, *, bias, alibi_slopes, alibi_positions, return_lse,
         **kw):
    """Execute `how`: pack, split, run the kernels, merge, unpack."""
    K = k.shape[2]
    G = q.shape[2] // K
    P = how.kv_splits
    if how.pack_heads:
        q, mask, bias = decode.pack_query(q, K), decode.pack_mask(mask, G), \
            decode.pack_bias(bias, K, G)
    if P > 1:
        q, k, v, mask, bias, alibi_slopes, alibi_positions = decode.split_keys(
            P, q, k, v, mask, bias, alibi_slopes, alibi_positions)
    with_lse = return_lse or P > 1
    res = _kernels(how, q, k, v, mask, bias=bias, alibi_slopes=alibi_slopes,
                   alibi_positions=alibi_positions, return_lse=with_lse, **kw)
    out, lse = res if with_lse else (res, None)
    if P > 1:
        out, lse = decode.merge_splits(out, lse, P)
    if how.pack_heads:
        out, lse = decode.unpack_out(out, G), None if lse is None else decode.unpack_lse(lse, G)
    return (out, lse) if return_lse else out


def _kernels(how: Plan, q, k, v, mask, *, interpret, hopper_config=None,
             hopper_backward_config=None, triton_config=None, **kw):
    """The plan's kernels on the (packed, split) request."""
    if how.kernels == "triton":
        return triton.flash_attention_triton(
            q, k, v, mask, **kw, interpret=False if interpret is None else interpret,
            forward=how.forward, hopper_config=hopper_config, backward=how.backward,
            hopper_backward_config=hopper_backward_config, triton_config=triton_config)
    return mosaic_tpu.flash_attention_tpu(q, k, v, mask, **kw, interpret=interpret)


# --------------------------------------------------------------------------- #
# implementation="pallas".
# --------------------------------------------------------------------------- #


def supports(r: AttentionRequest) -> str | None:
    reason = mask_support(r.mask)
    if reason:
        return reason
    if r.dtype not in ("float32", "bfloat16", "float16"):
        return f"the pallas kernels take float32/bfloat16/float16 inputs, got {r.dtype}"
    if r.backend == "gpu":
        return triton.supports(r)
    if r.backend == "tpu":
        rows = (r.mask.batch_size or 1) if r.mask is not None else 1
        need = mosaic_tpu.table_bytes(r.q_shape[1], r.k_shape[1], rows)
        if need > mosaic_tpu.SMEM_BYTES * 3 // 4:  # the rest: counts, offsets, mask scalars
            return (f"the pallas TPU kernels' tile table ({need >> 10} KiB for "
                    f"{r.q_shape[1]} x {r.k_shape[1]} tokens, {rows} table(s)) would not "
                    f"fit a core's {mosaic_tpu.SMEM_BYTES >> 20} MiB of scalar memory")
    return None


def _impl(q, k, v, mask, *, bias, alibi, relative_bias, scale, softcap, q_offset, kv_offset,
          return_lse):
    return flash_attention(q, k, v, mask, bias=bias, scale=scale, softcap=softcap,
                           relative_bias=relative_bias, q_offset=q_offset, kv_offset=kv_offset,
                           return_lse=return_lse, **Alibi.kwargs(alibi))


IMPLEMENTATION = Implementation(_impl, supports, relative_bias=True, partitionable=False)
