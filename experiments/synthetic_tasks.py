"""Which token mixers solve associative recall and induction heads? (issues 6.7, 25.5)

    python experiments/synthetic_tasks.py [--quick] [--steps N] [--seeds S] [--mixers a,b]
    python experiments/synthetic_tasks.py --workers 2    # the results file's run

Trains tiny decoders that differ only in their token mixer (dense causal
attention, sliding-window attention, causal linear attention, Mamba, Mamba-2,
Gated DeltaNet, and a hybrid of one attention and one Gated DeltaNet layer; same
depth, width, optimizer, data and steps, parameters equal within a few percent
and, for the recurrent mixers, the same 1,024-float state per layer: `MIXERS`)
on two tasks of `tfjax.data.synthetic`: MQAR (multi-query associative recall,
Arora et al. 2023, "Zoology") and induction heads (Olsson et al. 2022: a span seen
once must be continued when its trigger recurs). The loss is the cross-entropy on
the answer tokens only (`loss_mask`). Every `EVAL_EVERY` steps the answer accuracy
on fixed held-out batches is recorded; the table gives, per task and mixer, the
accuracy at the end (mean and std over seeds), the first evaluated step at which
each seed reached 90 % (or "not reached"), and the time; one plot per task shows
accuracy against steps (mean over seeds, band from min to max). The literature:
attention solves associative recall at any sequence length; linear attention,
SSMs and short windows struggle once the number of pairs outgrows their state /
the distance outgrows the window (Zoology Fig. 2, Based); Mamba solves induction
heads (Mamba Table 2 / Fig. 2).

The training loop here (`SyntheticTrainer`) is the small jitted optax step the
other synthetic experiments (window_receptive_field, lost_in_middle, moe) import.
"""

from __future__ import annotations

import os
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

# Equal parameters (within a few %) and, for the recurrent mixers, equal state: each
# layer's mixer keeps 1,024 floats per sequence (4 heads x 16 x 16 for linear attention,
# Mamba-2 and Gated DeltaNet; 64 channels x 16 for Mamba at expand 1). Gated DeltaNet's
# extra projections (output gate, decay and beta) are paid for by a narrower FFN. The
# chunk sizes pick each recurrent mixer's fastest training form on a CPU (Mamba's
# associative scan over all of T is 1.6-5x slower than chunks of 8: results file).
MIXERS = {
    "dense attention": dict(layer_pattern=("global",)),
    "sliding window": dict(layer_pattern=("local",)),  # window: WINDOW
    "linear attention": dict(layer_pattern=("linear",)),
    "mamba": dict(layer_pattern=("mamba",), ssm=dict(d_state=16, expand=1, chunk=4)),
    "mamba-2": dict(layer_pattern=("mamba2",),
                    mamba2=dict(d_state=16, head_dim=16, expand=1, chunk=16)),
    "gated deltanet": dict(layer_pattern=("gated_deltanet",), d_ff=104, gdn=dict(chunk=8)),
    "hybrid attention + gdn": dict(layer_pattern=("global", "gated_deltanet"), d_ff=116,
                                   gdn=dict(chunk=8)),
}
# A mixer's training step's rough cost relative to dense attention's on a CPU (batch 64,
# T=64): only the order in which `--workers` processes take the jobs.
RELATIVE_COST = {"mamba": 3, "gated deltanet": 3, "hybrid attention + gdn": 2, "mamba-2": 2}

# The full run (sized by pilots: see the results file): (task, its settings, steps).
VOCAB = 64
WINDOW = 8  # the sliding window: shorter than most recall distances the tasks ask
TASK_SETTINGS = [("mqar", dict(seq_len=64, num_pairs=8, vocab_size=VOCAB), 1500),
                 ("induction_heads", dict(seq_len=64, vocab_size=VOCAB, prefix_len=8), 1000)]
SEEDS, BATCH, N_EVAL, EVAL_EVERY, LR = 3, 64, 2, 100, 3e-3


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

    def fit(self, batches, *, seed: int = 0, log_every: int = 0, eval_every: int = 0,
            evals=()):
        """batches(step) -> (tokens, targets, loss_mask). Returns (params, rest, history)
        with history a list of (step, loss) every `log_every` steps (0: only the last).
        `eval_every` > 0: the answer accuracy on `evals` after every that many updates
        (and after the last) is kept in `self.curve` as (updates, accuracy)."""
        params, rest, opt = self.init(seed)
        hist, self.curve = [], []
        for i in range(self.steps):
            tokens, targets, mask = batches(i)
            params, rest, opt, stats = self.train_step(params, rest, opt, tokens, targets, mask)
            if (log_every and i % log_every == 0) or i == self.steps - 1:
                hist.append((i, float(stats["loss"])))
            if eval_every and ((i + 1) % eval_every == 0 or i == self.steps - 1):
                self._opt = opt
                self.curve.append((i + 1, self.accuracy(params, rest, evals)))
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


