"""Qwen3-Next (Qwen team 2025, Qwen3-Next-80B-A3B): a hybrid decoder of 48 layers in
cycles of three Gated DeltaNet layers and one gated-attention layer, every layer's
feed-forward a 512-expert top-10 MoE with a shared expert behind its own sigmoid
gate. The attention layers: GQA 16/2 of head_dim 256, QK-norm per head, RoPE on a
quarter of each head (base 10M), the output gated per channel by sigmoid(x W_gate)
(`model.attention.output_gate`). The Gated DeltaNet layers: 16 q/k heads and 32 value
heads of 128, short convolutions of width 4, output gate and norm
(`tfjax.nn.gated_deltanet`). Norms are zero-centred RMSNorms (`rmsnorm_plus_one`:
x * (1 + w)). Untied embeddings, vocab 151,936. Default: Qwen3-Next-80B-A3B
(79,674,391,296 parameters, what transformers' Qwen3NextForCausalLM of its config
counts; the model card: 80B total, 3B active). Variant "tiny" (CPU: 4 layers, d=64,
4 experts).

    python -m tfjax.train --config configs/qwen3_next.py:tiny --workdir /tmp/qwen3next

In tfjax terms: layer_pattern = 3 x gated_deltanet + global; ffn_pattern = (moe,);
moe: 512 experts, 10 per token, renormalised softmax gates, one shared expert of 512
with `shared_gate`.
"""

from tfjax.config import apply_variant, default_config

BYTE_VOCAB = 259  # tfjax.data's byte tokenizer: 256 bytes + pad, bos, eos


def get_config(arg=None):
    cfg = default_config()
    cfg.model.update(dict(
        arch="decoder", vocab_size=151936, d_model=2048, num_layers=48, num_heads=16,
        num_kv_heads=2, head_dim=256, d_ff=5632, max_len=262144, position="rope",
        norm="rmsnorm_plus_one", norm_eps=1e-6, activation="swiglu", ffn_bias=False,
        tie_embeddings=False,
        layer_pattern=3 * ("gated_deltanet",) + ("global",), ffn_pattern=("moe",),
        rope=dict(theta=10_000_000.0, fraction=0.25),
        moe=dict(num_experts=512, experts_per_token=10, d_ff=512, shared_experts=1,
                 shared_d_ff=512, shared_gate=True, router_renormalize=True,
                 aux_loss_weight=0.001),
        gdn=dict(num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128, d_conv=4,
                 chunk=64), attention=dict(qkv_bias=False, qk_norm=True, output_gate=True)))
    return apply_variant(cfg, arg, {
        "tiny": {"model": dict(vocab_size=BYTE_VOCAB, d_model=64, num_layers=4, num_heads=4,
                               num_kv_heads=2, head_dim=16, d_ff=96, max_len=2048,
                               moe=dict(num_experts=4, experts_per_token=2, d_ff=32,
                                        shared_d_ff=32),
                               gdn=dict(num_k_heads=2, num_v_heads=4, head_k_dim=16,
                                        head_v_dim=16, chunk=16))},
    })
