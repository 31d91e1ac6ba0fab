"""Preference optimisation preset (DPO; IPO, ORPO, SimPO by `train.objective`): start from
a Hugging Face checkpoint or a tfjax workdir (`init_from`, also the frozen reference)
and train on jsonl preference pairs (`tfjax.train.preference`, `tfjax.data.pairs`).

    python -m tfjax.train --config configs/dpo.py --workdir W \\
        --config.init_from=DIR --config.data.paths="('pairs.jsonl',)"
    python -m tfjax.train --config configs/dpo.py:lora ...      # the reference is the frozen base
    ... --config.train.objective=simpo --config.train.preference.beta=2.0

Each jsonl line is {"prompt": "...", "chosen": "...", "rejected": "..."} (or parquet files /
a `datasets` directory with those columns: --config.data.paths="('pairs/*.parquet',)"); the two
sequences of a pair are packed into one 1024-token row (with other whole pairs), the
loss on the responses. beta 0.1 (TRL's default), lr 5e-7 as in the DPO / Zephyr
recipes (LoRA: 5e-5). Logged as TRL logs: loss, rewards/chosen, rewards/rejected,
rewards/accuracies, rewards/margins (val_* at each evaluation). Variants: "lora" (rank
16, alpha 32, every matrix); "tiny": 24 steps of 4 x 128 tokens at lr 5e-3 (tests,
seconds on a CPU from a tiny checkpoint). Expect rewards/accuracies to rise from ~0.5
and rewards/margins from 0; run time depends on the checkpoint.
"""

from tfjax.config import apply_variant, default_config


def get_config(arg=None):
    cfg = default_config()  # model section at its defaults: the checkpoint's wins
    cfg.init_from = ""  # set on the command line: --config.init_from=DIR
    cfg.data.update(dict(source="jsonl", tokenizer="init_from", paths=("pairs.jsonl",)))
    cfg.train.update(dict(
        objective="dpo", steps=500, batch_size=8, seq_len=1024, lr=5e-7, schedule="linear",
        warmup_steps=50, lr_min_ratio=0.0, weight_decay=0.0, grad_clip=1.0, log_every=10,
        eval_every=100, eval_batches=8, sample_tokens=0))
    cfg.train.preference.update(dict(beta=0.1, label_smoothing=0.0, simpo_gamma=0.5))
    cfg.checkpoint.update(dict(every_steps=100, keep=2))
    return apply_variant(cfg, arg, {
        "lora": {"lora": dict(rank=16, alpha=32.0, targets="all"), "train": dict(lr=5e-5)},
        "tiny": {"train": dict(steps=24, batch_size=4, seq_len=128, lr=5e-3, warmup_steps=2,
                               schedule="constant", log_every=1, eval_every=0, eval_batches=2),
                 "checkpoint": dict(every_steps=0, async_save=False)},
    })
