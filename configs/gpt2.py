"""GPT-2 (Radford et al. 2019): decoder-only, learned positions, pre-LayerNorm,
GELU (tanh), biases everywhere, tied embeddings. Default: GPT-2 small (124M).

    python -m tfjax.train --config configs/gpt2.py:tiny --workdir /tmp/gpt2
"""

from tfjax.config import apply_variant, default_config

BYTE_VOCAB = 259  # tfjax.data's byte tokenizer: 256 bytes + pad, bos, eos


def get_config(arg=None):
    cfg = default_config()
    cfg.model.update(dict(
        arch="decoder", vocab_size=50257, d_model=768, num_layers=12, num_heads=12, d_ff=3072,
        max_len=1024, position="learned", norm="layernorm", norm_eps=1e-5,
        norm_placement="pre", activation="gelu_tanh", ffn_bias=True, tie_embeddings=True,
        init_std=0.02,
        attention=dict(qkv_bias=True, out_bias=True)))
    return apply_variant(cfg, arg, {
        "tiny": {"model": dict(vocab_size=BYTE_VOCAB, d_model=64, num_layers=2, num_heads=4,
                               d_ff=256, max_len=256)},
        "medium": {"model": dict(d_model=1024, num_layers=24, num_heads=16, d_ff=4096)},
    })
