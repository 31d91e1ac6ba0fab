"""Mixtral 8x7B (Jiang et al. 2024, "Mixtral of Experts"): the Mistral-7B decoder
(GQA 32/8, RoPE theta 1e6, RMSNorm, no biases, untied output) with every
feed-forward a sparse Mixture of Experts: 8 SwiGLU experts, top-2 routing,
softmax then top-k with the two gates renormalised, dropless dispatch (grouped
matmul), load-balancing loss 0.02 and router z-loss 0.001. Default:
Mixtral-8x7B-v0.1 (46,702,792,704 parameters, ~12.9B active per token).
Variants: "tiny" (CPU, 4 experts), "tiny_capacity" (tiny with capacity factor
1.25: over-capacity tokens are dropped, the GShard/Switch regime).

    python -m tfjax.train --config configs/mixtral.py:tiny --workdir /tmp/mixtral

The trainer adds `tfjax.nn.moe.moe_aux(model)["aux_loss"]` to the loss; expert
load and dropped-token metrics come from the same call. Expert weights carry the
logical axis "expert": set --config.mesh.expert=N for expert parallelism.
"""

from tfjax.config import apply_variant, default_config

BYTE_VOCAB = 259  # tfjax.data's byte tokenizer: 256 bytes + pad, bos, eos

TINY = dict(vocab_size=BYTE_VOCAB, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
            d_ff=96, max_len=2048, moe=dict(num_experts=4, experts_per_token=2))


def get_config(arg=None):
    cfg = default_config()
    cfg.model.update(dict(
        arch="decoder", vocab_size=32000, d_model=4096, num_layers=32, num_heads=32,
        num_kv_heads=8, d_ff=14336, max_len=32768, position="rope", norm="rmsnorm",
        norm_eps=1e-5, activation="swiglu", ffn_bias=False, tie_embeddings=False,
        ffn_pattern=("moe",),
        moe=dict(num_experts=8, experts_per_token=2, router_renormalize=True, capacity_factor=0.0,
                 impl="ragged", aux_loss_weight=0.02, z_loss_weight=0.001)))
    cfg.model.rope.theta = 1e6
    return apply_variant(cfg, arg, {
        "tiny": {"model": TINY},
        "tiny_capacity": {"model": dict(TINY, moe=dict(TINY["moe"], capacity_factor=1.25))},
    })
