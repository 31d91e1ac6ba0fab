"""Grouped-query and multi-query attention: KV cache size, decode speed, loss.

    .venv/bin/python experiments/gqa.py            # full: ~4 CPU-minutes
    .venv/bin/python experiments/gqa.py --quick    # seconds (CI)

1. KV cache bytes from `tfjax.models.cache_bytes` (abstract: `init_cache` under
   `jax.eval_shape`) for MHA (K = N), GQA (K = 4, 2) and MQA (K = 1), for the small
   decode model below and for a 70B-shaped model (80 layers, 64 query heads,
   H = 128, bf16, 4k tokens).
2. Decode ms/token: one jitted `model.step` of one token per row over a cache that
   holds a full prefix (B = 8 rows, prefix 2048, d_model 256, 2 layers, 8 query
   heads of H = 32, fp32), best of N, as experiments/bench_decode.py times it; process
   CPU time (robust to preemption on a shared machine) next to wall time.
3. Loss: tiny byte-level decoders (d_model 64, 2 layers, 8 query heads of H = 8)
   trained for the same steps on the stdlib corpus; validation bits/byte.

The seed's claims: GQA cuts the KV cache by G = N/K (MQA by N) and with it the
memory traffic of decoding, at a small quality cost (MQA more than GQA).
"""

from __future__ import annotations

from common import Experiment
from tinylm import bits_per_byte, build, corpus, load_average, n_params, timings, train

import jax
import jax.numpy as jnp
from flax import nnx

from tfjax import models
from tfjax.config import model_config
from tfjax.models import cache_bytes


def decode_ms(cfg, batch: int, prefix: int, reps: int) -> tuple[float, float]:
    """(wall ms, CPU ms) of one decode step, best of reps."""
    model = models.build(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)

    @jax.jit
    def step(state, cache, tok):
        return nnx.merge(graphdef, state).step(tok, cache)

    cache = model.init_cache(batch, prefix + 64)
    cache = cache.replace(length=jnp.full((batch,), prefix, jnp.int32))
    tok = jnp.ones((batch, 1), jnp.int32)
    box = [step(state, cache, tok)[1]]

    def one():
        _, box[0] = step(state, box[0], tok)
        return box[0].length

    wall, cpu = timings(one, reps)
    return 1e3 * wall, 1e3 * cpu


def main(argv=None):
    exp = Experiment("gqa", __doc__, argv=argv)
    q = exp.quick
    N = 8
    kinds = [("MHA", 8), ("GQA", 4), ("GQA", 2), ("MQA", 1)]
    exp.text(f"{load_average()} at start (2 shared cores: decode times are noisy).")

    # 1. cache bytes
    big = dict(arch="decoder", vocab_size=32000, d_model=8192, num_heads=64, head_dim=128,
               num_layers=80, d_ff=28672, dtype="bfloat16")
    small = dict(vocab_size=256, d_model=256, num_layers=2, num_heads=N, d_ff=1024, max_len=4096)
    batch, prefix = (2, 64) if q else (8, 2048)
    rows = []
    for name, k in (("MHA", 64), ("GQA", 8), ("MQA", 1)):
        b = cache_bytes(model_config(dict(big, num_kv_heads=k)), 1, 4096)
        assert b == 2 * 80 * k * 128 * 4096 * 2, (name, b)  # 2 (K and V) x L x K x H x T x 2
        rows.append([name, k, 64 // k, b / 1e9])
    for r in rows:
        r.append(f"1/{rows[0][3] / r[3]:.0f}")
    exp.table(["attention", "K", "G = N/K", "4k-token cache GB", "vs MHA"], rows,
              title="KV cache bytes (tfjax.models.cache_bytes), 70B shape: 80 layers, "
                    "N=64, H=128, bf16, one sequence of 4096 tokens")
    rows = []
    for name, k in kinds:
        b = cache_bytes(model_config(dict(small, num_kv_heads=k)), batch, prefix + 64)
        rows.append([name, k, N // k, b / 2 ** 20, f"1/{N // k}"])
    exp.table(["attention", "K", "G = N/K", "cache MiB", "vs MHA"], rows,
              title=f"KV cache bytes of the decode model below (2 layers, N=8, H=32, fp32, "
                    f"B={batch}, {prefix + 64} slots)")

    # 2. decode speed
    reps = 3 if q else 20
    run_kinds = kinds if not q else kinds[:1]
    rows, xs, ys = [], [], []
    for name, k in run_kinds:
        cfg = model_config(dict(small, num_kv_heads=k, d_model=64 if q else 256,
                                d_ff=64 if q else 1024, num_layers=1 if q else 2))
        wall, cpu = decode_ms(cfg, batch, prefix, reps)
        rows.append([name, k, cpu, wall])
        xs.append(k)
        ys.append(cpu)
    for r in rows:
        r.append(r[2] / rows[0][2])
    exp.table(["attention", "K", "CPU ms / step (all rows)", "wall ms / step", "CPU vs MHA"],
              rows,
              title=f"Decode: one jitted model.step, B={batch}, prefix {prefix}, fp32, "
                    f"best of {reps}")
    exp.plot({"decode CPU ms / step": (xs, ys)}, xlabel="kv heads K (N=8)",
             ylabel="CPU ms / step",
             logx=True, title=f"decode step, B={batch}, prefix {prefix}")

    # 3. loss
    steps, tb, seq_len = (3, 2, 32) if q else (200, 16, 128)
    data = corpus("train", 100_000 if q else 4_000_000)
    val = corpus("validation", 40_000)
    rows = []
    for name, k in (kinds if not q else kinds[3:]):
        _, model = build(num_heads=N, num_kv_heads=k, **(dict(d_model=32, num_layers=1, d_ff=64)
                                                          if q else {}))
        model, losses = train(model, data, steps=steps, batch=tb, seq_len=seq_len)
        rows.append([name, k, n_params(model), losses[-1],
                     bits_per_byte(model, val, seq_len, 256 if q else 16384)])
    exp.table(["attention", "K", "params", "final train loss (nats)", "val bits/byte"], rows,
              title=f"Loss after {steps} steps, batch {tb} x {seq_len} (d_model 64, 2 layers, "
                    f"8 query heads)")
    exp.text(f"{load_average()} at end.")
    exp.finish()


if __name__ == "__main__":
    main()
