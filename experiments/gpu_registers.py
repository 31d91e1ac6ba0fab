"""Registers, spills and shared memory of the GPU attention kernels (Triton, and
the Hopper kernels in Mosaic GPU) per tile choice, as ptxas compiles them for an
H200, on a machine without a GPU.

    python experiments/gpu_registers.py --write-launch  # jax[cuda13]: ~12 min, 2 cores
    python experiments/gpu_registers.py --write-launch \
        --from-table experiments/results/attention_gpu_ptxas_20261130.md  # no compiling

Each configuration (fwd, or fwd+bwd, S = 8k, GQA 32/8, bf16; for each feature class
of `launch_features`: causal, the per-tile extras at once, T5's bias) is compiled
by XLA:GPU for a deviceless H200 (the topology of `bench_attention.py
--compile-only`; needs jax's CUDA plugin, `pip install "jax[cuda13]"`, no GPU or
driver). XLA hands the Triton kernels' PTX to ptxas; its report (XLA logs it at
TF_CPP_VMODULE=subprocess_compilation=5) gives registers per thread and spill
stores/loads, and XLA's thunk sequence (--xla_dump_to) the launch: threads and
shared memory. From them, programs resident per SM by the occupancy rules of
sm_90: 65,536 registers per SM allocated per warp in units of 256, 228 KiB of
shared memory with 1 KiB reserved per program, at most 64 warps and 32 programs.

Why it matters before any timing: a kernel whose tiles need more than 255
registers per thread spills part of them to local memory, and its inner loop
then goes through L1/L2 for them. `tfjax.ops.pallas.triton.triton_launch` takes its
warps and stages from this table (`choose`: no spills, then the most programs per
SM, then fewer warps, then more stages): `--write-launch` writes that choice to
`tfjax/ops/pallas/triton_launch.json` (package data, naming the table it came
from), from this run's table or, with `--from-table`, from a committed one
without compiling anything; tests/ops/test_triton.py checks the file is the
choice of the table it names.

The Mosaic GPU kernels (`tfjax/ops/pallas/mosaic_gpu*.py`): when XLA compiles the program,
Mosaic GPU compiles each kernel through ptxas too; its report
(MOSAIC_GPU_DUMP_PTXAS=1), the PTX's thread count and the scratch shared memory
Mosaic allocates (MOSAIC_GPU_DUMP_RESOURCES=1) give the same columns, per forward
configuration (consumer warpgroups, key tile, stages, schedule) and backward tiles.

Writes experiments/results/attention_gpu_ptxas_<date>.md. A fwd+bwd row that failed
quotes the first kernel XLA rejected; XLA compiles the dq and dk/dv kernels in
parallel, so which one (and its shared-memory request) can differ between runs.
"""

from __future__ import annotations

import os
import sys
import tempfile

_DUMP = ""
if __name__ == "__main__":  # XLA reads these when its backends start: before jax is imported
    _DUMP = tempfile.mkdtemp(prefix="tfjax_ptxas_")
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "0"
    os.environ["TF_CPP_VMODULE"] = "subprocess_compilation=5"
    os.environ["XLA_FLAGS"] = (f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={_DUMP} "
                               "--xla_gpu_ptx_compiler_extra_flags=-v").strip()
    os.environ["MOSAIC_GPU_DUMP_PTX"] = "1"  # Mosaic GPU: PTX and ptxas -v on stdout
    os.environ["MOSAIC_GPU_DUMP_PTXAS"] = "1"
    os.environ["MOSAIC_GPU_DUMP_RESOURCES"] = "1"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import ctypes  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import glob  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import types  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench_attention import _as_if_on_gpu, _write_results  # noqa: E402
from tfjax.ops import RelativeBias  # noqa: E402
from tfjax.ops import masks as M  # noqa: E402
from tfjax.ops.pallas import flash_attention_gpu  # noqa: E402
from tfjax.ops.pallas.triton import (  # noqa: E402
    TritonConfig,
    default_block_sizes,
    padded_head_dim,
    triton_launch,
)

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
LAUNCH_FILE = os.path.join(ROOT, "tfjax", "ops", "pallas", "triton_launch.json")

