"""`dot_product_attention`: one API, many implementations.

    out = dot_product_attention(q, k, v, mask, bias=None, scale=None, softcap=None,
                                alibi_slopes=None, alibi_positions=None,
                                relative_bias=None, implementation="auto")

q `[B,T,N,H]`, k/v `[B,S,K,H]` with N % K == 0 (GQA / MQA without repeating K/V),
`mask` a lazy `tfjax.ops.masks.Mask` (or None), `bias` additive `[B|1, N|1, T, S]`,
`alibi_slopes` `[N]` or `[B, N]`: ALiBi's bias `-slope * |q_pos - kv_pos|` at the
positions `alibi_positions = (q [B,T], kv [B,S])` or, without them, the global
indices (`q_offset + i`, `kv_offset + j`); the tiled implementations evaluate it
per tile instead of reading a materialised `[B, N, T, S]` bias. `relative_bias`
a `tfjax.ops.RelativeBias`: T5's learned bias `table[bucket(kv_pos - q_pos), n]`,
evaluated per tile by the implementations registered with `relative_bias=True`
("blockwise" and "pallas": the table gradient is summed per bucket) and
materialised into `bias` for the others (the same values and gradients, O(T*S)
memory).

Implementations register themselves in `IMPLEMENTATIONS` with a `supports`
predicate that returns None or the reason it cannot serve a request. An explicit
`implementation=` that cannot serve the request raises (naming the reason);
`"auto"` takes the first in `AUTO_ORDER` for the current backend that can, except
that one whose `defer` gives a reason (a known cost for this request, e.g. the
Pallas TPU kernels on a decode step) yields to a later one that can. No
implementation silently changes semantics.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from tfjax.ops import masks as masks_lib
from tfjax.ops.reference import (
    Alibi,
    RelativeBias,
    attention_reference,
    check_relative_bias,
    make_alibi,
)
from tfjax.registry import Registry

__all__ = ["dot_product_attention", "Alibi", "RelativeBias", "AttentionRequest", "Implementation",
           "IMPLEMENTATIONS", "AUTO_ORDER", "register_implementation"]


@dataclasses.dataclass(frozen=True)
class AttentionRequest:
    """What an implementation is asked to do (static facts only)."""

    q_shape: tuple[int, ...]
    k_shape: tuple[int, ...]
    dtype: str
    backend: str
    mask: masks_lib.Mask | None
    has_bias: bool
    softcap: float | None
    offsets: bool  # non-zero q/kv offsets
    return_lse: bool
    has_alibi: bool = False  # alibi_slopes given (bias computed from positions)
    has_relative_bias: bool = False  # a T5 RelativeBias (has_bias too: see below)


@dataclasses.dataclass(frozen=True)
class Implementation:
    fn: Callable  # fn(q, k, v, mask, *, bias, alibi, scale, softcap, q_offset, kv_offset,
    #                   return_lse); alibi: None or a checked `Alibi`
    supports: Callable[[AttentionRequest], str | None]  # None if it can, else the reason
    # fn takes relative_bias= (a checked RelativeBias) itself; else the dispatch
    # materialises it into bias (so has_bias is set for a request with one)
    relative_bias: bool = False
    # False: fn is a custom call XLA's SPMD partitioner cannot split (the Pallas
    # kernels); under an active mesh the dispatch runs it per device in shard_map
    partitionable: bool = True
    # None, or a request -> None / the reason "auto" should try the implementations
    # after this one first (a cost, not a limit: it still serves when none of them can)
    defer: Callable[[AttentionRequest], str | None] | None = None


IMPLEMENTATIONS: Registry[Implementation] = Registry("attention implementation")

# Preference of "auto" per backend; kernels issues put their names in front.
AUTO_ORDER: dict[str, list[str]] = {
    "cpu": ["xla", "reference"],
    "gpu": ["xla", "reference"],
    "tpu": ["xla", "reference"],
}


def register_implementation(name: str, fn: Callable,
                            supports: Callable[[AttentionRequest], str | None] = lambda r: None,
                            *, auto: dict[str, int] | None = None,
                            relative_bias: bool = False, partitionable: bool = True,
                            defer: Callable[[AttentionRequest], str | None] | None = None) -> None:
    """Register `name`; `auto={"tpu": 0}` also inserts it at that rank of AUTO_ORDER.
    `relative_bias=True`: fn takes `relative_bias=` (else it gets it as `bias`).
    `partitionable=False`: fn is a custom call XLA cannot partition (a Pallas kernel);
    under an active mesh (`tfjax.parallel.sharding.use_rules`) it runs per device
    under shard_map over the batch axes (`batch_sharded_attention`). `defer`: a
    request -> None, or why "auto" should first try the implementations after it
    (it is still chosen when none of them can serve)."""
    IMPLEMENTATIONS.register(name, Implementation(fn, supports, relative_bias, partitionable,
                                                  defer))
    for backend, rank in (auto or {}).items():
        AUTO_ORDER.setdefault(backend, []).insert(rank, name)


def _check_shapes(q, k, v, bias) -> None:
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"dot_product_attention: q, k, v must be [B,T,N,H], [B,S,K,H], [B,S,K,H]; "
                         f"got ranks {q.ndim}, {k.ndim}, {v.ndim}")
    B, T, N, H = q.shape
    if k.shape != v.shape:
        raise ValueError(f"dot_product_attention: k and v shapes differ: {k.shape} vs {v.shape}")
    Bk, S, K, Hk = k.shape
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
                          relative_bias: RelativeBias | None = None,
                          implementation: str = "auto", q_offset=0, kv_offset=0,
                          return_lse: bool = False):
    """Scaled dot-product attention (Vaswani et al. 2017) with GQA, lazy masks,
    additive bias, ALiBi (Press et al. 2022) from per-head slopes, and logit
    soft-capping (Gemma 2). Returns `[B,T,N,H]` in q's dtype, and the fp32
    logsumexp `[B,N,T]` when `return_lse` (for merging partial results). Fully
    masked query rows return zeros.

    logits = softcap * tanh(scale * q.k / softcap) + bias - slope * |q_pos - kv_pos|
             + relative_bias.table[bucket(kv_pos - q_pos)]
    (`alibi_slopes` `[N]` / `[B|1, N]`, no gradient; `alibi_positions` see the
    module docstring and `tfjax.ops.reference.make_alibi`; `relative_bias` a
    `tfjax.ops.RelativeBias`, T5's bucketed bias, its table differentiable)."""
    from tfjax.parallel.sharding import target_platform

    _check_shapes(q, k, v, bias)
    B, T, N, _ = q.shape
    try:
        alibi = make_alibi(alibi_slopes, alibi_positions, B, N, T, k.shape[1])
        relative = check_relative_bias(relative_bias, B, N, T, k.shape[1])
    except ValueError as e:
        raise ValueError(f"dot_product_attention: {e}") from None
    if mask is not None and not isinstance(mask, masks_lib.Mask):
        raise TypeError(f"dot_product_attention: mask must be a tfjax.ops.masks.Mask or None, got "
                        f"{type(mask).__name__}; build one with tfjax.ops.masks (causal(), ...)")
    if mask is not None and mask.batch_size not in (None, q.shape[0]):
        raise ValueError(f"dot_product_attention: the mask's batch ({mask.batch_size}) differs "
                         f"from q's ({q.shape[0]})")
    softcap = float(softcap) if softcap else None
    request = AttentionRequest(
        q_shape=tuple(q.shape), k_shape=tuple(k.shape), dtype=str(q.dtype),
        backend=target_platform(), mask=mask,
        has_bias=bias is not None or relative is not None, softcap=softcap,
        offsets=not (isinstance(q_offset, int) and isinstance(kv_offset, int)
                     and q_offset == 0 and kv_offset == 0),
        return_lse=return_lse, has_alibi=alibi is not None,
        has_relative_bias=relative is not None)
    name = select_implementation(request, implementation)
    impl = IMPLEMENTATIONS.get(name)
    kw = {}
    if impl.relative_bias:
        kw["relative_bias"] = relative
    elif relative is not None:  # materialised: [B|1, N, T, S], differentiable in the table
        dense = relative.dense(T, k.shape[1], q_offset, kv_offset)
        bias = dense if bias is None else bias + dense
    if not impl.partitionable:
        from tfjax.parallel.ring_attention import batch_sharded_attention

        out = batch_sharded_attention(impl.fn, q, k, v, mask, bias=bias, alibi=alibi,
                                      scale=scale, softcap=softcap, q_offset=q_offset,
                                      kv_offset=kv_offset, return_lse=return_lse, **kw)
        if out is not None:
            return out
    return impl.fn(q, k, v, mask, bias=bias, alibi=alibi, scale=scale, softcap=softcap,
                   q_offset=q_offset, kv_offset=kv_offset, return_lse=return_lse, **kw)


def select_implementation(request: AttentionRequest, implementation: str = "auto") -> str:
    """The implementation that will serve `request`, or a ValueError saying why none can."""
    if implementation != "auto":
        impl = IMPLEMENTATIONS.get(implementation, field="implementation")
        reason = impl.supports(request)
        if reason:
            raise ValueError(f"implementation={implementation!r} cannot serve this call: {reason}")
        return implementation
    reasons, deferred = [], None
    for name in AUTO_ORDER.get(request.backend, AUTO_ORDER["cpu"]):
        if name not in IMPLEMENTATIONS:
            continue
        impl = IMPLEMENTATIONS.get(name)
        reason = impl.supports(request)
        if reason is None and impl.defer is not None and impl.defer(request):
            deferred = deferred or name  # the first that can, if no later one can
            continue
        if reason is None:
            return name
        reasons.append(f"{name}: {reason}")
    if deferred:
        return deferred
    raise ValueError("implementation='auto' found no implementation for this call: " + "; ".join(reasons))


# --------------------------------------------------------------------------- #
# "reference" and "xla".
# --------------------------------------------------------------------------- #


def _xla_attention(q, k, v, mask, *, bias, alibi, scale, softcap, q_offset, kv_offset,
                   return_lse):
    del softcap, return_lse  # refused by _xla_supports
    T, S = q.shape[1], k.shape[1]
    if alibi is not None:  # materialised, like any bias jax.nn takes
        a = alibi.dense(T, S, q_offset, kv_offset)
        bias = a if bias is None else bias.astype(jnp.float32) + a
    allowed = None
    if mask is not None:
        allowed = mask.dense(T, S, q_offset=q_offset, kv_offset=kv_offset)[:, None]  # [B|1,1,T,S]
    out = jax.nn.dot_product_attention(q, k, v, bias=bias, mask=allowed, scale=scale,
                                       implementation="xla")
    if allowed is not None:  # jax gives a uniform average on fully masked rows; we give 0
        any_key = jnp.any(allowed[:, 0], axis=-1)  # [B|1, T]
        out = jnp.where(any_key[:, :, None, None], out, jnp.zeros((), out.dtype))
    return out


def _xla_supports(r: AttentionRequest) -> str | None:
    if r.softcap:
        return "jax.nn.dot_product_attention has no logit soft-cap (use 'reference')"
    if r.return_lse:
        return "jax.nn.dot_product_attention does not return the logsumexp"
    return None


def _reference(q, k, v, mask, *, alibi, **kw):
    return attention_reference(q, k, v, mask, **kw, **Alibi.kwargs(alibi))


register_implementation("reference", _reference)
register_implementation("xla", _xla_attention, _xla_supports)
