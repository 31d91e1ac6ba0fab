"""Linear vs softmax attention: time and memory against T, and where they cross.

    .venv/bin/python experiments/linear_vs_softmax.py            # full: ~3 CPU-minutes
    .venv/bin/python experiments/linear_vs_softmax.py --quick    # seconds (CI)

Forward pass, jitted, B=1, N=K=4 heads of H=64, fp32, CPU, for T = 64 .. 16k (softmax timed up to 8k):
- softmax attention, causal: `tfjax.ops.dot_product_attention` with implementation
  "reference" (materialises the [N, T, T] scores) and "blockwise" (tiled online
  softmax), and non-causal "reference";
- linear attention (`tfjax.nn.linear_attention`, elu+1 features): causal (chunked
  scan, chunk 64) and non-causal (one [H, H] state per head).
Time is the best of N process-CPU times (robust to other jobs on the machine; wall
time beside it); memory is the compiled temporary bytes
(`jit(f).lower(...).compile().memory_analysis().temp_size_in_bytes`).

The seed's claim: linear attention costs O(T d^2) against softmax's O(T^2 d), so it
wins when d < n (head dim below the sequence length; here d = 64).
"""

from __future__ import annotations

from common import Experiment
from tinylm import load_average, timings

import jax
import jax.numpy as jnp
import numpy as np

from tfjax.nn.linear_attention import linear_attention
from tfjax.ops import dot_product_attention
from tfjax.ops import masks

MIB = 2 ** 20
B, N, H = 1, 4, 64


def make(kind: str):
    if kind == "softmax reference, causal":
        return lambda q, k, v: dot_product_attention(q, k, v, masks.causal(),
                                                     implementation="reference")
    if kind == "softmax reference, non-causal":
        return lambda q, k, v: dot_product_attention(q, k, v, None, implementation="reference")
    if kind == "softmax blockwise, causal":
        return lambda q, k, v: dot_product_attention(q, k, v, masks.causal(),
                                                     implementation="blockwise")
    if kind == "linear, causal (chunk 64)":
        return lambda q, k, v: linear_attention(q, k, v, causal=True, chunk_size=64)
    if kind == "linear, non-causal":
        return lambda q, k, v: linear_attention(q, k, v, causal=False)
    raise ValueError(kind)


KINDS = ("softmax reference, causal", "softmax blockwise, causal", "linear, causal (chunk 64)",
         "softmax reference, non-causal", "linear, non-causal")


def main(argv=None):
    exp = Experiment("linear_vs_softmax", __doc__, argv=argv)
    q = exp.quick
    lengths = [128, 512] if q else [64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
    # Softmax is timed only up to 8k (the reference's [N,T,T] fp32 scores are 4 GiB at
    # 16k; blockwise takes seconds per call there); its memory is compiled at every T.
    max_run = {k: 8192 for k in KINDS if k.startswith("softmax")}
    reps = 2 if q else 5
    exp.text(f"B={B}, N=K={N}, H={H}, fp32, forward only. {load_average()} at start.")
    rng = np.random.default_rng(0)
    rows, times, mems = [], {k: ([], []) for k in KINDS}, {k: ([], []) for k in KINDS}
    for T in lengths:
        q_, k_, v_ = (jnp.asarray(rng.standard_normal((B, T, N, H)) * 0.5, jnp.float32)
                      for _ in range(3))
        for kind in KINDS:
            f = jax.jit(make(kind))
            mem = f.lower(q_, k_, v_).compile().memory_analysis().temp_size_in_bytes
            if T <= max_run.get(kind, 1 << 30):
                wall, cpu = timings(lambda: f(q_, k_, v_), reps)
                times[kind][0].append(T)
                times[kind][1].append(1e3 * cpu)
                cpu_ms, wall_ms = 1e3 * cpu, 1e3 * wall
            else:
                cpu_ms = wall_ms = "not run"
            mems[kind][0].append(T)
            mems[kind][1].append(mem / MIB)
            rows.append([T, kind, cpu_ms, wall_ms, mem / MIB])
    exp.table(["T", "attention", "CPU ms", "wall ms", "temp MiB"], rows,
              title="Forward time and compiled temporary memory")

    # Where linear beats softmax: the smallest T from which linear stays faster.
    cross = []
    for lin, soft in (("linear, causal (chunk 64)", "softmax blockwise, causal"),
                      ("linear, causal (chunk 64)", "softmax reference, causal"),
                      ("linear, non-causal", "softmax reference, non-causal")):
        tl = dict(zip(*times[lin]))
        ts = dict(zip(*times[soft]))
        common_t = sorted(set(tl) & set(ts))
        wins = [T for T in common_t if tl[T] < ts[T]]
        first = next((T for T in common_t if all(tl[u] < ts[u] for u in common_t if u >= T)),
                     None)
        ratio = ", ".join(f"{T}: {ts[T] / tl[T]:.2f}x" for T in common_t)
        cross.append([lin, soft, first if first is not None else "never (in range)",
                      len(wins), ratio])
    exp.table(["linear", "softmax", "linear faster from T =", "T where linear faster",
               "softmax / linear CPU time by T"], cross, title="Crossover (CPU time)")
    exp.plot({k: v for k, v in times.items()}, xlabel="T", ylabel="forward CPU ms", logx=True,
             logy=True, title=f"forward time, H={H}")
    exp.plot({k: v for k, v in mems.items()}, xlabel="T", ylabel="temp MiB", logx=True,
             logy=True, title=f"compiled temp memory, H={H}", suffix="_memory")
    exp.text(f"{load_average()} at end.")
    exp.finish()


if __name__ == "__main__":
    main()
