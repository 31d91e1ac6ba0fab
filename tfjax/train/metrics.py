"""Training metrics: FLOPs and MFU (`flops_per_token`, `peak_flops`), the wall-time split
(`WallClock`), a terminal progress bar (`ProgressBar`), the records (`MetricWriter`:
metrics.jsonl, TensorBoard and, with `train.wandb`, Weights & Biases), and the gzip / xz
baseline a byte-level run's validation bits per byte is compared with
(`compression_bits_per_byte`, `compression_report`). The FLOPs formula is in
docs/training.md ("FLOPs and MFU").
"""

from __future__ import annotations

import contextlib
import gzip
import json
import lzma
import os
import sys
import tempfile
import time
import uuid
from typing import Any

import jax
import jax.numpy as jnp

from tfjax import storage
from tfjax.config import ModelConfig
from tfjax.parallel.mesh import usable_cores

__all__ = ["MetricWriter", "ProgressBar", "WallClock", "compression_bits_per_byte",
           "compression_report", "flops_per_token", "peak_flops"]

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
    if devices[0].platform == "cpu":  # one device runs on one core (XLA:CPU)
        cores = min(len(devices), usable_cores())
        return measure_matmul_peak() * cores, f"measured CPU matmul x {cores} core(s)"
    return 0.0, f"unknown device {kind!r} (set train.peak_flops)"


def compression_bits_per_byte(data: bytes) -> dict[str, float]:
    """Bits per byte of gzip -9 and xz -9e on `data` (the baselines to beat); empty
    `data` is a ValueError (a rate over zero bytes is no baseline)."""
    if not data:
        raise ValueError("compression_bits_per_byte: no bytes to compress (the validation "
                         "split scored none)")
    n = len(data)
    return dict(gzip=len(gzip.compress(data, 9)) * 8 / n,
                xz=len(lzma.compress(data, preset=9 | lzma.PRESET_EXTREME)) * 8 / n)


def compression_report(val_bpb: float, data: bytes) -> tuple[dict[str, float], str]:
    """(summary entries, one log line) comparing the model's `val_bpb` with gzip / xz on
    the same validation bytes `data`; with no bytes there is nothing to compare, and
    the line says so instead (no entries)."""
    if not data:
        return {}, ("  no validation bytes were scored, so there is nothing to compare with "
                    "gzip / xz (check data.paths / data.val_paths and train.eval_batches)")
    base = compression_bits_per_byte(data)
    beats = {k: val_bpb < base[k] for k in ("gzip", "xz")}
    verdict = {(True, True): "beats gzip and xz", (True, False): "beats gzip, not xz",
               (False, True): "beats xz, not gzip",
               (False, False): "beats neither gzip nor xz"}[beats["gzip"], beats["xz"]]
    return ({f"{k}_bpb": v for k, v in base.items()},
            f"  same bytes: gzip -9 {base['gzip']:.4f} bits/byte, xz -9e {base['xz']:.4f} "
            f"bits/byte; tfjax {verdict}")


# JAX's compile-time events (jax._src.dispatch): tracing, lowering, XLA compilation
# (a persistent-cache hit is timed as the compilation it replaces)
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                  "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")
WALL_PARTS = ("data", "checkpoint", "eval", "compile")  # the rest of the wall time: step


class WallClock:
    """Where the training loop's wall time goes: `split()` returns the seconds since
    the previous split as time_data_s (waiting for the next batch), time_checkpoint_s
    (saving), time_eval_s (evaluation), time_compile_s (tracing, lowering and
    compiling, wherever it happens: the union of the spans of JAX's own compile
    events, so a jit traced inside another is counted once) and time_step_s, the
    rest (dispatching and running steps, fetching their metrics), with wall_s their
    sum; `totals` sums every split. A part timed with `timing(part)` excludes the
    compilation inside it. Use it as a context manager: it listens to JAX's events
    while open."""

    def __init__(self):
        self._parts = dict.fromkeys(WALL_PARTS, 0.0)
        self._spans: list[tuple[float, float]] = []  # compile events since the split
        self._since = time.time()  # the clock JAX's event spans use
        self.totals: dict[str, float] = {}

    def _on_span(self, event: str, start: float, end: float, **_) -> None:
        if event in COMPILE_EVENTS:
            self._spans.append((start, end))

    def _compile_within(self, lo: float, hi: float) -> float:
        """Seconds of [lo, hi] covered by at least one compile span."""
        total, reach = 0.0, lo
        for s, e in sorted(self._spans):
            s, e = max(s, reach), min(e, hi)
            if e > s:
                total, reach = total + e - s, e
        return total

    def __enter__(self) -> WallClock:
        jax.monitoring.register_event_time_span_listener(self._on_span)
        self._since = time.time()
        return self

    def __exit__(self, *exc) -> None:
        jax.monitoring.unregister_event_time_span_listener(self._on_span)

    @contextlib.contextmanager
    def timing(self, part: str):
        start = time.time()
        try:
            yield
        finally:
            end = time.time()
            self._parts[part] += end - start - self._compile_within(start, end)

    def split(self) -> dict[str, float]:
        now = time.time()
        wall = now - self._since
        parts = {**self._parts, "compile": self._compile_within(self._since, now)}
        out = {f"time_{k}_s": v for k, v in parts.items()}
        out["time_step_s"] = max(wall - sum(parts.values()), 0.0)
        out["wall_s"] = wall
        self._parts = dict.fromkeys(WALL_PARTS, 0.0)
        self._spans, self._since = [], now
        for k, v in out.items():
            self.totals[k] = self.totals.get(k, 0.0) + v
        return out


