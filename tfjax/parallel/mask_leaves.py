"""An attention call's extras as `shard_map` arguments, for the modules that run
attention under `shard_map` (`ring_attention`, `per_device`).

`split_mask` flattens the pytree `(mask, alibi, relative_bias)` into array leaves of one
kind each: "q" / "kv" (per token, split like the tokens), "table" (T5's table, one copy
per device: `copy_tables`, `local_leaves`, so its gradient sums over the devices) and
"other" (per example, split over the batch axes); `unflatten` rebuilds the three.
`device_copies` is the per-device-copy transport alone (learned sinks); `shard_map` is
`jax.shard_map` without replication checks. See docs/long_context.md.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from tfjax.config import DEFAULT_RULES

from tfjax.ops.reference import Alibi

__all__ = ["KV_LEAVES", "Q_LEAVES", "TABLE_LEAVES", "bias_kwargs", "copy_tables", "device_axes",
           "device_copies", "leaf_kind", "local_leaves", "resolve_batch_axes", "shard_map",
           "split_kv_heads", "split_mask", "token_specs", "unflatten"]

# Leaf names by kind (the fields of masks, Alibi and RelativeBias that hold them).
Q_LEAVES, KV_LEAVES = ("q_segment_ids", "q_positions"), ("kv_segment_ids", "kv_positions")
TABLE_LEAVES = ("table",)


def shard_map(f, *, mesh, in_specs, out_specs):
    """`jax.shard_map(f, ...)` without replication checks."""
    if hasattr(jax, "shard_map"):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                             check_vma=False)
    from jax.experimental.shard_map import shard_map as legacy  # older jax

    return legacy(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


def leaf_kind(path) -> str:
    """"q", "kv", "table" or "other" for the leaf at `path` (a pytree key path)."""
    name = getattr(path[-1], "name", None) if path else None
    if name in Q_LEAVES:
        return "q"
    if name in KV_LEAVES:
        return "kv"
    if name in TABLE_LEAVES:
        return "table"
    return "other"


def split_mask(mask, alibi=None, rel=None):
    """Leaves, treedef and leaf kinds of the pytree `(mask, alibi, rel)` (a treedef of
    None when all are None)."""
    if mask is None and alibi is None and rel is None:
        return [], None, []
    leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path((mask, alibi, rel))
    kinds = [leaf_kind(p) for p, _ in leaves_with_path]
    return [leaf for _, leaf in leaves_with_path], treedef, kinds


def unflatten(treedef, leaves) -> tuple:
    """`(mask, alibi, rel)` from `split_mask`'s treedef and (local) leaves."""
    if treedef is None:
        return None, None, None
    return jax.tree_util.tree_unflatten(treedef, list(leaves))


def bias_kwargs(alibi, rel) -> dict:
    """The ALiBi / T5-bias keyword arguments of an attention call."""
    return {**Alibi.kwargs(alibi), **({} if rel is None else dict(relative_bias=rel))}


def infer_batch_axes(x, mesh, seq_axis):
    """The mesh axes a sequence-parallel call splits the batch over, when its caller
    named none (`batch_axes=None`): those `x`'s sharding splits its batch dim over
    (a committed array on a mesh with these axis names); else, traced, the mesh
    axes of tfjax's "batch" rule (`tfjax.config.DEFAULT_RULES`) present in `mesh`,
    or, on a mesh without them, every axis but `seq_axis`. Axes of size 1 are
    dropped and the rest kept, in order, while their product divides the batch; ()
    when none do (the batch is replicated)."""
    B = x.shape[0]
    sharding = None if isinstance(x, jax.core.Tracer) else getattr(x, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding) and \
            tuple(sharding.mesh.axis_names) == tuple(mesh.axis_names):
        first = sharding.spec[0] if len(sharding.spec) else None
        candidates = () if first is None else (first,) if isinstance(first, str) else first
    else:
        rule = dict((r[0], r[1:]) for r in DEFAULT_RULES)["batch"]
        candidates = tuple(a for a in rule if a in mesh.shape) or tuple(mesh.axis_names)
    axes, n = [], 1
    for a in candidates:
        size = mesh.shape[a]
        if a != seq_axis and size > 1 and B % (n * size) == 0:
            axes.append(a)
            n *= size
    return tuple(axes)


