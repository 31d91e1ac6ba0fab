"""`--compile_only --topology v5p:4x4x4`: AOT-compile the real sharded train step for a
TPU slice on a CPU-only machine (libtpu's topology descriptions, the `tpu` extra) and
print per-device memory: parameters, optimizer state, temporaries, and whether it
fits the chip's HBM. `--topology h200:8` does the same for one host of NVIDIA GPUs
(XLA:GPU compiling for a deviceless topology from an XLA target config; needs jax's
CUDA plugin, `pip install "jax[cuda13]"`, not a GPU). Without --topology it compiles
for the local devices. The step is traced under the topology's mesh, so attention
dispatch and the Pallas kernels build what that platform runs (the Mosaic TPU
kernels; on Hopper the Mosaic GPU ones), not the CPU's choices. `--num_slices N`
compiles for N TPU slices (`mesh.dcn_*` spans them) and prints the collectives that
cross the data-center network (docs/training.md, "Multi-slice").
"""

from __future__ import annotations

import contextlib
import math
import os
import sys

import jax
import jax.numpy as jnp

from tfjax.config import DCN_AXES, RunConfig
from tfjax.data.tokenizer import load_tokenizer
from tfjax.models import build, check_names
from tfjax.ops.target import gpu_lowering_target
from tfjax.parallel.collectives import collectives, dcn_totals
from tfjax.parallel.mesh import device_slices, make_mesh
from tfjax.train.objectives import batch_dtype
from tfjax.train.trainer import build_program, check_run

__all__ = ["GPU_TARGET_CONFIGS", "HBM_BYTES", "compile_only", "compile_step", "dcn_collectives",
           "estimated_seconds", "gpu_devices", "step_figures", "tpu_devices", "xla_cost"]

GiB = 1024 ** 3
# HBM per chip.
HBM_BYTES = {"v4": 32 * GiB, "v5e": 16 * GiB, "v5litepod": 16 * GiB, "v5p": 95 * GiB,
             "v6e": 32 * GiB}

_HOPPER_INFO = """
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132
  fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 } registers_per_core_limit: 65536
  registers_per_block_limit: 65536 clock_rate_ghz: 1.98"""
# XLA's description of a GPU (GpuTargetConfigProto text, the fields of XLA's
# gpu_specs) for compiling without one: SXM H100 (80 GB) and H200 (141 GB).
GPU_TARGET_CONFIGS = {
    name: f"""gpu_device_info {{{_HOPPER_INFO}
  memory_bandwidth: {bw} l2_cache_size: 52428800 device_memory_size: {mem}
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 }}
runtime_version {{ major: 12 minor: 8 }}
device_description_str: "NVIDIA {name.upper()}"
"""
    for name, bw, mem in (("h100", 3352320000000, 85520809984),
                          ("h200", 4800000000000, 150754820096))}
GPU_HBM_BYTES = {"h100": 85520809984, "h200": 150754820096}


def tpu_devices(topology: str, num_slices: int = 1):
    """Compile-only devices of `num_slices` TPU slices, each e.g. "v5e:2x2" or
    "v5p:4x4x4" (several slices: devices carry their `slice_index`)."""
    from jax.experimental import topologies

    # libtpu guards a real TPU with a lockfile; a compile-only topology needs no chip.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    if ":" not in topology:
        raise ValueError(f"--topology: expected <chip>:<shape> such as v5e:2x2 or v5p:4x4x4, "
                         f"got {topology!r}")
    chip, shape = topology.split(":", 1)
    if chip not in HBM_BYTES:
        raise ValueError(f"--topology: unknown chip {chip!r}; known: {', '.join(HBM_BYTES)}")
    dims = [int(d) for d in shape.split("x")]
    dims += [1] * (3 - len(dims))
    host = [min(d, 2) for d in dims[:2]] + [1]
    try:
        topo = topologies.get_topology_desc(
            topology_name=f"{chip}:{shape}", platform="tpu", chip_config_name="default",
            chips_per_host_bounds=tuple(host), num_slices=num_slices,
            wrap=tuple(d >= 4 for d in dims))
    except Exception as e:
        raise ValueError(f"--topology {topology}: libtpu could not describe this slice ({e}); "
                         "install libtpu: in the clone, .venv/bin/python -m pip install -e "
                         "'.[tpu]'") from e
    return list(topo.devices), HBM_BYTES[chip]


