"""Training metrics: FLOPs and MFU, a terminal progress bar, metrics.jsonl and TensorBoard.

FLOPs per trained token (decoder LM, dense), the formula MFU uses:
  forward  = 2 * P_matmul + 2 * L * T * N * H
  training = 3 * forward  (backward = 2 x forward)
where P_matmul counts the weights every token multiplies by: per layer the q, k,
v, o projections (D*N*H + 2*D*K*H + N*H*D) and the FFN (2 or, gated, 3 * D*F),
plus the output projection D*V (embedding lookups are not matmuls). Attention
scores QK^T and the weighted sum PV cost 2 * 2*T*N*H per token and layer; causal
masking halves that to 2*T*N*H. MFU = FLOPs/token * tokens/s / peak FLOP/s of
all devices (`train.peak_flops` per device; else a table of chips; on CPU a
matmul measured at start, once for all simulated devices since they share cores).
"""

from __future__ import annotations

import json
import os
import sys
import time

import jax
import jax.numpy as jnp

from tfjax.config import ModelConfig

__all__ = ["MetricWriter", "ProgressBar", "flops_per_token", "peak_flops"]

GATED = ("swiglu", "geglu", "geglu_tanh", "reglu")

# Dense bf16 peak FLOP/s per chip (vendor figures).
PEAK_FLOPS = {
    "TPU v4": 275e12, "TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v5p": 459e12,
    "TPU v5": 459e12, "TPU v6 lite": 918e12, "TPU v6e": 918e12,
    "NVIDIA H100": 989e12, "NVIDIA H200": 989e12, "NVIDIA A100": 312e12,
    "NVIDIA B200": 2250e12,
}


def flops_per_token(m: ModelConfig, seq_len: int) -> float:
    D, L, N, K, H, Hv, F, V = (m.d_model, m.num_layers, m.num_heads, m.kv_heads, m.head_size,
                               m.value_head_size, m.d_ff, m.vocab_size)
    p_attn = D * N * H + D * K * H + D * K * Hv + N * Hv * D  # q, k, v, o
    p_matmul = L * (p_attn + (3 if m.activation in GATED else 2) * D * F)
    p_matmul += D * V
    forward = 2 * p_matmul + L * seq_len * N * (H + Hv)
    return 3.0 * forward


def measure_matmul_peak(n: int = 1024, reps: int = 5) -> float:
    """FLOP/s of an f32 n x n matmul on the default device (the CPU's practical peak)."""
    x = jnp.ones((n, n), jnp.float32)
    f = jax.jit(lambda a: a @ a)
    f(x).block_until_ready()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        f(x).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best


def peak_flops(per_device: float = 0.0) -> tuple[float, str]:
    """(peak FLOP/s of all devices, how it was obtained)."""
    devices = jax.devices()
    if per_device > 0:
        return per_device * len(devices), "train.peak_flops"
    kind = devices[0].device_kind
    for name, value in PEAK_FLOPS.items():
        if kind.startswith(name):
            return value * len(devices), f"{kind} table"
    if devices[0].platform == "cpu":
        return measure_matmul_peak(), "measured CPU matmul"
    return 0.0, f"unknown device {kind!r} (set train.peak_flops)"


class MetricWriter:
    """One JSON record per logged step in WORKDIR/metrics.jsonl, and TensorBoard event files
    (tensorboardX) in WORKDIR/tb. Only process 0 writes."""

    def __init__(self, workdir: str, resume_step: int = 0):
        self.active = jax.process_index() == 0
        self.path = os.path.join(workdir, "metrics.jsonl")
        self._tb = None
        if not self.active:
            return
        os.makedirs(workdir, exist_ok=True)
        if os.path.exists(self.path):  # a resumed run rewrites what came after its checkpoint
            with open(self.path) as f:
                keep = [line for line in f if line.strip() and json.loads(line).get("step", 0) <= resume_step]
            with open(self.path, "w") as f:
                f.writelines(keep)
        try:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(os.path.join(workdir, "tb"))
        except Exception:  # noqa: BLE001 - TensorBoard is a convenience
            self._tb = None

    def write(self, step: int, **values) -> None:
        if not self.active:
            return
        record = {"step": int(step), **{k: (float(v) if not isinstance(v, str) else v)
                                         for k, v in values.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for k, v in record.items():
                if k != "step" and not isinstance(v, str):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


class ProgressBar:
    """`[#####.....] 120/1000 loss 2.31 ...` redrawn in place on a terminal; on a pipe or
    a file, one line per update."""

    def __init__(self, total: int, enabled: bool = True, stream=None):
        self.total, self.stream = total, stream or sys.stderr
        self.enabled = enabled and jax.process_index() == 0
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = time.time()

    def update(self, step: int, text: str) -> None:
        if not self.enabled:
            return
        frac = min(step / max(self.total, 1), 1.0)
        bar = "#" * int(30 * frac) + "." * (30 - int(30 * frac))
        elapsed = time.time() - self.t0
        line = f"[{bar}] {step}/{self.total} {text} {elapsed:.0f}s"
        if self.tty:
            self.stream.write("\r" + line + "\033[K")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()
