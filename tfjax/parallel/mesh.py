"""The device mesh: five named axes `data, fsdp, sequence, tensor, expert`.

`make_mesh` sizes them from `MeshConfig` (one axis may be -1: the devices left over),
within a slice; `mesh.dcn_data` / `mesh.dcn_fsdp` stretch the same named axes across
slices (TPU slices by `slice_index`; on CPU and GPU, one process per slice).
Every axis is always present (size 1 when unused) so the rules table can name any of
them; axes are `Auto` (GSPMD propagation from jit's shardings and `shard()`), not
`Explicit`. On a CPU host, `use_cpu_cores` gives JAX one XLA:CPU device per usable
core before its backends start: XLA:CPU runs a program on one thread, so a step uses a
second core only as a second device. See docs/training.md and docs/long_context.md.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh

from tfjax.config import DCN_AXES, MESH_AXES, MeshConfig

__all__ = ["MESH_AXES", "batch_axes_size", "cpu_device_count", "device_slices", "make_mesh",
           "mesh_shape", "usable_cores", "use_cpu_cores"]


def _product(sizes) -> str:
    return " x ".join(f"{a}={s}" for a, s in zip(MESH_AXES, sizes) if s != 1) or "all 1"


def mesh_shape(cfg: MeshConfig, num_devices: int, num_slices: int = 1) -> tuple[int, ...]:
    """The mesh's axis sizes over `num_devices` devices in `num_slices` equal slices:
    each within-slice size (-1 resolved against a slice's devices) times its `dcn_*`
    size. Raises, naming the field and the fix, where the sizes do not fit."""
    dcn = cfg.dcn_shape
    if math.prod(dcn) != num_slices:
        fix = (f"set the dcn_* sizes so their product is {num_slices} (e.g. "
               f"--config.mesh.dcn_data={num_slices})" if num_slices > 1 else
               "leave mesh.dcn_data and mesh.dcn_fsdp at 1, or run on several slices (on "
               "CPU: one process per slice)")
        sizes = " x ".join(f"dcn_{a}={getattr(cfg, f'dcn_{a}')}" for a in DCN_AXES)
        raise ValueError(f"mesh.dcn_data: {sizes} makes {math.prod(dcn)} slice(s) but the "
                         f"devices form {num_slices}; {fix}")
    if num_devices % num_slices:
        raise ValueError(f"mesh: {num_devices} devices do not split into {num_slices} equal "
                         f"slices; give every slice (process, on CPU) the same device count")
    per_slice = num_devices // num_slices
    where = f" per slice ({num_slices} slices)" if num_slices > 1 else ""
    sizes = list(cfg.shape)
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        i = sizes.index(-1)
        if per_slice % known:
            raise ValueError(
                f"mesh.{MESH_AXES[i]}: cannot fill the rest: the other axes multiply to {known}, "
                f"which does not divide the {per_slice} devices{where}; pick sizes whose "
                f"product divides {per_slice}")
        sizes[i] = per_slice // known
    if math.prod(sizes) != per_slice:
        raise ValueError(
            f"mesh: {_product(sizes)} makes {math.prod(sizes)} devices but there are "
            f"{per_slice}{where}; set the sizes so their product is {per_slice}, or set one "
            f"axis to -1 (e.g. --config.mesh.data=-1)")
    return tuple(s * d for s, d in zip(sizes, dcn))


def device_slices(devices: Sequence[jax.Device], cfg: MeshConfig) -> list[list[jax.Device]]:
    """`devices` grouped by slice, in slice order: by `slice_index` on TPU; elsewhere
    (CPU, GPU: their `slice_index`, where present, is 0 in every process of a gloo run)
    each process stands for a slice when the mesh names DCN axes, and all devices are
    one slice when it does not."""
    if _tpu(devices):
        key = lambda d: d.slice_index  # noqa: E731
    elif math.prod(cfg.dcn_shape) > 1:
        key = lambda d: d.process_index  # noqa: E731
    else:
        return [list(devices)]
    groups: dict[int, list[jax.Device]] = {}
    for d in devices:
        groups.setdefault(key(d), []).append(d)
    return [groups[k] for k in sorted(groups)]


def _tpu(devices: Sequence[jax.Device]) -> bool:
    return devices[0].platform == "tpu" and hasattr(devices[0], "slice_index")


def make_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A `Mesh` over `devices` (default: all devices of all processes). Within one slice,
    jax's topology-aware layout; across slices (`mesh.dcn_*`), jax's hybrid layout: the
    DCN part of each axis outermost, so the devices of a slice are contiguous blocks."""
    devices = list(devices) if devices is not None else jax.devices()
    slices = device_slices(devices, cfg)
    shape = mesh_shape(cfg, len(devices), len(slices))
    axis_types = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    if len(slices) == 1:
        try:
            return jax.make_mesh(shape, MESH_AXES, axis_types=axis_types, devices=devices)
        except Exception:  # noqa: BLE001 - odd device sets (a subset in tests): plain reshape
            return Mesh(np.asarray(devices).reshape(shape), MESH_AXES, axis_types=axis_types)
    if len({len(s) for s in slices}) > 1:
        raise ValueError(f"mesh: the slices hold different device counts "
                         f"({[len(s) for s in slices]}); give every slice (process, on CPU) "
                         f"the same count")
    dcn = cfg.dcn_shape
    ici = tuple(s // d for s, d in zip(shape, dcn))
    try:
        grid = mesh_utils.create_hybrid_device_mesh(
            ici, dcn, devices, process_is_granule=not _tpu(devices),
            allow_split_physical_axes=True)
    except Exception:  # noqa: BLE001 - a subset of a slice: each slice in device order
        blocks = np.empty(dcn, dtype=object)
        for i, s in enumerate(slices):
            blocks.flat[i] = np.asarray(s).reshape(ici)
        grid = np.block(blocks.tolist())
    return Mesh(grid, MESH_AXES, axis_types=axis_types)


def batch_axes_size(mesh: Mesh, rules) -> int:
    """How many ways the "batch" logical axis is split on `mesh`."""
    axes = dict((r[0], r[1:]) for r in rules).get("batch", ())
    return math.prod(mesh.shape[a] for a in axes)


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, e.g. under `taskset`)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cpu_device_count(cfg: MeshConfig, rows: int, cores: int) -> int:
    """How many CPU devices a run with this mesh and `rows` per (micro)batch uses on
    `cores` cores: the largest count <= cores that divides `rows`, for a data-parallel
    mesh (`data=-1`, every other axis 1); otherwise 1 (a mesh that names its sizes
    sets the count itself: `--cpu_devices`)."""
    if cfg.shape != tuple(-1 if a == "data" else 1 for a in MESH_AXES):
        return 1
    return max(n for n in range(1, max(1, min(cores, rows)) + 1) if rows % n == 0)


def use_cpu_cores(cfg: MeshConfig, rows: int) -> int | None:
    """Before JAX starts its backends: give the CPU platform `cpu_device_count`
    devices (a no-op where that is 1). Returns the count set, or None when the
    count was already chosen (XLA_FLAGS' `--xla_force_host_platform_device_count`,
    `jax_num_cpu_devices`) or the backends are running (then it changes nothing)."""
    chosen = "--xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", "")
    if chosen or jax.config.jax_num_cpu_devices != -1:
        return None
    n = cpu_device_count(cfg, rows, usable_cores())
    if n == 1:
        return None
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:  # backends already initialised: keep what they have
        return None
    return n