def gpu_devices(topology: str):
    """Compile-only devices of one host of NVIDIA GPUs, e.g. "h200:8": XLA:GPU compiles
    for them from `GPU_TARGET_CONFIGS` with no GPU present (jax's CUDA plugin needed)."""
    from jax.experimental import topologies

    chip, _, count = topology.partition(":")
    if chip not in GPU_TARGET_CONFIGS or not count.isdigit() or int(count) < 1:
        raise ValueError(f"--topology: expected <gpu>:<count> with gpu one of "
                         f"{', '.join(GPU_TARGET_CONFIGS)}, such as h200:8; got {topology!r}")
    try:
        topo = topologies.get_topology_desc(platform="cuda", topology=f"1x1x{count}",
                                            target_config=GPU_TARGET_CONFIGS[chip])
    except Exception as e:
        raise ValueError(f"--topology {topology}: jax could not describe these GPUs ({e}); "
                         "install jax's CUDA plugin (no GPU needed): pip install "
                         "'jax[cuda13]'") from e
    return list(topo.devices), GPU_HBM_BYTES[chip]


def topology_devices(topology: str, num_slices: int = 1):
    """(devices, HBM bytes per device) of `num_slices` TPU slices ("v5p:2x2x1") or a
    host of GPUs ("h200:8")."""
    if num_slices < 1:
        raise ValueError(f"--num_slices: must be >= 1, got {num_slices}")
    if topology.split(":", 1)[0] in GPU_TARGET_CONFIGS:
        if num_slices > 1:
            raise ValueError(f"--num_slices {num_slices}: several slices are TPU slices; "
                             f"--topology {topology} is one host of GPUs, drop --num_slices")
        return gpu_devices(topology)
    return tpu_devices(topology, num_slices)


def _fmt(n: float) -> str:
    if n >= GiB:
        return f"{n / GiB:.2f} GiB"
    return f"{n / 1024 ** 2:.1f} MiB" if n >= 1024 ** 2 else f"{n / 1024:.1f} KiB"


def _per_device_bytes(abstract, shardings) -> int:
    total = 0
    for x, s in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings)):
        total += math.prod(s.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize
    return total


def compile_step(cfg: RunConfig, topology: str | None, build_model=None, num_slices: int = 1):
    """AOT-compile the run's sharded train step for `num_slices` slices of `topology`
    (None: the local devices): (the compiled step, its `Program`, the mesh, HBM bytes
    per device or None)."""
    check_names(cfg.validate().model)
    if topology:
        devices, hbm = topology_devices(topology, num_slices)
    elif num_slices != 1:
        raise ValueError("--num_slices: needs --topology (the slices to compile for)")
    else:
        devices, hbm = jax.devices(), None
    mesh = make_mesh(cfg.mesh, devices)
    check_run(cfg, mesh, load_tokenizer(cfg.data.tokenizer))
    p = build_program(cfg, mesh, build_model or build)
    abstract_state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                  p.abstract_state, p.state_shardings)
    batch = {k: jax.ShapeDtypeStruct(shape, batch_dtype(k), sharding=p.batch_shardings[k])
             for k, shape in p.batch_shapes.items()}  # the objective's batch
    with _lowering_for(devices[0]):
        compiled = p.step.lower(abstract_state, batch).compile()
    return compiled, p, mesh, hbm


def step_figures(compiled, p) -> dict[str, float]:
    """Per-device bytes of a compiled step of `Program` p: params (with LoRA's frozen
    base), opt, temp (XLA's temporaries), code, total, and arguments (XLA's count of
    the step's inputs: the state and the batch); and XLA's own step-time estimate,
    `optimal_seconds` (`estimated_seconds`)."""
    mem = compiled.memory_analysis()
    params = sum(_per_device_bytes(p.abstract_state[k], p.state_shardings[k])
                 for k in ("params", "frozen") if k in p.abstract_state)
    opt = _per_device_bytes(p.abstract_state["opt"], p.state_shardings["opt"])
    temp = int(getattr(mem, "temp_size_in_bytes", 0) or 0) if mem is not None else 0
    code = int(getattr(mem, "generated_code_size_in_bytes", 0) or 0) if mem is not None else 0
    arguments = int(getattr(mem, "argument_size_in_bytes", 0) or 0) if mem is not None else 0
    return dict(params=params, opt=opt, temp=temp, code=code, total=params + opt + temp + code,
                arguments=arguments, optimal_seconds=estimated_seconds(compiled))


