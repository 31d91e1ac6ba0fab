"""Per-chip TPU training memory and XLA's step-time estimate, tfjax beside MaxText at
equal settings, both compiled by the real XLA:TPU compiler on this CPU (libtpu's
topology descriptions; no TPU).

    .venv/bin/python experiments/vs_maxtext.py                     # ~1 h on 2 busy cores
    .venv/bin/python experiments/vs_maxtext.py --points 1b_2k --variants 512:full
    .venv/bin/python experiments/vs_maxtext.py --quick              # llama tiny, one point

Points (bf16 compute, float32 parameters and AdamW, fsdp over every chip):
Llama-3.2-1B on v5p:2x2x1 at 8 x 2048 and 8 x 8192, Llama-3.1-8B on v5p:4x4x4 at
64 x 2048. tfjax's side is `tfjax.train.aot.compile_step` (what `python -m tfjax.train
--compile_only --topology ...` compiles) for each variant `LOSS_CHUNK:REMAT`
(`train.loss_chunk`, `model.remat`). MaxText's side is MaxText's own `train_compile`
(`compile_topology=v5p-8` / `v5p-128`, `remat_policy=full`), run with the Python of a
venv that has MaxText (`--maxtext-python`, default /tmp/maxtext_venv/bin/python):

    .venv/bin/python experiments/vs_maxtext.py --install-maxtext   # does the two steps:
    python3.12 -m venv /tmp/maxtext_venv
    /tmp/maxtext_venv/bin/pip install "maxtext[tpu]==0.2.2" jax==0.10.2 jaxlib==0.10.2 \
        libtpu==0.0.42.1

(plain `pip install maxtext` installs no dependencies at all). MaxText 0.2.2 (its `tpu`
extra asks jax >= 0.9.2) accepts the jax and libtpu tfjax compiles with, as do 0.2.3
(jax >= 0.10.0) and 0.2.4 (jax >= 0.10.2; context_parallel.py installs it for its TPU
ring and Ulysses): both sides then run the same XLA:TPU and Mosaic, and MaxText's splash
kernel compiles (0.2.5 needs jax >= 0.11.1, and its jax 0.12 Mosaic bytecode does not
parse in any libtpu tried: results/vs_maxtext.md). Where MaxText is
missing or its compile fails, the report says why and shows the temporaries issue
29 quotes for MaxText instead, marked as not remeasured (results/vs_maxtext.md says
which jax / libtpu pairs were tried).
Each compiled row is appended to `--rows` (JSON lines) and not compiled again, so
the table can be built over several runs. Memory figures do not depend on the load
of the machine; compile times do.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time

from common import Experiment, preset_config

from tfjax.config import run_config
from tfjax.train.aot import compile_step, step_figures

GiB = 1024 ** 3
# name -> (configs/llama.py variant, topology, fsdp, batch, seq, MaxText model, topology)
POINTS = {
    "1b_2k": ("1b", "v5p:2x2x1", 4, 8, 2048, "llama3.2-1b", "v5p-8"),
    "1b_8k": ("1b", "v5p:2x2x1", 4, 8, 8192, "llama3.2-1b", "v5p-8"),
    "8b_2k": (None, "v5p:4x4x4", 64, 64, 2048, "llama3.1-8b", "v5p-128"),
}
# MaxText's per-chip temporaries as issue 29 quotes them (MaxText 0.2.5 on its own jax
# and libtpu, full remat), shown when MaxText cannot be compiled here: not remeasured.
FROM_ISSUE_GIB = {"1b_2k": 3.31, "1b_8k": 11.15, "8b_2k": 3.21}
# What --install-maxtext installs into the MaxText venv (see the module docstring).
MAXTEXT_REQUIREMENTS = ("maxtext[tpu]==0.2.2", "jax==0.10.2", "jaxlib==0.10.2",
                        "libtpu==0.0.42.1")
QUICK_POINTS = {"tiny_256": ("tiny", "v5p:2x2x1", 4, 8, 256, None, None)}
VARIANTS = ("0:full", "512:full", "512:attn", "512:qkv_attn", "512:dots_attn",
            "512:attn_offload")
QUICK_VARIANTS = ("0:full", "64:full")


def tfjax_row(point, variant: str) -> dict:
    preset, topology, fsdp, batch, seq = point[:5]
    chunk, remat = variant.split(":")
    cfg = preset_config("llama", preset)
    cfg.model.update(dict(dtype="bfloat16", remat=remat))
    cfg.train.update(dict(batch_size=batch, seq_len=seq, loss_chunk=int(chunk)))
    cfg.mesh.update(dict(data=1, fsdp=fsdp))
    start = time.time()
    compiled, p, _, _ = compile_step(run_config(cfg), topology)
    f = step_figures(compiled, p)
    return dict(temp=f["temp"], args=f["arguments"], total=f["arguments"] + f["temp"] + f["code"],
                optimal_seconds=f["optimal_seconds"], compile_s=time.time() - start)


# Run with MaxText's Python: its own train_compile on its own base.yml.
_MAXTEXT_MAIN = """
import os, sys
import maxtext
from absl import app
from maxtext.trainers.pre_train import train_compile
base = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
sys.argv = ["train_compile", base] + sys.argv[1:]
app.run(train_compile.main)
"""
# MaxText (0.2.2 and 0.2.5) has no Llama-3.2-1B preset: its llama3.1-8b with 1B's shape
# and tied embeddings (logits through the embedding, unnormalised, as Llama's).
_MAXTEXT_MODELS = {
    "llama3.1-8b": ["model_name=llama3.1-8b"],
    "llama3.2-1b": ["model_name=llama3.1-8b", "override_model_config=true",
                    "base_emb_dim=2048", "base_num_decoder_layers=16", "base_mlp_dim=8192",
                    "head_dim=64", "logits_via_embedding=true",
                    "normalize_embedding_logits=false"],
}


def maxtext_command(point, python: str) -> list[str]:
    """MaxText's train_compile at the point: full remat, bf16 compute, float32 weights
    and AdamW (its defaults), fsdp over every chip, synthetic data."""
    *_, batch, seq, model, topology = point
    chips = int(topology.split("-")[1]) // 2  # v5p-N counts TensorCores, 2 a chip
    return [python, "-c", _MAXTEXT_MAIN, *_MAXTEXT_MODELS[model],
            f"compile_topology={topology}", "compile_topology_num_slices=1",
            f"per_device_batch_size={batch / chips:g}", f"max_target_length={seq}",
            f"ici_fsdp_parallelism={chips}", "remat_policy=full", "dtype=bfloat16",
            "weight_dtype=float32", "dataset_type=synthetic", "enable_checkpointing=false",
            "run_name=vs_maxtext", "base_output_directory=/tmp/vs_maxtext_out"]


def maxtext_row(point, python: str) -> dict | None:
    """MaxText's figures at the point (its printed memory and cost analyses); None
    when `python` is not a file."""
    if point[5] is None or not python or not os.path.isfile(python):
        return None
    cmd = maxtext_command(point, python)
    start = time.time()
    # For a venv with maxtext[tpu]'s own pins (jax 0.12.0.1, libtpu 0.0.52, which cannot
    # parse a field of jax's Mosaic calls, "debug_locations"): keeping the locations in
    # the kernel's bytecode leaves it out. Harmless with the install the docstring gives.
    env = dict(os.environ, JAX_MOSAIC_UNZIP_DEBUG_LOCATIONS="false")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    text = out.stdout + out.stderr
    mem = re.search(r"Memory analysis: CompiledMemoryStats\((.*?)\)", text)
    if out.returncode or not mem:
        raise RuntimeError(f"MaxText's compile failed (exit {out.returncode}):\n"
                           f"{' '.join(cmd[3:])}\n{text[-4000:]}")
    m = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", mem.group(1))}
    opt = re.search(r"'optimal_seconds': ([\d.eE+-]+)", text)
    return dict(temp=m["temp_size_in_bytes"], args=m["argument_size_in_bytes"],
                total=m["argument_size_in_bytes"] + m["temp_size_in_bytes"]
                + m.get("generated_code_size_in_bytes", 0),
                optimal_seconds=float(opt.group(1)) if opt else 0.0,
                compile_s=time.time() - start)


def add_maxtext_args(parser, python: str, what: str) -> None:
    """--maxtext-python (default `python`, `what` it must hold), --install-maxtext and
    --base-python: the MaxText venv's flags of every script that compiles MaxText."""
    parser.add_argument("--maxtext-python", default=python,
                        help=f"{what} ('' = tfjax's side only)")
    parser.add_argument("--install-maxtext", action="store_true",
                        help="first create --maxtext-python's venv (where missing) and "
                             "install MAXTEXT_REQUIREMENTS into it")
    parser.add_argument("--base-python", default="python3.12",
                        help="the Python (>= 3.12) that creates the MaxText venv")


