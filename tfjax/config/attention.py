"""The `model.attention` section: how the model's attention layers attend (biases,
QK-norm, scale, soft-cap, sinks, the implementation, variants, windows, context
parallelism), and its checks (called by `tfjax.config.model.validate_model`). The
head shape (`model.num_heads`, `num_kv_heads`, `head_dim`, `v_head_dim`) is the
model's, since recurrent and linear mixers share it."""

from __future__ import annotations

import dataclasses

from tfjax.config.checks import fail, non_negative, one_of

__all__ = ["AttentionConfig", "validate_attention"]

VALUE_RESIDUALS = ("none", "fixed", "learned")


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """The attention layers' knobs (`tfjax.nn.attention.MultiHeadAttention` takes this
    record whole). Zero means "derive" or "off" where noted."""

    qkv_bias: bool = False
    # with qkv_bias: False leaves the key projection without one (Whisper; a key bias
    # shifts every score of a query alike, which the softmax ignores)
    k_bias: bool = True
    out_bias: bool = False
    qk_norm: bool = False
    # "head": q and k normalised per head over head_dim (Qwen3, Gemma 3); "projection":
    # over all heads at once, before the heads split (OLMo 2)
    qk_norm_over: str = "head"
    # the QK-norm's kind ("" -> model.norm; "rmsnorm_unit": no scale, Llama 4's L2 norm)
    # and which attention layers have one: "all", or "rope" (those that rotate: Llama 4)
    qk_norm_kind: str = ""
    qk_norm_layers: str = "all"
    scale: float = 0.0  # 0 -> 1/sqrt(head_dim)
    softcap: float = 0.0  # 0 -> off; Gemma 2: 50
    sinks: bool = False  # a learned sink logit per head (gpt-oss; tfjax.ops.sinks)
    impl: str = "auto"  # tfjax.ops.dot_product_attention's implementation
    # Differential attention (Ye et al. 2024): each head's queries and keys split in two
    # halves of head_dim / 2, out = RMSNorm(softmax(q1 k1) v - lambda softmax(q2 k2) v)
    # * (1 - lambda_init), lambda learned per layer (tfjax.nn.attention; decoder only)
    differential: bool = False
    # Value-residual learning (ResFormer, Zhou et al. 2024): every layer after the first
    # mixes the first layer's values in, v_n <- l1 v_n + l2 v_1: "none" | "fixed"
    # (l1 = l2 = 0.5, the paper's) | "learned" (l1, l2 per layer, from 0.5; decoder only)
    value_residual: str = "none"
    # Gated attention (Qwen3-Next; Qiu et al. 2025): the attention output times
    # sigmoid(x @ W_gate) per head and channel, before the output projection
    output_gate: bool = False
    # Self-attention when the mesh splits the sequence (mesh.sequence > 1): "ring"
    # (ring attention, K/V circulate; O(S/n) memory) | "all_gather" (each device
    # gathers the whole K/V; the simple baseline) | "ulysses" (all-to-alls trade the
    # sequence shard for a head shard and back; num_heads % mesh.sequence == 0) |
    # "usp" (Ulysses inside groups of `ulysses_size` devices, the ring across them).
    # Ignored without a sequence axis.
    context_parallel: str = "ring"
    ulysses_size: int = 1  # "usp": devices per Ulysses group (divides mesh.sequence)
    # Zig-zag load balancing of the causal ring (2n chunks, device i holds i and 2n-1-i;
    # under "usp" the ring across the groups):
    # "data" (the trainer reorders each batch once on the host; layers skip the
    # re-layout; falls back to "layer", with a note, for models with order-dependent
    # layers: mamba / linear mixers, capacity-factor MoE) | "layer" (natural-order
    # data, every layer re-lays out q, k, v, out) | "none".
    zigzag: str = "data"
    sliding_window: int = 0  # keys before the query a "local" layer sees (plus itself)
    chunk: int = 0  # a "chunked" layer sees its own chunk (Llama 4: 8192)
    # "local" layers' RoPE base, unscaled (Gemma 3: 10000); 0 -> model.rope as the others
    local_rope_theta: float = 0.0
    # Llama 4's query temperature on "nope" layers: q *= 1 + scale * ln(1 + floor((p + 1) /
    # floor)) at position p (floor 8192, scale 0.1); floor 0 -> off
    temperature_floor: int = 0
    temperature_scale: float = 0.1


