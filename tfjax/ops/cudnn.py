"""`implementation="cudnn"`: cuDNN's fused flash attention through
`jax.nn.dot_product_attention(implementation="cudnn")`.

It serves only what cuDNN does natively and exactly as our semantics say: GPU,
fp16/bf16, no mask or a plain causal mask (top-left aligned, no offsets), no
soft-cap, no bias, no logsumexp output, head dims that are multiples of 8 up to
128. Anything else is refused with the reason, never approximated. On GPU
"auto" tries it first (`tfjax.ops.attention.AUTO_ORDER`): for a plain (causal)
request cuDNN's kernel is the fastest we have; every other request goes to the
Pallas kernels.
"""

from __future__ import annotations

import jax

from tfjax.ops import masks as M
from tfjax.ops.implementation import AttentionRequest, Implementation

__all__ = ["IMPLEMENTATION", "cudnn_attention", "supports"]


def supports(r: AttentionRequest) -> str | None:
    if r.backend != "gpu":
        return f"cuDNN attention needs a GPU (backend is {r.backend})"
    if r.dtype not in ("bfloat16", "float16"):
        return f"cuDNN attention takes bfloat16/float16, got {r.dtype}"
    if r.mask is not None and type(r.mask) is not M.Causal:
        return f"cuDNN attention serves no mask or a plain causal mask, got {type(r.mask).__name__}"
    if r.softcap:
        return "cuDNN attention has no logit soft-cap"
    if r.has_bias:
        return "this wrapper passes no bias to cuDNN"
    if r.has_alibi:
        return "jax's cuDNN attention takes no ALiBi slopes"
    if r.offsets:
        return "cuDNN attention has no q/kv position offsets"
    if r.return_lse:
        return "cuDNN attention does not return the logsumexp here"
    if r.has_sinks:
        return "cuDNN attention has no attention sinks (and returns no logsumexp here)"
    H = r.q_shape[-1]
    if r.value_head_dim != H:
        return f"this wrapper takes v's head dim equal to q/k's, got {r.value_head_dim} vs {H}"
    if H % 8 or H > 128:
        return f"cuDNN attention takes head dims that are multiples of 8 up to 128, got {H}"
    return None


def cudnn_attention(q, k, v, mask, *, bias, alibi, scale, softcap, q_offset, kv_offset,
                    return_lse):
    del bias, alibi, softcap, q_offset, kv_offset, return_lse  # refused by `supports`
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=mask is not None,
                                        implementation="cudnn")


IMPLEMENTATION = Implementation(cudnn_attention, supports)
