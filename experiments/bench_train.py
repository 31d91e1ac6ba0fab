"""Training throughput: tokens/s and MFU of the real sharded train step, against
PyTorch eager on the same model and batches, measured alternately in one run.

    python experiments/bench_train.py [--steps 8] [--rounds 5] [--presets default,default:small]
    taskset -c 0 python experiments/bench_train.py    # both frameworks on one core

For each preset: build the program exactly as `tfjax.train` does (one XLA:CPU device
per usable core for the data-parallel presets, `tfjax.parallel.mesh.use_cpu_cores`;
mesh, shardings, jitted donated step) and, for Llama-shaped presets, transformers'
LlamaForCausalLM in PyTorch (same shapes, batches, AdamW + clipping; intra-op threads
= usable cores). After one warm-up step each, `--rounds` rounds each time `--steps`
steps of tfjax, then of PyTorch; the table gives the median round of each and their
ratio (`--attention` adds tfjax rows with other attention implementations), and the
machine's load average before and after. MFU uses the FLOP formula
of `tfjax.train.metrics` against this machine's matmul peak measured in the same run
(an f32 1024^3 matmul on one device, times the devices that have a core each).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from common import preset_config
from tfjax.config import run_config
from tfjax.data import PackedBatches, documents, load_tokenizer
from tfjax.models import build
from tfjax.parallel.mesh import make_mesh, usable_cores, use_cpu_cores
from tfjax.train.metrics import flops_per_token, peak_flops
from tfjax.train.trainer import build_program, zigzag_rows

def load(preset: str):
    """A `name[:variant]` preset's ConfigDict."""
    name, _, variant = preset.partition(":")
    return preset_config(name, variant or None)


def packed_batches(cfg, n: int):
    t = cfg.train
    it = PackedBatches(documents(cfg.data, "train"), load_tokenizer(cfg.data.tokenizer),
                       seq_len=t.seq_len, global_batch=t.batch_size, seed=0)
    return [next(it) for _ in range(n)]


class TfjaxRun:
    """The preset's train step as `tfjax.train` builds it, warmed up (compiled)."""

    def __init__(self, preset: str, steps: int, attention: str = ""):
        raw = load(preset)
        if attention:
            raw.model.attention.impl = attention
        cfg = self.cfg = run_config(raw)
        p = self.program = build_program(cfg, make_mesh(cfg.mesh), build)
        order = (lambda v: zigzag_rows(v, p.zigzag)) if p.zigzag else (lambda v: v)  # as Trainer
        self.batches = [{k: jax.device_put(order(v), p.batch_sharding) for k, v in b.items()}
                        for b in packed_batches(cfg, steps + 1)]
        self.state, m = p.step(p.init(), self.batches[0])
        jax.block_until_ready(m)
        self.params = p.num_params
        self.label = (f"tfjax (jax {jax.__version__}, {len(jax.devices())} CPU devices"
                      + (f", attention {attention!r})" if attention else ")"))

    def seconds_per_step(self) -> float:
        t0 = time.perf_counter()
        for b in self.batches[1:]:
            self.state, m = self.program.step(self.state, b)
        jax.block_until_ready(m)
        return (time.perf_counter() - t0) / (len(self.batches) - 1)


