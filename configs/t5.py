"""T5 (Raffel et al. 2020): encoder-decoder with bucketed relative position bias
(32 buckets, max distance 128; one table for the encoder, one for the decoder),
RMSNorm without bias (pre-norm), ReLU FFN, no biases, unscaled attention logits
(the scale is folded into the initialisation), tied embeddings with the output
rescaled by d_model^-1/2. Default: t5-base (v1.0).

    model = tfjax.models.build(get_config("tiny").model)
    logits = model(encoder_tokens, decoder_tokens)

Trains with T5's span corruption (`train.objective="span_corruption"`: noise density
0.15, mean span 3, each span a sentinel in the encoder input; the decoder length
follows from train.seq_len) on the stdlib corpus by default:

    python -m tfjax.train --config configs/t5.py:tiny --workdir /tmp/t5

(300 steps of 16 rows, encoder 128 / decoder 32 tokens: about 85 s on a busy 2-core
CPU, then val_loss 3.27 nats per target token, val_accuracy 0.224)

or on a jsonl of `input` / `target` pairs with `--config.train.objective=seq2seq
--config.data.source=jsonl --config.data.paths="('pairs.jsonl',)"`. Sentinels are
the ids after the byte tokenizer's 259, so "tiny" keeps vocab_size 512.
"""

from tfjax.config import apply_variant, default_config


def get_config(arg=None):
    cfg = default_config()
    cfg.model.update(dict(
        arch="encoder_decoder", vocab_size=32128, d_model=768, num_layers=12, num_heads=12,
        d_ff=3072, max_len=512, position="t5", t5=dict(num_buckets=32, max_distance=128),
        norm="rmsnorm", norm_eps=1e-6, norm_placement="pre", activation="relu",
        ffn_bias=False, tie_embeddings=True,
        logits_scale=768 ** -0.5, dropout_rate=0.1,
        attention=dict(qkv_bias=False, out_bias=False, scale=1.0)))
    cfg.train.objective = "span_corruption"
    return apply_variant(cfg, arg, {
        "tiny": {"model": dict(vocab_size=512, d_model=64, num_layers=2, num_heads=4, d_ff=256,
                               t5=dict(num_buckets=16, max_distance=32), logits_scale=64 ** -0.5,
                               dropout_rate=0.0),
                 "train": dict(seq_len=128, batch_size=16, steps=300, warmup_steps=30)},
        "v1_1": {"model": dict(activation="geglu", tie_embeddings=False, logits_scale=1.0,
                               d_ff=2048, dropout_rate=0.0)},
    })
