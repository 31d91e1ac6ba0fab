"""What an attention implementation is, so that implementation modules can describe
themselves without importing the dispatch. See docs/attention.md.

`AttentionRequest`: the static facts of one `dot_product_attention` call, from which an
implementation decides whether it can serve it. `Implementation`: the record each
implementation module exports as `IMPLEMENTATION`; its `fn`, called only for requests
its `supports` accepted, with q `[B,T,N,H]`, k `[B,S,K,H]`, v `[B,S,K,Hv]`, is

    fn(q, k, v, mask, *, bias, alibi, scale, softcap, q_offset, kv_offset, return_lse
       [, relative_bias] [, sinks]) -> out [B,T,N,Hv], or (out, lse [B,N,T] fp32)
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from tfjax.ops import masks as masks_lib

__all__ = ["AttentionRequest", "Implementation"]


@dataclasses.dataclass(frozen=True)
class AttentionRequest:
    """What an implementation is asked to do (static facts only)."""

    q_shape: tuple[int, ...]
    k_shape: tuple[int, ...]
    dtype: str
    backend: str  # the target platform (`tfjax.ops.target.target_platform`)
    mask: masks_lib.Mask | None
    has_bias: bool
    softcap: float | None
    offsets: bool  # non-zero q/kv offsets
    return_lse: bool
    has_alibi: bool = False  # alibi_slopes given (bias computed from positions)
    has_relative_bias: bool = False  # a T5 RelativeBias (has_bias too: see below)
    v_head_dim: int | None = None  # v's head dim; None: q/k's (q_shape[-1])
    has_sinks: bool = False  # learned sinks (`tfjax.ops.sinks`; see `Implementation.sinks`)
    # q's sharding names a mesh that nothing else in the trace covers (no shard_map, no
    # per-device runner: a plain jit of sharded inputs), so XLA's SPMD partitioner
    # must split the call: "auto" then skips unpartitionable implementations
    sharded_without_runner: bool = False
    # k and v are `tfjax.ops.paged.Paged` (a page pool and a page table per row)
    paged: bool = False
    # the pages are 8-bit with per-token scales (`Paged.scale`, tfjax.ops.kv_quant)
    paged_scaled: bool = False

    @property
    def value_head_dim(self) -> int:
        return self.q_shape[-1] if self.v_head_dim is None else self.v_head_dim


def _serves_every_request(request: AttentionRequest) -> str | None:
    return None


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One attention implementation (see the module docstring for `fn`)."""

    fn: Callable
    # request -> None if it can serve it, else the reason it cannot (shown to the user)
    supports: Callable[[AttentionRequest], str | None] = _serves_every_request
    # True: fn takes relative_bias= (a checked RelativeBias) itself; False: the
    # dispatch materialises it into bias (so has_bias is set for a request with one)
    relative_bias: bool = False
    # True: fn takes sinks= `[N]` itself; False: the dispatch asks fn for its
    # logsumexp and adds the sinks to (out, lse) (`tfjax.ops.sinks.add_sinks`; the
    # gradient flows through fn's logsumexp cotangent): an fn without a logsumexp
    # refuses requests with `has_sinks`
    sinks: bool = False
    # False: fn is a custom call XLA's SPMD partitioner cannot split (the Pallas
    # kernels); under an active per-device runner (`tfjax.ops.target.per_device`,
    # set by `use_rules`) the dispatch runs it once per device
    partitionable: bool = True
    # True: fn takes paged k/v (`tfjax.ops.paged.Paged`) itself; False: the dispatch
    # gives it the gathered `[B, S, K, H]` arrays
    paged: bool = False