def install_maxtext(python: str, base_python: str,
                    requirements=MAXTEXT_REQUIREMENTS) -> None:
    """Create the venv `python` belongs to (<venv>/bin/python) with `base_python` (3.12 or
    newer: MaxText's floor) where it is missing, and pip-install `requirements`."""
    venv = os.path.dirname(os.path.dirname(os.path.abspath(python)))
    if not os.path.isfile(python):
        if not shutil.which(base_python):
            raise SystemExit(f"--install-maxtext: no {base_python!r} on PATH; MaxText needs "
                             f"Python >= 3.12: name one with --base-python")
        subprocess.run([base_python, "-m", "venv", venv], check=True)
    subprocess.run([python, "-m", "pip", "install", *requirements], check=True)


def _cached(path, key, compute):
    rows = {}
    if path and os.path.exists(path):
        with open(path) as f:
            rows = {r["key"]: r for r in map(json.loads, f)}
    if key in rows:
        return rows[key]
    row = compute()
    if row is None:
        return None
    row = dict(row, key=key)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")
    return row


def _gib(x):
    return None if x is None else x / GiB


DIFFERENCES = """Differences that remain between the two programs at each point:

- Compilers: tfjax runs jax 0.10.2 with libtpu 0.0.42.1 (its `tpu` extra); the
  MaxText venv installed as the docstring says runs the same pair, so one XLA:TPU
  and one Mosaic compile both (MaxText 0.2.2: 0.2.5 needs jax >= 0.11.1).
- XLA's `optimal_seconds` prices a Mosaic kernel (a custom call without a cost
  estimate) at about nothing, so it cannot see the attention forward that the
  `attn*` policies spare the backward; it does price the host transfers of
  `*_offload`.
- Attention: tfjax's own Pallas kernels (`[B, T, N, H]` layout, head dim 64 not
  padded); MaxText's splash attention (`attention=autoselected`).
- Loss: tfjax's chunked cross-entropy (`train.loss_chunk`: at most that many
  positions' float32 logits alive, recomputed in the backward; 0 = the whole
  `[B, T, V]` in float32); MaxText's cross-entropy with its own VJP over the whole
  `[B, T, V]` in bfloat16 (`num_vocab_tiling=1`).
- Rematerialisation: tfjax's `model.remat` per scanned layer; MaxText's
  `remat_policy=full` per scanned layer (the MaxText rows are always `full`).
- Model: MaxText 0.2.2 has no Llama-3.2-1B preset; its llama3.1-8b with 1B's shape
  (2048 wide, 16 layers, 8192 FFN, head dim 64) and the embedding as the output
  head (unnormalised logits). RoPE scaling differs (costs no memory).
- Arguments: both count the train state (float32 parameters, AdamW's two float32
  moments, the step) and the batch; MaxText's batch has inputs, targets, positions
  and segment ids of both, plus an RNG key; tfjax's the six keys of its packed
  batches.
"""


