"""Quantized training on TPU, compiled by the real XLA:TPU compiler on this CPU (libtpu
topologies, no TPU): XLA's step-time estimate, per-chip memory and the 8-bit dots of the
train step of Llama-3.2-1B with `model.quant` none (bf16 compute) / int8 / fp8.

    .venv/bin/python experiments/quant.py                    # 1B on v5e:2x2 and v6e:2x2
    .venv/bin/python experiments/quant.py --topologies v5e:2x2
    .venv/bin/python experiments/quant.py --quick            # Llama tiny on v5e:2x2

Point: configs/llama.py "1b" (bf16 compute, float32 parameters and AdamW, full remat,
the chunked loss), global batch 8 x 2048 tokens, FSDP over the 4 chips. The 8-bit dots
are counted from the optimized HLO's operand types (as tests/train/test_quant_train.py).
"""

from __future__ import annotations

import argparse
import collections
import re
import time

from common import Experiment, preset_config

from tfjax.config import run_config
from tfjax.train.aot import compile_step, step_figures

GiB = 1024 ** 3
FORMATS = ("none", "int8", "fp8")
_DEF = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*\(?([a-z][a-z0-9]*)\[")
_DOT = re.compile(r"\b(?:dot|convolution)\(([^)]*)\)")


def dot_operand_types(hlo: str) -> collections.Counter:
    types = {m.group(1): m.group(2) for m in map(_DEF.match, hlo.splitlines()) if m}
    out = collections.Counter()
    for line in hlo.splitlines():
        if m := _DOT.search(line):
            out[tuple(types.get(n.strip().lstrip("%"), "?") for n in m.group(1).split(","))] += 1
    return out


def row(variant: str, topology: str, quant: str, batch: int, seq: int) -> dict:
    cfg = preset_config("llama", variant)
    cfg.model.update(dict(dtype="bfloat16", remat="full", quant=quant))
    cfg.train.update(dict(batch_size=batch, seq_len=seq, loss_chunk=512, microbatches=1))
    cfg.mesh.update(dict(data=1, fsdp=4))
    start = time.time()
    compiled, p, _, _ = compile_step(run_config(cfg), topology)
    f = step_figures(compiled, p)
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, (list, tuple)) and cost else cost) or {}
    print(topology, quant, {k: cost.get(k) for k in ("optimal_seconds", "flops",
                                                     "bytes accessed", "utilization")},
          flush=True)
    ops = dot_operand_types(compiled.as_text())
    eight = sum(n for k, n in ops.items() if any(t.startswith(("s8", "f8")) for t in k))
    return dict(optimal_seconds=f["optimal_seconds"], temp=f["temp"],
                raw_seconds=float(cost.get("optimal_seconds", 0.0) or 0.0),
                tflops=float(cost.get("flops", 0.0) or 0.0) / 1e12,
                total=f["arguments"] + f["temp"] + f["code"], dots=sum(ops.values()),
                eight_bit=eight, compile_s=time.time() - start)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--topologies", default="v5e:2x2,v6e:2x2")
    exp = Experiment("quant", __doc__, parser=parser, argv=argv)
    a = exp.args
    variant, batch, seq = ("tiny", 8, 256) if exp.quick else ("1b", 8, 2048)
    topologies = ["v5e:2x2"] if exp.quick else a.topologies.split(",")
    table = []
    for topology in topologies:
        base = None
        for quant in FORMATS:
            r = row(variant, topology, quant, batch, seq)
            base = base or r
            est = r["optimal_seconds"]
            table.append([topology, quant, est * 1e3 if est > 0 else "—",
                          est / base["optimal_seconds"] if est > 0 and base["optimal_seconds"] > 0
                          else "—", r["temp"] / GiB, r["total"] / GiB,
                          r["raw_seconds"] * 1e3, r["tflops"],
                          f"{r['eight_bit']} / {r['dots']}", r["compile_s"]])
            print(table[-1], flush=True)
    exp.table(["topology", "model.quant", "optimal ms", "/ bf16", "temp GiB", "total GiB",
               "raw optimal ms", "XLA TFLOP", "8-bit dots / dots", "compile s"], table,
              title=f"Llama-3.2-1B ({variant}) train step, batch {batch} x {seq}, fsdp 4, "
                    f"per chip, XLA:TPU (libtpu topologies on this CPU)")
    exp.finish()


if __name__ == "__main__":
    main()