class MetricWriter:
    """One JSON record per logged step in WORKDIR/metrics.jsonl, TensorBoard event files
    (tensorboardX) in WORKDIR/tb, and with `wandb` (a project name) the same records in
    a Weights & Biases run kept under WORKDIR/wandb. The run's id is stored in
    WORKDIR/wandb_run_id, so a resumed training run continues the same W&B run (W&B
    keeps the values it already has for the steps between the checkpoint and the
    stop). W&B holds one row per step: records written at the same step (the last
    train step and the evaluation after it) are merged, their wall-time parts
    (`WallClock`) added. Only process 0 writes.

    A workdir on a bucket (`gs://...`) is written in a local staging directory and
    uploaded by `sync()`: every `SYNC_S` seconds, at each checkpoint (the trainer calls
    it) and at `close()`, so what a resume keeps (the records up to its checkpoint) is
    always on the bucket."""

    SYNC_S = 60.0

    def __init__(self, workdir: str, resume_step: int = 0, *, wandb: str = "",
                 wandb_mode: str = "", config: dict[str, Any] | None = None):
        self.active = jax.process_index() == 0
        self.workdir, self._staging = workdir, None
        self._tb = self._wandb = None
        self._wandb_row: tuple[int, dict[str, float]] = (-1, {})  # step, its time parts
        self.path = os.path.join(workdir, "metrics.jsonl")
        if not self.active:
            return
        if storage.is_remote(workdir):
            self._staging = tempfile.TemporaryDirectory(prefix="tfjax-workdir-")
            for name in ("metrics.jsonl", "wandb_run_id"):  # what a resume continues
                if (remote := storage.path(workdir) / name).exists():
                    with open(os.path.join(self._staging.name, name), "wb") as f:
                        f.write(remote.read_bytes())
            workdir = self._staging.name
            self.path = os.path.join(workdir, "metrics.jsonl")
        self._synced = time.monotonic()
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
        if wandb:
            self._wandb = _wandb_run(workdir, wandb, wandb_mode, config or {})

    def write(self, step: int, **values) -> None:
        if not self.active:
            return
        record = {"step": int(step), **{k: (float(v) if not isinstance(v, str) else v)
                                         for k, v in values.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self._staging is not None and time.monotonic() - self._synced > self.SYNC_S:
            self.sync()
        if self._tb is not None:
            for k, v in record.items():
                if k != "step" and not isinstance(v, str):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            row = {k: v for k, v in record.items() if k != "step"}
            times = {k: v for k, v in row.items() if k.startswith("time_") or k == "wall_s"}
            if self._wandb_row[0] == step:  # the same W&B row: successive intervals add
                prev = self._wandb_row[1]
                times = {**prev, **{k: v + prev.get(k, 0.0) for k, v in times.items()}}
                row.update(times)
            self._wandb_row = (int(step), times)
            self._wandb.log(row, step=int(step))

    def sync(self) -> None:
        """Upload the staged files to a workdir on a bucket (nothing to do when local)."""
        if self._staging is None:
            return
        if self._tb is not None:
            self._tb.flush()
        root = self._staging.name
        for d, _, files in os.walk(root):
            for name in files:
                rel = os.path.relpath(os.path.join(d, name), root)
                if rel.split(os.sep)[0] != "wandb":  # W&B keeps its own copy on its server
                    storage.upload(os.path.join(d, name), f"{self.workdir.rstrip('/')}/{rel}")
        self._synced = time.monotonic()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        self.sync()
        if self._staging is not None:
            self._staging.cleanup()
            self._staging = None


def _wandb_run(workdir: str, project: str, mode: str, config: dict[str, Any]):
    """A W&B run for `workdir`: a new one, or the one WORKDIR/wandb_run_id names."""
    try:
        import wandb
    except ImportError as e:
        raise ImportError("train.wandb needs the wandb package: pip install 'tfjax[tracking]' "
                          "(or wandb), or leave train.wandb empty") from e
    id_file = os.path.join(workdir, "wandb_run_id")
    if os.path.exists(id_file):
        with open(id_file) as f:
            run_id = f.read().strip()
    else:
        run_id = uuid.uuid4().hex[:12]
        with open(id_file, "w") as f:
            f.write(run_id)
    return wandb.init(project=project, id=run_id, resume="allow", dir=workdir,
                      mode=mode or None, config=config,
                      name=os.path.basename(os.path.abspath(workdir)))


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