def main(argv=None):
    import argparse
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", default="", help="comma-separated; default all")
    parser.add_argument("--variants", default="", help="LOSS_CHUNK:REMAT, comma-separated")
    add_maxtext_args(parser, "/tmp/maxtext_venv/bin/python", "a Python with MaxText")
    parser.add_argument("--sides", default="tfjax,maxtext", help="which to compile")
    parser.add_argument("--rows", default="/tmp/vs_maxtext_rows.jsonl",
                        help="JSON lines of compiled rows, reused ('' = none)")
    exp = Experiment("vs_maxtext", __doc__, parser=parser, argv=argv)
    a = exp.args
    if a.install_maxtext:
        install_maxtext(a.maxtext_python, a.base_python)
    points = QUICK_POINTS if exp.quick else POINTS
    names = a.points.split(",") if a.points else list(points)
    variants = a.variants.split(",") if a.variants else (QUICK_VARIANTS if exp.quick
                                                          else VARIANTS)
    table, notes = [], []
    for name in names:
        point, mt = points[name], None
        if "maxtext" in a.sides and point[5] is not None:
            why = f"no MaxText in {a.maxtext_python!r} (--install-maxtext installs it)"
            try:
                mt = _cached(a.rows, f"maxtext/{name}",
                             lambda: maxtext_row(point, a.maxtext_python))
            except RuntimeError as e:
                lines = str(e).strip().splitlines()
                why = next((x for x in reversed(lines) if "Error" in x), lines[-1]).strip()
            if mt is None:
                notes.append(f"MaxText at {name} not compiled: {why}")
                if name in FROM_ISSUE_GIB:
                    mt = dict(temp=FROM_ISSUE_GIB[name] * GiB, args=None, total=None,
                              optimal_seconds=0.0, compile_s=None, quoted=True)
        for v in variants if "tfjax" in a.sides else ():
            r = _cached(a.rows, f"tfjax/{name}/{v}", lambda: tfjax_row(point, v))
            table.append([name, v, _gib(r["temp"]), _gib(r["args"]), _gib(r["total"]),
                          r["optimal_seconds"] * 1e3,
                          r["temp"] / mt["temp"] if mt else None,
                          r["optimal_seconds"] / mt["optimal_seconds"]
                          if mt and mt["optimal_seconds"] else None, r["compile_s"]])
        if mt:
            label = ("MaxText (full), from issue 29, not remeasured" if mt.get("quoted")
                     else "MaxText (full)")
            table.append([name, label, _gib(mt["temp"]), _gib(mt["args"]), _gib(mt["total"]),
                          mt["optimal_seconds"] * 1e3 or None, 1.0,
                          1.0 if mt["optimal_seconds"] else None, mt["compile_s"]])
    table = [["—" if c is None else c for c in row] for row in table]
    exp.table(["point", "tfjax loss_chunk:remat", "temp GiB", "args GiB", "total GiB",
               "optimal ms", "temp / MaxText", "optimal / MaxText", "compile s"], table,
              title="Per chip, XLA:TPU (libtpu topologies on this CPU)")
    for note in notes:
        exp.text(note)
    exp.text(DIFFERENCES)
    exp.finish()


if __name__ == "__main__":
    sys.exit(main())