KERNELS = {"fwd": "tfjax_flash_fwd_gpu", "dq": "tfjax_flash_dq_gpu",
           "dkv": "tfjax_flash_dkv_gpu"}
# sm_90 (H100 / H200) occupancy limits
REGS_PER_SM, REG_UNIT, SMEM_PER_SM, SMEM_RESERVED, MAX_WARPS, MAX_PROGRAMS = (
    65536, 256, 228 * 1024, 1024, 64, 32)


@contextlib.contextmanager
def _output_to(path):
    """Everything written to file descriptors 1 and 2 (Mosaic GPU's dumps, XLA's
    C++ log) goes to `path`."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "wb") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            ctypes.CDLL(None).fflush(None)  # C stdio buffers (Mosaic GPU prints through them)
            for fd, old in zip((1, 2), saved):
                os.dup2(old, fd)
                os.close(old)


def parse_ptxas(log: str) -> dict[str, dict]:
    """ptxas -v reports in `log` -> {function: {registers, spill_stores, spill_loads, stack}}."""
    out = {}
    for chunk in log.split("Compiling entry function '")[1:]:
        name = chunk.split("'", 1)[0]
        frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, "
                          r"(\d+) bytes spill loads", chunk)
        regs = re.search(r"Used (\d+) registers", chunk)
        if frame and regs:
            out[name] = dict(registers=int(regs.group(1)), stack=int(frame.group(1)),
                             spill_stores=int(frame.group(2)), spill_loads=int(frame.group(3)))
    return out


def parse_launches(thunks: str) -> dict[str, dict]:
    """XLA's thunk sequence -> {kernel: {threads, smem}} (threads per program)."""
    out = {}
    for m in re.finditer(r"(\w+) grid: \[[\d, ]+\] threads: \[(\d+), (\d+), (\d+)\]\s+"
                         r"shared_memory: (\d+) bytes", thunks):
        threads = int(m.group(2)) * int(m.group(3)) * int(m.group(4))
        out[m.group(1)] = dict(threads=threads, smem=int(m.group(5)))
    return out


