"""Recurrent presets' training step compiled for a TPU slice: per-chip memory beside
a Transformer of the same size.

    .venv/bin/python experiments/recurrent_tpu_aot.py             # ~8 min on 2 cores (libtpu)
    .venv/bin/python experiments/recurrent_tpu_aot.py --quick     # one row, tiny

The real XLA:TPU compiler run on this CPU through libtpu's topology description
(`tfjax.train.aot.compile_only`, what `python -m tfjax.train --compile_only
--topology v5p:2x2x1` prints), for configs/mamba2.py (mamba2-130m), configs/mamba.py
(mamba-130m) and configs/gpt2.py (124M, max_len raised to the sequence length) at a
global batch of 8 x 2048 on v5p:2x2x1 with fsdp=4 (two sequences a chip), float32
parameters and AdamW, without and with full rematerialisation (`model.remat`).
"""

from __future__ import annotations

import io
import re

from common import Experiment, preset_config

from tfjax.config import run_config
from tfjax.train.aot import compile_only

PRESETS = {
    "mamba2-130m (configs/mamba2.py)": ("mamba2", {}),
    "mamba-130m (configs/mamba.py)": ("mamba", {}),
    "gpt2 124M (configs/gpt2.py)": ("gpt2", {"max_len": 2048}),
}


def per_chip(preset: str, variant, model: dict, remat: str, batch: int, seq: int,
             topology: str) -> dict:
    cfg = preset_config(preset, variant)
    cfg.model.update({**model, "remat": remat})
    cfg.train.update(dict(batch_size=batch, seq_len=seq))
    cfg.mesh.update(dict(data=1, fsdp=4))
    out = io.StringIO()
    compile_only(run_config(cfg), topology, out=out)
    text = out.getvalue()
    got = dict(re.findall(r"(parameters|optimizer|temporaries) ([\d.]+ [KMG]iB)", text))
    got["params"] = re.search(r"model: ([\d.,]+M) parameters", text).group(1)
    return got


def main(argv=None):
    exp = Experiment("recurrent_tpu_aot", __doc__, argv=argv)
    topology = "v5p:2x2x1"
    if exp.quick:
        runs = [("mamba2 tiny", "mamba2", "tiny", {}, "none", 8, 64)]
    else:
        runs = [(label, name, None, model, remat, 8, 2048)
                for label, (name, model) in PRESETS.items() for remat in ("none", "full")]
    rows = []
    for label, name, variant, model, remat, batch, seq in runs:
        got = per_chip(name, variant, model, remat, batch, seq, topology)
        rows.append((label, got["params"], remat, f"{batch} x {seq}", got["parameters"],
                     got["optimizer"], got["temporaries"]))
        print(f"  {label} remat={remat}: temporaries {got['temporaries']}", flush=True)
    exp.table(["model", "parameters", "remat", "global batch", "params / chip", "AdamW / chip",
               "temporaries / chip"], rows, title=f"Train step on {topology}, fsdp=4")
    exp.finish()
    return rows


if __name__ == "__main__":
    main()
