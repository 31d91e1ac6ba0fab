"""The `make train` preset: a tiny Llama-style byte-level decoder LM trained on the
Python standard library's own sources (the stdlib corpus of `tfjax.data`), on CPU.

    python -m tfjax.train --config configs/default.py --workdir workdirs/default

Llama recipe at toy size (0.82M parameters): RoPE, RMSNorm, SwiGLU, GQA, no biases,
tied embeddings; bytes (259 ids: 256 + pad, bos, eos); 1500 steps of 32 rows x 128
tokens (6.14M tokens) in four microbatches of 8, AdamW 4e-3, warmup 50, cosine to
5% (the recipe: experiments/results/default_recipe.md); remat `qkv_attn`, which on
CPU is faster than keeping every activation, and four microbatches, faster than two
now that each device sums its gradients once a step (measured in
experiments/results/bench_train_cpu.md and train_default_cpu.md). Expected on an idle 2-core CPU (one device
per core): about 4 minutes, then val 1.663 bits/byte on the 147,369 validation bytes,
printed beside gzip -9 (1.913) and xz -9e (1.697) on the same bytes
(experiments/results/train_default_cpu.md).
Variants: "quick" (a smoke run of ~30 s), "tiny" (a 2-layer d=64 model), "small"
(d=256, 6 layers, 4.79M parameters: experiments/bench_train.py's second preset; remat
`dots_attn`, faster there than `qkv_attn`, which is faster at the default's size:
experiments/results/bench_train_cpu.md).
"""

from tfjax.config import apply_variant, default_config


def get_config(arg=None):
    cfg = default_config()
    cfg.model.update(dict(
        arch="decoder", vocab_size=259, d_model=128, num_layers=4, num_heads=4, num_kv_heads=2,
        d_ff=384, max_len=1024, position="rope", norm="rmsnorm", activation="swiglu",
        ffn_bias=False, qkv_bias=False, out_bias=False, tie_embeddings=True, norm_bias=False,
        scale_embeddings=False, remat="qkv_attn"))
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
