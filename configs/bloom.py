"""BLOOM (BigScience 2022): ALiBi positions (no embeddings of position), a
LayerNorm right after the token embedding, GELU (tanh), biases, tied output.
Default: BLOOM-560m.

    python -m tfjax.train --config configs/bloom.py:tiny --workdir /tmp/bloom
"""

from tfjax.config import apply_variant, default_config

BYTE_VOCAB = 259  # tfjax.data's byte tokenizer: 256 bytes + pad, bos, eos


def get_config(arg=None):
    cfg = default_config()
    cfg.model.update(dict(
        arch="decoder", vocab_size=250880, d_model=1024, num_layers=24, num_heads=16, d_ff=4096,
        max_len=2048, position="alibi", norm="layernorm", norm_eps=1e-5, embed_norm=True,
        activation="gelu_tanh", ffn_bias=True, tie_embeddings=True,
        attention=dict(qkv_bias=True, out_bias=True)))
    return apply_variant(cfg, arg, {
        "tiny": {"model": dict(vocab_size=BYTE_VOCAB, d_model=64, num_layers=2, num_heads=6,
                               head_dim=16, d_ff=256, max_len=2048)},
    })
