"""The `make train` preset: a tiny Llama-style byte-level decoder LM trained on the
Python standard library's own sources (the stdlib corpus of `tfjax.data`), on CPU.

    python -m tfjax.train --config configs/default.py --workdir workdirs/default

Llama recipe at toy size: RoPE, RMSNorm, SwiGLU, GQA, no biases, tied embeddings;
bytes (259 ids: 256 + pad, bos, eos); 1500 steps of 32 rows x 128 tokens in four
microbatches, AdamW with warmup and a cosine decay, remat `qkv_attn`. Expected on an
idle 2-core CPU: a few minutes, then validation bits per byte below gzip -9 and
xz -9e on the same bytes, printed beside them (figures and how the recipe was chosen:
experiments/results/train_default_cpu.md, default_recipe.md, bench_train_cpu.md).
Variants: "quick" (a smoke run), "tiny" (a 2-layer d=64 model), "small" (d=256, 6
layers: experiments/bench_train.py's second preset, remat `dots_attn`).
"""

from tfjax.config import apply_variant, default_config


def get_config(arg=None):
    cfg = default_config()
    cfg.model.update(dict(
        arch="decoder", vocab_size=259, d_model=128, num_layers=4, num_heads=4, num_kv_heads=2,
        d_ff=384, max_len=1024, position="rope", norm="rmsnorm", activation="swiglu",
        ffn_bias=False, tie_embeddings=True, norm_bias=False, scale_embeddings=False,
        remat="qkv_attn", attention=dict(qkv_bias=False, out_bias=False)))
    cfg.train.update(dict(
        steps=1500, batch_size=32, microbatches=4, seq_len=128, lr=4e-3, warmup_steps=50,
        lr_min_ratio=0.05,
        weight_decay=0.1, grad_clip=1.0, log_every=10, eval_every=0, eval_batches=0,
        sample_tokens=160, sample_prompt="def "))
    cfg.checkpoint.update(dict(every_steps=500, keep=2))
    return apply_variant(cfg, arg, {
        "quick": {"train": dict(steps=40, warmup_steps=10, eval_batches=4, sample_tokens=40)},
        "tiny": {"model": dict(d_model=64, num_layers=2, d_ff=192)},
        "small": {"model": dict(d_model=256, num_layers=6, num_heads=8, num_kv_heads=4, d_ff=768,
                                remat="dots_attn")},
    })
