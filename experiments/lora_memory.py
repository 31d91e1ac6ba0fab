"""LoRA's memory: parameter, gradient and optimizer-state bytes of a full fine-tune
and of LoRA fine-tunes of the Llama presets, from the abstract train state
(`tfjax.train.lora.train_state_shape` under `jax.eval_shape`: nothing is allocated).

    .venv/bin/python experiments/lora_memory.py         # seconds; writes results/lora_memory.md
    .venv/bin/python experiments/lora_memory.py --aot   # + the compiled step (~3 CPU-minutes)

Gradients are the size of the trainable parameters (the step differentiates with
respect to `state["params"]`, the adapters under LoRA). Per-step transients (the
merged matrices and their full-size gradients that `tfjax.train.lora` forms, the
activations) are not in this table; `--aot` adds the compiled train step's memory
(`tfjax.train.aot.compile_only`, XLA's memory_analysis on the local CPU) for
Llama-3.2-1B at batch 1 x 1024, full and LoRA r=8 on q,v.
"""

from __future__ import annotations

import io
import math
import os
import sys

import jax
from flax import nnx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "configs"))

from tfjax.config import run_config  # noqa: E402
from tfjax.models import build  # noqa: E402
from tfjax.train.lora import train_state_shape  # noqa: E402

GIB = 2 ** 30
CASES = [("full fine-tune", None), ("LoRA r=8, q,v", dict(rank=8, targets="q,v")),
         ("LoRA r=16, all", dict(rank=16, targets="all"))]


def nbytes(tree) -> int:
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def numel(tree) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


def rows(preset: str):
    import llama

    out = []
    for name, lora in CASES:
        c = llama.get_config(preset)
        if lora:
            c.lora.update(lora)
        cfg = run_config(c)
        with nnx.use_eager_sharding(False):
            abstract = nnx.eval_shape(lambda: build(cfg.model, rngs=nnx.Rngs(0)))
        _, aparams, arest = nnx.split(abstract, nnx.Param, ...)
        state, _, _ = train_state_shape(cfg, aparams, arest)
        params = nbytes(state["params"]) + nbytes(state.get("frozen", {}))
        out.append((name, numel(state["params"]), params, nbytes(state["params"]),
                    nbytes(state["opt"])))
    return out


def aot_lines() -> list[str]:
    import llama

    from tfjax.train.aot import compile_only

    lines = ["## Compiled train step, Llama-3.2-1B, batch 1 x 1024, one CPU device", "",
             "`tfjax.train.aot.compile_only` (as `python -m tfjax.train --config "
             "configs/llama.py:1b --compile_only --config.train.batch_size=1 "
             "--config.train.seq_len=1024 --config.mesh.data=1 [--config.lora.rank=8 "
             "--config.lora.targets=q,v]`); temporaries include the gradients.", "", "```"]
    for rank in (0, 8):
        c = llama.get_config("1b")
        c.train.update(dict(batch_size=1, seq_len=1024))
        c.mesh.data = 1
        c.lora.update(dict(rank=rank, targets="q,v"))
        buf = io.StringIO()
        compile_only(run_config(c), None, out=buf)
        lines += [f"lora.rank={rank}", *buf.getvalue().strip().splitlines()[-1:]]
    return lines + ["```", ""]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    lines = ["# LoRA memory: parameters, gradients, optimizer state", "",
             "Command: `.venv/bin/python experiments/lora_memory.py` (abstract shapes, "
             "`jax.eval_shape`; float32 parameters as the presets train, AdamW: two moments "
             "per trainable parameter). Whole-model bytes, before sharding over a mesh. Not "
             "counted: per-step transients; `tfjax.train.lora` merges in parameter space, so "
             "a step also holds the merged adapted matrices and their full-size gradients "
             "(as a full fine-tune's step does) until they are reduced to the adapters'.", ""]
    for preset, title in (("1b", "Llama-3.2-1B (`configs/llama.py:1b`)"),
                          (None, "Llama-3.1-8B (`configs/llama.py`)")):
        lines += [f"## {title}", "",
                  "| run | trainable params | params (GiB) | gradients (GiB) | optimizer (GiB) "
                  "| total (GiB) |", "|---|---:|---:|---:|---:|---:|"]
        for name, n, p, g, o in rows(preset):
            lines.append(f"| {name} | {n:,} | {p / GIB:.2f} | {g / GIB:.3f} | {o / GIB:.3f} | "
                         f"{(p + g + o) / GIB:.2f} |")
        lines.append("")
    if "--aot" in argv:
        lines += aot_lines()
    text = "\n".join(lines)
    path = os.path.join(os.path.dirname(__file__), "results", "lora_memory.md")
    with open(path, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
