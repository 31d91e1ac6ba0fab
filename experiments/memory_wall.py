"""The memory wall: the T x T attention matrix, computed and measured.

    .venv/bin/python experiments/memory_wall.py            # full: ~2-4 CPU-minutes
    .venv/bin/python experiments/memory_wall.py --quick    # seconds (CI)

1. The seed's table, computed: bytes of one T x T score matrix per head per example
   in fp32 and bf16, and for a 32-head model (one layer, one example), for
   T = 2k .. 512k.
2. Measured: compiled temporary memory (`jax.jit(f).lower(...).compile()
   .memory_analysis().temp_size_in_bytes`) of causal attention forward + backward
   (grad of sum(out) w.r.t. q, k, v), B=1, N=4 heads, K=4, H=64, fp32, with
   implementation "reference" (materialises [B,N,T,S]), "blockwise" (tiled online
   softmax with custom_vjp) and "pallas" (on CPU the Pallas kernel runs in interpret
   mode: the kernel body is lowered to ordinary XLA ops inside loops, so its
   compiled memory is that of the interpreter, not of a Mosaic/Triton kernel; it is
   reported with that caveat, at the lengths where it compiles in reasonable time).
   Nothing is executed: compiling is enough to know the memory.

The claim: materialised attention memory is O(T^2) (16x per 4x T); tiled attention
(FlashAttention-style) is O(T) (4x per 4x T, or less while fixed costs dominate).
"""

from __future__ import annotations

import time

from common import Experiment
from tinylm import load_average

import jax
import jax.numpy as jnp

from tfjax.ops import dot_product_attention
from tfjax.ops import masks

MIB = 2 ** 20


def seed_table(exp: Experiment, lengths):
    rows = []
    for T in lengths:
        per = T * T
        rows.append([f"{T // 1024}k", per * 4 / MIB, per * 2 / MIB, 32 * per * 2 / 2 ** 30])
    exp.table(["T", "fp32 MiB / head / example", "bf16 MiB / head / example",
               "bf16 GiB, 32 heads (one layer, one example)"], rows,
              title="The T x T score matrix (computed: T^2 x bytes)")


def temp_bytes(impl: str, T: int, N=4, K=4, H=64) -> tuple[int, float]:
    """(temp bytes, compile seconds) of causal attention fwd+bwd at length T."""
    def loss(q, k, v):
        out = dot_product_attention(q, k, v, masks.causal(), implementation=impl)
        return out.astype(jnp.float32).sum()

    f = jax.jit(jax.grad(loss, (0, 1, 2)))
    q = jax.ShapeDtypeStruct((1, T, N, H), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, T, K, H), jnp.float32)
    t = time.perf_counter()
    mem = f.lower(q, kv, kv).compile().memory_analysis()
    return int(mem.temp_size_in_bytes), time.perf_counter() - t


def main(argv=None):
    exp = Experiment("memory_wall", __doc__, argv=argv)
    q = exp.quick
    seed_table(exp, [2 ** k * 1024 for k in range(1, 10)])
    plan = {
        "reference": [128, 256] if q else [1024, 2048, 4096, 8192, 16384],
        "blockwise": [256] if q else [1024, 2048, 4096, 8192, 16384, 32768, 65536],
        "pallas": [128] if q else [512, 1024, 2048, 4096],
    }
    exp.text(f"Causal attention forward+backward, B=1, N=K=4, H=64, fp32, CPU. {load_average()}.")
    rows, curves = [], {}
    for impl, Ts in plan.items():
        xs, ys, prev, prev_t = [], [], None, None
        for T in Ts:
            try:
                b, secs = temp_bytes(impl, T)
            except Exception as e:  # a compile that fails is a result too; say why
                rows.append([impl, T, f"failed: {type(e).__name__}", "", ""])
                break
            growth = f"{b / prev:.2f}x per {T // prev_t}x T" if prev else ""
            score = 4 * 4 * T * T  # one fp32 [N, T, T] matrix
            rows.append([impl, T, b / MIB, growth, b / score])
            print(f"  {impl} T={T}: {b / MIB:.1f} MiB (compiled in {secs:.1f} s)", flush=True)
            xs.append(T)
            ys.append(b / MIB)
            prev, prev_t = b, T
        curves[impl + (" (interpret mode)" if impl == "pallas" else "")] = (xs, ys)
    exp.table(["implementation", "T", "temp MiB (fwd+bwd)", "growth",
               "temp / one fp32 [N,T,T]"], rows,
              title="Measured compiled temporary memory")
    exp.plot(curves, xlabel="T", ylabel="temp MiB (fwd+bwd)", logx=True, logy=True,
             title="attention fwd+bwd compiled temp memory")
    exp.finish()


if __name__ == "__main__":
    main()
