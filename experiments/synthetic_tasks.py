"""Which token mixers solve associative recall and induction heads? (issue 6 item 7)

    python experiments/synthetic_tasks.py [--quick]

Trains tiny decoders that differ only in their token mixer (dense causal
attention, sliding-window attention, causal linear attention, Mamba; same width,
depth, FFN, optimizer and steps) on two tasks of `tfjax.data.synthetic`:
MQAR (multi-query associative recall, Arora et al. 2023, "Zoology") and induction
heads (Olsson et al. 2022; the Mamba paper's version: recall the token after a
trigger seen once before). The loss is the cross-entropy on the answer tokens only
(`loss_mask`); the table reports accuracy on answer tokens of fresh held-out
batches. The literature: attention solves associative recall at any
sequence length; linear attention and short windows struggle once the number of
pairs outgrows their state / the distance outgrows the window (Zoology Fig. 2,
Based); Mamba sits in between (Mamba Table 2 / Fig. 2 for induction heads).

The training loop here (`SyntheticTrainer`) is the small jitted optax step the
other synthetic experiments (window_receptive_field, lost_in_middle, moe) import.
"""

from __future__ import annotations

import time

from common import Experiment

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from tfjax.config import model_config
from tfjax.data import synthetic
from tfjax.models import build
from tfjax.nn.moe import moe_aux

BASE = dict(arch="decoder", d_model=64, num_layers=2, num_heads=4, d_ff=128, position="rope",
            norm="rmsnorm", activation="swiglu", ffn_bias=False, max_len=4096,
            ssm=dict(d_state=16, expand=2), linear=dict(chunk=32))

MIXERS = {
    "dense attention": dict(layer_pattern=("global",)),
    "sliding window": dict(layer_pattern=("local",)),  # window set per task
    "linear attention": dict(layer_pattern=("linear",)),
    "mamba": dict(layer_pattern=("mamba",)),
}


class SyntheticTrainer:
    """A model config + AdamW (warmup-cosine) + one jitted train step and one jitted
    eval forward, reusable over seeds and data: `fit` re-initialises the model."""

    def __init__(self, cfg: dict, *, steps: int, lr: float = 3e-3, warmup: int | None = None,
                 weight_decay: float = 0.01, aux: bool = True):
        self.cfg = model_config(cfg)
        self.steps = steps
        warmup = max(1, steps // 10) if warmup is None else warmup
        sched = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, warmup + 1),
                                                   lr * 0.1)
        self.tx = optax.chain(optax.clip_by_global_norm(1.0),
                              optax.adamw(sched, b2=0.98, weight_decay=weight_decay))
        cfg_ = self.cfg
        graphdef, _, _ = nnx.split(nnx.eval_shape(lambda: build(cfg_, rngs=nnx.Rngs(0))),
                                   nnx.Param, ...)
        self.graphdef = graphdef
        tx = self.tx

        def forward(params, rest, tokens):
            rest = jax.tree.map(lambda x: x, rest)  # fresh Variables in this trace
            model = nnx.merge(graphdef, params, rest)
            logits = model(tokens)
            return logits, moe_aux(model), nnx.state(model, nnx.Not(nnx.Param))

        def loss_fn(params, rest, tokens, targets, mask):
            logits, aux_out, rest = forward(params, rest, tokens)
            ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32),
                                                                 targets)
            m = mask.astype(jnp.float32)
            loss = jnp.sum(ce * m) / jnp.maximum(jnp.sum(m), 1.0)
            total = loss + (aux_out["aux_loss"] if aux else 0.0)
            right = jnp.sum((jnp.argmax(logits, -1) == targets) & mask)
            stats = dict(loss=loss, right=right, answers=jnp.sum(mask), **aux_out)
            return total, (stats, rest)

        # One compiled function serves training and evaluation (the statistics are of
        # the forward pass before the update; evaluation discards the update): tracing
        # and compiling an NNX model costs seconds, a wasted backward pass milliseconds.
        @jax.jit
        def train_step(params, rest, opt, tokens, targets, mask):
            (_, (stats, rest)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
                params, rest, tokens, targets, mask)
            updates, opt = tx.update(grads, opt, params)
            return optax.apply_updates(params, updates), rest, opt, stats

        self.train_step = train_step

    def init(self, seed: int):
        """(params, rest, optimizer state) of a fresh model initialised from `seed`."""
        # Eager: XLA caches each op's executable across configs of equal shapes, which
        # makes this cheaper than compiling an init function per config.
        _, params, rest = nnx.split(build(self.cfg, rngs=nnx.Rngs(seed)), nnx.Param, ...)
        return params, rest, self.tx.init(params)

    def fit(self, batches, *, seed: int = 0, log_every: int = 0):
        """batches(step) -> (tokens, targets, loss_mask). Returns (params, rest, history)
        with history a list of (step, loss) every `log_every` steps (0: only the last)."""
        params, rest, opt = self.init(seed)
        hist = []
        for i in range(self.steps):
            tokens, targets, mask = batches(i)
            params, rest, opt, stats = self.train_step(params, rest, opt, tokens, targets, mask)
            if (log_every and i % log_every == 0) or i == self.steps - 1:
                hist.append((i, float(stats["loss"])))
        self._opt = opt  # evaluation feeds it to the step (and drops the update)
        return params, rest, hist

    def evaluate(self, params, rest, batches) -> dict:
        """Over an iterable of (tokens, targets, loss_mask): answer-token accuracy, loss,
        and the mean of the MoE statistics (expert_load etc., when the model has MoE)."""
        right = total = 0
        sums: dict = {}
        n = 0
        for tokens, targets, mask in batches:
            _, _, _, st = self.train_step(params, rest, self._opt, tokens, targets, mask)
            right, total, n = right + int(st["right"]), total + int(st["answers"]), n + 1
            for k, v in st.items():
                if k not in ("right", "answers"):
                    sums[k] = sums.get(k, 0) + np.asarray(v)
        out = {k: v / max(n, 1) for k, v in sums.items()}
        out["accuracy"] = right / max(total, 1)
        return out

    def accuracy(self, params, rest, batches) -> float:
        """Accuracy on answer tokens over an iterable of (tokens, targets, loss_mask)."""
        return self.evaluate(params, rest, batches)["accuracy"]


