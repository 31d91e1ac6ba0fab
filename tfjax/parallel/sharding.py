"""Activation sharding by logical axis names.

Models annotate activations with `shard(x, ("batch", "length", "embed"))`. The
annotation is a no-op unless a mesh and a rules table are active (the trainer
activates them with `use_rules(mesh, rules)`); under them it becomes
`jax.lax.with_sharding_constraint` with the mesh axes the rules give. One rules
table maps every logical name to mesh axes, so parallelism is a config change.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

LogicalRules = Sequence[tuple[str, str | tuple[str, ...] | None]]


class _Active(threading.local):
    mesh: Mesh | None = None
    rules: dict[str, str | tuple[str, ...] | None] = {}


_ACTIVE = _Active()


@contextlib.contextmanager
def use_rules(mesh: Mesh, rules: LogicalRules) -> Iterator[None]:
    """Activate `mesh` and a logical -> mesh axis table for `shard` and `logical_to_spec`."""
    saved = (_ACTIVE.mesh, _ACTIVE.rules)
    _ACTIVE.mesh, _ACTIVE.rules = mesh, dict(rules)
    try:
        yield
    finally:
        _ACTIVE.mesh, _ACTIVE.rules = saved


def active_mesh() -> Mesh | None:
    return _ACTIVE.mesh


def target_platform() -> str:
    """The platform what is being traced will run on: that of the active mesh's
    devices (`use_rules`, as the trainer and its AOT compiles set it; a TPU or GPU
    topology compiled on a CPU machine is "tpu" / "gpu"), else jax's default
    backend. Attention dispatch (`implementation="auto"`) and the Pallas kernels'
    interpret default follow it, so an AOT compile builds what the target runs."""
    mesh = _ACTIVE.mesh
    if mesh is not None and mesh.devices.size:
        platform = mesh.devices.flat[0].platform
        return "gpu" if platform in ("cuda", "rocm") else platform
    return jax.default_backend()


def logical_to_spec(names: Sequence[str | None], rules: LogicalRules | None = None) -> PartitionSpec:
    """Logical names -> PartitionSpec; a name absent from the rules is replicated,
    and a mesh axis already used by an earlier dimension is not reused."""
    table = dict(rules) if rules is not None else _ACTIVE.rules
    used: set[str] = set()
    out = []
    for name in names:
        axes = table.get(name) if name is not None else None
        if axes is None:
            out.append(None)
            continue
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        axes = tuple(a for a in axes if a not in used)
        used.update(axes)
        out.append(axes[0] if len(axes) == 1 else (axes or None))
    return PartitionSpec(*out)


def shard(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Constrain activation `x` to the sharding its logical axis `names` map to."""
    mesh = _ACTIVE.mesh
    if mesh is None:
        return x
    if len(names) != x.ndim:
        raise ValueError(f"shard: {len(names)} logical names {tuple(names)} for an array of "
                         f"rank {x.ndim} (shape {x.shape})")
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, logical_to_spec(names)))


def with_logical_axes(init, names: Sequence[str | None]):
    """Initializer `init` annotated with logical axis `names` (one per dimension).

    The names are annotations only (`eager_sharding=False`): a layer built with no
    mesh (tests, a laptop) must not look for mesh axes called "embed"; the trainer
    maps names to mesh axes through its rules table when it shards the state.
    """
    from flax import nnx

    return nnx.with_partitioning(init, tuple(names), eager_sharding=False)
