"""Attention implementations: memory and speed.

    .venv/bin/python experiments/bench_attention.py cpu            # ~10 min on 2 cores
    .venv/bin/python experiments/bench_attention.py gpu            # < 8 min on one H100/H200
    .venv/bin/python experiments/bench_attention.py tune --budget-s 80   # GPU kernel tiles
    .venv/bin/python experiments/bench_attention.py gpu --lower-only     # preflight, no GPU
    python experiments/bench_attention.py gpu --compile-only  # XLA:GPU for an H200, no GPU
    .venv/bin/python experiments/bench_attention.py alibi          # ~5 min on 2 cores
    .venv/bin/python experiments/bench_attention.py t5             # ~5 min on 2 cores
    .venv/bin/python experiments/bench_attention.py t5-tpu-aot --sizes 2048,8192  # libtpu
    .venv/bin/python experiments/bench_attention.py cache-tpu-aot --sizes 32768  # libtpu
    .venv/bin/python experiments/bench_attention.py layer-tpu-aot --sizes 4096,8192,16384
    .venv/bin/python experiments/bench_attention.py decode --budget-s 60   # a GPU

cpu: compiled temporary memory (`memory_analysis().temp_size_in_bytes`) and wall
time of reference / xla / blockwise at S = 1k, 4k, 16k (causal self-attention,
GQA 4/1, H=64, fp32, forward and forward+backward), and the growth factor per
4x S. The claim: materialising attention grows ~16x per 4x S; tiled attention
~4x (its memory is O(T*H)). Time is measured only where the temporary memory is
below --max-run-gib (compiling is enough to know the memory).

alibi: the same memory/time table for an ALiBi layer (causal, GQA 4/1, H=64,
fp32, packed-style explicit positions): ALiBi as a materialised `[B,N,T,S]` bias
(`nn.alibi_bias` -> `bias=`, what a model does without in-kernel ALiBi) next to
`alibi_slopes` + `alibi_positions` evaluated per tile, for "blockwise" (and
"xla", which always materialises). The claim: the bias alone makes tiled
attention O(T*S) again; computed per tile it stays O(T*H).

t5: the same for T5's learned bucketed bias (unidirectional, 32 buckets, max
distance 128): the table gathered into a `[B,N,T,S]` bias (what a T5 model did
before `relative_bias`) next to `relative_bias=RelativeBias(...)` evaluated per
tile; fwd+bwd also differentiates the table (per tile: dlogits summed per bucket).

t5-tpu-aot: per-device compiled memory of the Pallas TPU kernels' fwd+bwd for a
v5e:2x2 topology (real XLA:TPU / Mosaic compilation on this CPU, libtpu needed):
no bias, T5's bias per tile at index and explicit positions, and T5's bias
materialised as a `[B,N,T,S]` fp32 bias. Then the kernels beside jax's splash
attention (causal, GQA 32/8, H = 128 and 64, bf16, one example per chip, 512
tiles for splash with its separate dq kernel, ours at its default tiles): ours through the public
`dot_product_attention(..., implementation="pallas")` in a shard_map with no mesh
context, given `[B,T,N,H]` and given splash's native `[B,N,T,H]` (transposed to
ours in the traced program), splash given `[B,T,N,H]` (transposed to its layout
and back) and on `[B,N,T,H]`; the ratio of ours to splash at the same layout.

cache-tpu-aot: per-device compiled memory of attention over a KV cache on a
v5e:2x2 (real XLA:TPU / Mosaic compilation, libtpu; GQA 32/8, H=128, bf16, the
cache's `masks.positions` from traced positions): a decode step (T=1) and
chunked prefill (T=512, 2048) over S slots (the last of --sizes), "xla" vs
"pallas".

layer-tpu-aot: a whole attention layer (q/k/v projections, RoPE, attention, output
projection; fwd+bwd, causal, GQA 32/8, H = 128 and 64, D = N*H, bf16, one example
per chip) compiled for a v5e:2x2 (libtpu): the layer as built (`implementation=
"pallas"`) and the same layer around splash attention (its native `[B,N,T,H]`,
transposed in the program), per chip temporaries and the activation-sized
relayouts (`copy` / `transpose` of at least T*K*H elements) left in the compiled
program. The kernels read `[B,N,T,H]`; inside a program XLA makes the projections
and RoPE write that layout and the gradients read it, which the op benchmarks
above (q/k/v as row-major program arguments) cannot show. Then the decode programs
(`generate`'s prefill + loop, `stream`'s per-step jit) of 2 layers of Llama-3.1-8B
(H = 128) and Llama-3.2-1B (H = 64) over a 32k-slot cache, layers scanned and
unrolled, xla vs pallas: temporaries and cache-sized relayouts (in the program and
in one decode step).
Writes attention_layer_tpu_aot_<date>.md.

decode: a decode step's attention over a half-filled KV cache on a GPU (T=1,
GQA 32/8, H=128, bf16, B x S in 1 x 8k, 1 x 32k, 8 x 32k, 32 x 8k): "pallas"
as dispatched (query heads packed, keys split when the grid is small), packed
without the split, neither, and xla; microseconds per call (16 chained in one
jit) and the bandwidth of the filled half's K/V bytes. --compile-only compiles
each row for a deviceless H200 (attention_decode_gpu_aot_<date>.md).

gpu: forward, backward and forward+backward TFLOP/s (4*B*N*T*S*H FLOPs, halved
when causal; backward counted as 2.5x forward) of "pallas" (the Triton kernels,
and on Hopper also the Mosaic GPU forward of `tfjax/ops/pallas/mosaic_gpu.py` and
backward of `mosaic_gpu_backward.py`) next to
jax.nn.dot_product_attention(implementation="cudnn" / "xla") and jax's own Pallas
GPU attention, for H in {64, 128, 256}, S from 1k to 16k, causal and not, GQA
32/8, sliding-window and segment masks (cuDNN given the explicit dense mask),
causal with ALiBi at S = 8k ("auto": on Hopper its Mosaic GPU forward and
backward; the Triton kernels; xla with the materialised bias), and causal with
T5's bias at S = 4k, 8k (the Triton kernels per tile vs the same kernels and xla
reading it as a materialised `[B,N,T,S]` bias).
Writes a markdown table to experiments/results/attention_gpu_<date>.md.

--lower-only (gpu, tune): on a machine without a GPU, every row's forward and
fwd+bwd is traced and lowered for the cuda platform as for an H200
(`gpu_lowering_target`: the Triton and Mosaic GPU kernels are lowered in Python,
the Hopper ones chosen as on sm_90), each row saying "lowered" or why it failed,
so a session lent the GPU does not spend it on a row that cannot lower. cuDNN
rows are not lowered (its lowering asks the local GPU's cuDNN). Nothing is timed
or written to results/.

--compile-only (gpu, tune): every row compiled by XLA:GPU for a deviceless H200
topology (`jax.experimental.topologies` with `tfjax.train.aot.GPU_TARGET_CONFIGS`; needs jax's
CUDA plugin, `pip install "jax[cuda13]"`, no GPU or driver): the Triton kernels
go through Triton and ptxas (a tile that overflows shared memory fails here), cuDNN
and XLA's fusions compile too; each cell gives XLA's compiled temporary memory.
The Mosaic GPU kernels are compiled too: XLA's compile hands each one to Mosaic,
which runs its MLIR passes and ptxas for sm_90a (experiments/gpu_registers.py
reads ptxas's report). Writes attention_gpu_aot_<date>.md /
attention_gpu_tiles_aot_<date>.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import itertools
import math
import os
import re
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax
import jax.numpy as jnp
from flax import nnx

from tfjax.ops import RelativeBias, dot_product_attention
from tfjax.ops import masks as M

GIB = 1024 ** 3
MOSAIC_CALL = 'custom_call_target="tpu_custom_call"'  # a Mosaic kernel in compiled HLO text


def _aot(f, q, k, v, args) -> str:
    """--lower-only: the jitted `f` traced and lowered for cuda; --compile-only:
    compiled by XLA:GPU for the deviceless H200 of `args.gpu_sharding` (Triton
    kernels through Triton and ptxas). The caller is under `_as_if_on_gpu`.
    A table cell: "lowered", or "compiled" and the compiled temporaries."""
    shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=args.gpu_sharding)
              for x in (q, k, v)]
    if args.aot == "lower":
        f.trace(*shapes).lower(lowering_platforms=("cuda",))
        return "lowered"
    mem = f.lower(*shapes).compile().memory_analysis()
    return f"compiled, {mem.temp_size_in_bytes / 2**20:,.1f} MiB temp"


def _time(f, *args, reps=2):
    jax.block_until_ready(f(*args))  # compile + warm up
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        best = min(best, time.perf_counter() - t)
    return best


def _fn(impl, mask, grad, **kw):
    def fwd(q, k, v):
        return dot_product_attention(q, k, v, mask, implementation=impl, **kw)

    if not grad:
        return jax.jit(fwd)
    return jax.jit(jax.grad(lambda q, k, v: fwd(q, k, v).astype(jnp.float32).sum(), (0, 1, 2)))


# --------------------------------------------------------------------------- #
# CPU.
# --------------------------------------------------------------------------- #


def bench_cpu(args):
    B, N, K, H = 1, 4, 1, 64
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = []
    print(f"# CPU attention: B={B} N={N} K={K} H={H} fp32 causal; jax {jax.__version__}, "
          f"{jax.devices()[0].device_kind}, {os.cpu_count()} cores; "
          f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC", flush=True)
    print("| impl | pass | S | temp memory | time (s) |\n|---|---|---|---|---|", flush=True)
    for impl in ("reference", "xla", "blockwise"):
        for grad in (False, True):
            for S in sizes:
                q = jax.ShapeDtypeStruct((B, S, N, H), jnp.float32)
                kv = jax.ShapeDtypeStruct((B, S, K, H), jnp.float32)
                f = _fn(impl, M.causal(), grad)
                temp = f.lower(q, kv, kv).compile().memory_analysis().temp_size_in_bytes
                t = None
                if temp < args.max_run_gib * GIB:
                    ks = jax.random.split(jax.random.key(0), 3)
                    x = [jax.random.normal(kk, s.shape, s.dtype) for kk, s in zip(ks, (q, kv, kv))]
                    t = _time(f, *x, reps=args.reps)
                rows.append((impl, grad, S, temp, t))
                print(f"| {impl} | {'fwd+bwd' if grad else 'fwd'} | {S} | {temp / 2**20:,.1f} MiB "
                      f"| {'-' if t is None else f'{t:.3f}'} |", flush=True)
    print("\n| impl | pass | memory growth per 4x S | time growth per 4x S |\n|---|---|---|---|")
    for impl in ("reference", "xla", "blockwise"):
        for grad in (False, True):
            sel = [r for r in rows if r[0] == impl and r[1] == grad]
            mem = [f"{b[3] / max(a[3], 1):.1f}x" for a, b in itertools.pairwise(sel)]
            tim = [f"{b[4] / a[4]:.1f}x" if a[4] and b[4] else "-"
                   for a, b in itertools.pairwise(sel)]
            print(f"| {impl} | {'fwd+bwd' if grad else 'fwd'} | {', '.join(mem)} | "
                  f"{', '.join(tim)} |")


def bench_position_bias(args):
    """ALiBi (`args.part == "alibi"`) or T5's bucketed bias ("t5"): materialised as a
    `[B,N,T,S]` bias next to evaluated per tile."""
    from tfjax.nn.positions import T5RelativeBias, alibi_bias, alibi_slopes

    B, N, K, H = 1, 4, 1, 64
    slopes = jnp.asarray(alibi_slopes(N))
    t5 = args.part == "t5"
    table0 = jnp.asarray(T5RelativeBias(N, bidirectional=False, rngs=nnx.Rngs(0)).embedding[...])
    name = "T5 bias (32 buckets, max distance 128)" if t5 else "ALiBi"
    sizes = [int(s) for s in args.sizes.split(",")]
    print(f"# CPU {name} attention: B={B} N={N} K={K} H={H} fp32 causal; jax {jax.__version__}, "
          f"{jax.devices()[0].device_kind}, {os.cpu_count()} cores; "
          f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC", flush=True)
    print(f"| impl | {'bias' if t5 else 'ALiBi'} as | pass | S | temp memory | time (s) |\n"
          "|---|---|---|---|---|---|", flush=True)
    per_tile = "per-tile table" if t5 else "in-kernel slopes"
    cases = [("xla", "bias [B,N,T,S]"), ("blockwise", "bias [B,N,T,S]"), ("blockwise", per_tile)]
    rows = []
    for (impl, how), grad in itertools.product(cases, (False, True)):
        for S in sizes:
            def fwd(q, k, v, table, pos, impl=impl, how=how):
                if t5:
                    rb = RelativeBias(table, bidirectional=False, q_positions=pos,
                                      kv_positions=pos)
                    kw = (dict(bias=rb.dense(S, S)) if how.startswith("bias") else
                          dict(relative_bias=rb))
                else:
                    kw = (dict(bias=alibi_bias(pos, pos, slopes)) if how.startswith("bias") else
                          dict(alibi_slopes=slopes, alibi_positions=(pos, pos)))
                return dot_product_attention(q, k, v, M.causal(), implementation=impl, **kw)

            # T5's table is learned: fwd+bwd differentiates it too
            f = jax.jit(fwd if not grad else jax.grad(
                lambda q, k, v, t, p: fwd(q, k, v, t, p).sum(), (0, 1, 2, 3) if t5 else (0, 1, 2)))
            q = jax.ShapeDtypeStruct((B, S, N, H), jnp.float32)
            kv = jax.ShapeDtypeStruct((B, S, K, H), jnp.float32)
            pos = jax.ShapeDtypeStruct((B, S), jnp.int32)
            table = jax.ShapeDtypeStruct(table0.shape, table0.dtype)
            temp = f.lower(q, kv, kv, table, pos).compile().memory_analysis().temp_size_in_bytes
            t = None
            if temp < args.max_run_gib * GIB:
                ks = jax.random.split(jax.random.key(0), 3)
                x = [jax.random.normal(kk, s.shape, s.dtype) for kk, s in zip(ks, (q, kv, kv))]
                t = _time(f, *x, table0, jnp.arange(S, dtype=jnp.int32)[None] % 1000,
                          reps=args.reps)
            rows.append((impl, how, grad, S, temp, t))
            print(f"| {impl} | {how} | {'fwd+bwd' if grad else 'fwd'} | {S} | "
                  f"{temp / 2**20:,.1f} MiB | {'-' if t is None else f'{t:.3f}'} |", flush=True)
    print(f"\n| impl | {'bias' if t5 else 'ALiBi'} as | pass | memory growth per 4x S |\n"
          "|---|---|---|---|")
    for (impl, how), grad in itertools.product(cases, (False, True)):
        sel = [r for r in rows if r[:3] == (impl, how, grad)]
        mem = [f"{b[4] / max(a[4], 1):.1f}x" for a, b in itertools.pairwise(sel)]
        print(f"| {impl} | {how} | {'fwd+bwd' if grad else 'fwd'} | {', '.join(mem)} |")


# --------------------------------------------------------------------------- #
# GPU.
# --------------------------------------------------------------------------- #


def _jax_pallas_gpu(causal):
    from jax.experimental.pallas.ops.gpu import attention as jax_attention

    def f(q, k, v):  # jax's kernel has no GQA: K/V are repeated for it
        G = q.shape[2] // k.shape[2]
        k, v = (jnp.repeat(x, G, axis=2) for x in (k, v))
        return jax_attention.mha(q, k, v, segment_ids=None, causal=causal)

    return f


def _cudnn(mask, T, S, kind):
    def f(q, k, v):
        if kind == "explicit":
            dense = mask.dense(T, S)[:, None]
            return jax.nn.dot_product_attention(q, k, v, mask=dense, implementation="cudnn")
        return jax.nn.dot_product_attention(q, k, v, is_causal=kind == "causal",
                                            implementation="cudnn")
    return f


def _write_results(lines, stem):
    """experiments/results/<stem>_<date>.md"""
    os.makedirs(os.path.join(os.path.dirname(__file__), "results"), exist_ok=True)
    path = os.path.join(os.path.dirname(__file__), "results",
                        f"{stem}_{datetime.date.today():%Y%m%d}.md")
    with open(path, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print(f"wrote {path}")
    return path


def _write_gpu_results(args, out, stem):
    """A GPU table: <stem>_aot with --compile-only, <stem> when timed, nothing when lowered."""
    if args.aot == "compile":
        _write_results(out, f"{stem}_aot")
    elif not args.aot:
        _write_results(out, stem)


def _failed(cells: str, e: Exception, width: int = 80) -> str:
    """A table row whose remaining cells say why it failed."""
    return f"| {cells} | failed: {type(e).__name__}: {str(e).splitlines()[0][:width]} | | |"


def _inputs(keys, q_shape, kv_shape, dtype, args):
    """Random q, k, v; shapes only with --lower-only / --compile-only."""
    if args.aot:
        return tuple(jax.ShapeDtypeStruct(s, dtype) for s in (q_shape, kv_shape, kv_shape))
    return tuple(jax.random.normal(key, s, dtype)
                 for key, s in zip(keys, (q_shape, kv_shape, kv_shape)))


@contextlib.contextmanager
def _as_if_on_gpu(args, gpu="H200"):
    """--lower-only / --compile-only: jax's default backend reads "gpu" (the
    dispatch of implementation="pallas" follows it), the kernels lower for `gpu`,
    and (--compile-only) `args.gpu_sharding` places arrays on a deviceless H200
    topology, which needs jax's CUDA plugin installed (`pip install
    "jax[cuda13]"`; no GPU or driver needed)."""
    from tfjax.ops.target import gpu_lowering_target

    args.gpu_sharding = None
    if args.aot == "compile":
        from jax.experimental import topologies

        from tfjax.train.aot import GPU_TARGET_CONFIGS

        topo = topologies.get_topology_desc(platform="cuda", topology="1x1x1",
                                            target_config=GPU_TARGET_CONFIGS[gpu.lower()])
        mesh = topologies.make_mesh(topo, (1,), ("x",))
        args.gpu_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    default_backend = jax.default_backend
    jax.default_backend = lambda: "gpu"
    try:
        with gpu_lowering_target(gpu):
            yield
    finally:
        jax.default_backend = default_backend


def _device_kind(args) -> str:
    if getattr(args, "aot", None) == "compile":
        return f"{args.gpu_sharding.mesh.devices.flat[0].device_kind}, compiled without one"
    if getattr(args, "aot", None) == "lower":
        return "lowered for an NVIDIA H200 without one"
    return jax.devices()[0].device_kind


def bench_gpu(args):
    from tfjax.ops.pallas import flash_attention_gpu
    from tfjax.ops.pallas.mosaic_gpu import HopperConfig
    from tfjax.ops.target import is_hopper

    hopper = is_hopper()
    B, N, K = 1, 32, 8
    dtype = jnp.bfloat16
    what = "TFLOP/s" if not args.aot else "per-row compilation"
    out = [(f"# GPU attention {what} ({_device_kind(args)}, jax {jax.__version__}, "
            f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC)"), "",
           (f"B={B}, N={N}, K={K} (GQA), bf16. FLOPs 4*B*N*T*S*H (x0.5 causal), "
            "backward = 2.5x forward." if not args.aot else
            f"B={B}, N={N}, K={K} (GQA), bf16. Cells: lowered / compiled and XLA's compiled "
            "temporary memory (memory_analysis) of the forward and of fwd+bwd."), "",
           "| H | S | mask | impl | fwd TFLOP/s | bwd TFLOP/s | fwd+bwd TFLOP/s |" if not args.aot
           else "| H | S | mask | impl | fwd | | fwd+bwd |",
           "|---|---|---|---|---|---|---|"]
    print("\n".join(out), flush=True)
    deadline = time.time() + args.budget_s
    # The rows the targets need first (a lent GPU's budget runs out: every
    # row compiles its kernels there): forward vs cuDNN at H=128 S=8k, causal vs
    # non-causal, window and segment masks vs cuDNN with the explicit mask. Then the
    # sweep over H and S, then ALiBi and T5.
    configs = [(128, 8192, "none"), (128, 8192, "causal"), (128, 16384, "window1k"),
               (128, 16384, "segments4")]
    for H in (64, 128, 256):
        for S in (1024, 4096, 8192, 16384):
            for mask_name in ("none", "causal"):
                configs.append((H, S, mask_name))
    configs += [(128, 4096, "window1k"), (128, 4096, "segments4")]
    configs += [(128, 8192, "causal+alibi"), (128, 4096, "causal+t5"), (128, 8192, "causal+t5")]
    configs = list(dict.fromkeys(configs))  # the first four are not repeated in the sweep
    for H, S, mask_name in configs:
        if time.time() > deadline:
            out.append(f"| {H} | {S} | {mask_name} | (time budget spent) | | | |")
            continue
        T = S
        mask = {"none": None, "causal": M.causal(), "window1k": M.sliding_window(1024),
                "segments4": M.segments(jnp.repeat(jnp.arange(4), S // 4)[None]),
                "causal+t5": M.causal(), "causal+alibi": M.causal()}[mask_name]
        frac = {"none": 1.0, "causal": 0.5, "window1k": min(1.0, 1025 / S),
                "segments4": 0.25, "causal+t5": 0.5, "causal+alibi": 0.5}[mask_name]
        flops = 4 * B * N * T * S * H * frac
        ks = jax.random.split(jax.random.key(0), 3)
        q, k, v = _inputs(ks, (B, T, N, H), (B, S, K, H), dtype, args)
        impls = {
            # "auto" = on sm_90 the Hopper (Mosaic GPU) forward and, for H <= 128, the
            # Hopper backward; else the Triton kernels
            "tfjax pallas (auto)": lambda q, k, v, m=mask: dot_product_attention(
                q, k, v, m, implementation="pallas"),
            "tfjax pallas (triton)": lambda q, k, v, m=mask: flash_attention_gpu(
                q, k, v, m, forward="triton", backward="triton"),
        }
        if hopper and H <= 128:  # what the Hopper backward buys over Triton's
            impls["tfjax pallas (hopper fwd, triton bwd)"] = \
                lambda q, k, v, m=mask: flash_attention_gpu(q, k, v, m, forward="hopper",
                                                            backward="triton")
        if hopper and H == 128:  # what the warpgroups' ping-pong schedule buys
            impls["tfjax pallas (hopper fwd, no ping-pong)"] = \
                lambda q, k, v, m=mask: flash_attention_gpu(
                    q, k, v, m, forward="hopper", hopper_config=HopperConfig(pingpong=False))
        if mask_name == "causal+alibi":  # slopes per head, the term formed per tile
            sl = 2.0 ** -jnp.arange(1, N + 1, dtype=jnp.float32)
            impls = {
                "tfjax pallas (auto, ALiBi)": lambda q, k, v, m=mask, sl=sl: dot_product_attention(
                    q, k, v, m, alibi_slopes=sl, implementation="pallas"),
                "tfjax pallas (triton, ALiBi)": lambda q, k, v, m=mask, sl=sl: flash_attention_gpu(
                    q, k, v, m, alibi_slopes=sl, forward="triton", backward="triton"),
                "xla (ALiBi as a [B,N,T,S] bias)": lambda q, k, v, m=mask, sl=sl:
                    dot_product_attention(q, k, v, m, alibi_slopes=sl, implementation="xla"),
            }
        elif mask_name == "causal+t5":  # 32 buckets; the table is a constant here, so XLA
            # drops the dense bias's gradient while the kernels' dq still sums the table's
            rb = RelativeBias(jax.random.normal(ks[0], (32, N)), bidirectional=False)
            impls = {
                "tfjax pallas (T5 per tile)": lambda q, k, v, m=mask, rb=rb: flash_attention_gpu(
                    q, k, v, m, relative_bias=rb),
                "tfjax pallas (T5 as a [B,N,T,S] bias)": lambda q, k, v, m=mask, rb=rb:
                    flash_attention_gpu(q, k, v, m, bias=rb.dense(T, S)),
                "xla (T5 as a [B,N,T,S] bias)": lambda q, k, v, m=mask, rb=rb:
                    dot_product_attention(q, k, v, m, relative_bias=rb, implementation="xla"),
            }
        elif mask_name in ("none", "causal"):
            impls["cudnn"] = _cudnn(mask, T, S, "causal" if mask_name == "causal" else "none")
            impls["jax pallas gpu"] = _jax_pallas_gpu(mask_name == "causal")
            if S <= 8192:
                impls["xla"] = lambda q, k, v, m=mask: dot_product_attention(q, k, v, m,
                                                                             implementation="xla")
        else:
            impls["cudnn (explicit mask)"] = _cudnn(mask, T, S, "explicit")
        for name, f in impls.items():
            if args.aot == "lower" and name.startswith("cudnn"):
                continue  # its lowering asks the local GPU's cuDNN
            try:
                fwd = jax.jit(f)
                fb = jax.jit(jax.grad(lambda q, k, v, f=f: f(q, k, v).astype(jnp.float32).sum(),
                                      (0, 1, 2)))
                if args.aot:
                    row = (f"| {H} | {S} | {mask_name} | {name} | {_aot(fwd, q, k, v, args)} | | "
                           f"{_aot(fb, q, k, v, args)} |")
                else:
                    t_f, t_fb = _time(fwd, q, k, v, reps=3), _time(fb, q, k, v, reps=3)
                    t_b = max(t_fb - t_f, 1e-9)
                    row = (f"| {H} | {S} | {mask_name} | {name} | {flops / t_f / 1e12:.1f} | "
                           f"{2.5 * flops / t_b / 1e12:.1f} | {3.5 * flops / t_fb / 1e12:.1f} |")
            except Exception as e:  # noqa: BLE001 - a row says why an implementation failed
                row = _failed(f"{H} | {S} | {mask_name} | {name}", e)
            out.append(row)
            print(row, flush=True)
    _write_gpu_results(args, out, "attention_gpu")


def bench_tune(args, S=8192, N=32, K=8, head_dims=(128, 64)):
    """Block sizes of the GPU kernels at one shape (causal, S = 8k, GQA 32/8, bf16,
    H = 128 then 64): forward TFLOP/s of the Hopper forward (per tile choice, and
    its schedules: ping-pong, none, intra-warpgroup overlap; one consumer; the LPT
    launch order) and the Triton
    forward per tile choice, backward TFLOP/s ((fwd+bwd) - fwd) of the Hopper and
    Triton backward per tile choice; the Triton kernels at their default tiles also
    with 4 warps everywhere (their launch before `triton_launch` chose warps and
    stages from ptxas's register report). Rows print as they are measured (a killed
    run keeps them); the defaults are marked *."""
    from tfjax.ops.pallas import flash_attention_gpu
    from tfjax.ops.pallas.triton import TritonConfig, default_block_sizes
    from tfjax.ops.target import is_hopper
    from tfjax.ops.pallas.mosaic_gpu import SMEM_BYTES, HopperConfig
    from tfjax.ops.pallas.mosaic_gpu_backward import HopperBackwardConfig

    B = 1
    mask = M.causal()
    out = [(f"# GPU kernel tiles ({_device_kind(args)}, jax {jax.__version__}, "
            f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC)"), "",
           f"B={B}, N={N}, K={K}, T=S={S}, causal, bf16; FLOPs 2*B*N*S*S*H (fwd), x2.5 (bwd).",
           "", "| H | kernel | tiles | fwd TFLOP/s | bwd TFLOP/s |" if not args.aot else
           "| H | kernel | tiles | fwd | fwd+bwd |", "|---|---|---|---|---|"]
    print("\n".join(out), flush=True)
    deadline = time.time() + args.budget_s
    hopper = is_hopper()
    for H in head_dims:
        ks = jax.random.split(jax.random.key(0), 3)
        q, k, v = _inputs(ks, (B, S, N, H), (B, S, K, H), jnp.bfloat16, args)
        flops = 2 * B * N * S * S * H
        rows = []  # (kernel, tiles, is default, forward kwargs, backward kwargs or None)
        if hopper:
            for bk, st in itertools.product((64, 128), (2, 3)):
                c = HopperConfig(block_kv=bk, stages=st)
                if c.smem_bytes(H) <= SMEM_BYTES:
                    rows.append(("hopper fwd", f"block_kv={bk} stages={st}",
                                 c == HopperConfig.default(H),
                                 dict(forward="hopper", hopper_config=c), None))
            for name, c in (("no ping-pong", dataclasses.replace(HopperConfig.default(H),
                                                                 pingpong=False)),
                            ("overlap", dataclasses.replace(HopperConfig.default(H),
                                                            overlap=True)),
                            # one warpgroup, no producer: 2 programs per SM where its
                            # registers allow (experiments/gpu_registers.py)
                            ("1 consumer", dataclasses.replace(HopperConfig.default(H),
                                                               compute_warpgroups=1,
                                                               pingpong=False)),
                            # longest first across heads (experiments/launch_order.py)
                            ("LPT order", dataclasses.replace(HopperConfig.default(H),
                                                              order="lpt"))):
                rows.append(("hopper fwd", f"default tiles, {name}", False,
                             dict(forward="hopper", hopper_config=c), None))
            for bdq, bdkv in itertools.product((64, 128), (64, 128)):
                c = HopperBackwardConfig(bdq, bdkv)
                if c.smem_bytes(H) <= SMEM_BYTES:
                    rows.append(("hopper bwd", f"block_kv_dq={bdq} block_q_dkv={bdkv}",
                                 c == HopperBackwardConfig(), dict(forward="hopper"),
                                 dict(forward="hopper", backward="hopper",
                                      hopper_backward_config=c)))
        d = default_block_sizes(H)
        for bq, bk in itertools.product((64, 128), (32, 64, 128)):
            bs = dataclasses.replace(d, block_q=bq, block_kv=bk)
            rows.append(("triton fwd", f"block_q={bq} block_kv={bk}", bs == d,
                         dict(forward="triton", block_sizes=bs), None))
        for b in (32, 64, 128):
            bs = dataclasses.replace(d, block_q_dq=b, block_kv_dq=b, block_q_dkv=b,
                                     block_kv_dkv=b)
            rows.append(("triton bwd", f"dq and dk/dv tiles {b}x{b}", bs == d,
                         dict(forward="triton", block_sizes=d),
                         dict(forward="triton", backward="triton", block_sizes=bs)))
        # the default tiles at the fixed launch the kernels had before `triton_launch`
        # (4 warps everywhere): does ptxas's no-spill choice pay?
        fixed = TritonConfig()
        rows.append(("triton fwd", "default tiles, 4 warps 3 stages", False,
                     dict(forward="triton", block_sizes=d, triton_config=fixed), None))
        rows.append(("triton bwd", "default tiles, 4 warps", False,
                     dict(forward="triton", block_sizes=d),
                     dict(forward="triton", backward="triton", block_sizes=d,
                          triton_config=fixed)))
        for kernel, tiles, default, fwd_kw, bwd_kw in rows:
            if time.time() > deadline:
                out.append(f"| {H} | {kernel} | {tiles} | (time budget spent) | |")
                print(out[-1], flush=True)
                continue
            try:
                f_fwd = jax.jit(lambda q, k, v, kw=fwd_kw: flash_attention_gpu(q, k, v, mask, **kw))
                f_fb = None
                if bwd_kw is not None:
                    loss = lambda q, k, v, kw=bwd_kw: flash_attention_gpu(
                        q, k, v, mask, **kw).astype(jnp.float32).sum()
                    f_fb = jax.jit(jax.grad(loss, (0, 1, 2)))
                if args.aot:  # a backward row: the default forward's fwd+bwd
                    fwd, bwd = ("", _aot(f_fb, q, k, v, args)) if f_fb else \
                        (_aot(f_fwd, q, k, v, args), "")
                else:
                    t_f = _time(f_fwd, q, k, v, reps=3)
                    fwd, bwd = f"{flops / t_f / 1e12:.1f}", ""
                    if f_fb is not None:
                        t_fb = _time(f_fb, q, k, v, reps=3)
                        bwd = f"{2.5 * flops / max(t_fb - t_f, 1e-9) / 1e12:.1f}"
                        fwd = ""  # the forward of a backward row is the default's
                row = f"| {H} | {kernel} | {tiles}{' *' if default else ''} | {fwd} | {bwd} |"
            except Exception as e:  # noqa: BLE001 - a row says why a tile choice failed
                row = (f"| {H} | {kernel} | {tiles} | failed: {type(e).__name__}: "
                       f"{str(e).splitlines()[0][:80]} | |")
            out.append(row)
            print(row, flush=True)
    _write_gpu_results(args, out, "attention_gpu_tiles")


def bench_t5_tpu_aot(args, topology="v5e:2x2", N=8, K=2, H=128):
    """Per-device compiled memory of the Pallas TPU kernels' fwd+bwd (causal, bf16,
    512 tiles), compiled by the real XLA:TPU / Mosaic compilers on this CPU (libtpu
    topologies): no bias, T5's bias per tile (index / explicit positions, the table
    differentiated), and a materialised `[B,N,T,S]` fp32 bias (its gradient too)."""
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from tfjax.ops.pallas import BlockSizes, flash_attention_tpu

    topo = topologies.get_topology_desc(platform="tpu", topology_name=topology)
    mesh = Mesh(np.array(topo.devices).reshape(-1), ("data",))
    D, bs = mesh.devices.size, BlockSizes(*(512,) * 6)
    out = [f"# Pallas TPU kernels, fwd+bwd compiled per-device memory ({topology}, one example "
           f"per chip, N={N} K={K} H={H} bf16 causal, 512 tiles; jax {jax.__version__}, "
           f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC)", "",
           "| bias | T=S | temp MiB | arguments MiB | outputs MiB |", "|---|---|---|---|---|"]
    print("\n".join(out), flush=True)
    for how in ("none", "t5 index positions", "t5 explicit positions", "[B,N,T,S] fp32 bias"):
        for T in (int(s) for s in args.sizes.split(",")):
            def local(q, k, v, pos, table, bias, how=how):
                def loss(q, k, v, table, bias):
                    rel = None
                    if how.startswith("t5"):
                        p = pos if how.endswith("explicit positions") else None
                        rel = RelativeBias(table, bidirectional=False, q_positions=p,
                                           kv_positions=p)
                    o = flash_attention_tpu(q, k, v, M.causal(), bias=bias, relative_bias=rel,
                                            interpret=False, block_sizes=bs)
                    return o.astype(jnp.float32).sum()
                return jax.grad(loss, (0, 1, 2, 3, 4) if bias is not None else (0, 1, 2, 3))(
                    q, k, v, table, bias)

            sh = lambda s: NamedSharding(mesh, s)
            sds = lambda shape, dt, s=P("data"): jax.ShapeDtypeStruct(shape, dt, sharding=sh(s))
            dense = how.startswith("[B")
            a = (sds((D, T, N, H), jnp.bfloat16), sds((D, T, K, H), jnp.bfloat16),
                 sds((D, T, K, H), jnp.bfloat16), sds((D, T), jnp.int32),
                 sds((32, N), jnp.float32, P()), sds((D, N, T, T), jnp.float32) if dense else None)
            specs = (P("data"),) * 4 + (P(),) + ((P("data"),) if dense else (None,))
            outs = (P("data"),) * 3 + (P(),) + ((P("data"),) if dense else ())
            f = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=outs, check_vma=False)
            try:  # the dense bias outgrows the chip's HBM at 16k (2 x 8 GiB)
                m = jax.jit(f).lower(*a).compile().memory_analysis()
                row = (f"| {how} | {T} | {m.temp_size_in_bytes / 2**20:,.1f} | "
                       f"{m.argument_size_in_bytes / 2**20:,.1f} | "
                       f"{m.output_size_in_bytes / 2**20:,.1f} |")
            except Exception as e:  # noqa: BLE001 - a row says why it failed
                row = _failed(f"{how} | {T}", e, 100)
            out.append(row)
            print(row, flush=True)
    out += _vs_splash_tpu_aot(args, mesh)
    _write_results(out, "attention_t5_tpu_aot")


def _vs_splash_tpu_aot(args, mesh, N=32, K=8):
    """The table rows of the kernels beside splash attention (see the module)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    D = mesh.devices.size
    out = ["", f"## Beside jax's splash attention (causal, GQA {N}/{K}, bf16, fwd+bwd, one "
           "example per chip, splash at 512 tiles, ours at its defaults; MiB per chip)", "",
           "| H | T=S | implementation | layout given | temp | arguments | outputs | "
           "Mosaic calls | temp vs splash, same layout |", "|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(out), flush=True)
    heads_major = lambda x: x.transpose(0, 2, 1, 3)  # [B,T,N,H] <-> [B,N,T,H]
    for H, T in itertools.product((128, 64), (int(s) for s in args.sizes.split(","))):
        blocks = sk.BlockSizes(*(512,) * 8)  # q, kv, kv compute; dkv's three; dq's two
        splash = jax.vmap(sk.make_splash_mha(sm.MultiHeadMask([sm.CausalMask((T, T))] * N),
                                             head_shards=1, q_seq_shards=1, block_sizes=blocks))
        ours = lambda q, k, v: dot_product_attention(q, k, v, M.causal(), implementation="pallas")
        rows = [  # (implementation, layout given, attention on that layout)
            ("tfjax pallas", "[B,T,N,H]", ours),
            ("splash", "[B,T,N,H]", lambda q, k, v: heads_major(splash(
                heads_major(q) * H ** -0.5, heads_major(k), heads_major(v)))),
            ("tfjax pallas", "[B,N,T,H]", lambda q, k, v: heads_major(
                ours(heads_major(q), heads_major(k), heads_major(v)))),
            ("splash", "[B,N,T,H]", lambda q, k, v: splash(q * H ** -0.5, k, v)),
        ]
        ours_temp = None
        for name, layout, attention in rows:
            def local(q, k, v, attention=attention):
                loss = lambda *a: attention(*a).astype(jnp.float32).sum()
                return jax.grad(loss, (0, 1, 2))(q, k, v)

            shape = (lambda n: (D, n, T, H)) if layout == "[B,N,T,H]" else (lambda n: (D, T, n, H))
            sds = lambda n: jax.ShapeDtypeStruct(shape(n), jnp.bfloat16,
                                                 sharding=NamedSharding(mesh, P("data")))
            f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P("data"), out_specs=P("data"),
                                      check_vma=False))
            try:
                c = f.lower(sds(N), sds(K), sds(K)).compile()
                m, mib = c.memory_analysis(), lambda b: f"{b / 2**20:,.1f}"
                temp = m.temp_size_in_bytes
                ratio = ""
                if name == "splash" and ours_temp is not None:  # ours, then splash, per layout
                    ratio = _vs_splash(ours_temp, temp)
                ours_temp = temp if name != "splash" else None
                calls = c.as_text().count(MOSAIC_CALL)
                row = (f"| {H} | {T} | {name} | {layout} | {mib(temp)} | "
                       f"{mib(m.argument_size_in_bytes)} | {mib(m.output_size_in_bytes)} | "
                       f"{calls} | {ratio} |")
            except Exception as e:  # noqa: BLE001 - a row says why it failed
                ours_temp = None
                row = _failed(f" {H} | {T} | {name} | {layout}", e, 100)
            out.append(row)
            print(row, flush=True)
    return out


def _vs_splash(ours_temp: int, splash_temp: int) -> str:
    """The "temp vs splash" cell: ours / splash's compiled temporaries."""
    if splash_temp:
        return f"{ours_temp / splash_temp:.2f}x"
    return "both 0" if not ours_temp else f"{ours_temp / 2**20:,.1f} vs 0"


def relayouts(hlo_text: str, min_elements: int, length: int, params=()) -> list[str]:
    """The `copy` / `transpose` instructions of a compiled HLO text (fusion bodies
    included) whose result holds at least `min_elements` and has an axis of `length`,
    other than arrays shaped as one of `params` (weights and their gradients, whose
    layout changes are weight-sized): the activation- or cache-sized relayouts."""
    skip = {tuple(p.shape) for p in params}
    found = []
    for m in re.finditer(r"= \w+\[([\d,]*)\]\{[^}]*\} (copy|transpose)\(", hlo_text):
        dims = [int(d) for d in m.group(1).split(",") if d]
        if length in dims and math.prod(dims) >= min_elements and tuple(dims) not in skip:
            found.append(m.group(0))
    return found


def last_loop_body(hlo_text: str) -> str:
    """The HLO text of every computation reachable from the body of the entry
    computation's last `while` (a decode loop, which runs after its prefill)."""
    comps, name = {}, None
    for line in hlo_text.splitlines():
        if line and not line.startswith(" ") and line.rstrip().endswith("{"):
            name = "ENTRY" if line.startswith("ENTRY") else line.split()[0].lstrip("%")
            comps[name] = []
        elif name is not None and line.startswith("  "):
            comps[name].append(line)
    bodies = [m.group(1) for line in comps.get("ENTRY", [])
              for m in [re.search(r" while\(.*body=%?([\w.\-]+)", line)] if m]
    seen, todo = set(), bodies[-1:]
    while todo:
        c = todo.pop()
        if c in seen or c not in comps:
            continue
        seen.add(c)
        for line in comps[c]:
            for m in re.finditer(r"(?:calls|body|condition|to_apply|branch_computations)="
                                 r"\{?([%\w.\-, ]+)\}?", line):
                todo += [n.strip().lstrip("%") for n in m.group(1).split(",")]
    return "\n".join(line for c in seen for line in comps[c])


def bench_layer_tpu_aot(args, topology="v5e:2x2", N=32, K=8):
    """A whole attention layer on TPU (see the module): ours and splash in the same
    layer, then the decode programs over a KV cache."""
    import numpy as np
    from jax.experimental import topologies
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from tfjax.config import AttentionConfig
    from tfjax.nn.attention import MultiHeadAttention
    from tfjax.nn.positions import RotaryEmbedding

    topo = topologies.get_topology_desc(platform="tpu", topology_name=topology)
    mesh = Mesh(np.array(topo.devices).reshape(-1), ("data",))
    chips = mesh.devices.size
    out = [f"# An attention layer on TPU, compiled per chip ({topology}, one example per chip, "
           f"GQA {N}/{K}, bf16, RoPE, causal, fwd+bwd of projections + attention + output "
           f"projection; jax {jax.__version__}, "
           f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC)", "",
           "Relayouts: `copy` / `transpose` instructions of at least T*K*H elements with a "
           "T axis, not shaped as a weight, anywhere in the compiled program (`relayouts`).",
           "",
           "| H | D | T | attention | temp MiB | relayouts | Mosaic calls | temp vs splash |",
           "|---|---|---|---|---|---|---|---|"]
    print("\n".join(out), flush=True)
    heads_major = lambda x: x.transpose(0, 2, 1, 3)  # [B,T,N,H] <-> [B,N,T,H]
    for H, T in itertools.product((128, 64), (int(s) for s in args.sizes.split(","))):
        D = N * H
        layer = MultiHeadAttention(D, N, num_kv_heads=K, head_dim=H,
                                   attention=AttentionConfig(impl="pallas"),
                                   rope=RotaryEmbedding(H), dtype=jnp.bfloat16,
                                   param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
        graphdef, params = nnx.split(layer)
        splash = jax.vmap(sk.make_splash_mha(
            sm.MultiHeadMask([sm.CausalMask((T, T))] * N), head_shards=1, q_seq_shards=1,
            block_sizes=sk.BlockSizes(*(512,) * 8)))
        ours_temp = None
        for name in ("tfjax pallas", "splash"):
            def local(params, x, name=name):
                def loss(params, x):
                    m = nnx.merge(graphdef, params)
                    if name == "splash":  # the same layer around splash on [B,N,T,H]
                        q, k, v = m.project(x)
                        o = heads_major(splash(heads_major(q) * m.scale, heads_major(k),
                                               heads_major(v)))
                        y = m.o(o)
                    else:
                        y = m(x, mask=M.causal())
                    return jnp.square(y.astype(jnp.float32)).sum()
                return jax.grad(loss, (0, 1))(params, x)

            rep = NamedSharding(mesh, P())
            a = (jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=rep),
                              params),
                 jax.ShapeDtypeStruct((chips, T, D), jnp.bfloat16,
                                      sharding=NamedSharding(mesh, P("data"))))
            f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data")),
                                      out_specs=(P(), P("data")), check_vma=False))
            try:
                c = f.lower(*a).compile()
                text, temp = c.as_text(), c.memory_analysis().temp_size_in_bytes
                ratio = (_vs_splash(ours_temp, temp) if name == "splash" and ours_temp is not None
                         else "")
                ours_temp = temp if name != "splash" else None
                row = (f"| {H} | {D} | {T} | {name} | {temp / 2**20:,.1f} | "
                       f"{len(relayouts(text, T * K * H, T, jax.tree.leaves(params)))} | "
                       f"{text.count(MOSAIC_CALL)} | {ratio} |")
            except Exception as e:  # noqa: BLE001 - a row says why it failed
                ours_temp = None
                row = _failed(f" {H} | {D} | {T} | {name}", e, 100)
            out.append(row)
            print(row, flush=True)
    out += _decode_programs_tpu_aot(args)
    _write_results(out, "attention_layer_tpu_aot")


def _decode_programs_tpu_aot(args, topology="v5e:2x2", S=32768, T=512):
    """The decode programs' rows (see the module)."""
    import numpy as np
    from common import preset_config  # experiments/common.py (this TPU part runs on CPU)
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from tfjax.config import DEFAULT_RULES, MESH_AXES, run_config
    from tfjax.models import build
    from tfjax.parallel.rules import logical_rules
    from tfjax.parallel.sharding import use_rules

    from tfjax.inference.generate import _programs

    topo = topologies.get_topology_desc(platform="tpu", topology_name=topology)
    devices = np.array(topo.devices).reshape(-1, *(1,) * (len(MESH_AXES) - 1))
    mesh = Mesh(devices, MESH_AXES)
    chips = devices.size
    out = ["", f"## Decoding over a KV cache (2 layers of Llama-3.1-8B's shape, H = 128, and of "
           f"Llama-3.2-1B's, H = 64; bf16, {S:,} slots, one example per chip, a {T}-token "
           "prompt)", "",
           "`generate`: the prefill and the decode loop, one program; `stream`: one decode "
           "step per call (the cache a donated argument). Layers scanned (`model.scan_layers`, "
           "the presets' default) or unrolled. Relayouts: cache-sized (S*K*H elements with "
           "an S axis), in the whole program and in one decode step (`stream`: the program; "
           "`generate`: its decode loop's body, `last_loop_body`).", "",
           "| H | program | layers | attention | temp MiB | relayouts | relayouts a step | "
           "Mosaic calls |", "|---|---|---|---|---|---|---|---|"]
    print("\n".join(out), flush=True)
    settings = dict(temperature=jnp.float32(0), top_k=jnp.int32(0), top_p=jnp.float32(1))
    rows = lambda a: NamedSharding(mesh, P("data") if a.ndim and a.shape[0] == chips else
                                   P(None, "data") if a.ndim > 1 and a.shape[1] == chips else P())
    for variant, program, scanned, impl in itertools.product(
            (None, "1b"), ("generate", "stream"), (True, False), ("xla", "pallas")):
        layers = "scanned" if scanned else "unrolled"
        cfg = preset_config("llama", variant)
        cfg.model.update(dict(dtype="bfloat16", num_layers=2, scan_layers=scanned,
                              attention=dict(impl=impl)))
        mcfg = run_config(cfg).model
        model = nnx.eval_shape(lambda: build(mcfg, rngs=nnx.Rngs(0)))
        graphdef, state = nnx.split(model)
        state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                            sharding=NamedSharding(mesh, P())),
                             state)
        per_chip = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt,
                                                          sharding=NamedSharding(mesh, P("data")))
        try:
            with use_rules(mesh, logical_rules(DEFAULT_RULES)):
                start, step, run, _ = _programs(graphdef, mesh)
                if program == "generate":
                    lowered = run.lower(state, per_chip((chips, T), jnp.int32),
                                        per_chip((chips,), jnp.int32), jax.random.key(0),
                                        settings, jnp.int32(-1), jnp.int32(0), cache_len=S,
                                        n=S - T, decoder_start_id=0, prefill_chunk=0)
                else:
                    cache = jax.eval_shape(lambda: model.init_cache(chips, S))
                    cache = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                                        sharding=rows(a)), cache)
                    lowered = step.lower(state, cache, per_chip((chips,), jnp.int32),
                                         jax.random.key(0), jnp.int32(1), settings)
            c = lowered.compile()
            text = c.as_text()
            step_text = last_loop_body(text) if program == "generate" else text
            K, H = mcfg.num_kv_heads, mcfg.d_model // mcfg.num_heads
            row = (f"| {H} | {program} | {layers} | {impl} | "
                   f"{c.memory_analysis().temp_size_in_bytes / 2**20:,.1f} | "
                   f"{len(relayouts(text, S * K * H, S))} | "
                   f"{len(relayouts(step_text, S * K * H, S))} | "
                   f"{text.count(MOSAIC_CALL)} |")
        except Exception as e:  # noqa: BLE001 - a row says why it failed
            row = _failed(f" {variant or '8b'} | {program} | {layers} | {impl}", e, 100)
        out.append(row)
        print(row, flush=True)
    return out


def _cache_positions(B, S, filled):
    """A KV cache's positions `[B, S]`: slot = position for the first `filled`
    slots, -1 (empty) after."""
    return jnp.broadcast_to(jnp.where(jnp.arange(S) < filled, jnp.arange(S), -1),
                            (B, S)).astype(jnp.int32)


def bench_decode(args, N=32, K=8, H=128):
    """A decode step's attention over a KV cache (T = 1, GQA 32/8, H = 128, bf16,
    the cache half filled, its mask `masks.Positions` from traced positions as in
    `tfjax.inference`): "auto" (query heads packed as rows, the keys split into
    chunks when the grid is small, `tfjax/ops/pallas/decode.py`), the same kernels
    without the split and without either, and xla. Time per call from 16 calls
    chained in one jit (no dispatch in the timing), and the bandwidth of the
    filled half's K/V bytes (what must be read)."""
    from tfjax.ops.pallas import flash_attention
    from tfjax.ops.pallas.decode import auto_kv_splits
    from tfjax.ops.pallas.triton import default_block_sizes
    from tfjax.ops.target import sm_count

    dtype, reps = jnp.bfloat16, 16
    out = [(f"# Decode-step attention over a KV cache ({_device_kind(args)}, jax {jax.__version__}, "
            f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC)"), "",
           f"T=1, N={N}, K={K}, H={H}, bf16; the cache's S slots half filled (positions as "
           "an input). GB/s: K/V bytes of the filled half per call time.", "",
           "| B | S | impl | splits | us / call | K/V GB/s | vs xla |" if not args.aot else
           "| B | S | impl | splits | compiled |", "|---|---|---|---|---|---|---|"
           if not args.aot else "|---|---|---|---|---|"]
    print("\n".join(out), flush=True)
    deadline = time.time() + args.budget_s
    for B, S in ((1, 8192), (1, 32768), (8, 32768), (32, 8192)):
        P = auto_kv_splits(B, K, N // K, S, default_block_sizes(H).block_q, sm_count())
        impls = {
            "tfjax pallas (auto)": (P, lambda q, k, v, m: dot_product_attention(
                q, k, v, m, implementation="pallas")),
            "tfjax pallas (packed, no split)": (1, lambda q, k, v, m: flash_attention(
                q, k, v, m, kv_splits=1)),
            "tfjax pallas (neither)": (1, lambda q, k, v, m: flash_attention(
                q, k, v, m, pack_heads=False, kv_splits=1)),
            "xla": (1, lambda q, k, v, m: dot_product_attention(q, k, v, m, implementation="xla")),
        }
        ks = jax.random.split(jax.random.key(0), 3)
        q, k, v = _inputs(ks, (B, 1, N, H), (B, S, K, H), dtype, args)
        kv_bytes = 2 * B * (S // 2) * K * H * jnp.dtype(dtype).itemsize
        t_xla = None
        for name, (splits, f) in reversed(impls.items()):  # xla first: the peer
            if time.time() > deadline:
                out.append(f"| {B} | {S} | {name} | (time budget spent) | | | |")
                continue

            def chained(q, k, v, f=f, S=S, B=B):
                m = M.positions(jnp.full((B, 1), S // 2, jnp.int32), _cache_positions(B, S, S // 2))
                return jax.lax.fori_loop(0, reps, lambda i, q: f(q, k, v, m).astype(q.dtype), q)

            try:
                fn = jax.jit(chained)
                if args.aot:
                    row = f"| {B} | {S} | {name} | {splits} | {_aot(fn, q, k, v, args)} |"
                else:
                    t = _time(fn, q, k, v, reps=3) / reps
                    t_xla = t if name == "xla" else t_xla
                    row = (f"| {B} | {S} | {name} | {splits} | {t * 1e6:,.1f} | "
                           f"{kv_bytes / t / 1e9:,.0f} | {t_xla / t:.2f}x |")
            except Exception as e:  # noqa: BLE001 - a row says why an implementation failed
                row = _failed(f"{B} | {S} | {name} | {splits}", e)
            out.append(row)
            print(row, flush=True)
    _write_gpu_results(args, out, "attention_decode_gpu")


def bench_cache_tpu_aot(args, topology="v5e:2x2", N=32, K=8, H=128):
    """Per-device compiled memory of attention over a KV cache on a TPU (real
    XLA:TPU / Mosaic compilation on this CPU, libtpu topologies; GQA 32/8,
    H = 128, bf16, forward): chunked prefill (T new tokens over S slots, one
    example per chip; `masks.Positions` from traced positions) and a decode step
    (T = 1, 1 and 8 examples per chip), by "xla" (what "auto" ran before the
    Pallas kernels took the cache's mask) and "pallas"."""
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from tfjax.ops.pallas import flash_attention

    topo = topologies.get_topology_desc(platform="tpu", topology_name=topology)
    mesh = Mesh(np.array(topo.devices).reshape(-1), ("data",))
    D = mesh.devices.size
    out = [f"# Attention over a KV cache on TPU, compiled per-device memory ({topology}, "
           f"N={N} K={K} H={H} bf16, forward; jax {jax.__version__}, "
           f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC)", "",
           "| step | B per chip | T | S | impl | temp MiB | arguments MiB | outputs MiB |",
           "|---|---|---|---|---|---|---|---|"]
    print("\n".join(out), flush=True)
    S = int(args.sizes.split(",")[-1])
    for T, E in ((1, 1), (1, 8), (512, 1), (2048, 1)):  # E examples per chip
        for impl in ("xla", "pallas"):
            def local(q, k, v, qpos, kvpos, impl=impl):
                m = M.positions(qpos, kvpos)
                if impl == "pallas":  # the Mosaic kernels (this CPU would interpret them)
                    return flash_attention(q, k, v, m, interpret=False)
                return dot_product_attention(q, k, v, m, implementation=impl)

            sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt,
                                                         sharding=NamedSharding(mesh, P("data")))
            a = (sds((D * E, T, N, H), jnp.bfloat16), sds((D * E, S, K, H), jnp.bfloat16),
                 sds((D * E, S, K, H), jnp.bfloat16), sds((D * E, T), jnp.int32),
                 sds((D * E, S), jnp.int32))
            f = jax.shard_map(local, mesh=mesh, in_specs=(P("data"),) * 5, out_specs=P("data"),
                              check_vma=False)
            try:
                m = jax.jit(f).lower(*a).compile().memory_analysis()
                row = (f"| {'decode' if T == 1 else 'chunked prefill'} | {E} | {T} | {S} | {impl} | "
                       f"{m.temp_size_in_bytes / 2**20:,.1f} | "
                       f"{m.argument_size_in_bytes / 2**20:,.1f} | "
                       f"{m.output_size_in_bytes / 2**20:,.1f} |")
            except Exception as e:  # noqa: BLE001 - a row says why it failed
                row = _failed(f" | {E} | {T} | {S} | {impl}", e, 100)
            out.append(row)
            print(row, flush=True)
    _write_results(out, "attention_cache_tpu_aot")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("part", choices=["cpu", "alibi", "t5", "t5-tpu-aot", "cache-tpu-aot",
                                    "layer-tpu-aot", "gpu", "decode", "tune"])
    p.add_argument("--sizes", default="1024,4096,16384")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--max-run-gib", type=float, default=3.0)
    p.add_argument("--budget-s", type=float, default=420.0)
    p.add_argument("--lower-only", dest="aot", action="store_const", const="lower",
                   help="gpu, tune: lower every row for cuda as for an H200, on any machine")
    p.add_argument("--compile-only", dest="aot", action="store_const", const="compile",
                   help="gpu, tune: compile every row with XLA:GPU for a deviceless H200 "
                        "(needs jax's CUDA plugin, no GPU); compiled temporaries per row")
    args = p.parse_args()
    if args.part in ("cpu", "alibi", "t5"):
        (bench_cpu if args.part == "cpu" else bench_position_bias)(args)
    elif args.part == "t5-tpu-aot":
        bench_t5_tpu_aot(args)
    elif args.part == "cache-tpu-aot":
        bench_cache_tpu_aot(args)
    elif args.part == "layer-tpu-aot":
        bench_layer_tpu_aot(args)
    else:
        bench = {"gpu": bench_gpu, "decode": bench_decode, "tune": bench_tune}[args.part]
        if args.aot:
            with _as_if_on_gpu(args):
                bench(args)
            return
        if jax.default_backend() != "gpu":
            sys.exit(f"bench_attention.py {args.part}: needs a GPU, jax backend is "
                     f"{jax.default_backend()} (--lower-only lowers its rows without one)")
        bench(args)


if __name__ == "__main__":
    main()
