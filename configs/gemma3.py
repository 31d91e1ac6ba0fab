"""Gemma 3 (Gemma Team 2025), text decoder: five sliding-window layers per global
one (local RoPE base 10k, unscaled; global base 1M, linear x8 from the 4B up),
QK-norm per head, sandwich norms with (1 + w) RMSNorm, GeGLU (tanh), GQA, no
soft-caps, embeddings scaled by sqrt(d_model), tied output. Default: Gemma-3-1B.
Variants: "4b", "27b" (their text decoders), "tiny" (CPU).

    python -m tfjax.train --config configs/gemma3.py:tiny --workdir /tmp/gemma3
"""

from tfjax.config import apply_variant, default_config

BYTE_VOCAB = 259  # tfjax.data's byte tokenizer: 256 bytes + pad, bos, eos
PATTERN = ("local",) * 5 + ("global",)


def get_config(arg=None):
    cfg = default_config()
    cfg.model.update(dict(
        arch="decoder", vocab_size=262144, d_model=1152, num_layers=26, num_heads=4,
        num_kv_heads=1, head_dim=256, d_ff=6912, max_len=32768, position="rope",
        norm="rmsnorm_plus_one", norm_eps=1e-6, norm_placement="sandwich",
        activation="geglu_tanh", ffn_bias=False, tie_embeddings=True, scale_embeddings=True,
        layer_pattern=PATTERN,
        attention=dict(qk_norm=True, scale=256 ** -0.5, sliding_window=512,
                       local_rope_theta=10000.0)))
    cfg.model.rope.update(dict(theta=1_000_000.0))
    big = dict(vocab_size=262208, max_len=131072, rope=dict(scaling="linear", factor=8.0),
               attention=dict(sliding_window=1024))
    return apply_variant(cfg, arg, {
        "tiny": {"model": dict(vocab_size=BYTE_VOCAB, d_model=64, num_layers=7, num_heads=4,
                               num_kv_heads=2, head_dim=16, d_ff=192, max_len=2048,
                               rope=dict(theta=10000.0),
                               attention=dict(scale=0.25, sliding_window=32,
                                              local_rope_theta=100.0))},
        "4b": {"model": dict(big, d_model=2560, num_layers=34, num_heads=8, num_kv_heads=4,
                             d_ff=10240)},
        "27b": {"model": dict(big, d_model=5376, num_layers=62, num_heads=32, num_kv_heads=16,
                              head_dim=128, d_ff=21504, attention=dict(scale=168 ** -0.5))},
    })
