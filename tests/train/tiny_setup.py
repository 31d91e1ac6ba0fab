"""A tiny run (CPU-sized model, short sequences) for trainer tests."""

import jax

from tfjax import config as C
from tfjax.train import Trainer


def tiny_config(**sections):
    """RunConfig with a 2-layer d=32 decoder, batch 8 x 32 tokens; `sections` override,
    e.g. mesh=dict(data=8), train=dict(steps=4)."""
    base = dict(
        model=dict(vocab_size=259, d_model=32, num_heads=4, num_kv_heads=2, d_ff=64,
                   num_layers=2, activation="gelu", norm="rmsnorm", position="rope"),
        train=dict(steps=4, batch_size=8, seq_len=32, warmup_steps=2, lr=1e-2, log_every=1,
                   eval_batches=1, eval_at_end=False, sample_tokens=0, progress=False),
        checkpoint=dict(enabled=False, every_steps=0, async_save=False),
    )
    for k, v in sections.items():
        base[k] = {**base.get(k, {}), **v}
    return C.from_dict(C.RunConfig, base)


def devices(n):
    return jax.devices()[:n]


def run(tmp_path, cfg, n_devices=1, name="w"):
    """(the Trainer of `cfg` in workdir `tmp_path / name` on `n_devices`, its summary)."""
    tr = Trainer(cfg, str(tmp_path / name), devices=devices(n_devices), log=lambda s: None)
    return tr, tr.train()


def losses(summary):
    """A run summary's logged losses in step order."""
    h = summary["history"]
    return [h[k] for k in sorted(h)]


def preempt_after(trainer, n):
    """Make `trainer` stop as SIGTERM would after its n-th step (the handler's flag is
    raised inside step n, so step n still completes and is checkpointed)."""
    step_fn, calls = trainer.program.step, []

    def step(state, batch):
        calls.append(1)
        if len(calls) == n:
            trainer._on_sigterm(15, None)
        return step_fn(state, batch)

    trainer.program.step = step
