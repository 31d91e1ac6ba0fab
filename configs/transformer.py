"""The original Transformer (Vaswani et al. 2017, "base"): encoder-decoder with
sinusoidal positions, post-LayerNorm, ReLU FFN, biases, embeddings scaled by
sqrt(d_model) and shared between encoder, decoder and output, dropout 0.1.

    model = tfjax.models.build(get_config("tiny").model)
    logits = model(source_tokens, target_tokens)
"""

from tfjax.config import apply_variant, default_config


def get_config(arg=None):
    cfg = default_config()
    cfg.model.update(dict(
        arch="encoder_decoder", vocab_size=37000, d_model=512, num_layers=6, num_heads=8,
        d_ff=2048, max_len=512, position="sinusoidal", norm="layernorm", norm_eps=1e-6,
        norm_placement="post", final_norm=False, activation="relu", ffn_bias=True,
        scale_embeddings=True, tie_embeddings=True,
        dropout_rate=0.1, attention=dict(qkv_bias=True, out_bias=True)))
    return apply_variant(cfg, arg, {
        "tiny": {"model": dict(vocab_size=512, d_model=64, num_layers=2, num_heads=4, d_ff=256,
                               dropout_rate=0.0)},
        "big": {"model": dict(d_model=1024, num_heads=16, d_ff=4096, dropout_rate=0.3)},
    })
