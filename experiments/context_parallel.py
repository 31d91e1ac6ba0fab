"""Context parallelism on a TPU pod slice, compiled by the real XLA:TPU compiler on this
CPU (libtpu topologies, no TPU): per-chip memory, XLA's step-time estimate and the
collectives of the train step, for the ring, all-gather, Ulysses and USP, beside
MaxText's own compile of its all-gather, ring, Ulysses and USP at the same settings.

    .venv/bin/python experiments/context_parallel.py             # 12 tfjax compiles + MaxText's
    .venv/bin/python experiments/context_parallel.py --sides tfjax
    .venv/bin/python experiments/context_parallel.py --quick     # Llama tiny on v5p:2x2x1

Points: Llama-3.1-8B (configs/llama.py; bf16 compute, float32 parameters and AdamW, full
remat, the chunked loss) on v5p:4x4x4 (64 chips) at 32k and 128k tokens a row, the
sequence split over 16 chips (context parallelism 16, as MaxText's published Llama
long-context runs) and FSDP over the other 4, one row per FSDP group (global batch 4);
parameters and optimizer state sharded over all 64 chips (the `embed` rule takes the
sequence axis too). One more point (`8b_32k_cp8`: the sequence over 8 chips, FSDP
over 8, batch 8) compares the ring and Ulysses only: MaxText's Ulysses needs the 8 kv
heads divisible by the context parallelism, so it refuses 16.
Modes (`model.attention.context_parallel`): ring (zig-zag data), all_gather, ulysses
(32 query heads: 2 a chip; 8 kv heads repeated to 16), usp with ulysses_size 4 (the ring
over 4 groups of 4). Collective bytes are each chip's input to the step's collectives
(`tfjax.parallel.collectives`: executions per step times bytes), by kind.

MaxText's side is its `train_compile` (`ici_context_parallelism=16`,
`context_parallel_strategy`; USP: `ici_context_parallelism=4`,
`ici_context_usp_ulysses_parallelism=4`) on Tokamax's splash kernel (`attention=flash
use_tokamax_splash=true`, which its TPU ring, Ulysses and USP require; the all-gather
row runs it too), its collectives read the same way from the optimized HLO XLA dumps
(`--xla_dump_to`). It needs MaxText >= 0.2.4 (the first release with TPU ring, Ulysses
and USP; 0.2.4 still runs on jax 0.10.2 / libtpu 0.0.42.1) in the venv of
`--maxtext-python`; `--install-maxtext` creates it:

    python3.12 -m venv /tmp/maxtext_cp_venv
    /tmp/maxtext_cp_venv/bin/pip install "maxtext[tpu]==0.2.4" jax==0.10.2 \
        jaxlib==0.10.2 libtpu==0.0.42.1

A MaxText row is left out, with the reason, where MaxText is missing or refuses the
settings (its Ulysses needs the kv heads divisible by the context parallelism).
Compiled rows are appended to `--rows` and not compiled again.
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import tempfile
import time

from common import Experiment, preset_config
from vs_maxtext import _MAXTEXT_MAIN, _cached, add_maxtext_args, install_maxtext

from tfjax.config import run_config
from tfjax.parallel.collectives import KINDS, collectives
from tfjax.train.aot import compile_step, step_figures

GiB, MiB = 1024 ** 3, 1024 ** 2
MODES = ("ring", "all_gather", "ulysses", "ulysses:blockwise", "usp")
USP_ULYSSES = 4
# name -> (preset variant, topology, fsdp, sequence, batch, seq_len, MaxText topology)
POINTS = {"8b_32k": (None, "v5p:4x4x4", 4, 16, 4, 32768, "v5p-128"),
          "8b_128k": (None, "v5p:4x4x4", 4, 16, 4, 131072, "v5p-128"),
          # MaxText's Ulysses needs the 8 kv heads divisible by the context parallelism:
          # its ring and Ulysses beside ours over 8 chips of sequence (FSDP over 8)
          "8b_32k_cp8": (None, "v5p:4x4x4", 8, 8, 8, 32768, "v5p-128")}
POINT_MODES = {"8b_32k_cp8": ("ring", "ulysses")}
QUICK_POINTS = {"tiny_2k": ("tiny", "v5p:2x2x1", 1, 4, 1, 2048, None)}
# MaxText's context_parallel_strategy for each of our modes (all four since 0.2.4)
MAXTEXT_STRATEGY = {"ring": "ring", "all_gather": "all_gather", "ulysses": "ulysses",
                    "usp": "usp"}
# What --install-maxtext installs (see the module docstring).
MAXTEXT_REQUIREMENTS = ("maxtext[tpu]==0.2.4", "jax==0.10.2", "jaxlib==0.10.2",
                        "libtpu==0.0.42.1")


def tfjax_row(point, mode: str) -> dict:
    """`mode`: a context_parallel mode, or "mode:impl" with `model.attention.impl`."""
    variant, topology, fsdp, sequence, batch, seq = point[:6]
    mode, _, impl = mode.partition(":")
    cfg = preset_config("llama", variant)
    cfg.model.update(dict(dtype="bfloat16", remat="full", max_len=max(seq, cfg.model.max_len)))
    cfg.model.attention.update(dict(context_parallel=mode, impl=impl or "auto",
                                    ulysses_size=USP_ULYSSES if mode == "usp" else 1))
    cfg.train.update(dict(batch_size=batch, seq_len=seq, loss_chunk=512))
    # parameters and optimizer state sharded over every chip (ZeRO-3 over fsdp and the
    # sequence axis, as MaxText's rules shard weights over its context axis)
    rules = tuple(("embed", "fsdp", "sequence") if r[0] == "embed" else r
                  for r in cfg.mesh.rules)
    cfg.mesh.update(dict(data=1, fsdp=fsdp, sequence=sequence, rules=rules))
    start = time.time()
    compiled, p, _, _ = compile_step(run_config(cfg), topology)
    f = step_figures(compiled, p)
    by_kind: dict[str, int] = {}
    for c in collectives(compiled.as_text()):
        by_kind[c.kind] = by_kind.get(c.kind, 0) + c.count * c.bytes
    return dict(temp=f["temp"], total=f["arguments"] + f["temp"] + f["code"],
                optimal_seconds=f["optimal_seconds"], collectives=by_kind,
                compile_s=time.time() - start)


def maxtext_flags(mode: str, sequence: int) -> list[str]:
    """MaxText's settings for `mode` with the sequence over `sequence` chips."""
    flags = [f"context_parallel_strategy={MAXTEXT_STRATEGY[mode]}", "attention=flash",
             "use_tokamax_splash=true"]
    if sequence == 8:  # on v5p:4x4x4 an axis of 8 chips splits a physical axis of 4
        flags.append("allow_split_physical_axes=true")  # (MaxText refuses by default)
    if mode == "usp":  # the ring over `context`, the all-to-all over `context_usp_ulysses`
        return flags + [f"ici_context_parallelism={sequence // USP_ULYSSES}",
                        f"ici_context_usp_ulysses_parallelism={USP_ULYSSES}"]
    flags.append(f"ici_context_parallelism={sequence}")
    if mode == "ulysses":  # its default reorder would break the causal mask (its check)
        flags.append("context_parallel_load_balance=false")
    return flags


