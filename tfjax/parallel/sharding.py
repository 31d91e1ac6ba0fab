"""Activation sharding by logical axis names.

Models annotate activations with `shard(x, ("batch", "length", "embed"))`, a no-op
unless a mesh and a rules table are active (`use_rules(mesh, rules)`, which the trainer
enters); under them it becomes `jax.lax.with_sharding_constraint` with the mesh axes the
rules give. `use_rules` also targets the ops at the mesh (`tfjax.ops.target.targeting`):
its platform, and `tfjax.parallel.per_device.batch_sharded_attention` as the runner of
kernels XLA cannot partition. See docs/training.md and docs/long_context.md.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from typing import Callable, Iterator, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from tfjax.ops.target import device_platform, targeting
from tfjax.parallel.per_device import batch_sharded_attention

LogicalRules = Sequence[tuple[str, str | tuple[str, ...] | None]]


class _Active(threading.local):
    mesh: Mesh | None = None
    rules: dict[str, str | tuple[str, ...] | None] = {}


_ACTIVE = _Active()


@contextlib.contextmanager
def use_rules(mesh: Mesh, rules: LogicalRules) -> Iterator[None]:
    """Activate `mesh` and a logical -> mesh axis table for `shard` and `logical_to_spec`,
    and target the mesh's platform and devices (`tfjax.ops.target.targeting`)."""
    saved = (_ACTIVE.mesh, _ACTIVE.rules)
    _ACTIVE.mesh, _ACTIVE.rules = mesh, dict(rules)
    platform = device_platform(mesh.devices.flat[0]) if mesh is not None and mesh.devices.size \
        else None
    try:
        with targeting(platform, per_device=_per_device(mesh, _ACTIVE.rules)):
            yield
    finally:
        _ACTIVE.mesh, _ACTIVE.rules = saved


def _per_device(mesh: Mesh | None, rules) -> Callable | None:
    """The runner `dot_product_attention` hands unpartitionable implementations to:
    per device over the mesh axes the rules give "batch" and "heads"."""
    if mesh is None:
        return None
    axes = lambda name: logical_to_spec((name,), rules)[0]
    return functools.partial(batch_sharded_attention, mesh=mesh, batch_axes=axes("batch"),
                             head_axes=axes("heads"))


def active_mesh() -> Mesh | None:
    return _ACTIVE.mesh


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


def shard_count(name: str) -> int:
    """How many ways the active rules split logical axis `name` over the active mesh (1
    without a mesh): the product of the mesh axes it maps to."""
    mesh = _ACTIVE.mesh
    if mesh is None:
        return 1
    axes = logical_to_spec((name,))[0]
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    return math.prod(mesh.shape[a] for a in axes)


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
