"""Fine-tuning preset: start from a Hugging Face checkpoint or a tfjax workdir
(`init_from`) and train on your own jsonl instruction data, the loss on the
completions only (`tfjax.train.init_from`, `tfjax.data.pipeline`).

    python -m tfjax.train --config configs/finetune.py --workdir W \\
        --config.init_from=DIR --config.data.paths="('train.jsonl',)"
    python -m tfjax.export --workdir W --out W/hf    # transformers' from_pretrained reads it

Each jsonl line is {"prompt": "...", "completion": "..."}, laid out as
[bos] + prompt + completion + [eos] and packed into 512-token rows with document
boundaries, as pretraining packs documents; 1 in 50 lines is held out for
validation (or name files with data.val_paths). The model (every shape field) and
the tokenizer (DIR/tokenizer.json) come from DIR; the model section of this file
sets only how it runs (float32 parameters, remat, attention implementation).
Variants: "text": plain text files (`data.source="text"`, every token a target);
"tiny": no checkpoint, a 2-layer d=64 byte-level decoder trained from scratch on the
jsonl (a smoke test of the instruction pipeline, seconds on a CPU); "lora": LoRA
(`tfjax.train.lora`) of rank 16, alpha 32 on every attention and FFN matrix, base
frozen, lr 2e-4 (`--config.lora.*` to change them).
Run time and metrics depend on the checkpoint and the data: with a 100M-parameter
model on one GPU expect a few minutes for the 300 steps; watch val_loss (nats per
completion token) fall from the base model's.
"""

from tfjax.config import apply_variant, default_config


def get_config(arg=None):
    cfg = default_config()  # model section at its defaults: the checkpoint's wins
    cfg.init_from = ""  # set on the command line: --config.init_from=DIR
    cfg.data.update(dict(source="jsonl", format="instruction", tokenizer="init_from",
                         paths=("train.jsonl",)))
    cfg.train.update(dict(
        steps=300, batch_size=8, seq_len=512, lr=2e-5, schedule="cosine", warmup_steps=20,
        lr_min_ratio=0.1, weight_decay=0.0, grad_clip=1.0, log_every=10, eval_every=100,
        eval_batches=8, sample_tokens=0))
    cfg.checkpoint.update(dict(every_steps=100, keep=2))
    return apply_variant(cfg, arg, {
        "text": {"data": dict(source="text", format="document", paths=("corpus/*.txt",))},
        "lora": {"lora": dict(rank=16, alpha=32.0, targets="all"), "train": dict(lr=2e-4)},
        "tiny": {"data": dict(tokenizer="byte"),
                 "model": dict(vocab_size=259, d_model=64, num_layers=2, num_heads=4,
                               num_kv_heads=2, d_ff=192, norm="rmsnorm", activation="swiglu",
                               ffn_bias=False),
                 "train": dict(steps=20, seq_len=128, lr=3e-3, warmup_steps=5, eval_every=0)},
    })
