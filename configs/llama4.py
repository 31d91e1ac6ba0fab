"""Llama 4 (Meta 2025, Llama-4-Scout-17B-16E, its text decoder): 48 layers in cycles
of three RoPE layers with chunked attention (8,192-token chunks) and one NoPE layer
with global attention and Llama 4's query temperature (floor 8,192, scale 0.1); GQA
40/8 of head_dim 128; a weightless L2 QK-norm on the RoPE layers only
(`attention.qk_norm_kind="rmsnorm_unit"`, `attention.qk_norm_layers="rope"`); RoPE base 500k,
unscaled (a released checkpoint's long-context `rope_scaling` is not reproduced
here: set `model.rope`); every feed-forward a 16-expert MoE with top-1
sigmoid routing that scales the chosen expert's input (`moe.gate_input`) plus a
shared expert, each of width 8,192 (`tfjax.nn.moe`). RMSNorm, untied embeddings,
vocab 202,048. Default: Llama-4-Scout's text model (107,769,861,120 parameters, what
transformers' Llama4ForCausalLM of its text config counts; the model card: 109B total
with the vision encoder, 17B active). Variant "tiny" (CPU: 4 layers, d=64).

    python -m tfjax.train --config configs/llama4.py:tiny --workdir /tmp/llama4

In tfjax terms: layer_pattern = 3 x chunked + nope; ffn_pattern = (moe,).
"""

from tfjax.config import apply_variant, default_config

BYTE_VOCAB = 259  # tfjax.data's byte tokenizer: 256 bytes + pad, bos, eos


def get_config(arg=None):
    cfg = default_config()
    cfg.model.update(dict(
        arch="decoder", vocab_size=202048, d_model=5120, num_layers=48, num_heads=40,
        num_kv_heads=8, head_dim=128, d_ff=8192, max_len=262144, position="rope",
        norm="rmsnorm", norm_eps=1e-5, activation="swiglu", ffn_bias=False,
        tie_embeddings=False, layer_pattern=3 * ("chunked",) + ("nope",),
        ffn_pattern=("moe",),
        rope=dict(theta=500000.0, layout="interleaved"),  # complex pairs, as Meta's
        moe=dict(num_experts=16, experts_per_token=1, score="sigmoid", gate_input=True,
                 shared_experts=1, router_renormalize=False),
                 attention=dict(qk_norm=True, qk_norm_kind="rmsnorm_unit", qk_norm_layers="rope",
                                chunk=8192, temperature_floor=8192, temperature_scale=0.1)))
    return apply_variant(cfg, arg, {
        "tiny": {"model": dict(vocab_size=BYTE_VOCAB, d_model=64, num_layers=4, num_heads=4,
                               num_kv_heads=2, head_dim=16, d_ff=64, max_len=2048,
                               moe=dict(num_experts=4),
                               attention=dict(chunk=8, temperature_floor=8))},
    })