def maxtext_row(point, mode: str, python: str) -> dict | None:
    """MaxText's train_compile of Llama-3.1-8B at the point with its context
    parallelism (`MAXTEXT_STRATEGY[mode]`); None where MaxText or the mode is missing."""
    if mode not in MAXTEXT_STRATEGY or point[6] is None or not os.path.isfile(python or ""):
        return None
    _, _, fsdp, sequence, batch, seq, topology = point
    chips = fsdp * sequence
    cmd = [python, "-c", _MAXTEXT_MAIN, "model_name=llama3.1-8b", f"compile_topology={topology}",
           "compile_topology_num_slices=1", f"per_device_batch_size={batch / chips:g}",
           f"max_target_length={seq}", f"ici_fsdp_parallelism={fsdp}",
           *maxtext_flags(mode, sequence), "remat_policy=full",
           "dtype=bfloat16", "weight_dtype=float32", "dataset_type=synthetic",
           "enable_checkpointing=false", "run_name=cp", "base_output_directory=/tmp/cp_out"]
    start = time.time()
    with tempfile.TemporaryDirectory(prefix="maxtext_hlo_") as dump:
        # the optimized HLO of the train step, for its collectives (as tfjax's rows read
        # them from compiled.as_text())
        flags = (f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump} "
                 "--xla_dump_hlo_module_re=jit_train_step").strip()
        out = subprocess.run(cmd, capture_output=True, text=True,
                             env=dict(os.environ, JAX_MOSAIC_UNZIP_DEBUG_LOCATIONS="false",
                                      XLA_FLAGS=flags, ALLOW_MULTIPLE_LIBTPU_LOAD="1"))
        hlo = sorted(glob.glob(os.path.join(dump, "*jit_train_step*.after_optimizations.txt")))
        by_kind = None
        if hlo:
            with open(hlo[-1]) as f:
                by_kind = {}
                for c in collectives(f.read()):
                    by_kind[c.kind] = by_kind.get(c.kind, 0) + c.count * c.bytes
    text = out.stdout + out.stderr
    mem = re.search(r"Memory analysis: CompiledMemoryStats\((.*?)\)", text)
    if out.returncode or not mem:
        lines = text.strip().splitlines() or ["(no output)"]
        why = next((x for x in lines if "Value error" in x), None) or next(
            (x for x in reversed(lines) if "Error" in x), lines[-1])
        raise RuntimeError(why.strip().split(" [type=")[0][:300])
    m = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", mem.group(1))}
    opt = re.search(r"'optimal_seconds': ([\d.eE+-]+)", text)
    return dict(temp=m["temp_size_in_bytes"],
                total=m["argument_size_in_bytes"] + m["temp_size_in_bytes"]
                + m.get("generated_code_size_in_bytes", 0),
                optimal_seconds=float(opt.group(1)) if opt else 0.0, collectives=by_kind,
                compile_s=time.time() - start)


