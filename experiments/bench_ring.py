"""Ring attention: per-device memory, longest trainable sequence, ring vs all-gather.

    nice .venv/bin/python experiments/bench_ring.py            # a few CPU minutes
    nice .venv/bin/python experiments/bench_ring.py --quick    # ~1 minute

Writes experiments/results/bench_ring[_quick].md (+ .png). Causal self-attention,
forward + backward, GQA 4/1, H = 64, fp32, on n = 1, 2, 4, 8 simulated CPU devices
on a `sequence` mesh axis (`--xla_force_host_platform_device_count=8`). Four
programs per n:

- ring: `ring_attention(..., load_balance="zigzag", natural_order=False)` (inputs
  already in zig-zag order, as a data pipeline would give them), as it runs on CPU:
  the ring's steps unrolled (XLA's CPU runtime can deadlock a while loop holding
  collectives; XLA's CPU scheduler then issues transfers early and holds more blocks);
- ring (while): the same with `unroll=False`, the steps as a while loop (one K/V block
  in flight), as it runs on TPU/GPU; the longest-sequence table uses this one;
- all_gather: `all_gather_attention` (each device gathers the whole K/V);
- single: `blockwise_attention` on one device at the same total length S.

1. Per-device memory from `jit(...).lower().compile().memory_analysis()`:
   temporaries (`temp_size_in_bytes`) at a fixed number of tokens per device.
2. Longest trainable sequence for a fixed per-device budget (`--budget-mib`,
   counting temporaries + arguments + outputs): memory is roughly affine in the
   tokens per device for a fixed n and tile size, so two compiles give a guess;
   a galloping walk and bisection over multiples of 256 tokens per device find
   a fitting length whose next one fails, and two more above it are compiled
   (compiled memory is not monotone in the length; see `longest`).
3. Step time (fwd+bwd, fastest of --reps after a warm-up), ring (unrolled) vs all-gather.
   CPU CAVEAT: the "devices" are threads of one host sharing its cores (2 on the
   machine these numbers come from) and a collective-permute is a memcpy, so the
   times measure how much arithmetic and copying each program does on a shared
   CPU; they say nothing about link bandwidth or about compute/communication
   overlap, which is what decides ring vs all-gather on real accelerators.

Overlap condition (on paper). One ring step: a device attends its c = S/n local
queries to one block of c keys while the next K/V block (c tokens x K kv heads x
H x 2 tensors x 2 bytes in bf16 = 4cKH bytes) crosses one link. A full block's
forward is two matmuls, 2 x 2c^2 H flops per query head: 4c^2 N H flops. The
transfer hides behind the compute when

    4 c^2 N H / F  >=  4 c K H / BW     <=>     c >= (K / N) F / BW = F / (G BW)

(H cancels; G = N / K query heads per kv head). With peak numbers:

- H100 SXM / H200 (same compute): F = 989e12 dense bf16 FLOP/s, NVLink 4
  BW = 450e9 B/s per direction (900 GB/s bidirectional): F / BW = 2,198, so
  c >= 2,198 tokens per device for MHA (G = 1), 275 for GQA with G = 8.
- TPU v5p: F = 459e12 bf16 FLOP/s per chip; ICI 1,200 GB/s bidirectional per chip
  (Cloud TPU v5p docs, docs.cloud.google.com/tpu/docs/v5p; the older page
  quotes 4,800 Gbps = 600 GB/s) over 6 torus links, so a one-directional ring
  along one torus axis has BW = 1,200 / 6 / 2 = 100e9 B/s (50e9 with the older
  figure): F / BW = 4,590 (9,180), so c >= 4,590 (9,180) tokens per chip for
  MHA, 574 (1,148) for G = 8. A bidirectional ring (half the blocks each way)
  halves these.

Causal masks with zig-zag balancing do half a full block per step on average,
which doubles c (about 4.4k tokens per device on H100 for MHA). The backward step
does 5 matmuls (10 c^2 N H flops) while moving K/V (bf16, 4cKH bytes) and the
fp32 dK/dV accumulators (8cKH bytes): c >= 1.2 F / (G BW), about the same as
the forward. Real kernels reach a fraction of peak FLOP/s (and links of peak
bandwidth); the condition uses the achieved ratio, so a kernel at 60% of peak
needs 60% of these tokens.
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import argparse  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from common import Experiment  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from tfjax.ops import masks  # noqa: E402
from tfjax.ops.blockwise import blockwise_attention  # noqa: E402
from tfjax.parallel.ring_attention import all_gather_attention, ring_attention  # noqa: E402

N, K, H = 4, 1, 64
MIB = 2**20
UNIT = 256  # tokens per device are searched in multiples of this


def _mesh(n):
    return jax.make_mesh((n,), ("sequence",), axis_types=(AxisType.Auto,),
                         devices=jax.devices()[:n])


def _program(method, n, blk):
    """fwd+bwd of causal attention: f(q, k, v) -> (dq, dk, dv), and its mesh (or None)."""
    if method == "single":
        attn = lambda q, k, v: blockwise_attention(q, k, v, masks.causal(), block_q=blk,
                                                   block_kv=blk)
        mesh = None
    else:
        mesh = _mesh(n)
        if method in ("ring", "ring_while"):
            # "ring": the CPU default (steps unrolled); "ring_while": the steps as a
            # while loop, the default on TPU/GPU.
            attn = lambda q, k, v: ring_attention(q, k, v, masks.causal(), mesh=mesh,
                                                  load_balance="zigzag", natural_order=False,
                                                  block_q=blk, block_kv=blk,
                                                  unroll=method == "ring")
        else:
            attn = lambda q, k, v: all_gather_attention(q, k, v, masks.causal(), mesh=mesh,
                                                        block_q=blk, block_kv=blk)
    loss = lambda q, k, v: jnp.sum(attn(q, k, v).astype(jnp.float32))
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2))), mesh


def _shapes(S, mesh):
    sh = None if mesh is None else NamedSharding(mesh, P(None, "sequence"))
    return (jax.ShapeDtypeStruct((1, S, N, H), jnp.float32, sharding=sh),
            jax.ShapeDtypeStruct((1, S, K, H), jnp.float32, sharding=sh),
            jax.ShapeDtypeStruct((1, S, K, H), jnp.float32, sharding=sh))


def memory(method, n, tpd, blk):
    """(temp, total) per-device bytes; total = temporaries + arguments + outputs."""
    S = n * tpd if method != "single" else tpd
    fn, mesh = _program(method, n, blk)
    m = fn.lower(*_shapes(S, mesh)).compile().memory_analysis()
    return m.temp_size_in_bytes, (m.temp_size_in_bytes + m.argument_size_in_bytes
                                  + m.output_size_in_bytes)


def longest(method, n, budget, blk, t1, t2, known=None, above=2, max_compiles=24):
    """Largest tokens per device (a multiple of UNIT) whose total fits `budget` bytes.
    An affine fit through t1 and t2 guesses it; from there a galloping walk (steps
    of UNIT, doubling) finds a fitting and a failing length, bisection narrows them
    to a fitting t and a failing t + UNIT, and `above` more lengths above that are
    compiled too: compiled memory is not monotone in the length (XLA's buffer
    assignment changes with the shapes: e.g. 6,144 tokens fit, 6,400 not, 6,656
    again), so a fitting one there restarts the walk from it.
    -> (t, bytes, bracketed): bracketed when t fits and t + UNIT ... t + (above + 1)
    UNIT all fail within `max_compiles` compiles."""
    known = dict(known or {})
    compiles = [0]

    def fits(t):
        if t not in known:
            compiles[0] += 1
            known[t] = memory(method, n, t, blk)[1]
        return known[t] <= budget

    fits(t1), fits(t2)
    slope = (known[t2] - known[t1]) / (t2 - t1)
    base = known[t1] - slope * t1
    t = max(UNIT, int((budget - base) / slope) // UNIT * UNIT) if slope > 0 else t2
    # Gallop to a bracket lo (fits, or 0) < hi (fails).
    if fits(t):
        lo, step = t, UNIT
        while compiles[0] < max_compiles and fits(lo + step):
            lo, step = lo + step, 2 * step
        hi = lo + step
    else:
        hi, step = t, UNIT
        while hi - step >= UNIT and compiles[0] < max_compiles and not fits(hi - step):
            hi, step = hi - step, 2 * step
        lo = max(hi - step, 0)
    while True:
        while hi - lo > UNIT and compiles[0] < max_compiles:  # bisect on the UNIT grid
            mid = (lo + hi) // 2 // UNIT * UNIT
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        higher = [u for u in range(hi + UNIT, hi + (above + 1) * UNIT, UNIT)
                  if compiles[0] < max_compiles and fits(u)]
        if not higher:
            break
        lo, step = max(higher), UNIT  # a dip: walk on from the fitting length above it
        while compiles[0] < max_compiles and fits(lo + step):
            lo, step = lo + step, 2 * step
        hi = lo + step
    checked = [lo + k * UNIT for k in range(1, above + 2)]
    bracketed = (lo == 0 or known.get(lo, budget + 1) <= budget) and all(
        known.get(u, 0) > budget for u in checked)
    return lo, known.get(lo), bracketed


def step_time(method, n, tpd, blk, reps):
    fn, mesh = _program(method, n, blk)
    S = n * tpd
    shapes = _shapes(S, mesh)
    keys = jax.random.split(jax.random.key(0), 3)
    args = [jax.device_put(jax.random.normal(kk, s.shape, s.dtype), s.sharding)
            for kk, s in zip(keys, shapes)]
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.min(times))  # the least disturbed run: other processes share the CPU


def main():
    ap = argparse.ArgumentParser(description="ring attention memory and speed")
    ap.add_argument("--tokens-per-device", type=int, default=1024)
    ap.add_argument("--block", type=int, default=256)
    ap.add_argument("--budget-mib", type=float, default=64.0)
    ap.add_argument("--time-tokens-per-device", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    exp = Experiment("bench_ring", __doc__, parser=ap)
    a = exp.args
    tpd, blk = (256, 128) if exp.quick else (a.tokens_per_device, a.block)
    budget = (16.0 if exp.quick else a.budget_mib) * MIB
    ttpd, reps = (128, 3) if exp.quick else (a.time_tokens_per_device, a.reps)
    ns = (1, 2, 4, 8)
    exp.text(f"Causal attention fwd+bwd, GQA {N}/{K}, H={H}, fp32, tiles {blk}; "
             f"{jax.devices()[0].platform} simulated devices.")

    # 1. Memory at a fixed number of tokens per device.
    rows, temps, totals = [], {}, {}
    for n in ns:
        for method in ("ring", "ring_while", "all_gather") if n > 1 else ("ring", "ring_while"):
            temps[method, n], totals[method, n] = memory(method, n, tpd, blk)
        temps["single", n], totals["single", n] = memory("single", n, n * tpd, blk)
        ag = temps.get(("all_gather", n))
        rows.append([n, n * tpd, temps["ring", n] / MIB, temps["ring_while", n] / MIB,
                     "-" if ag is None else ag / MIB, temps["single", n] / MIB,
                     temps["ring", n] / temps["single", n],
                     temps["ring_while", n] / temps["single", n]])
    exp.table(["n", "S", "ring temp MiB", "ring (while) temp MiB", "all-gather temp MiB",
               "single temp MiB", "ring / single", "ring (while) / single"], rows,
              title=f"Per-device temporaries, {tpd} tokens per device (S = n x {tpd})")
    exp.plot({"ring (per device)": (list(ns), [temps["ring", n] / MIB for n in ns]),
              "all-gather (per device)": (list(ns[1:]), [temps["all_gather", n] / MIB
                                                         for n in ns[1:]]),
              "single device, same S": (list(ns), [temps["single", n] / MIB for n in ns])},
             xlabel="devices n (S = n x tokens per device)", ylabel="temporaries (MiB)",
             title=f"causal fwd+bwd, {tpd} tokens/device", logx=True)

    # 2. Longest trainable sequence for a per-device budget.
    rows = []
    t2 = 2 * tpd
    for n in ns:
        row = [n]
        for method in ("ring_while", "all_gather"):
            if method == "all_gather" and n == 1:
                row += ["-", "-"]
                continue
            t, total, ok = longest(method, n, budget, blk, tpd, t2,
                                   known={tpd: totals[method, n]})
            row += [f"{n * t:,}" + ("" if ok else " (not bracketed)"),
                    None if total is None else total / MIB]
        rows.append(row)
    t, total, _ = longest("single", 1, budget, blk, tpd, t2, known={tpd: totals["single", 1]})
    exp.table(["n", "ring (while) longest S", "ring (while) MiB used", "all-gather longest S",
               "all-gather MiB used"], rows,
              title=f"Longest sequence within {budget / MIB:g} MiB per device "
                    f"(temporaries + arguments + outputs; multiples of {UNIT} tokens/device)")
    exp.text(f"Single-device blockwise within the same budget: S = {t} ({total / MIB:.1f} MiB).")

    # 3. Step time, ring vs all-gather.
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    rows = []
    for n in ns[1:]:
        r = step_time("ring", n, ttpd, blk, reps)
        g = step_time("all_gather", n, ttpd, blk, reps)
        rows.append([n, n * ttpd, r * 1e3, g * 1e3, r / g])
    exp.table(["n", "S", "ring ms", "all-gather ms", "ring / all-gather"], rows,
              title=f"fwd+bwd step time, {ttpd} tokens per device (CPU caveat: simulated "
                    f"devices share the host's {os.cpu_count()} cores, load average "
                    f"{load:.1f} when timing started; says nothing about overlap)")
    exp.finish()


if __name__ == "__main__":
    main()
