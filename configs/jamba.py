"""Jamba (Lieber et al. 2024, "Jamba: A Hybrid Transformer-Mamba Language Model"):
blocks of 8 layers, one attention layer (GQA 32/8, no position encoding) at
offset 4 and seven Mamba layers (with RMSNorms on dt, B, C; dt rank 256), and a
16-expert top-2 MoE replacing the MLP in every other layer (offset 1); router
gates are not renormalised. Default: Jamba-v0.1 (51,570,323,328 parameters by
its config; the model card says 52B total, 12B active).
Variants: "tiny" (CPU: 4 layers, attention at 2, 4 experts).

    python -m tfjax.train --config configs/jamba.py:tiny --workdir /tmp/jamba

In tfjax terms: layer_pattern = 4 x mamba, global, 3 x mamba; ffn_pattern =
(dense, moe); the scanned cycle is lcm(8, 2) = 8 layers.
"""

from tfjax.config import apply_variant, default_config

BYTE_VOCAB = 259  # tfjax.data's byte tokenizer: 256 bytes + pad, bos, eos

PATTERN = ("mamba",) * 4 + ("global",) + ("mamba",) * 3  # attn_layer_offset 4, period 8


def get_config(arg=None):
    cfg = default_config()
    cfg.model.update(dict(
        arch="decoder", vocab_size=65536, d_model=4096, num_layers=32, num_heads=32,
        num_kv_heads=8, d_ff=14336, max_len=262144, position="none", norm="rmsnorm",
        norm_eps=1e-6, activation="swiglu", ffn_bias=False, tie_embeddings=False,
        layer_pattern=PATTERN, ffn_pattern=("dense", "moe"),
        moe=dict(num_experts=16, experts_per_token=2, router_renormalize=False,
                 aux_loss_weight=0.001),
        ssm=dict(d_state=16, d_conv=4, expand=2, dt_rank=256, conv_bias=True, proj_bias=False,
                 inner_norm=True, chunk=256)))
    return apply_variant(cfg, arg, {
        # Jamba-tiny-random's shape: attention every 4 layers (offset 2).
        "tiny": {"model": dict(vocab_size=BYTE_VOCAB, d_model=64, num_layers=4, num_heads=4,
                               num_kv_heads=2, d_ff=96, max_len=2048, moe=dict(num_experts=4),
                               layer_pattern=("mamba", "mamba", "global", "mamba"),
                               ssm=dict(dt_rank=8, d_state=8, chunk=64))},
    })
