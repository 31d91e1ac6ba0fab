"""Context parallelism on a TPU pod slice, compiled by the real XLA:TPU compiler on this
CPU (libtpu topologies, no TPU): per-chip memory, XLA's step-time estimate and the
collectives of the train step, for the ring, all-gather, Ulysses and USP, beside
MaxText's own compile of its ring and all-gather at the same settings.

    .venv/bin/python experiments/context_parallel.py             # 8 tfjax compiles + MaxText's
    .venv/bin/python experiments/context_parallel.py --sides tfjax
    .venv/bin/python experiments/context_parallel.py --quick     # Llama tiny on v5p:2x2x1

Points: Llama-3.1-8B (configs/llama.py; bf16 compute, float32 parameters and AdamW, full
remat, the chunked loss) on v5p:4x4x4 (64 chips) at 32k and 128k tokens a row, the
sequence split over 16 chips (context parallelism 16, as MaxText's published Llama
long-context runs) and FSDP over the other 4, one row per FSDP group (global batch 4);
parameters and optimizer state sharded over all 64 chips (the `embed` rule takes the
sequence axis too).
Modes (`model.attention.context_parallel`): ring (zig-zag data), all_gather, ulysses
(32 query heads: 2 a chip; 8 kv heads repeated to 16), usp with ulysses_size 4 (the ring
over 4 groups of 4). Collective bytes are each chip's input to the step's collectives
(`tfjax.parallel.collectives`: executions per step times bytes), by kind. MaxText's side
is its `train_compile` (`ici_context_parallelism=16`, `context_parallel_strategy`) run
with the Python of a venv that has it (`--maxtext-python`; experiments/vs_maxtext.py
says how to install it); its rows are left out, with the reason, where it is missing.
Compiled rows are appended to `--rows` and not compiled again.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time

from common import Experiment, preset_config
from vs_maxtext import _MAXTEXT_MAIN, _cached

from tfjax.config import run_config
from tfjax.parallel.collectives import KINDS, collectives
from tfjax.train.aot import compile_step, step_figures

GiB, MiB = 1024 ** 3, 1024 ** 2
MODES = ("ring", "all_gather", "ulysses", "ulysses:blockwise", "usp")
USP_ULYSSES = 4
# name -> (preset variant, topology, fsdp, sequence, batch, seq_len, MaxText topology)
POINTS = {"8b_32k": (None, "v5p:4x4x4", 4, 16, 4, 32768, "v5p-128"),
          "8b_128k": (None, "v5p:4x4x4", 4, 16, 4, 131072, "v5p-128")}
QUICK_POINTS = {"tiny_2k": ("tiny", "v5p:2x2x1", 1, 4, 1, 2048, None)}
# MaxText's context_parallel_strategy for each of our modes that it has
MAXTEXT_STRATEGY = {"ring": "ring", "all_gather": "all_gather"}


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
           f"ici_context_parallelism={sequence}",
           f"context_parallel_strategy={MAXTEXT_STRATEGY[mode]}", "remat_policy=full",
           "dtype=bfloat16", "weight_dtype=float32", "dataset_type=synthetic",
           "enable_checkpointing=false", "run_name=cp", "base_output_directory=/tmp/cp_out"]
    start = time.time()
    out = subprocess.run(cmd, capture_output=True, text=True,
                         env=dict(os.environ, JAX_MOSAIC_UNZIP_DEBUG_LOCATIONS="false"))
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
                optimal_seconds=float(opt.group(1)) if opt else 0.0, collectives=None,
                compile_s=time.time() - start)


def main(argv=None):
    import argparse
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", default="", help="comma-separated; default all")
    parser.add_argument("--modes", default=",".join(MODES),
                        help="context_parallel modes, or mode:impl (model.attention.impl)")
    parser.add_argument("--sides", default="tfjax,maxtext")
    parser.add_argument("--maxtext-python", default="/tmp/maxtext_venv/bin/python")
    parser.add_argument("--rows", default="/tmp/context_parallel_rows.jsonl",
                        help="JSON lines of compiled rows, reused ('' = none)")
    exp = Experiment("context_parallel", __doc__, parser=parser, argv=argv)
    a = exp.args
    points = QUICK_POINTS if exp.quick else POINTS
    names = a.points.split(",") if a.points else list(points)
    table, notes = [], []
    for name in names:
        point = points[name]
        base = None
        for mode in a.modes.split(","):
            for side in a.sides.split(","):
                try:
                    if side == "tfjax":
                        r = _cached(a.rows, f"tfjax/{name}/{mode}",
                                    lambda: tfjax_row(point, mode))
                    else:
                        r = _cached(a.rows, f"maxtext/{name}/{mode}",
                                    lambda: maxtext_row(point, mode, a.maxtext_python))
                except Exception as e:  # noqa: BLE001 - a compile that fails is a result
                    text = str(e)
                    at = text.find("Ran out of memory")  # XLA:TPU's verdict, without its dump
                    why = (text[at:at + 200].split("\\n")[0].splitlines()[0] if at >= 0
                           else text.strip().splitlines()[0][:300])
                    notes.append(f"{side} {mode} at {name} not compiled: {why}")
                    continue
                if r is None:
                    if side == "maxtext" and mode in MAXTEXT_STRATEGY and point[6]:
                        notes.append(f"maxtext {mode} at {name}: no MaxText in "
                                     f"{a.maxtext_python!r}")
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