def quick_mode() -> None:
    """--quick: compile fast (XLA optimisations off); the numbers only prove the script runs."""
    jax.config.update("jax_disable_most_optimizations", True)


_TRAINERS: dict = {}


def trainer(cfg: dict, **kw) -> SyntheticTrainer:
    """One SyntheticTrainer (one compilation) per distinct model config and settings."""
    key = repr(sorted(cfg.items())) + repr(sorted(kw.items()))
    if key not in _TRAINERS:
        _TRAINERS[key] = SyntheticTrainer(cfg, **kw)
    return _TRAINERS[key]


def run_task(base: dict, task: str, kw: dict, vocab: int, window: int, steps: int, batch: int,
             eval_batches: int, lr: float):
    rows, accs = [], {}
    f = synthetic.TASKS[task]
    evals = [f(10_000 + i, batch=batch, **kw) for i in range(eval_batches)]
    for name, mixer in MIXERS.items():
        cfg = dict(base, vocab_size=vocab, **mixer)
        if name == "sliding window":
            cfg["sliding_window"] = window
        tr = trainer(cfg, steps=steps, lr=lr)
        t0 = time.perf_counter()
        params, rest, hist = tr.fit(lambda i: f(i, batch=batch, **kw))
        acc = tr.accuracy(params, rest, evals)
        accs[name] = acc
        rows.append([task, name, steps, hist[-1][1], acc, time.perf_counter() - t0])
        print(rows[-1], flush=True)
    return rows, accs


def main(argv=None):
    exp = Experiment("synthetic_tasks", __doc__, argv=argv)
    base = dict(BASE)
    if exp.quick:
        quick_mode()
        base.update(num_layers=1, d_model=32, d_ff=64)
        steps, batch, n_eval, lr = 10, 8, 1, 3e-3
        sizes = dict(mqar=[dict(seq_len=32, num_pairs=4)], induction_heads=[dict(seq_len=32)])
        vocab = {"mqar": 32, "induction_heads": 32}  # equal shapes: one compile per mixer
    else:
        steps, batch, n_eval, lr = 300, 32, 4, 3e-3
        sizes = dict(mqar=[dict(seq_len=48, num_pairs=4)], induction_heads=[dict(seq_len=48)])
        vocab = {"mqar": 64, "induction_heads": 64}
    W = 8  # the sliding window: shorter than every recall distance the tasks ask
    rows, curves = [], {}
    for task, settings in sizes.items():
        for s in settings:
            kw = dict(s, vocab_size=vocab[task])
            label = task + "".join(f" {k}={v}" for k, v in s.items())
            r, accs = run_task(base, task, kw, vocab[task], W, steps, batch, n_eval, lr)
            for row in r:
                row[0] = label
            rows += r
            curves[label] = accs
    exp.text(f"Tiny decoders: {base['num_layers']} layers, d_model={base['d_model']}, "
             f"{base['num_heads']} heads, SwiGLU FFN {base['d_ff']}, RoPE (attention mixers); "
             f"sliding window W={W}; AdamW lr {lr}, batch {batch}, {steps} steps, "
             f"loss on answer tokens only; accuracy over {n_eval * batch} held-out sequences.")
    exp.table(["task", "mixer", "steps", "final train loss", "answer accuracy", "seconds"], rows,
              title="Accuracy on answer tokens")
    names = list(MIXERS)
    labels = list(curves)
    exp.plot({lab: (list(range(len(names))), [curves[lab][n] for n in names]) for lab in labels},
             xlabel="mixer: " + ", ".join(f"{i}={n}" for i, n in enumerate(names)),
             ylabel="answer accuracy", title="Synthetic tasks by token mixer")
    return exp.finish()


if __name__ == "__main__":
    main()
