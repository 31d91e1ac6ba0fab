"""Sparse attention patterns: work and memory of tiled attention grow as O(T*W + T*G).

    .venv/bin/python experiments/sparse_attention.py            # a few minutes on 2 cores
    .venv/bin/python experiments/sparse_attention.py --quick    # seconds (CI)

The claim (Longformer, Beltagy et al. 2020; BigBird, Zaheer et al. 2020): with a
local window of W keys, G global tokens and R random blocks, attention costs
O(T*(W + G + R*b)) instead of O(T^2). In a tiled kernel that is only true if the
kernel skips the tiles the mask empties; tfjax's masks give a block view (which
tiles are EMPTY / PARTIAL / FULL) that blockwise and pallas use for that.

1. Work: the number of non-empty 128x128 tiles (what blockwise and pallas compute)
   against T for dense causal, sliding window, Longformer and BigBird, and its
   growth per 2x T (dense causal ~4x, the sparse patterns ~2x).
2. Memory: compiled temporary memory of blockwise forward+backward (and of the
   materialising reference at the lengths it fits) from
   `jit(...).lower(...).compile().memory_analysis()`.
3. Time: blockwise forward wall time at one length per pattern (CPU; best of 3).

Tiles are the unit of work: G global tokens cost one tile row and column each
unless they share tiles, so "G=16 first" (contiguous, like a [CLS] span or
BigBird's globals) costs ~1 tile column while "G=16 spread" (16 tokens in 16
different tiles) costs ~16: O(T*(W + G*block)) work, not O(T*(W + G)).
"""

from __future__ import annotations

import time

from common import Experiment

import jax
import jax.numpy as jnp
import numpy as np

from tfjax.ops import dot_product_attention
from tfjax.ops import masks as M
from tfjax.ops import sparse_masks as SM

BLOCK = 128
MIB = 1024 ** 2


def patterns(T):
    spread = tuple(int(p) for p in np.linspace(0, T - 1, 16))  # 16 global tokens
    return {
        "causal (dense)": M.causal(),
        "window 256 & causal": M.sliding_window(256) & M.causal(),
        "longformer w=256, G=16 first": SM.longformer(256, range(16)),
        "longformer w=256, G=16 spread": SM.longformer(256, spread),
        "bigbird w=192, G=64, R=3x64": SM.bigbird(192, 64, 3, 64, seed=0, seq_len=T),
    }


def nonempty_tiles(mask, T):
    codes = np.asarray(mask.blocks(T, T, BLOCK, BLOCK))
    return int((codes != M.EMPTY).sum())


def grad_fn(mask, impl):
    def loss(q, k, v):
        return dot_product_attention(q, k, v, mask, implementation=impl).astype(jnp.float32).sum()
    return jax.jit(jax.grad(loss, (0, 1, 2)))


def temp_mib(mask, impl, T, N=4, K=1, H=64):
    sds = (jax.ShapeDtypeStruct((1, T, N, H), jnp.float32),
           jax.ShapeDtypeStruct((1, T, K, H), jnp.float32),
           jax.ShapeDtypeStruct((1, T, K, H), jnp.float32))
    m = grad_fn(mask, impl).lower(*sds).compile().memory_analysis()
    return m.temp_size_in_bytes / MIB


def main(argv=None):
    exp = Experiment("sparse_attention", __doc__, argv=argv)
    lengths = [1024, 2048] if exp.quick else [2048, 4096, 8192, 16384, 32768, 65536]
    names = list(patterns(1024))

    # 1. work
    rows, curves = [], {n: ([], []) for n in names}
    for T in lengths:
        counts = {n: nonempty_tiles(m, T) for n, m in patterns(T).items()}
        rows.append([T, (T // BLOCK) ** 2] + [counts[n] for n in names])
        for n in names:
            curves[n][0].append(T)
            curves[n][1].append(counts[n])
    growth = ["growth per 2x T", ""] + [
        f"{(rows[-1][2 + i] / rows[-2][2 + i]):.2f}x" for i in range(len(names))]
    exp.table(["T", "all tiles"] + names, rows + [growth],
              title=f"Non-empty {BLOCK}x{BLOCK} tiles (work of blockwise / pallas)")
    exp.plot(curves, xlabel="T (tokens)", ylabel="non-empty tiles", logx=True, logy=True,
             title="Tiles computed vs T")

    # 2. memory (compile only)
    mem_lengths = [512] if exp.quick else [2048, 8192, 32768]
    ref_max = 512 if exp.quick else 8192
    rows = []
    for T in mem_lengths:
        for n, m in patterns(T).items():
            ref = f"{temp_mib(m, 'reference', T):.1f}" if T <= ref_max else "(not compiled)"
            rows.append([T, n, f"{temp_mib(m, 'blockwise', T):.1f}", ref])
    exp.table(["T", "pattern", "blockwise fwd+bwd temp (MiB)", "reference temp (MiB)"], rows,
              title="Compiled temporary memory, B=1, N=4, K=1, H=64, fp32")

    # 3. time
    T = 512 if exp.quick else 8192
    key = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(key[0], (1, T, 4, 64))
    k = jax.random.normal(key[1], (1, T, 1, 64))
    v = jax.random.normal(key[2], (1, T, 1, 64))
    rows, base = [], None
    for n, m in patterns(T).items():
        f = jax.jit(lambda q, k, v, m=m: dot_product_attention(q, k, v, m,
                                                               implementation="blockwise"))
        jax.block_until_ready(f(q, k, v))
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            jax.block_until_ready(f(q, k, v))
            best = min(best, time.perf_counter() - t0)
        base = base or best
        rows.append([n, nonempty_tiles(m, T), f"{best * 1e3:.1f}", f"{best / base:.2f}"])
    exp.table(["pattern", "non-empty tiles", "blockwise forward (ms)", "time / dense causal"],
              rows, title=f"Blockwise forward at T={T} (CPU, best of 3)")
    exp.finish()


if __name__ == "__main__":
    main()
