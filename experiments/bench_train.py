"""Training throughput: tokens/s and MFU of the real sharded train step.

    python experiments/bench_train.py [--steps 10] [--presets default,default:small]

For each preset: build the program exactly as `tfjax.train` does (mesh, shardings,
jitted donated step), feed packed stdlib batches, time `--steps` steps after one
warm-up (compile) step. MFU uses the FLOP formula of `tfjax.train.metrics` against
this machine's own matmul peak, measured in the same run (an f32 1024^3 matmul on
one device; on CPU every simulated device shares those cores).
The PyTorch comparison (transformers LlamaForCausalLM on the same data) needs the
`hf` extra; without it the row says so.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

import jax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tfjax.config import run_config
from tfjax.data import PackedBatches, documents, load_tokenizer
from tfjax.models import build
from tfjax.parallel.mesh import make_mesh
from tfjax.train.metrics import flops_per_token, measure_matmul_peak
from tfjax.train.trainer import build_program

SMALL = dict(d_model=256, num_layers=6, num_heads=8, num_kv_heads=4, d_ff=768)


def load(preset: str):
    path, _, arg = preset.partition(":")
    spec = importlib.util.spec_from_file_location("preset", os.path.join(ROOT, "configs", path + ".py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if path == "default" and arg == "small":
        cfg = mod.get_config()
        cfg.model.update(SMALL)
        return cfg
    return mod.get_config(arg or None)


def bench(preset: str, steps: int) -> dict:
    cfg = run_config(load(preset))
    mesh = make_mesh(cfg.mesh)
    p = build_program(cfg, mesh, build)
    t = cfg.train
    it = PackedBatches(documents(cfg.data, "train"), load_tokenizer(cfg.data.tokenizer),
                       seq_len=t.seq_len, global_batch=t.batch_size, seed=0)
    batches = [{k: jax.device_put(v, p.batch_sharding) for k, v in next(it).items()}
               for _ in range(steps + 1)]
    state = p.init()
    state, m = p.step(state, batches[0])
    jax.block_until_ready(m)
    t0 = time.perf_counter()
    for b in batches[1:]:
        state, m = p.step(state, b)
    jax.block_until_ready(m)
    dt = (time.perf_counter() - t0) / steps
    tps = t.batch_size * t.seq_len / dt
    return dict(preset=preset, params=p.num_params, tokens_per_s=tps, step_s=dt,
                flops=flops_per_token(cfg.model, t.seq_len) * tps)


def torch_row() -> str:
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return "| PyTorch LlamaForCausalLM | not run: install the `hf` extra | | | |"
    return "| PyTorch LlamaForCausalLM | not implemented in this script yet | | | |"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--presets", default="default,default:small")
    a = ap.parse_args()
    peak = measure_matmul_peak()
    print(f"{jax.devices()[0].device_kind} x{len(jax.devices())}: measured matmul peak "
          f"{peak / 1e9:.1f} GFLOP/s\n")
    print("| preset | parameters | tokens/s | step (s) | MFU |")
    print("|---|---|---|---|---|")
    for preset in a.presets.split(","):
        r = bench(preset, a.steps)
        print(f"| {preset} | {r['params'] / 1e6:.2f}M | {r['tokens_per_s']:,.0f} | "
              f"{r['step_s']:.3f} | {100 * r['flops'] / peak:.1f}% |")
    print(torch_row())


if __name__ == "__main__":
    main()
