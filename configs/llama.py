"""Llama 3.1 (Dubey et al. 2024): decoder-only, GQA (32 query / 8 kv heads), RoPE
(theta 500k, llama3 scaling x8 from 8k), RMSNorm, SwiGLU, no biases, untied
output. Default: Llama-3.1-8B. Variants: "tiny" (CPU), "1b" (Llama-3.2-1B).

    python -m tfjax.train --config configs/llama.py:tiny --workdir /tmp/llama
"""

from tfjax.config import apply_variant, default_config

BYTE_VOCAB = 259  # tfjax.data's byte tokenizer: 256 bytes + pad, bos, eos


def get_config(arg=None):
    cfg = default_config()
    cfg.model.update(dict(
        arch="decoder", vocab_size=128256, d_model=4096, num_layers=32, num_heads=32,
        num_kv_heads=8, d_ff=14336, max_len=131072, position="rope", norm="rmsnorm",
        norm_eps=1e-5, norm_placement="pre", activation="swiglu", ffn_bias=False,
        tie_embeddings=False, attention=dict(qkv_bias=False, out_bias=False)))
    cfg.model.rope.update(dict(theta=500000.0, scaling="llama3", factor=8.0,
                               original_max_len=8192, low_freq_factor=1.0, high_freq_factor=4.0))
    return apply_variant(cfg, arg, {
        "tiny": {"model": dict(vocab_size=BYTE_VOCAB, d_model=64, num_layers=2, num_heads=4,
                               num_kv_heads=2, d_ff=192, max_len=2048,
                               rope=dict(theta=10000.0, scaling="none", factor=1.0))},
        "1b": {"model": dict(d_model=2048, num_layers=16, num_heads=32, num_kv_heads=8,
                             d_ff=8192, tie_embeddings=True, rope=dict(factor=32.0))},
    })
