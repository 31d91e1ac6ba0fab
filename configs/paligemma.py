"""PaliGemma 2 (Steiner et al. 2024): a SigLIP image tower (no head) whose patch
features, through a linear projector, are the bidirectional prefix of a Gemma 2
decoder, trained with `train.objective="image_lm"` (image + prompt -> target, loss
on the target). Default: PaliGemma-2-3B at 224 px (SigLIP So400m/14, Gemma-2-2B).

    python -m tfjax.train --config configs/paligemma.py:tiny --workdir /tmp/paligemma

"tiny" (CPU): a 4-layer d=64 decoder and a 2-layer d=48 tower on the built-in shape
scenes (`data.source="synthetic"`: 24 px images, 3 x 3 patches of 8 px; captions and VQA,
byte tokenizer with the image token at id 259), 1200 steps of 32 rows x 64 tokens. The
loss falls from ~5.6 to ~0.35 in the first 150 steps and to ~0.1 by step 1200; held-out
greedy answers: colour questions all right, shapes and places still mostly guessed
(val_exact_match ~0.27), in ~17 min on a heavily loaded 2-core CPU
(experiments/results/multimodal_training.md).
"""

from tfjax.config import apply_variant, default_config

BYTE_VOCAB = 259  # tfjax.data's byte tokenizer: 256 bytes + pad, bos, eos


def get_config(arg=None):
    cfg = default_config()
    cfg.model.update(dict(
        arch="decoder", vocab_size=257216, d_model=2304, num_layers=26, num_heads=8,
        num_kv_heads=4, head_dim=256, d_ff=9216, max_len=8192, position="rope",
        norm="rmsnorm_plus_one", norm_eps=1e-6, norm_placement="sandwich",
        activation="geglu_tanh", ffn_bias=False, tie_embeddings=True, scale_embeddings=True,
        final_softcap=30.0, prefix_lm=True, layer_pattern=("local", "global"),
        attention=dict(scale=256 ** -0.5, softcap=50.0, sliding_window=4096),
        vision=dict(image_size=224, patch_size=14, pooling="none", image_token_id=257152,
                    d_model=1152, num_layers=27, num_heads=16, d_ff=4304,
                    activation="gelu_tanh", norm_eps=1e-6)))
    cfg.train.update(dict(objective="image_lm", seq_len=512, sample_tokens=0))
    # your examples: --config.data.source=jsonl --config.data.paths="('DIR/train.jsonl',)"
    cfg.data.update(dict(source="synthetic"))
    return apply_variant(cfg, arg, {
        "tiny": {
            "model": dict(vocab_size=BYTE_VOCAB + 1, d_model=64, num_layers=4, num_heads=4,
                          num_kv_heads=2, head_dim=16, d_ff=192, max_len=64,
                          attention=dict(scale=0.25, sliding_window=64),
                          vision=dict(image_size=24, patch_size=8, image_token_id=BYTE_VOCAB,
                                      d_model=48, num_layers=2, num_heads=4, d_ff=96)),
            "train": dict(steps=1200, batch_size=32, seq_len=64, lr=3e-3, warmup_steps=50,
                          lr_min_ratio=0.05, weight_decay=0.01, grad_clip=1.0, log_every=50,
                          eval_every=300, eval_batches=0),
            "checkpoint": dict(every_steps=600, keep=2)},
    })
