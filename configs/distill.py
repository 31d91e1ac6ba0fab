"""Logit distillation preset: a student (`init_from`, or from scratch) learns a teacher's
next-token distributions (`train.teacher`: a Hugging Face directory or a tfjax workdir
with the same vocabulary) by the generalized Jensen-Shannon divergence of TRL's GKD
(`tfjax.train.distill`; beta 0 forward KL, 1 reverse KL, 0.5 JSD) at a temperature.

    python -m tfjax.train --config configs/distill.py --workdir W \\
        --config.train.teacher=TEACHER --config.init_from=STUDENT \\
        --config.data.paths="('corpus/*.txt',)"

Data as pretraining (packed documents, every token scored; `data.source` as usual).
The logged loss is the divergence per token (nats). Variants: "forward_kl" (beta 0),
"reverse_kl" (beta 1); "tiny": a 2-layer d=64 byte-level student trained from
scratch for 20 steps on the Python standard library (seconds on a CPU; the teacher
must have vocab_size 259). Run time depends on the teacher's size.
"""

from tfjax.config import apply_variant, default_config


def get_config(arg=None):
    cfg = default_config()
    cfg.data.update(dict(source="text", paths=("corpus/*.txt",)))
    cfg.train.update(dict(
        objective="distill", teacher="", steps=1000, batch_size=16, seq_len=1024, lr=1e-4,
        schedule="cosine", warmup_steps=50, weight_decay=0.0, log_every=10, eval_every=200,
        sample_tokens=0))
    cfg.train.distill.update(dict(beta=0.5, temperature=1.0))
    cfg.checkpoint.update(dict(every_steps=200, keep=2))
    return apply_variant(cfg, arg, {
        "forward_kl": {"train": dict(distill=dict(beta=0.0))},
        "reverse_kl": {"train": dict(distill=dict(beta=1.0))},
        "tiny": {"data": dict(source="stdlib", paths=(), tokenizer="byte"),
                 "model": dict(vocab_size=259, d_model=64, num_layers=2, num_heads=4,
                               num_kv_heads=2, d_ff=192, norm="rmsnorm", activation="swiglu",
                               ffn_bias=False),
                 "train": dict(steps=20, batch_size=4, seq_len=128, lr=3e-3, warmup_steps=2,
                               eval_every=0, eval_batches=2),
                 "checkpoint": dict(every_steps=0, async_save=False)},
    })
