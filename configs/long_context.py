"""Long-context training with ring attention: the `default` tiny Llama-style byte
decoder at 16x its sequence length (2,048 tokens, not 128), split over 8 devices on
the `sequence` mesh axis.

    python -m tfjax.train --config configs/long_context.py --workdir workdirs/long_context \\
        --cpu_devices=8

Each of the 8 (simulated) devices holds 256 of the 2,048 tokens of every row (the
length one device would train in the same per-device memory), and every attention
layer runs `ring_attention` over the `sequence` axis, zig-zag balanced for the
causal mask: the trainer puts each batch (tokens, positions, segment ids, loss
weights) in zig-zag order once, so no layer re-lays out its q, k, v
(`model.attention.zigzag="data"`; `--config.model.attention.zigzag=layer` keeps natural order and
re-lays out in every layer, `none` runs unbalanced).
`--config.model.attention.context_parallel=all_gather` runs the all-gather baseline instead.
Everything else (embeddings, FFN, loss) is sequence-sharded.
Variants: "quick" (10 steps, a smoke run; a few minutes on 2 shared CPU cores,
mostly compilation), "tiny" (a 2-layer d=64 model; what the preset tests build).
Not tuned: there is no expected metric yet; compare `context_parallel` variants,
or `mesh.sequence=1` at `train.seq_len=256`, by loss at equal steps.
"""

from tfjax.config import apply_variant, default_config

DEVICES = 8
TOKENS_PER_DEVICE = 256


def get_config(arg=None):
    cfg = default_config()
    cfg.model.update(dict(
        arch="decoder", vocab_size=259, d_model=128, num_layers=4, num_heads=4, num_kv_heads=2,
        d_ff=384, max_len=DEVICES * TOKENS_PER_DEVICE, position="rope", norm="rmsnorm",
        activation="swiglu", ffn_bias=False, tie_embeddings=True, norm_bias=False,
        scale_embeddings=False,
        attention=dict(qkv_bias=False, out_bias=False, context_parallel="ring", zigzag="data")))
    cfg.train.update(dict(
        steps=200, batch_size=2, seq_len=DEVICES * TOKENS_PER_DEVICE, lr=3e-3,
        warmup_steps=20, lr_min_ratio=0.05, weight_decay=0.1, grad_clip=1.0, log_every=10,
        eval_every=0, eval_batches=0, sample_tokens=0))
    cfg.mesh.update(dict(data=1, fsdp=1, sequence=DEVICES, tensor=1, expert=1))
    cfg.checkpoint.update(dict(every_steps=100, keep=2))
    return apply_variant(cfg, arg, {
        "quick": {"train": dict(steps=10, warmup_steps=2, log_every=1)},
        "tiny": {"model": dict(d_model=64, num_layers=2, d_ff=192)},
    })