def steps_to(curve, level: float = 0.9):
    """The first evaluated step whose accuracy reaches `level`, or None."""
    return next((step for step, acc in curve if acc >= level), None)


def param_count(cfg: dict) -> int:
    model = nnx.eval_shape(lambda: build(model_config(cfg), rngs=nnx.Rngs(0)))
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def run_mixer(base: dict, task: str, kw: dict, name: str, mixer: dict, *, window: int,
              steps: int, batch: int, n_eval: int, lr: float, seeds: int,
              eval_every: int) -> dict:
    """One mixer on one task over `seeds` seeds (the seed draws the initialisation and the
    training stream; the held-out batches are the same for every seed and mixer).
    Returns dict(params, curves [seed][(step, accuracy)], final [seed], loss [seed],
    seconds [seed])."""
    f = synthetic.TASKS[task]
    evals = [f(np.random.default_rng([10_000, i]), batch=batch, **kw) for i in range(n_eval)]
    cfg = dict(base, **mixer)
    if "local" in cfg["layer_pattern"]:
        cfg["attention"] = dict(cfg.get("attention", {}), sliding_window=window)
    tr = trainer(cfg, steps=steps, lr=lr)
    r = dict(params=param_count(cfg), curves=[], final=[], loss=[], seconds=[])
    for seed in range(seeds):
        t0 = time.perf_counter()
        _, _, hist = tr.fit(lambda i: f(np.random.default_rng([seed, i]), batch=batch, **kw),
                            seed=seed, eval_every=eval_every, evals=evals)
        r["seconds"].append(time.perf_counter() - t0)
        r["curves"].append(tr.curve)
        r["final"].append(tr.curve[-1][1])
        r["loss"].append(hist[-1][1])
        print(f"{task} {name} seed {seed}: accuracy {tr.curve[-1][1]:.3f}, steps to 90% "
              f"{steps_to(tr.curve)}, {r['seconds'][-1]:.1f} s "
              f"[{', '.join(f'{a:.2f}' for _, a in tr.curve)}]", flush=True)
    return r


def _pin_worker(cores, quick: bool) -> None:
    """ProcessPoolExecutor initializer: this worker runs on one core of its own (XLA:CPU
    runs a small program on one thread; two workers sharing a core only contend)."""
    os.sched_setaffinity(0, {cores.get()})
    if quick:
        quick_mode()


def run_jobs(jobs: list, *, workers: int, quick: bool) -> list:
    """jobs: [(kwargs for run_mixer, relative cost)]. Returns run_mixer's results in the
    order of `jobs`. workers > 1: that many spawned processes, each pinned to one usable
    core, taking the costliest jobs first (the results do not depend on which process
    ran a job: every job is seeded)."""
    if workers <= 1:
        return [run_mixer(**job) for job, _ in jobs]
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    ctx = multiprocessing.get_context("spawn")
    cores = ctx.Queue()
    for core in sorted(os.sched_getaffinity(0))[:workers]:
        cores.put(core)
    order = sorted(range(len(jobs)), key=lambda i: -jobs[i][1])
    with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_pin_worker,
                             initargs=(cores, quick)) as pool:
        futures = {i: pool.submit(run_mixer, **jobs[i][0]) for i in order}
        return [futures[i].result() for i in range(len(jobs))]


def label(task: str, kw: dict) -> str:
    return task + "".join(f" {k}={v}" for k, v in kw.items())


