"""Mistral 7B (Jiang et al. 2023): Llama-style decoder with GQA (32/8) and
sliding-window attention in every layer (a query sees 4096 keys back plus
itself). Default: Mistral-7B-v0.1.

    python -m tfjax.train --config configs/mistral.py:tiny --workdir /tmp/mistral
"""

from tfjax.config import apply_variant, default_config

BYTE_VOCAB = 259  # tfjax.data's byte tokenizer: 256 bytes + pad, bos, eos


def get_config(arg=None):
    cfg = default_config()
    cfg.model.update(dict(
        arch="decoder", vocab_size=32000, d_model=4096, num_layers=32, num_heads=32,
        num_kv_heads=8, d_ff=14336, max_len=32768, position="rope", norm="rmsnorm",
        norm_eps=1e-5, activation="swiglu", ffn_bias=False, tie_embeddings=False,
        layer_pattern=("local",), attention=dict(sliding_window=4096)))
    cfg.model.rope.theta = 10000.0
    return apply_variant(cfg, arg, {
        "tiny": {"model": dict(vocab_size=BYTE_VOCAB, d_model=64, num_layers=2, num_heads=4,
                               num_kv_heads=2, d_ff=192, max_len=2048,
                               attention=dict(sliding_window=32))},
    })
