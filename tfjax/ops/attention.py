"""`dot_product_attention`: one API, many implementations, one decision.

q `[B,T,N,H]`, k `[B,S,K,H]`, v `[B,S,K,Hv]` -> `[B,T,N,Hv]` (N % K == 0, K/V never
repeated), under a lazy `tfjax.ops.masks.Mask` or None, with optional additive bias,
ALiBi, T5's `RelativeBias`, soft-cap, learned sinks and global offsets; with
`return_lse` also the fp32 logsumexp `[B,N,T]`. The whole decision is here:
`IMPLEMENTATIONS` (the fixed table), `AUTO_ORDER` (per target platform),
`select_implementation` (an explicit name that cannot serve raises with the reason;
"auto" takes the first that can) and `select_ring_block` (ring attention's per-block
choice, `RING_AUTO_ORDER`). See docs/attention.md.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from typing import Callable, Mapping

import jax.numpy as jnp

from tfjax.ops import blockwise, cudnn, paged, reference, sinks as sinks_lib, target, xla
from tfjax.ops.paged import Paged
from tfjax.ops import masks as masks_lib
from tfjax.ops import pallas
from tfjax.ops.blockwise import DEFAULT_BLOCK
from tfjax.ops.implementation import AttentionRequest, Implementation
from tfjax.ops.pallas import mosaic_tpu as pallas_tpu
from tfjax.ops.pallas import paged_tpu
from tfjax.ops.pallas.common import BlockSizes, mask_support
from tfjax.ops.reference import Alibi, RelativeBias, check_relative_bias, make_alibi
from tfjax.registry import Registry

__all__ = ["AUTO_ORDER", "Alibi", "AttentionRequest", "IMPLEMENTATIONS", "Implementation",
           "RING_AUTO_ORDER", "RING_BLOCKS", "RelativeBias", "RingBlock", "dot_product_attention",
           "select_implementation", "select_ring_block"]

IMPLEMENTATIONS: Registry[Implementation] = Registry("attention implementation", {
    "reference": reference.IMPLEMENTATION,  # materialising jnp; the ground truth
    "xla": xla.IMPLEMENTATION,  # jax.nn.dot_product_attention
    "cudnn": cudnn.IMPLEMENTATION,  # cuDNN flash attention (GPU, plain requests)
    "blockwise": blockwise.IMPLEMENTATION,  # pure-JAX tiled online softmax
    "pallas": pallas.IMPLEMENTATION,  # the Pallas kernels (Mosaic TPU, Triton, Mosaic GPU)
    "paged": paged.IMPLEMENTATION,  # plain-JAX paged attention (paged k/v only)
    "paged_tpu": paged_tpu.IMPLEMENTATION,  # Pallas TPU paged attention (paged k/v only)
})

# implementation="auto": the first that serves the request (other platforms: "cpu"'s);
# paged k/v go to an implementation that reads pages, or gathered to the next.
AUTO_ORDER: Mapping[str, tuple[str, ...]] = types.MappingProxyType({
    "cpu": ("paged", "blockwise", "xla", "reference"),
    "gpu": ("cudnn", "pallas", "xla", "blockwise", "reference"),
    "tpu": ("paged_tpu", "pallas", "xla", "blockwise", "reference"),
})


def select_implementation(request: AttentionRequest, implementation: str = "auto") -> str:
    """The implementation that will serve `request`, or a ValueError saying why none can."""
    if implementation != "auto":
        impl = IMPLEMENTATIONS.get(implementation, field="implementation")
        reason = impl.supports(request)
        if reason:
            raise ValueError(f"implementation={implementation!r} cannot serve this call: {reason}")
        return implementation
    reasons = []
    for name in AUTO_ORDER.get(request.backend, AUTO_ORDER["cpu"]):
        impl = IMPLEMENTATIONS.get(name)
        reason = impl.supports(request)
        if reason is None and request.sharded_without_runner and not impl.partitionable:
            reason = ("not partitionable, and q is sharded outside a shard_map or "
                      "per-device runner (tfjax.parallel.sharding.use_rules provides one)")
        if reason is None:
            return name
        reasons.append(f"{name}: {reason}")
    raise ValueError("implementation='auto' found no implementation for this call: " + "; ".join(reasons))


# Ring attention's per-block attention on the mesh's platform (other platforms: "cpu"'s).
RING_AUTO_ORDER: Mapping[str, tuple[str, ...]] = types.MappingProxyType({
    "cpu": ("blockwise",),
    "gpu": ("blockwise",),
    "tpu": ("pallas", "blockwise"),
})


def select_ring_block(backend: str, mask: masks_lib.Mask | None, implementation: str = "auto",
                      *, block_q: int = DEFAULT_BLOCK, block_kv: int = DEFAULT_BLOCK,
                      block_sizes: BlockSizes | None = None) -> RingBlock:
    """What ring attention on a `backend` mesh runs per block for `mask` (see
    `RingBlock`), by `implementation`: "auto" (the first of `RING_AUTO_ORDER` that
    can), or one of `RING_BLOCKS`, which must be able to. The tile options go here,
    each to the family that takes it: `block_q` x `block_kv` ("blockwise"),
    `block_sizes` ("pallas")."""
    allowed = ", ".join(map(repr, ("auto", *RING_BLOCKS)))
    if implementation == "auto":
        order = RING_AUTO_ORDER.get(backend, RING_AUTO_ORDER["cpu"])
        name = next(n for n in order if _ring_refusal(n, backend, mask) is None)
    elif implementation in RING_BLOCKS:
        reason = _ring_refusal(implementation, backend, mask)
        if reason:
            raise ValueError(f"ring_attention: implementation={implementation!r} {reason}")
        name = implementation
    elif implementation in IMPLEMENTATIONS:
        raise ValueError(f"ring_attention: implementation={implementation!r} has no ring block "
                         f"(one returning its logsumexp, with a backward from the final output); "
                         f"implementation must be one of {allowed}")
    else:
        raise ValueError(f"ring_attention: implementation must be one of {allowed}, got "
                         f"{implementation!r}")
    return RING_BLOCKS[name](backend, block_q=block_q, block_kv=block_kv, block_sizes=block_sizes)


def _ring_refusal(name: str, backend: str, mask) -> str | None:
    """None when ring block `name` runs `mask` on `backend`, else why not (and the fix)."""
    if name != "pallas":
        return None  # blockwise runs everything, everywhere
    if backend == "gpu":
        return ("runs the Pallas TPU kernels (Mosaic on TPU, interpret mode on CPU); on GPU "
                "use implementation='blockwise'")
    reason = mask_support(mask)
    return reason and f"cannot run this mask: {reason}; use implementation='blockwise'"


@dataclasses.dataclass(frozen=True)
class RingBlock:
    """Ring attention's attention of one (q block, kv block) pair, tiles bound:

        forward(q, k, v, mask, *, scale, softcap, q_offset, kv_offset, alibi_slopes=,
                alibi_positions=, relative_bias=) -> (out [B,T,N,H], lse [B,N,T] fp32)
        backward(q, k, v, mask, out, lse, dout, *, <forward's keywords>)
            -> (dq, dk, dv) fp32, and T5's table gradient with `relative_bias`

    `backward` takes the *final* out / lse of these queries (over every block), so
    the per-block gradients sum to the full gradient."""

    name: str
    forward: Callable
    backward: Callable


def _blockwise_block(backend, *, block_q, block_kv, block_sizes) -> RingBlock:
    tiles = dict(block_q=block_q, block_kv=block_kv)
    return RingBlock("blockwise",
                     functools.partial(blockwise.blockwise_attention, return_lse=True, **tiles),
                     functools.partial(blockwise.blockwise_attention_backward, **tiles))


def _pallas_block(backend, *, block_q, block_kv, block_sizes) -> RingBlock:
    """The Pallas TPU kernels: Mosaic on TPU, interpret mode on a CPU mesh. The
    forward reads K/V in the row tiles the backward kernels read (it runs under the
    ring's own VJP, undifferentiated)."""
    tiles = dict(block_sizes=block_sizes, interpret=backend == "cpu")
    return RingBlock("pallas",
                     functools.partial(pallas_tpu.flash_attention_tpu, return_lse=True,
                                       keys_on_lanes=False, **tiles),
                     functools.partial(pallas_tpu.flash_attention_tpu_backward, **tiles))


RING_BLOCKS: Mapping[str, Callable[..., RingBlock]] = types.MappingProxyType({
    "blockwise": _blockwise_block,
    "pallas": _pallas_block,
})


# --------------------------------------------------------------------------- #
# The entry point.
# --------------------------------------------------------------------------- #


def _check_shapes(q, k, v, bias) -> None:
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"dot_product_attention: q, k, v must be [B,T,N,H], [B,S,K,H], [B,S,K,H]; "
                         f"got ranks {q.ndim}, {k.ndim}, {v.ndim}")
    B, T, N, H = q.shape
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"dot_product_attention: k and v differ in batch, length or heads: "
                         f"{k.shape} vs {v.shape} (only the head dim of v may differ)")
    Bk, S, K, Hk = k.shape
    not_float = [n for n, x in (("q", q), ("k", k), ("v", v))
                if not jnp.issubdtype(x.dtype, jnp.floating)]
    if not_float:
        raise TypeError(f"dot_product_attention: {', '.join(not_float)} must be floating point "
                        f"(bfloat16, float16 or float32), got "
                        f"{', '.join(str(x.dtype) for x in (q, k, v))}; cast with .astype()")
    if Bk != B:
        raise ValueError(f"dot_product_attention: batch of q ({B}) and k/v ({Bk}) differ")
    if Hk != H:
        raise ValueError(f"dot_product_attention: head dim of q ({H}) and k/v ({Hk}) differ")
    if N % K:
        raise ValueError(f"dot_product_attention: query heads N={N} must be a multiple of "
                         f"kv heads K={K}")
    if bias is not None:
        ok = (bias.ndim == 4 and bias.shape[0] in (1, B) and bias.shape[1] in (1, N)
              and bias.shape[2:] == (T, S))
        if not ok:
            raise ValueError(f"dot_product_attention: bias must be [B|1, N|1, T, S] = "
                             f"[{B}|1, {N}|1, {T}, {S}], got {bias.shape}")


