"""gpt-oss (OpenAI 2025, gpt-oss-20b): a decoder of 24 layers alternating a sliding-
window layer (128 keys) and a full-attention layer, GQA 64/8 of head_dim 64 with
biases on q, k, v and o and a learned sink logit per head (`model.attention.sinks`),
RoPE of base 150k with YaRN x32 over a 4,096-token pre-training context; every
feed-forward a 32-expert top-4 MoE whose experts and router carry biases, with
gpt-oss's clamped SwiGLU ((clip(up, ±7) + 1) * gate * sigmoid(1.702 gate), gate <= 7)
and softmax gates over the chosen experts (`tfjax.nn.moe`). RMSNorm, untied
embeddings, vocab 201,088. Default: gpt-oss-20b (20,914,757,184 parameters, what
transformers' GptOssForCausalLM of its config counts; the model card: 21B total,
3.6B active). Variant "tiny" (CPU: 4 layers, d=64, 4 experts).

    python -m tfjax.train --config configs/gpt_oss.py:tiny --workdir /tmp/gptoss

In tfjax terms: layer_pattern = (local, global); ffn_pattern = (moe,); moe: 32
experts, 4 per token, router_bias, glu="clamped", expert biases from model.ffn_bias.
"""

from tfjax.config import apply_variant, default_config

BYTE_VOCAB = 259  # tfjax.data's byte tokenizer: 256 bytes + pad, bos, eos


def get_config(arg=None):
    cfg = default_config()
    cfg.model.update(dict(
        arch="decoder", vocab_size=201088, d_model=2880, num_layers=24, num_heads=64,
        num_kv_heads=8, head_dim=64, d_ff=2880, max_len=131072, position="rope",
        norm="rmsnorm", norm_eps=1e-5, activation="swiglu", ffn_bias=True, tie_embeddings=False,
        # HF's sliding_window=128 counts the query: 127 keys before it, here
        layer_pattern=("local", "global"), ffn_pattern=("moe",),
        rope=dict(theta=150000.0, scaling="yarn", factor=32.0, original_max_len=4096,
                  beta_fast=32.0, beta_slow=1.0, truncate=False),
        moe=dict(num_experts=32, experts_per_token=4, router_bias=True, glu="clamped",
                 glu_alpha=1.702, glu_limit=7.0, router_renormalize=True),
                 attention=dict(qkv_bias=True, out_bias=True, sinks=True, sliding_window=127)))
    return apply_variant(cfg, arg, {
        "tiny": {"model": dict(vocab_size=BYTE_VOCAB, d_model=64, num_layers=4, num_heads=4,
                               num_kv_heads=2, head_dim=16, d_ff=64, max_len=2048,
                               moe=dict(num_experts=4, experts_per_token=2),
                               rope=dict(original_max_len=256), attention=dict(sliding_window=8))},
    })
