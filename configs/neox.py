"""GPT-NeoX / Pythia (Black et al. 2022; Biderman et al. 2023): parallel
attention + FFN block with two LayerNorms, partial rotary (25% of each head),
exact GELU, biases, untied output. Default: Pythia-1.4B.

    python -m tfjax.train --config configs/neox.py:tiny --workdir /tmp/neox
"""

from tfjax.config import apply_variant, default_config

BYTE_VOCAB = 259  # tfjax.data's byte tokenizer: 256 bytes + pad, bos, eos


def get_config(arg=None):
    cfg = default_config()
    cfg.model.update(dict(
        arch="decoder", vocab_size=50304, d_model=2048, num_layers=24, num_heads=16, d_ff=8192,
        max_len=2048, position="rope", norm="layernorm", norm_eps=1e-5, block="parallel",
        parallel_shared_norm=False, activation="gelu", ffn_bias=True, tie_embeddings=False,
        attention=dict(qkv_bias=True, out_bias=True)))
    cfg.model.rope.update(dict(fraction=0.25, theta=10000.0, layout="half"))
    return apply_variant(cfg, arg, {
        "tiny": {"model": dict(vocab_size=BYTE_VOCAB, d_model=64, num_layers=2, num_heads=4,
                               d_ff=256, max_len=2048)},
    })
