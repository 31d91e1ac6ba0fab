"""Tiny byte-level language models for the experiments: corpus, a jitted optax loop,
evaluation in bits per byte, and a best-of-N timer.

The corpus is the one `tfjax.data` trains on by default (the Python standard
library's .py files, split by `tfjax.data.sources.stdlib_files`), read directly as
bytes: the byte tokenizer maps byte b to id b, so a model with vocab_size=256
needs no specials, and nats per token / ln 2 is bits per byte. Training rows are
random crops of the concatenated train split; evaluation uses fixed,
non-overlapping windows of the validation split, the same bytes at every length.
"""

from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from tfjax import models
from tfjax.config import model_config
from tfjax.data.sources import stdlib_files

LN2 = math.log(2.0)

TINY = dict(vocab_size=256, d_model=64, num_layers=2, num_heads=4, d_ff=256, max_len=1024,
            position="rope", norm="rmsnorm", activation="gelu")


def corpus(split: str, max_bytes: int) -> np.ndarray:
    """The first `max_bytes` bytes of the stdlib `split` (train | validation), as int32."""
    out, n = [], 0
    for path in stdlib_files(split):
        with open(path, "rb") as f:
            data = f.read()
        out.append(data)
        n += len(data)
        if n >= max_bytes:
            break
    return np.frombuffer(b"".join(out)[:max_bytes], np.uint8).astype(np.int32)


def build(**overrides):
    cfg = model_config(dict(TINY, **overrides))
    return cfg, models.build(cfg, rngs=nnx.Rngs(0))


def n_params(model) -> int:
    return int(sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))))


def _loss(model, tokens):
    logits = model(tokens[:, :-1])
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
    return -jnp.take_along_axis(lp, tokens[:, 1:, None], -1).mean()


def train(model, data: np.ndarray, *, steps: int, batch: int, seq_len: int, lr: float = 3e-3,
          warmup: int = 30, seed: int = 0, clip: float = 1.0):
    """AdamW with warmup + cosine on random crops. Returns (model, per-step losses);
    a non-finite loss stops training early (the returned list ends with it)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    sched = optax.warmup_cosine_decay_schedule(0.0, lr, max(1, warmup), max(steps, warmup + 1),
                                               lr * 0.1)
    tx = optax.chain(optax.clip_by_global_norm(clip) if clip else optax.identity(),
                     optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=0.1))
    opt = tx.init(params)

    @jax.jit
    def step(params, opt, tokens):
        def f(p):
            return _loss(nnx.merge(graphdef, p, rest), tokens)
        loss, g = jax.value_and_grad(f)(params)
        upd, opt = tx.update(g, opt, params)
        return optax.apply_updates(params, upd), opt, loss

    rng = np.random.default_rng(seed)
    losses = []
    for _ in range(steps):
        idx = rng.integers(0, len(data) - seq_len - 1, batch)
        tokens = jnp.asarray(np.stack([data[i:i + seq_len + 1] for i in idx]))
        params, opt, loss = step(params, opt, tokens)
        losses.append(float(loss))
        if not math.isfinite(losses[-1]):
            break
    return nnx.merge(graphdef, params, rest), losses


def bits_per_byte(model, data: np.ndarray, seq_len: int, total_tokens: int,
                  batch: int = 8) -> float:
    """Mean next-byte loss in bits over non-overlapping windows of `seq_len` covering
    the first `total_tokens` targets of `data` (every position of each window counts)."""
    n = max(1, total_tokens // seq_len)
    batch = min(batch, n)
    n -= n % batch  # one compiled shape
    rows = np.stack([data[i * seq_len:(i + 1) * seq_len + 1] for i in range(n)])
    graphdef, state = nnx.split(model)

    @jax.jit
    def f(state, tokens):
        return _loss(nnx.merge(graphdef, state), tokens)

    tot = 0.0
    for i in range(0, n, batch):
        chunk = rows[i:i + batch]
        tot += float(f(state, jnp.asarray(chunk))) * len(chunk)
    return tot / n / LN2


def best_of(f, reps: int = 5) -> float:
    """Best wall time of `f()` (blocked) over `reps` calls, after one warm-up call."""
    return timings(f, reps)[0]


def timings(f, reps: int = 5) -> tuple[float, float]:
    """(best wall seconds, best process CPU seconds) of `f()` (blocked) over `reps` calls,
    after one warm-up call. CPU time (all threads of this process) is what to compare
    on a machine shared with other jobs: preemption inflates wall time, not CPU time."""
    jax.block_until_ready(f())
    wall = cpu = float("inf")
    for _ in range(reps):
        t, c = time.perf_counter(), time.process_time()
        jax.block_until_ready(f())
        wall = min(wall, time.perf_counter() - t)
        cpu = min(cpu, time.process_time() - c)
    return wall, cpu


def load_average() -> str:
    try:
        import os
        return "load average (1/5/15 min) %.1f / %.1f / %.1f" % os.getloadavg()
    except OSError:
        return "load average unavailable"
