"""Gemma 2 (Gemma Team 2024): local/global alternation (4096-token window),
sandwich norm with (1 + w) RMSNorm, attention logit soft-cap 50, final soft-cap
30, GeGLU (tanh), GQA, head dim 256 with query scale 256^-1/2, embeddings scaled
by sqrt(d_model), tied output. Default: Gemma-2-2B.

    python -m tfjax.train --config configs/gemma2.py:tiny --workdir /tmp/gemma2
"""

from tfjax.config import apply_variant, default_config

BYTE_VOCAB = 259  # tfjax.data's byte tokenizer: 256 bytes + pad, bos, eos


def get_config(arg=None):
    cfg = default_config()
    cfg.model.update(dict(
        arch="decoder", vocab_size=256000, d_model=2304, num_layers=26, num_heads=8,
        num_kv_heads=4, head_dim=256, d_ff=9216, max_len=8192, position="rope",
        norm="rmsnorm_plus_one", norm_eps=1e-6, norm_placement="sandwich",
        activation="geglu_tanh", ffn_bias=False, tie_embeddings=True, scale_embeddings=True,
        final_softcap=30.0,
        layer_pattern=("local", "global"),
        attention=dict(scale=256 ** -0.5, softcap=50.0, sliding_window=4096)))
    return apply_variant(cfg, arg, {
        "tiny": {"model": dict(vocab_size=BYTE_VOCAB, d_model=64, num_layers=4, num_heads=4,
                               num_kv_heads=2, head_dim=16, d_ff=192, max_len=2048,
                               attention=dict(scale=0.25, sliding_window=32))},
        "9b": {"model": dict(d_model=3584, num_layers=42, num_heads=16, num_kv_heads=8,
                             d_ff=14336)},
    })
