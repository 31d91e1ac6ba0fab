"""The device mesh: five named axes `data, fsdp, sequence, tensor, expert`.

`make_mesh` sizes them from `MeshConfig` (one axis may be -1: the devices left over).
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
from jax.sharding import Mesh

from tfjax.config import MESH_AXES, MeshConfig

__all__ = ["MESH_AXES", "batch_axes_size", "cpu_device_count", "make_mesh", "mesh_shape",
           "usable_cores", "use_cpu_cores"]


def mesh_shape(cfg: MeshConfig, num_devices: int) -> tuple[int, ...]:
    """Resolve -1 and check that the axis sizes multiply to `num_devices`."""
    sizes = list(cfg.shape)
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        i = sizes.index(-1)
        if num_devices % known:
            raise ValueError(
                f"mesh.{MESH_AXES[i]}: cannot fill the rest: the other axes multiply to {known}, "
                f"which does not divide the {num_devices} devices; pick sizes whose product "
                f"divides {num_devices}")
        sizes[i] = num_devices // known
    if math.prod(sizes) != num_devices:
        desc = " x ".join(f"{a}={s}" for a, s in zip(MESH_AXES, sizes) if s != 1) or "all 1"
        raise ValueError(
            f"mesh: {desc} makes {math.prod(sizes)} devices but there are {num_devices}; set the "
            f"sizes so their product is {num_devices}, or set one axis to -1 "
            f"(e.g. --config.mesh.data=-1)")
    return tuple(sizes)


def make_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A `Mesh` over `devices` (default: all devices of all processes)."""
    devices = list(devices) if devices is not None else jax.devices()
    shape = mesh_shape(cfg, len(devices))
    axis_types = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    try:
        return jax.make_mesh(shape, MESH_AXES, axis_types=axis_types, devices=devices)
    except Exception:  # noqa: BLE001 - odd device sets (a subset in tests): plain reshape
        return Mesh(np.asarray(devices).reshape(shape), MESH_AXES, axis_types=axis_types)


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