def estimated_seconds(compiled) -> float:
    """XLA's own time estimate of a compiled program (`cost_analysis()`'s
    `optimal_seconds`; 0 where the backend has none), with XLA:TPU's unpriced
    `ConcatBitcast` custom calls taken out: each counts -1 s in it (checked in
    experiments/results/quant.md). Cross-slice transfers count negative too, not as
    exactly: a program of several slices keeps a negative estimate (none). Like every
    figure of the cost analysis it counts a `while` body once (a scanned stack's
    layers, the chunked loss's chunks), and a Mosaic kernel at about nothing."""
    seconds = float(xla_cost(compiled).get("optimal_seconds", 0.0) or 0.0)
    return seconds + compiled.as_text().count('custom_call_target="ConcatBitcast"')


def xla_cost(compiled) -> dict:
    """A compiled program's `cost_analysis()` as one dict (flops, bytes accessed,
    optimal_seconds, ...; empty where the backend has none)."""
    cost = compiled.cost_analysis()
    return (cost[0] if isinstance(cost, (list, tuple)) and cost else cost) or {}


def dcn_collectives(compiled, mesh, cfg: RunConfig) -> dict[str, tuple[int, int]]:
    """{kind: (executions, bytes per device)} per step of the compiled step's
    collectives that cross slices (`tfjax.parallel.collectives`)."""
    devices = list(mesh.devices.flat)
    slice_number = {d: i for i, group in enumerate(device_slices(devices, cfg.mesh))
                    for d in group}
    return dcn_totals(collectives(compiled.as_text(), [slice_number[d] for d in devices]))


def compile_only(cfg: RunConfig, topology: str | None, build_model=None, out=sys.stdout,
                 num_slices: int = 1) -> int:
    compiled, p, mesh, hbm = compile_step(cfg, topology, build_model, num_slices)
    devices, t = list(mesh.devices.flat), cfg.train
    f = step_figures(compiled, p)
    total = f["total"]
    where = topology or f"{len(devices)} local {devices[0].platform} device(s)"
    if num_slices > 1:
        where = f"{num_slices} slices of {where}"
    lines = [
        f"compiled train step for {where}, mesh {dict(mesh.shape)}",
        f"  model: {p.num_params / 1e6:,.1f}M parameters ({cfg.model.param_dtype}), "
        f"global batch {t.batch_size} x {t.seq_len}",
        f"  per device: parameters {_fmt(f['params'])}, optimizer {_fmt(f['opt'])}, "
        f"temporaries {_fmt(f['temp'])}, code {_fmt(f['code'])} -> {_fmt(total)}",
    ]
    if f["optimal_seconds"] > 0:  # none for several slices (see estimated_seconds)
        lines.append(f"  XLA's step-time estimate (optimal_seconds): "
                     f"{f['optimal_seconds'] * 1e3:,.1f} ms")
    if num_slices > 1:
        dcn = dcn_collectives(compiled, mesh, cfg)
        spans = " x ".join(f"dcn_{a}={getattr(cfg.mesh, f'dcn_{a}')}" for a in DCN_AXES)
        lines.append(f"  {num_slices} slices of {len(devices) // num_slices} chips, {spans}")
        lines.append("  across slices (DCN), per device per step: " + (", ".join(
            f"{kind} {n}x {_fmt(b)}" for kind, (n, b) in dcn.items()) or "no collectives"))
    if hbm:
        lines.append(f"  HBM per chip {hbm / GiB:.0f} GiB: "
                     f"{'FITS' if total <= hbm else 'DOES NOT FIT'} ({100 * total / hbm:.0f}%)")
    print("\n".join(lines), file=out)
    return 0 if (hbm is None or total <= hbm) else 1


def _lowering_for(device):
    """Lowering for a compile-only GPU: the Pallas GPU kernels are told which GPU
    (`gpu_lowering_target`; jax's Triton lowering would ask the local device)."""
    kind = getattr(device, "device_kind", "")
    if device.platform not in ("gpu", "cuda") or jax.default_backend() == "gpu":
        return contextlib.nullcontext()
    name = next((n for n in ("GH200", "H200", "H100") if n in kind), None)
    if name is None:
        raise ValueError(f"compile_only: no GPU lowering target for device kind {kind!r}")
    return gpu_lowering_target(name)
