"""Training throughput: tokens/s and MFU of the real sharded train step.

    python experiments/bench_train.py [--steps 10] [--presets default,default:small]

For each preset: build the program exactly as `tfjax.train` does (mesh, shardings,
jitted donated step), feed packed stdlib batches, time `--steps` steps after one
warm-up (compile) step. MFU uses the FLOP formula of `tfjax.train.metrics` against
this machine's own matmul peak, measured in the same run (an f32 1024^3 matmul on
one device; on CPU every simulated device shares those cores).
Each Llama-shaped preset is also trained as transformers' LlamaForCausalLM in
PyTorch (same shapes, batches, AdamW + clipping; CPU threads = all cores) and the
ratio printed; that needs the `hf` extra (without it the row says so).
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
from tfjax.train.trainer import build_program, zigzag_rows

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
    order = (lambda v: zigzag_rows(v, p.zigzag)) if p.zigzag else (lambda v: v)  # as Trainer
    batches = [{k: jax.device_put(order(v), p.batch_sharding) for k, v in next(it).items()}
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


def torch_bench(preset: str, steps: int) -> dict | str:
    """The same model as transformers' LlamaForCausalLM, trained the same way in PyTorch.

    Same shapes, batch and optimizer (AdamW, clipping); causal attention over each
    row (PyTorch has no packed-document mask here, so it does slightly less
    masking work than tfjax, which also applies segment ids)."""
    try:
        import numpy as np
        import torch
        import transformers
    except ImportError:
        return "not run: install the `hf` extra"
    cfg = run_config(load(preset))
    m, t = cfg.model, cfg.train
    if not (m.arch == "decoder" and m.position == "rope" and m.norm == "rmsnorm"
            and m.activation == "swiglu"):
        return "not run: only Llama-shaped presets map onto LlamaForCausalLM"
    torch.manual_seed(0)
    torch.set_num_threads(os.cpu_count() or 1)
    hf = transformers.LlamaConfig(
        vocab_size=m.vocab_size, hidden_size=m.d_model, intermediate_size=m.d_ff,
        num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads,
        num_key_value_heads=m.num_kv_heads or m.num_heads, max_position_embeddings=m.max_len,
        rms_norm_eps=m.norm_eps, tie_word_embeddings=m.tie_embeddings,
        attention_bias=False, mlp_bias=False)
    model = transformers.LlamaForCausalLM(hf)
    model.config._attn_implementation = "sdpa"
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, weight_decay=t.weight_decay)
    it = PackedBatches(documents(cfg.data, "train"), load_tokenizer(cfg.data.tokenizer),
                       seq_len=t.seq_len, global_batch=t.batch_size, seed=0)
    batches = []
    for _ in range(steps + 1):
        b = next(it)
        batches.append((torch.from_numpy(np.asarray(b["inputs"], np.int64)),
                        torch.from_numpy(np.asarray(b["targets"], np.int64))))

    def step(x, y):
        logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                                 y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip or 1e9)
        opt.step()
        return loss

    step(*batches[0])  # warm-up
    t0 = time.perf_counter()
    for x, y in batches[1:]:
        step(x, y)
    dt = (time.perf_counter() - t0) / steps
    return dict(params=sum(p.numel() for p in model.parameters()),
                tokens_per_s=t.batch_size * t.seq_len / dt, step_s=dt,
                flops=flops_per_token(m, t.seq_len) * t.batch_size * t.seq_len / dt,
                version=torch.__version__)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--presets", default="default,default:small")
    ap.add_argument("--no_torch", action="store_true", help="skip the PyTorch rows")
    a = ap.parse_args()
    peak = measure_matmul_peak()
    print(f"{jax.devices()[0].device_kind} x{len(jax.devices())}: measured matmul peak "
          f"{peak / 1e9:.1f} GFLOP/s\n")
    print("| preset | framework | parameters | tokens/s | step (s) | MFU | tfjax / PyTorch |")
    print("|---|---|---|---|---|---|---|")
    for preset in a.presets.split(","):
        r = bench(preset, a.steps)
        print(f"| {preset} | tfjax (jax {jax.__version__}) | {r['params'] / 1e6:.2f}M | "
              f"{r['tokens_per_s']:,.0f} | {r['step_s']:.3f} | "
              f"{100 * r['flops'] / peak:.1f}% | |", flush=True)
        if a.no_torch:
            continue
        tr = torch_bench(preset, a.steps)
        if isinstance(tr, str):
            print(f"| {preset} | PyTorch | {tr} | | | | |")
            continue
        print(f"| {preset} | PyTorch {tr['version']} (LlamaForCausalLM) | "
              f"{tr['params'] / 1e6:.2f}M | {tr['tokens_per_s']:,.0f} | {tr['step_s']:.3f} | "
              f"{100 * tr['flops'] / peak:.1f}% | "
              f"{r['tokens_per_s'] / tr['tokens_per_s']:.2f}x |", flush=True)

if __name__ == "__main__":
    main()
