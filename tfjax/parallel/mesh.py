"""The device mesh: five named axes `data, fsdp, sequence, tensor, expert`.

Sizes come from `MeshConfig`; one axis may be -1 and takes the devices left over.
Every axis is always present (size 1 when unused) so the rules table can name any
of them whatever the run's parallelism. Axes are `Auto` (GSPMD propagation from
the shardings we give jit and from `shard()` constraints), not `Explicit`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from tfjax.config import MESH_AXES, MeshConfig

__all__ = ["MESH_AXES", "batch_axes_size", "make_mesh", "mesh_shape"]


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
