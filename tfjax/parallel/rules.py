"""Logical axis names -> mesh axes, for whole trees of parameters and state.

Parameters declare logical names once (`nnx.with_partitioning(init, ("embed",
"mlp"))`, stored as the Variable's `out_sharding` metadata). The rules table of
`MeshConfig.rules` turns them into `NamedSharding`s. A name the table does not
list is an error (a typo must not silently replicate a 100 GB matrix); a dimension
that the mesh axes do not divide is replicated instead, and reported, so e.g. MQA's
single kv head still works with tensor=4.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from tfjax.parallel.sharding import LogicalRules, logical_to_spec

__all__ = ["logical_rules", "replicated", "spec_for", "tree_shardings", "variable_axes"]


def logical_rules(rules: Sequence[Sequence[str]]) -> LogicalRules:
    """`MeshConfig.rules` rows `(name, *mesh_axes)` -> `[(name, axes | None)]` for sharding.py."""
    return tuple((r[0], tuple(r[1:]) or None) for r in rules)


def variable_axes(v: Any) -> tuple[str | None, ...] | None:
    """The logical axis names a Variable was annotated with, or None."""
    if not isinstance(v, nnx.Variable):
        return None
    meta = v.get_metadata()
    for key in ("out_sharding", "sharding_names", "sharding"):
        names = meta.get(key)
        if names:
            return tuple(names)
    return None


def spec_for(path: str, names: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
             rules: LogicalRules, notes: list[str] | None = None) -> PartitionSpec:
    """PartitionSpec for one array with logical `names`; checks names and divisibility."""
    table = dict(rules)
    if len(names) != len(shape):
        raise ValueError(f"{path}: {len(names)} logical axes {tuple(names)} for shape {tuple(shape)}")
    for n in names:
        if n is not None and n not in table:
            raise ValueError(
                f"mesh.rules: {path} has logical axis {n!r} that no rule names; add "
                f"('{n}',) (replicated) or e.g. ('{n}', 'tensor') to mesh.rules "
                f"(known: {', '.join(sorted(table))})")
    spec = list(logical_to_spec(names, rules))
    spec += [None] * (len(shape) - len(spec))
    for d, axes in enumerate(spec):
        if axes is None:
            continue
        tup = (axes,) if isinstance(axes, str) else tuple(axes)
        size = math.prod(mesh.shape[a] for a in tup)
        if shape[d] % size:
            if notes is not None:
                notes.append(f"{path}: dim {d} ({names[d]}={shape[d]}) not divisible by "
                             f"{'x'.join(tup)}={size}; replicated")
            spec[d] = None
    return PartitionSpec(*spec)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def tree_shardings(tree: Any, mesh: Mesh, rules: LogicalRules,
                   notes: list[str] | None = None) -> Any:
    """A tree of NamedShardings matching `tree` (Variables keep their wrapper).

    Annotated Variables follow the rules; anything else (optimizer counters, RNG
    keys, unannotated arrays) is replicated; a Variable that holds no array (the
    `optax.MaskedNode` of a parameter another partition of the optimizer owns) stays.
    """

    def one(path, x):
        names = variable_axes(x)
        shape = getattr(x, "shape", None)
        if isinstance(x, nnx.Variable):
            if not jax.tree.leaves(x):  # holds no array (optax's MaskedNode in a state)
                return x
            shape = x.get_value().shape if hasattr(x.get_value(), "shape") else None
        if names is None or shape is None:
            s = replicated(mesh)
        else:
            s = NamedSharding(mesh, spec_for(jax.tree_util.keystr(path), names, shape, mesh,
                                             rules, notes))
        return x.replace(s) if isinstance(x, nnx.Variable) else s

    return jax.tree_util.tree_map_with_path(
        one, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))