def dot_product_attention(q, k, v, mask: masks_lib.Mask | None = None, *, bias=None, scale=None,
                          softcap=None, alibi_slopes=None, alibi_positions=None,
                          relative_bias: RelativeBias | None = None, sinks=None,
                          implementation: str = "auto", q_offset=0, kv_offset=0,
                          return_lse: bool = False):
    """Scaled dot-product attention (Vaswani et al. 2017) with GQA, lazy masks,
    additive bias, ALiBi (Press et al. 2022) from per-head slopes, logit
    soft-capping (Gemma 2) and learned sinks (gpt-oss). Returns `[B,T,N,Hv]` in q's
    dtype, and the fp32 logsumexp `[B,N,T]` when `return_lse` (for merging partial
    results; with sinks it includes them). Fully masked query rows return zeros,
    with sinks too (the sink takes the whole row and has no value).

    logits = softcap * tanh(scale * q.k / softcap) + bias - slope * |q_pos - kv_pos|
             + relative_bias.table[bucket(kv_pos - q_pos)]
    (`alibi_slopes` `[N]` / `[B|1, N]`, no gradient; `alibi_positions` see the
    module docstring and `tfjax.ops.reference.make_alibi`; `relative_bias` a
    `tfjax.ops.RelativeBias`, T5's bucketed bias, its table differentiable;
    `sinks` `[N]` float, differentiable). k and v may be `tfjax.ops.paged.Paged` (both,
    one table): pages read in place by an implementation that can, else gathered."""
    paged = isinstance(k, Paged)
    if paged != isinstance(v, Paged):
        raise TypeError("dot_product_attention: k and v must both be tfjax.ops.paged.Paged "
                        "or both arrays")
    _check_shapes(q, k, v, bias)
    B, T, N, _ = q.shape
    try:
        alibi = make_alibi(alibi_slopes, alibi_positions, B, N, T, k.shape[1])
        relative = check_relative_bias(relative_bias, B, N, T, k.shape[1])
    except ValueError as e:
        raise ValueError(f"dot_product_attention: {e}") from None
    sinks = sinks_lib.check_sinks(sinks, N)
    if mask is not None and not isinstance(mask, masks_lib.Mask):
        raise TypeError(f"dot_product_attention: mask must be a tfjax.ops.masks.Mask or None, got "
                        f"{type(mask).__name__}; build one with tfjax.ops.masks (causal(), ...)")
    if mask is not None and mask.batch_size not in (None, q.shape[0]):
        raise ValueError(f"dot_product_attention: the mask's batch ({mask.batch_size}) differs "
                         f"from q's ({q.shape[0]})")
    masks_lib.check_lengths(mask, T, k.shape[1], "dot_product_attention")
    softcap = float(softcap) if softcap else None
    request = AttentionRequest(
        q_shape=tuple(q.shape), k_shape=tuple(k.shape), dtype=str(q.dtype),
        # a `targeting` (use_rules), the mesh traced under, else q's / k's / v's
        # sharding's (a plain jit lowered for a TPU slice), else the host's
        backend=target.target_platform(q, *((k.pool, v.pool) if paged else (k, v))),
        mask=mask,
        sharded_without_runner=(target.per_device() is None
                                and target.sharded_outside_a_mesh(q)),
        has_bias=bias is not None or relative is not None, softcap=softcap,
        offsets=not (isinstance(q_offset, int) and isinstance(kv_offset, int)
                     and q_offset == 0 and kv_offset == 0),
        return_lse=return_lse, has_alibi=alibi is not None,
        has_relative_bias=relative is not None, v_head_dim=v.shape[-1],
        has_sinks=sinks is not None, paged=paged,
        paged_scaled=paged and getattr(k, "scale", None) is not None)
    name = select_implementation(request, implementation)
    impl = IMPLEMENTATIONS.get(name)
    if paged and not impl.paged:
        k, v = k.dense(), v.dense()
    kw = {}
    if impl.relative_bias:
        kw["relative_bias"] = relative
    elif relative is not None:  # materialised: [B|1, N, T, S], differentiable in the table
        dense = relative.dense(T, k.shape[1], q_offset, kv_offset)
        bias = dense if bias is None else bias + dense
    add_sinks = sinks is not None and not impl.sinks
    if sinks is not None and impl.sinks:
        kw["sinks"] = sinks
    args = dict(bias=bias, alibi=alibi, scale=scale, softcap=softcap, q_offset=q_offset,
                kv_offset=kv_offset, return_lse=return_lse or add_sinks, **kw)
    out = None
    per_device = None if impl.partitionable else target.per_device()
    if per_device is not None:  # None from it: nothing to split, run fn as is
        out = per_device(impl.fn, q, k, v, mask, **args)
    if out is None:
        out = impl.fn(q, k, v, mask, **args)
    if not add_sinks:
        return out
    out, lse = sinks_lib.add_sinks(*out, sinks)
    out = out.astype(q.dtype)
    return (out, lse) if return_lse else out