def programs_per_sm(registers: int, threads: int, smem: int) -> tuple[int, str]:
    """Resident programs per SM on sm_90 and the resource that limits them."""
    warps = -(-threads // 32)
    per_warp = -(-registers * 32 // REG_UNIT) * REG_UNIT
    limits = {"registers": REGS_PER_SM // (per_warp * warps),
              "shared memory": SMEM_PER_SM // (smem + SMEM_RESERVED),
              "warps": MAX_WARPS // warps, "programs": MAX_PROGRAMS}
    which = min(limits, key=limits.get)
    return limits[which], which


def _compile(f, shapes, log_path):
    before = set(glob.glob(os.path.join(_DUMP, "*thunk_sequence.txt")))
    with _output_to(log_path):
        f.lower(*shapes).compile()
    new = sorted(set(glob.glob(os.path.join(_DUMP, "*thunk_sequence.txt"))) - before)
    thunks = "".join(open(p).read() for p in new)
    return parse_ptxas(open(log_path, errors="replace").read()), parse_launches(thunks)


FWD_TILES = ((64, 32), (64, 64), (64, 128), (128, 32), (128, 64), (128, 128))
# (dq tiles, dk/dv tiles), query x key: square, and FlashAttention-2's Triton shapes
# (long query tiles for dq, long key tiles for dk/dv)
BWD_TILES = (((32, 32), (32, 32)), ((64, 32), (32, 64)), ((64, 64), (64, 64)),
             ((128, 32), (32, 128)), ((128, 64), (64, 128)), ((128, 128), (128, 128)))


MOSAIC_NAMES = {"kernel_mosaic_gpu_kernel": "fwd", "dq_kernel_mosaic_gpu_kernel": "dq",
                "dkv_kernel_mosaic_gpu_kernel": "dkv"}


def mosaic_kernels(lowering_log: str, compile_log: str, kernels) -> dict[str, dict]:
    """{"fwd" | "dq" | "dkv": report} of the Mosaic GPU kernels of one program.
    While lowering, Mosaic prints each kernel's resources (MOSAIC_GPU_DUMP_RESOURCES:
    its shared memory scratch), in program order (`kernels`); when XLA compiles the
    program, Mosaic compiles each kernel through ptxas and prints its PTX (threads:
    .maxntid) and ptxas's report, named after the kernel's body (kernel, dq_kernel,
    dkv_kernel in mosaic_gpu*.py)."""
    smem = [int(b) for b in re.findall(r"Resources\(smem_scratch_bytes=(\d+)", lowering_log)]
    threads = dict(re.findall(r"\.entry (\w+)\([^)]*\)\s*\.maxntid (\d+)", compile_log))
    out = {}
    for name, r in parse_ptxas(compile_log).items():
        if name in MOSAIC_NAMES and name in threads:
            out[MOSAIC_NAMES[name]] = dict(r, threads=int(threads[name]))
    for kern, b in zip(kernels, smem):
        if kern in out:
            out[kern]["smem"] = b
    return out


def hopper_rows(H):
    """(kind, config text, forward kwargs, kernels) for the Mosaic GPU kernels."""
    from tfjax.ops.pallas.mosaic_gpu import SMEM_BYTES, HopperConfig
    from tfjax.ops.pallas.mosaic_gpu_backward import HopperBackwardConfig

    dflt = HopperConfig.default(H)
    for wg, bk, st in itertools.product((2, 1), (64, 128), (2, 3)):
        c = HopperConfig(block_kv=bk, stages=st, compute_warpgroups=wg)
        if c.smem_bytes(H) <= SMEM_BYTES:
            yield ("fwd", f"{wg} consumer{'s' if wg > 1 else ''}, block_kv={bk} stages={st}"
                   f"{' *' if c == dflt else ''}", dict(forward="hopper", hopper_config=c),
                   ("fwd",))
    for name, c in (("no ping-pong", dataclasses.replace(dflt, pingpong=False)),
                    ("overlap", dataclasses.replace(dflt, overlap=True))):
        yield ("fwd", f"default, {name}", dict(forward="hopper", hopper_config=c), ("fwd",))
    if H <= 128:
        for bdq, bdkv in itertools.product((64, 128), (64, 128)):
            c = HopperBackwardConfig(bdq, bdkv)
            if c.smem_bytes(H) <= SMEM_BYTES:
                yield ("bwd", f"block_kv_dq={bdq} block_q_dkv={bdkv}"
                       f"{' *' if c == HopperBackwardConfig() else ''}",
                       dict(forward="hopper", backward="hopper", hopper_backward_config=c),
                       ("fwd", "dq", "dkv"))


FEATURES = ("plain", "masked", "t5")  # `tfjax.ops.pallas.triton.launch_features`


def feature_kwargs(features: str, B: int, S: int, N: int) -> dict:
    """flash_attention_gpu arguments of each feature class: "plain" causal; "masked"
    the per-tile extras at once (a 1k sliding window with 4 packed documents, ALiBi,
    soft-capping), the most registers a mask asks of the kernels; "t5" causal with
    T5's bias per tile (32 buckets)."""
    if features == "plain":
        return dict(mask=M.causal())
    if features == "masked":
        seg = jnp.repeat(jnp.arange(4, dtype=jnp.int32), S // 4)[None].repeat(B, 0)
        return dict(mask=M.sliding_window(1024) & M.segments(seg), softcap=30.0,
                    alibi_slopes=jnp.linspace(0.5, 0.01, N))
    return dict(mask=M.causal(), relative_bias=RelativeBias(
        jnp.linspace(-1.0, 1.0, 32 * N).reshape(32, N), bidirectional=False))


def rows_for(H, features="plain"):
    """(kind, BlockSizes, TritonConfig, kernels to report) per configuration; the
    backward's rows run the default forward at its launch (`triton_launch`)."""
    d = default_block_sizes(H)
    w, st = triton_launch("fwd", padded_head_dim(H), d.block_q, d.block_kv, features)
    base = TritonConfig(num_warps=w, num_stages=st)
    for (bq, bk), w, st in itertools.product(FWD_TILES, (4, 8), (3, 2)):
        yield ("fwd", dataclasses.replace(d, block_q=bq, block_kv=bk),
               dataclasses.replace(base, num_warps=w, num_stages=st), ("fwd",))
    for ((bq, bk), (bq2, bk2)), w in itertools.product(BWD_TILES, (4, 8)):
        yield ("bwd", dataclasses.replace(d, block_q_dq=bq, block_kv_dq=bk, block_q_dkv=bq2,
                                          block_kv_dkv=bk2),
               dataclasses.replace(base, num_warps_dq=w, num_warps_dkv=w), ("dq", "dkv"))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--head-dims", default="64,128,256")
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--only", choices=["triton", "hopper"], default=None,
                   help="one family of kernels (the results file then holds only it)")
    p.add_argument("--write-launch", action="store_true",
                   help=f"write the Triton launches chosen from the table to {LAUNCH_FILE}")
    p.add_argument("--from-table", metavar="RESULTS_MD", default=None,
                   help="read the Triton rows of this results file instead of compiling")
    args = p.parse_args()
    if args.from_table:
        if args.write_launch:
            write_launch(args.from_table)
        else:
            print(format_launch(choose(read_table(args.from_table))))
        return
    B, N, K, S = 1, 32, 8, args.seq
    out = [f"# Attention kernels as ptxas compiles them for an NVIDIA H200 (sm_90a), "
           f"without a GPU (jax {jax.__version__}, "
           f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC)", "",
           f"`python experiments/gpu_registers.py` (deviceless XLA:GPU compile, ptxas -v). "
           f"B={B}, N={N}, K={K}, T=S={S}, bf16. Features: plain = causal; masked = a 1k "
           f"sliding window with 4 packed documents, ALiBi and soft-capping at once; t5 = "
           f"causal with T5's bias (32 buckets). Triton tiles are query x key (a dq row and "
           f"the dk/dv row under it come from one fwd+bwd compile). Programs/SM: resident "
           f"programs by sm_90's occupancy rules, and what limits them. Defaults marked *.",
           "", "| H | features | kernel | tiles | warps, stages | registers | "
           "spill stores / loads (B) | shared memory (KiB) | programs/SM |",
           "|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(out), flush=True)
    aot = types.SimpleNamespace(aot="compile")
    log = os.path.join(_DUMP, "ptxas.log")
    default_tiles = []  # lines of the default tiles' rows
    grad = lambda attn: jax.jit(jax.grad(
        lambda q, k, v: attn(q, k, v).astype(jnp.float32).sum(), (0, 1, 2)))
    with _as_if_on_gpu(aot):
        for H, features in itertools.product((int(h) for h in args.head_dims.split(",")),
                                             FEATURES if args.only != "hopper" else ()):
            shapes = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=aot.gpu_sharding)
                      for s in ((B, S, N, H), (B, S, K, H), (B, S, K, H))]
            dflt, fkw = default_block_sizes(H), feature_kwargs(features, B, S, N)
            for kind, bs, tc, kernels in rows_for(H, features):
                attn = lambda q, k, v, bs=bs, tc=tc: flash_attention_gpu(
                    q, k, v, forward="triton", backward="triton", block_sizes=bs,
                    triton_config=tc, **fkw)
                f = jax.jit(attn) if kind == "fwd" else grad(attn)
                try:
                    ptxas, launches = _compile(f, shapes, log)
                    error = None
                except Exception as e:  # noqa: BLE001 - a row says why a configuration failed
                    error = f"{type(e).__name__}: {str(e).splitlines()[0][:90]}"
                for kern in kernels:
                    bq, bk, warps, stages = _kernel_key(bs, tc, kern)
                    if (bq, bk) == _kernel_key(dflt, tc, kern)[:2]:
                        default_tiles.append(len(out))
                    head = (f"| {H} | {features} | {kern} | {bq}x{bk} | "
                            f"{warps}, {stages} |")
                    r, ln = (None, None) if error else (ptxas.get(KERNELS[kern]),
                                                        launches.get(KERNELS[kern]))
                    if error or r is None or ln is None:
                        why = error or "no ptxas report (kernel compiled earlier and cached)"
                        row = f"{head} failed: {why} | | | |" if error else f"{head} {why} | | | |"
                    else:
                        n, lim = programs_per_sm(r["registers"], ln["threads"], ln["smem"])
                        row = (f"{head} {r['registers']} | {r['spill_stores']} / "
                               f"{r['spill_loads']} | {ln['smem'] / 1024:.1f} | {n} ({lim}) |")
                    out.append(row)
                    print(row, flush=True)
    # the default: the default tiles at the launch the rule picks from these rows
    # (what `triton_launch` returns once triton_launch.json holds that choice)
    choice = choose(r for r in map(_row_of, out) if r)
    for i in default_tiles:
        r = _row_of(out[i])
        if r and choice.get(_key(r)) == (r["warps"], r["stages"]):
            out[i] = out[i].replace(f" {r['bq']}x{r['bk']} |", f" {r['bq']}x{r['bk']} * |", 1)
    out += ["", "Mosaic GPU (the Hopper kernels, `tfjax/ops/pallas/mosaic_gpu*.py`): Mosaic "
            "compiles each kernel to a cubin through ptxas when XLA compiles the program "
            "(its report: MOSAIC_GPU_DUMP_PTXAS=1; shared memory: the scratch Mosaic "
            "allocates, MOSAIC_GPU_DUMP_RESOURCES=1). A fwd+bwd row reports the "
            "backward's dq and dk/dv kernels.", "",
            "| H | features | kernel | config | threads | registers | "
            "spill stores / loads (B) | shared memory (KiB) | programs/SM |",
            "|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(out[-5:]), flush=True)
    perf_notes = []  # ptxas's "Potential Performance Loss" notes (e.g. serialised wgmma)
    with _as_if_on_gpu(aot):
        for H, features in itertools.product((int(h) for h in args.head_dims.split(",")),
                                             ("plain", "masked") if args.only != "triton"
                                             else ()):
            shapes = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=aot.gpu_sharding)
                      for s in ((B, S, N, H), (B, S, K, H), (B, S, K, H))]
            fkw = feature_kwargs(features, B, S, N)
            for kind, text, kw, kernels in hopper_rows(H):
                attn = lambda q, k, v, kw=kw: flash_attention_gpu(q, k, v, **kw, **fkw)
                f = jax.jit(attn) if kind == "fwd" else grad(attn)
                try:
                    with _output_to(log):
                        lowered = f.lower(*shapes)
                    with _output_to(log + ".compile"):
                        lowered.compile()
                    compile_log = open(log + ".compile", errors="replace").read()
                    found = mosaic_kernels(open(log, errors="replace").read(), compile_log,
                                           kernels)
                    perf_notes += [f"{H}, {features}, {text}: {m.strip()}"
                                   for m in re.findall(r"Performance Loss[^\n]*", compile_log)]
                    missing = [k for k in kernels if "smem" not in found.get(k, {})]
                    error = f"no Mosaic GPU report for {missing}" if missing else None
                except Exception as e:  # noqa: BLE001 - a row says why a configuration failed
                    error = f"{type(e).__name__}: {str(e).splitlines()[0][:90]}"
                for kern in kernels:
                    if kind == "bwd" and kern == "fwd":
                        continue
                    head = f"| {H} | {features} | {kern} | {text} |"
                    if error:
                        row = f"{head} failed: {error} | | | | |"
                    else:
                        r = found[kern]
                        n, lim = programs_per_sm(r["registers"], r["threads"], r["smem"])
                        row = (f"{head} {r['threads']} | {r['registers']} | {r['spill_stores']}"
                               f" / {r['spill_loads']} | {r['smem'] / 1024:.1f} | {n} ({lim}) |")
                    out.append(row)
                    print(row, flush=True)
    if args.only != "triton":
        out += ["", "ptxas's performance notes on the Mosaic GPU kernels (\"Potential Performance "
                "Loss\", e.g. wgmma instructions serialised because an accumulator or a register "
                "operand is touched while the wgmma is in flight): "
                + ("; ".join(perf_notes) if perf_notes else "none in any row.")]
    path = _write_results(out, "attention_gpu_ptxas" + (f"_{args.only}" if args.only else ""))
    if args.write_launch:
        write_launch(path)
    else:
        print("\n# the Triton launches by the rule (see choose; --write-launch writes them):")
        print(format_launch(choose(read_table(path))))


