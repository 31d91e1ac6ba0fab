"""The tests' tiny training run on disk: a 2-layer d=32 byte-level decoder on a
small text corpus (`tiny_run_config`), and a run directory as `python -m
tfjax.train` leaves it (`saved_run`), for the tests of what reads one (generation,
evaluation, lm-eval tasks during training).

Test code, not a test double: it lives beside the tests (tests/ is on sys.path
through tests/conftest.py), not in `tfjax/testing/`."""

from __future__ import annotations

import json
import pathlib

CORPUS = "def add(a, b):\n    return a + b\n" * 40


def tiny_run_config(tmp_path, **sections):
    """The tiny run's `RunConfig`, its corpus written to `tmp_path`/corpus.txt (train
    and validation split), checkpoints saved synchronously at the end; `sections`
    override field by field (`train=dict(steps=2)`)."""
    from tfjax import config as C

    corpus = pathlib.Path(tmp_path) / "corpus.txt"
    corpus.write_text(CORPUS)
    base = dict(
        model=dict(vocab_size=259, d_model=32, num_heads=4, num_kv_heads=2, d_ff=64,
                   num_layers=2, norm="rmsnorm", position="rope"),
        train=dict(batch_size=2, seq_len=32, warmup_steps=1, log_every=1, sample_tokens=0,
                   progress=False),
        data=dict(source="text", paths=(str(corpus),), val_paths=(str(corpus),)),
        checkpoint=dict(enabled=True, every_steps=0, async_save=False))
    for name, fields in sections.items():
        base[name] = {**base.get(name, {}), **fields}
    return C.from_dict(C.RunConfig, base)


def saved_run(tmp_path):
    """(workdir, state) of a run directory under `tmp_path` as `python -m tfjax.train`
    leaves it: the trainer's own initial state (init_std 0.5, so that it predicts
    something) saved by its own Checkpointer at step 3, and config.json as
    `Trainer.train` writes it. No train step is compiled: that is the trainer's test."""
    import jax

    from tfjax.train.trainer import Trainer, _plain

    cfg = tiny_run_config(tmp_path, model=dict(init_std=0.5),
                          train=dict(steps=3, eval_at_end=False))
    wd = str(pathlib.Path(tmp_path) / "w")
    tr = Trainer(cfg, wd, devices=jax.devices()[:1], log=lambda s: None)
    state = tr.init_state()
    tr.checkpointer.save(3, state, tr.train_iterator().get_state(), wait=True)
    tr.checkpointer.close()
    with open(f"{wd}/config.json", "w") as f:
        json.dump(_plain(cfg), f, indent=1)
    return wd, state
