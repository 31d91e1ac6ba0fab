"""DeepSeek-V3 (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report"): 61 layers of
Multi-head Latent Attention (128 heads; a 1,536-rank query, a 512-wide key/value
latent with a shared 64-dim rotary key, 128 + 64 query/key dims per head, values of
128; `tfjax.nn.latent_attention`, whose KV cache holds the latent alone) and, after
three dense layers (FFN 18,432), a 256-expert MoE of width 2,048 with one shared
expert: sigmoid scores, group-limited top-8 (8 groups, the best 4 kept by their top-2
scores), the score-correction bias for choosing experts (updated by the
auxiliary-loss-free balancing rule in training, `moe.bias_update_rate`), gates
renormalised and scaled by 2.5 (`tfjax.nn.moe`). RoPE with YaRN x40 over 4,096
tokens and DeepSeek's softmax mscale. RMSNorm, untied embeddings, vocab 129,280.
Default: DeepSeek-V3 (671,026,404,352 parameters without the multi-token-prediction
module, what transformers' DeepseekV3ForCausalLM of its config counts; the report:
671B total, 37B active). Variant "tiny" (CPU: 4 layers, the first dense).

    python -m tfjax.train --config configs/deepseek_v3.py:tiny --workdir /tmp/dsv3

In tfjax terms: layer_pattern = (mla,); ffn_pattern = 3 x dense + 58 x moe (the
whole stack is the scanned unit, so it is unrolled: compile time grows with depth).
"""

from tfjax.config import apply_variant, default_config

BYTE_VOCAB = 259  # tfjax.data's byte tokenizer: 256 bytes + pad, bos, eos


def get_config(arg=None):
    cfg = default_config()
    cfg.model.update(dict(
        arch="decoder", vocab_size=129280, d_model=7168, num_layers=61, num_heads=128,
        num_kv_heads=128, d_ff=18432, max_len=163840, position="rope", norm="rmsnorm",
        norm_eps=1e-6, activation="swiglu", ffn_bias=False, tie_embeddings=False,
        layer_pattern=("mla",), ffn_pattern=3 * ("dense",) + 58 * ("moe",),
        rope=dict(theta=10000.0, scaling="yarn", factor=40.0, original_max_len=4096,
                  layout="interleaved",  # HF's rope_interleave
                  # HF's mscale = mscale_all_dim = 1: cos / sin untempered (0 here), the
                  # softmax scaled by mla.mscale_all_dim's factor squared
                  beta_fast=32.0, beta_slow=1.0, mscale=0.0),
        mla=dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                 qk_rope_head_dim=64, v_head_dim=128, mscale_all_dim=1.0),
        moe=dict(num_experts=256, experts_per_token=8, d_ff=2048, shared_experts=1,
                 score="sigmoid", n_group=8, topk_group=4, score_bias=True,
                 bias_update_rate=0.001, routed_scaling_factor=2.5,
                 router_renormalize=True, aux_loss_weight=0.0001)))
    return apply_variant(cfg, arg, {
        "tiny": {"model": dict(vocab_size=BYTE_VOCAB, d_model=64, num_layers=4, num_heads=4,
                               num_kv_heads=4, d_ff=128, max_len=2048,
                               ffn_pattern=("dense",) + 3 * ("moe",),
                               rope=dict(original_max_len=256),
                               mla=dict(q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
                                        qk_rope_head_dim=8, v_head_dim=16),
                               moe=dict(num_experts=8, experts_per_token=2, d_ff=32,
                                        n_group=4, topk_group=2))},
    })