ROW = re.compile(r"^\| (\d+) \| (\w+) \| (fwd|dq|dkv) \| (\d+)x(\d+)(?: \*)? \| "
                 r"(\d+), (\d+) \| (\d+) \| (\d+) / (\d+) \| [\d.]+ \| (\d+) ")


def _row_of(line: str) -> dict | None:
    """A measured Triton row of the table as a dict, else None."""
    m = ROW.match(line)
    if not m:
        return None
    H, feat, kern, bq, bk, w, st, regs, ss, sl, prog = m.groups()
    return dict(H=int(H), features=feat, kernel=kern, bq=int(bq), bk=int(bk), warps=int(w),
                stages=int(st), registers=int(regs), spill=int(ss) + int(sl),
                programs=int(prog))


def _key(r):
    return r["features"], r["kernel"], r["H"], r["bq"], r["bk"]


def read_table(path) -> list[dict]:
    """The measured Triton rows of a results file (failed compiles left out)."""
    return [r for r in map(_row_of, open(path)) if r]


def choose(rows) -> dict[tuple[str, str, int, int, int], tuple[int, int]]:
    """The launch per (features, kernel, H, query tile, key tile): among those that
    compile (shared memory permitting), those at which ptxas
    spills nothing, the most resident programs per SM, then fewer warps, then more
    stages; where every launch spills, the fewest spilled bytes, then fewer warps."""
    by_key = {}
    for r in rows:
        by_key.setdefault(_key(r), []).append(r)
    best = {}
    for key, rs in by_key.items():
        r = min(rs, key=lambda r: (r["spill"] > 0, r["spill"], -r["programs"], r["warps"],
                                   -r["stages"]))
        best[key] = (r["warps"], r["stages"])
    return best