class TorchRun:
    """The same model as transformers' LlamaForCausalLM, trained the same way in
    PyTorch eager (AdamW, clipping), warmed up. Causal attention over each row:
    PyTorch has no packed-document mask here, so it does slightly less masking
    work than tfjax, which also applies segment ids."""

    @staticmethod
    def refusal(preset: str) -> str | None:
        try:
            import torch  # noqa: F401
            import transformers  # noqa: F401
        except ImportError:
            return "not run: install the `hf` extra"
        m = run_config(load(preset)).model
        if not (m.arch == "decoder" and m.position == "rope" and m.norm == "rmsnorm"
                and m.activation == "swiglu"):
            return "not run: only Llama-shaped presets map onto LlamaForCausalLM"
        return None

    def __init__(self, preset: str, steps: int):
        import numpy as np
        import torch
        import transformers

        cfg = run_config(load(preset))
        m, t = cfg.model, cfg.train
        torch.manual_seed(0)
        torch.set_num_threads(usable_cores())
        hf = transformers.LlamaConfig(
            vocab_size=m.vocab_size, hidden_size=m.d_model, intermediate_size=m.d_ff,
            num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads,
            num_key_value_heads=m.num_kv_heads or m.num_heads, max_position_embeddings=m.max_len,
            rms_norm_eps=m.norm_eps, tie_word_embeddings=m.tie_embeddings,
            attention_bias=False, mlp_bias=False)
        model = self.model = transformers.LlamaForCausalLM(hf)
        model.config._attn_implementation = "sdpa"
        model.train()
        self.opt = torch.optim.AdamW(model.parameters(), lr=t.lr, weight_decay=t.weight_decay)
        self.clip = t.grad_clip or 1e9
        self.batches = [(torch.from_numpy(np.asarray(b["inputs"], np.int64)),
                         torch.from_numpy(np.asarray(b["targets"], np.int64)))
                        for b in packed_batches(cfg, steps + 1)]
        self.params = sum(p.numel() for p in model.parameters())
        self.label = f"PyTorch {torch.__version__} eager, {torch.get_num_threads()} threads"
        self._step(*self.batches[0])  # warm-up

    def _step(self, x, y):
        import torch

        logits = self.model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                                 y.reshape(-1))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()

    def seconds_per_step(self) -> float:
        t0 = time.perf_counter()
        for x, y in self.batches[1:]:
            self._step(x, y)
        return (time.perf_counter() - t0) / (len(self.batches) - 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8, help="steps per timed round")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds per framework")
    ap.add_argument("--presets", default="default,default:small")
    ap.add_argument("--no_torch", action="store_true", help="skip the PyTorch rows")
    ap.add_argument("--attention", default="", help="also time tfjax with these "
                    "model.attention.impl values (comma-separated), in the same rounds")
    a = ap.parse_args()
    presets = a.presets.split(",")
    first = run_config(load(presets[0]))
    use_cpu_cores(first.mesh, first.train.batch_size // first.train.microbatches)
    peak, how = peak_flops()
    load_before = os.getloadavg()
    print(f"{jax.devices()[0].device_kind} x{len(jax.devices())} on {usable_cores()} usable cores; "
          f"matmul peak {peak / 1e9:.1f} GFLOP/s ({how}); load average {load_before[0]:.2f}\n")
    print("| preset | framework | parameters | tokens/s | step (s) | MFU | tfjax / PyTorch |")
    print("|---|---|---|---|---|---|---|")
    for preset in presets:
        runs = [TfjaxRun(preset, a.steps)]
        refusal = "not run: --no_torch" if a.no_torch else TorchRun.refusal(preset)
        if refusal is None:
            runs.append(TorchRun(preset, a.steps))
        runs += [TfjaxRun(preset, a.steps, impl) for impl in filter(None, a.attention.split(","))]
        times = [[] for _ in runs]
        for _ in range(a.rounds):
            for run, ts in zip(runs, times):
                ts.append(run.seconds_per_step())
        cfg = runs[0].cfg
        tokens = cfg.train.batch_size * cfg.train.seq_len
        rates = [tokens / statistics.median(ts) for ts in times]
        for i, (run, ts, rate) in enumerate(zip(runs, times, rates)):
            mfu = flops_per_token(cfg.model, cfg.train.seq_len) * rate / peak
            torch_rate = None if refusal else rates[1]
            ratio = f"{rate / torch_rate:.2f}x" if torch_rate and i != 1 else ""
            print(f"| {preset} | {run.label} | {run.params / 1e6:.2f}M | {rate:,.0f} | "
                  f"{statistics.median(ts):.3f} | {100 * mfu:.1f}% | {ratio} |", flush=True)
        if refusal:
            print(f"| {preset} | PyTorch | {refusal} | | | | |")
    after = os.getloadavg()
    print(f"\nload average (1 min) before {load_before[0]:.2f}, after {after[0]:.2f}; "
          f"{a.rounds} alternating rounds of {a.steps} steps, median round")


if __name__ == "__main__":
    main()