def resolve_batch_axes(batch_axes, x, mesh, seq_axis, where: str):
    """The caller's batch axes (a name or tuple; () = the batch replicated), or, for
    None, those `infer_batch_axes` finds; None when there are none. The sequence axis
    among them is a ValueError starting with `where` (the calling function)."""
    if batch_axes is None:
        batch_axes = infer_batch_axes(x, mesh, seq_axis)
    if isinstance(batch_axes, str):
        batch_axes = (batch_axes,)
    if seq_axis in batch_axes:
        raise ValueError(f"{where}: batch_axes {batch_axes} include the sequence axis "
                         f"{seq_axis!r}; name the mesh axes the batch is split over")
    return tuple(batch_axes) or None


def split_kv_heads(k, v, n: int):
    """k, v `[B,S,K,.]` with each kv head repeated the fewest times r that make the kv
    heads divide over `n` devices (K*r = lcm(K, n); r = 1: as they are). With the query
    heads split over the same n devices in order, query head h still reads a copy of
    its own kv head (K*r divides N when K and n do); the repeat's transpose sums the
    copies' gradients."""
    r = n // math.gcd(k.shape[2], n)
    if r == 1:
        return k, v
    return jnp.repeat(k, r, axis=2), jnp.repeat(v, r, axis=2)


def device_axes(batch_axes, seq_axis=None) -> tuple:
    """The mesh axes the tokens are split over: the batch axes, then the sequence
    axes `seq_axis` if given (each a name, a tuple of names or None)."""
    names = lambda a: () if a is None else (a,) if isinstance(a, str) else tuple(a)
    return (*names(batch_axes), *names(seq_axis))


def device_copies(x, mesh, axes):
    """`x` as one copy per device of `axes` (`[D, *x.shape]`, to be split over them
    with `P(axes)`): each device's copy receives that device's partial gradient,
    and the broadcast's transpose sums them outside `shard_map`. None stays None."""
    if x is None:
        return None
    D = int(np.prod([mesh.shape[a] for a in axes]))
    return jnp.broadcast_to(x[None], (D, *x.shape))


def copy_tables(leaves, kinds, mesh, axes):
    """T5's table as `device_copies` (`[D, nb, N]`); the other leaves as they are."""
    return [device_copies(x, mesh, axes) if kd == "table" else x for x, kd in zip(leaves, kinds)]


def local_leaves(leaves, kinds):
    """Inside `shard_map`: the device's own table copy in place of its `[1, nb, N]`
    block; the other leaves as they are."""
    return [x[0] if kd == "table" else x for x, kd in zip(leaves, kinds)]


def token_specs(leaves, kinds, batch_axes, seq_axis):
    """`shard_map` specs of a sequence-parallel call: q/k/v `[B,T,.,.]` split over
    the batch axes and `seq_axis` (a name, or a tuple of names splitting the sequence
    in order), and the leaves (per-token ones like the tokens, per-example ones over
    the batch axes only, T5's per-device table copies `[D, nb, N]` over the batch axes
    and `seq_axis`). A leaf with a batch dim of 1 is replicated over the batch axes."""
    def leaf_spec(x, kind):
        if kind == "table":
            return P(device_axes(batch_axes, seq_axis), None, None)
        b = batch_axes if x.shape[0] != 1 else None
        return P(b, seq_axis) if kind != "other" else P(*([b] + [None] * (x.ndim - 1)))

    return (P(batch_axes, seq_axis, None, None),
            [leaf_spec(x, kd) for x, kd in zip(leaves, kinds)])