def report(exp: Experiment, results: list) -> None:
    """The table (one row per task x mixer) and one plot per task; results: a list of
    (task, task kwargs, steps, {mixer: run_mixer's result})."""
    rows = []
    for task, kw, steps, res in results:
        for name, r in res.items():
            final = np.array(r["final"])
            reached = [steps_to(c) for c in r["curves"]]
            rows.append([label(task, kw), name, f"{r['params']:,}", f"{steps:,}",
                         f"{final.mean():.3f} ± {final.std():.3f}",
                         " / ".join(f"{f:.2f}" for f in final),
                         " / ".join(str(s) if s else "not reached" for s in reached),
                         f"{np.mean(r['loss']):.3g}", f"{np.mean(r['seconds']):.0f}"])
    exp.table(["task", "mixer", "params", "steps", "accuracy at the end (mean ± std over seeds)",
               "per seed", "steps to 90 % (per seed)", "final train loss (mean)",
               "seconds per seed (train + evals)"], rows, title="Answer accuracy")
    for i, (task, kw, _, res) in enumerate(results):
        curves = {}
        for name, r in res.items():
            xs = [s for s, _ in r["curves"][0]]
            accs = np.array([[a for _, a in c] for c in r["curves"]])  # [seeds, evals]
            curves[name] = (xs, accs.mean(0), accs.min(0), accs.max(0))
        exp.plot(curves, xlabel="training steps",
                 ylabel="held-out answer accuracy\n(mean over seeds, band: min-max)",
                 title=label(task, kw),
                 suffix="_" + task if i else "")  # the first: <name>.png


def main(argv=None):
    import argparse
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--steps", type=int, default=0,
                   help="training steps for every task (0: each task's own)")
    p.add_argument("--seeds", type=int, default=0, help="seeds per mixer (0: the mode's)")
    p.add_argument("--mixers", default="", help="comma-separated subset of the mixers")
    p.add_argument("--workers", type=int, default=1,
                   help="processes, each pinned to a core of its own (at most the usable "
                        "cores); the results do not depend on it")
    exp = Experiment("synthetic_tasks", __doc__, parser=p, argv=argv)
    a = exp.args
    base = dict(BASE, vocab_size=VOCAB)
    if exp.quick:
        quick_mode()
        base.update(num_layers=1, d_model=32, d_ff=64)
        seeds, batch, n_eval, eval_every = 1, 8, 1, 5
        tasks = [("mqar", dict(seq_len=32, num_pairs=4, vocab_size=32), 10),
                 ("induction_heads", dict(seq_len=32, vocab_size=16, prefix_len=2), 10)]
        base["vocab_size"] = 32  # equal shapes: one compile per mixer
    else:
        seeds, batch, n_eval, eval_every = SEEDS, BATCH, N_EVAL, EVAL_EVERY
        tasks = TASK_SETTINGS
    tasks = [(task, kw, a.steps or steps) for task, kw, steps in tasks]
    seeds = a.seeds or seeds
    unknown = [m for m in a.mixers.split(",") if a.mixers and m not in MIXERS]
    if unknown:
        raise SystemExit(f"--mixers: unknown {unknown}; choose from {list(MIXERS)}")
    if not 1 <= a.workers <= len(os.sched_getaffinity(0)):
        raise SystemExit(f"--workers must be between 1 and the {len(os.sched_getaffinity(0))} "
                         f"usable cores, got {a.workers}")
    mixers = {k: v for k, v in MIXERS.items() if not a.mixers or k in a.mixers.split(",")}
    jobs = [(dict(base=base, task=task, kw=kw, name=name, mixer=mixer, window=WINDOW,
                  steps=steps, batch=batch, n_eval=n_eval, lr=LR, seeds=seeds,
                  eval_every=eval_every), steps * RELATIVE_COST.get(name, 1))
            for task, kw, steps in tasks for name, mixer in mixers.items()]
    t0 = time.perf_counter()
    out = iter(run_jobs(jobs, workers=a.workers, quick=exp.quick))
    results = [(task, kw, steps, {name: next(out) for name in mixers})
               for task, kw, steps in tasks]
    exp.text(f"Decoders of {base['num_layers']} layers, d_model {base['d_model']}, "
             f"{base['num_heads']} heads, SwiGLU FFN (d_ff {base['d_ff']} unless the mixer "
             f"sets it), RMSNorm, RoPE in the attention layers, vocabulary {base['vocab_size']}; "
             f"sliding window W={WINDOW}; AdamW lr {LR} (warmup 10 %, cosine to 10 %), batch "
             f"{batch}, steps per task: " + ", ".join(f"{t} {s}" for t, _, s in tasks) +
             f"; {seeds} seed(s) (initialisation and training stream); loss on answer tokens "
             f"only; held-out accuracy on {n_eval * batch} fixed sequences every {eval_every} "
             f"steps. {a.workers} worker process(es). Total wall time "
             f"{time.perf_counter() - t0:.0f} s.")
    exp.text("Mixers (`layer_pattern`, per-kind config): " + "; ".join(
        f"{k}: {v}" for k, v in mixers.items()))
    report(exp, results)
    return exp.finish()


if __name__ == "__main__":
    main()