# The flat `model.` fields this section replaced: an old path is an error naming the new one.
MOVED = {
    "qkv_bias": "attention.qkv_bias", "out_bias": "attention.out_bias",
    "qk_norm": "attention.qk_norm", "qk_norm_over": "attention.qk_norm_over",
    "qk_norm_kind": "attention.qk_norm_kind", "qk_norm_layers": "attention.qk_norm_layers",
    "attn_scale": "attention.scale", "attn_softcap": "attention.softcap",
    "attention_sinks": "attention.sinks", "attention_impl": "attention.impl",
    "diff_attn": "attention.differential", "value_residual": "attention.value_residual",
    "attn_output_gate": "attention.output_gate",
    "context_parallel": "attention.context_parallel", "zigzag": "attention.zigzag",
    "sliding_window": "attention.sliding_window", "attention_chunk": "attention.chunk",
    "local_rope_theta": "attention.local_rope_theta",
    "nope_temperature_floor": "attention.temperature_floor",
    "nope_temperature_scale": "attention.temperature_scale",
}


def validate_attention(c, p: str) -> None:
    """The attention section's ranges and what its variants need of the model `c` (a
    `ModelConfig`; which layer kinds carry the variants is `tfjax.models.check_names`'s)."""
    a, q = c.attention, f"{p}.attention"
    one_of(f"{q}.context_parallel", a.context_parallel, ("ring", "all_gather", "ulysses", "usp"))
    if a.ulysses_size < 1:
        fail(f"{q}.ulysses_size", f"must be >= 1, got {a.ulysses_size}")
    one_of(f"{q}.qk_norm_over", a.qk_norm_over, ("head", "projection"))
    one_of(f"{q}.qk_norm_layers", a.qk_norm_layers, ("all", "rope"))
    one_of(f"{q}.zigzag", a.zigzag, ("data", "layer", "none"))
    one_of(f"{q}.value_residual", a.value_residual, VALUE_RESIDUALS)
    for name in ("scale", "softcap", "chunk", "local_rope_theta", "temperature_floor",
                 "temperature_scale", "sliding_window"):
        non_negative(f"{q}.{name}", getattr(a, name))
    if "local" in c.layer_pattern and a.sliding_window < 1:
        fail(f"{q}.sliding_window", f"must be >= 1 when layer_pattern has 'local' layers, "
             f"got {a.sliding_window}")
    if "chunked" in c.layer_pattern and a.chunk < 1:
        fail(f"{q}.chunk", f"must be >= 1 when layer_pattern has 'chunked' layers, "
             f"got {a.chunk}")
    for name, on in (("differential", a.differential),
                     ("value_residual", a.value_residual != "none")):
        if on and c.arch != "decoder":
            fail(f"{q}.{name}", f"is for arch='decoder' only (arch={c.arch!r})")
    if not a.differential:
        return
    if c.head_size % 2:
        fail(f"{q}.differential", f"splits each head's queries and keys in two halves: "
             f"head_dim must be even, got {c.head_size}")
    if a.sinks:
        fail(f"{q}.sinks", "does not combine with model.attention.differential (two softmax "
             "maps per head); set one of them")
    if a.qk_norm:
        fail(f"{q}.qk_norm", "does not combine with model.attention.differential (not "
             "implemented: the norm would be per half-head); set one of them")
    if c.position == "rope" and (c.rope.fraction * c.head_size / 2) % 2:
        fail(f"{p}.rope.fraction", f"model.attention.differential rotates each half-head of "
             f"head_dim / 2 = {c.head_size // 2}: fraction * head_dim / 2 must be even, got "
             f"{c.rope.fraction * c.head_size / 2:g}")