def _failure_as_row(compute) -> dict | None:
    """compute(), or a refusal or an out-of-memory verdict as {"error": why} (a result,
    kept in --rows so that a rerun reports it without compiling again); any other
    failure (e.g. libtpu's lock file held by another process) raises, not kept."""
    try:
        return compute()
    except Exception as e:  # noqa: BLE001 - a compile that fails is a result
        text = str(e)
        at = text.find("Ran out of memory")  # XLA:TPU's verdict, without its dump
        why = (text[at:at + 200].split("\\n")[0].splitlines()[0] if at >= 0
               else (text.strip().splitlines() or ["(no message)"])[0][:300])
        if at < 0 and "Value error" not in why:
            raise RuntimeError(why) from e
        return dict(error=why)


def main(argv=None):
    import argparse
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", default="", help="comma-separated; default all")
    parser.add_argument("--modes", default=",".join(MODES),
                        help="context_parallel modes, or mode:impl (model.attention.impl)")
    parser.add_argument("--sides", default="tfjax,maxtext")
    add_maxtext_args(parser, "/tmp/maxtext_cp_venv/bin/python",
                     "a Python with MaxText >= 0.2.4")
    parser.add_argument("--rows", default="/tmp/context_parallel_rows.jsonl",
                        help="JSON lines of compiled rows, reused ('' = none)")
    parser.add_argument("--from-rows", action="store_true",
                        help="compile nothing: the table of the rows in --rows, the "
                             "missing ones listed")
    exp = Experiment("context_parallel", __doc__, parser=parser, argv=argv)
    a = exp.args
    if a.install_maxtext:
        install_maxtext(a.maxtext_python, a.base_python, MAXTEXT_REQUIREMENTS)
    points = QUICK_POINTS if exp.quick else POINTS
    names = a.points.split(",") if a.points else list(points)
    table, notes = [], []
    for name in names:
        point = points[name]
        base = None
        for mode in a.modes.split(","):
            if mode not in POINT_MODES.get(name, (mode,)):
                continue
            for side in a.sides.split(","):
                key = f"{side}/{name}/{mode}"
                if side == "tfjax":
                    compute = lambda: tfjax_row(point, mode)  # noqa: E731
                else:
                    compute = lambda: maxtext_row(point, mode, a.maxtext_python)  # noqa: E731
                try:
                    r = _cached(a.rows, key, (lambda: _failure_as_row(compute))
                                if not a.from_rows else lambda: None)
                except RuntimeError as e:
                    notes.append(f"{side} {mode} at {name} not compiled: {e}")
                    continue
                if r is None and a.from_rows:
                    if side == "tfjax" or (mode in MAXTEXT_STRATEGY and point[6]):
                        notes.append(f"{side} {mode} at {name}: not in {a.rows!r} (--from-rows)")
                    continue
                if r is not None and "error" in r:
                    notes.append(f"{side} {mode} at {name} not compiled: {r['error']}")
                    continue
                if r is None:
                    if side == "maxtext" and mode in MAXTEXT_STRATEGY and point[6]:
                        notes.append(f"maxtext {mode} at {name}: no MaxText in "
                                     f"{a.maxtext_python!r} (--install-maxtext installs it)")
                    continue
                if side == "maxtext" and mode not in MAXTEXT_STRATEGY:
                    continue
                if side == "tfjax" and mode == "ring":
                    base = r
                coll = r.get("collectives") or {}
                est = r["optimal_seconds"] if r["optimal_seconds"] > 0 else None  # <= 0: none
                table.append([name, side, mode, r["temp"] / GiB, r["total"] / GiB,
                              None if est is None else est * 1e3,
                              est / base["optimal_seconds"]
                              if est and base and base["optimal_seconds"] > 0 else None,
                              *[coll.get(k, 0) / MiB if r.get("collectives") is not None
                                else None for k in KINDS], r["compile_s"]])
    table = [["—" if c is None else c for c in row] for row in table]
    exp.table(["point", "side", "mode", "temp GiB", "total GiB", "optimal ms",
               "optimal / tfjax ring", *[f"{k} MiB" for k in KINDS], "compile s"], table,
              title="Per chip, per train step, XLA:TPU (libtpu topologies on this CPU)")
    for note in notes:
        exp.text(note)
    exp.finish()


if __name__ == "__main__":
    main()
