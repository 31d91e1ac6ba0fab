"""T5 (Raffel et al. 2020): encoder-decoder with bucketed relative position bias
(32 buckets, max distance 128; one table for the encoder, one for the decoder),
RMSNorm without bias (pre-norm), ReLU FFN, no biases, unscaled attention logits
(the scale is folded into the initialisation), tied embeddings with the output
rescaled by d_model^-1/2. Default: t5-base (v1.0).

    model = tfjax.models.build(get_config("tiny").model)
    logits = model(encoder_tokens, decoder_tokens)
"""

from tfjax.config import apply_variant, default_config


def get_config(arg=None):
    cfg = default_config()
    cfg.model.update(dict(
        arch="encoder_decoder", vocab_size=32128, d_model=768, num_layers=12, num_heads=12,
        d_ff=3072, max_len=512, position="t5", t5=dict(num_buckets=32, max_distance=128),
        norm="rmsnorm", norm_eps=1e-6, norm_placement="pre", activation="relu",
        ffn_bias=False, qkv_bias=False, out_bias=False, attn_scale=1.0, tie_embeddings=True,
        logits_scale=768 ** -0.5, dropout_rate=0.1))
    return apply_variant(cfg, arg, {
        "tiny": {"model": dict(vocab_size=512, d_model=64, num_layers=2, num_heads=4, d_ff=256,
                               t5=dict(num_buckets=16, max_distance=32), logits_scale=64 ** -0.5,
                               dropout_rate=0.0)},
        "v1_1": {"model": dict(activation="geglu", tie_embeddings=False, logits_scale=1.0,
                               d_ff=2048, dropout_rate=0.0)},
    })
