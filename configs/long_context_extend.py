"""Context extension: continue a trained `default` run (128 tokens a row) at 8x its
sequence length (1,024) with Llama 3's RoPE scaling, ring attention over 4 devices on
the `sequence` mesh axis, then test retrieval with the passkey evaluation.

    python -m tfjax.train --config configs/default.py --workdir workdirs/default
    python -m tfjax.train --config configs/long_context_extend.py --workdir workdirs/extend \\
        --cpu_devices=4
    python -m tfjax.eval.passkey --workdir workdirs/extend --cpu_devices 4 --mesh sequence=4 \\
        --output workdirs/extend/passkey.json --plot workdirs/extend/passkey.png

The model and its weights come from `init_from` (a tfjax workdir or a Hugging Face
checkpoint); `context_extension=True` lets this config's `model.rope` (scaling "llama3",
factor 8, original_max_len 128) replace the checkpoint's, and nothing else of the model
(`tfjax.train.init_from.CONTEXT_FIELDS`). `--config.model.attention.context_parallel=
ulysses` (num_heads divisible by mesh.sequence) or `usp` with `attention.ulysses_size`
run the other context-parallel modes. Variants: "quick": 10 steps from a
`configs/default.py:quick` run (workdirs/default_quick), a smoke run of a few minutes
on 2 CPU cores; "tiny": 20 steps from a `configs/default.py:tiny` run
(workdirs/default_tiny, the 2-layer d=64 model). Not tuned: no expected metric; docs/long_context.md ("Long-context
recipe") shows what the CPU run measured.
"""

from tfjax.config import apply_variant, default_config

ORIGINAL_LEN = 128  # the default preset's train.seq_len
FACTOR = 8
DEVICES = 4


def get_config(arg=None):
    cfg = default_config()
    cfg.init_from = "workdirs/default"
    cfg.context_extension = True
    cfg.model.update(dict(
        max_len=FACTOR * ORIGINAL_LEN,
        rope=dict(scaling="llama3", factor=float(FACTOR), original_max_len=ORIGINAL_LEN),
        attention=dict(context_parallel="ring", zigzag="data")))
    cfg.train.update(dict(
        steps=200, batch_size=4, seq_len=FACTOR * ORIGINAL_LEN, lr=1e-3, warmup_steps=20,
        lr_min_ratio=0.1, weight_decay=0.1, grad_clip=1.0, log_every=10, eval_every=0,
        eval_batches=0, sample_tokens=0))
    cfg.mesh.update(dict(data=1, fsdp=1, sequence=DEVICES, tensor=1, expert=1))
    cfg.checkpoint.update(dict(every_steps=100, keep=2))
    return apply_variant(cfg, arg, {
        "quick": {"init_from": "workdirs/default_quick",
                  "train": dict(steps=10, warmup_steps=2, log_every=1)},
        "tiny": {"init_from": "workdirs/default_tiny",
                 "train": dict(steps=20, warmup_steps=2, log_every=5)},
    })