def format_launch(choice) -> str:
    items = [f"{k!r}: {v!r}," for k, v in sorted(choice.items())]
    return "{\n" + "\n".join(f"    {i}" for i in items) + "\n}"


LAUNCH_COLUMNS = ("features", "kernel", "H", "bq", "bk", "warps", "stages")


def launch_json(choice, measured: str) -> str:
    """The text of tfjax/ops/pallas/triton_launch.json: `choice` (`choose`'s), one
    launch a line, and the results file `measured` (a path from the repository
    root) it was chosen from."""
    head = {
        "about": "Launches (warps, stages) of the Triton attention kernels per feature class, "
                 "kernel, padded head dim H, query tile bq and key tile bk: the rule `choose` "
                 "of experiments/gpu_registers.py applied to ptxas's register report for an "
                 "H200 (sm_90a) in `measured`. Read by tfjax.ops.pallas.triton.triton_launch.",
        "measured": measured,
        "written_by": f"python experiments/gpu_registers.py --from-table {measured} "
                      "--write-launch",
        "columns": list(LAUNCH_COLUMNS),
    }
    rows = [json.dumps([*key, *launch]) for key, launch in sorted(choice.items())]
    return "\n".join(["{", *(f"  {json.dumps(k)}: {json.dumps(v)}," for k, v in head.items()),
                      '  "launches": [', ",\n".join(f"    {r}" for r in rows), "  ]", "}"]) + "\n"


def write_launch(table: str, path: str = LAUNCH_FILE) -> str:
    """Write the Triton launches chosen from results file `table` to `path`."""
    measured = os.path.relpath(os.path.abspath(table), ROOT)
    with open(path, "w") as f:
        f.write(launch_json(choose(read_table(table)), measured))
    print(f"wrote {path} (from {measured})")
    return path


def _kernel_key(bs, tc, kern):
    """(query tile, key tile, warps, stages) of one kernel."""
    return {"fwd": (bs.block_q, bs.block_kv, tc.num_warps, tc.num_stages),
            "dq": (bs.block_q_dq, bs.block_kv_dq, tc.num_warps_dq, tc.num_stages_dq),
            "dkv": (bs.block_q_dkv, bs.block_kv_dkv, tc.num_warps_dkv, tc.num_stages_dkv)}[kern]


if __name__ == "__main__":
    main()
