"""Ulysses context parallelism (DeepSpeed-Ulysses, Jacobs et al. 2023) and USP (Fang &
Zhao 2024) over a mesh's sequence axis.

`ulysses_attention(q, k, v, mask, *, mesh, seq_axis, implementation, ...)`: q, k, v split
over `seq_axis` -> `attention_reference`'s result. Under `jax.shard_map` an all-to-all
per tensor trades the sequence shard for a head shard (the whole sequence, N/n heads a
device), the layer's implementation attends with every mask at natural positions, and
an all-to-all brings the output back; kv heads are repeated as needed, never gathered.
`usp_attention(..., ulysses_size=u)`: Ulysses inside groups of u consecutive devices,
`ring_attention` across the groups. See docs/long_context.md.
"""

from __future__ import annotations

import dataclasses

from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from tfjax.ops import masks as masks_lib
from tfjax.ops.attention import dot_product_attention
from tfjax.ops.reference import RelativeBias, check_relative_bias, make_alibi
from tfjax.ops.sinks import check_sinks
from tfjax.ops.target import device_platform, targeting
from tfjax.parallel import mask_leaves
from tfjax.parallel.ring_attention import ring_attention

__all__ = ["check_heads", "ulysses_attention", "usp_attention", "usp_mesh"]


def check_heads(num_heads: int, n: int, where: str, fix: str = "") -> None:
    """Query heads that do not divide over Ulysses' n devices: a one-line ValueError
    naming the fix (default: for Ulysses over the whole sequence axis)."""
    if num_heads % n:
        fix = fix or (f"set mesh.sequence to a divisor of {num_heads}, or use "
                      f"model.attention.context_parallel='ring' or 'usp'")
        raise ValueError(f"{where}: the {num_heads} query heads do not divide over the {n} "
                         f"Ulysses devices (each gets N/{n} heads); {fix}")


def ulysses_attention(q, k, v, mask: masks_lib.Mask | None = None, *, mesh,
                      seq_axis: str = "sequence", batch_axes=None, scale=None, softcap=None,
                      implementation: str = "auto", alibi_slopes=None, alibi_positions=None,
                      relative_bias: RelativeBias | None = None, sinks=None):
    """Attention of q, k, v sharded over `seq_axis` by Ulysses' all-to-alls (the module
    docstring). `implementation`: any entry of `tfjax.ops.attention.IMPLEMENTATIONS`,
    run by `dot_product_attention` on each device's heads over the whole sequence,
    targeting the mesh's platform. Masks, ALiBi / T5 positions and segment ids are
    per-token arrays split like the tokens: gathered whole on every device (int32
    `[b, T]`, small beside K/V). `sinks` `[N]`, ALiBi's slopes and T5's table are per
    head: each device takes its heads' part."""
    n = mesh.shape[seq_axis]
    B, T, N, _ = q.shape
    S, K = k.shape[1], k.shape[2]
    masks_lib.check_lengths(mask, T, S, "ulysses_attention")
    if T % n or S % n:
        raise ValueError(f"ulysses_attention: T={T} and S={S} must be divisible by the {n} "
                         f"devices on {seq_axis!r}")
    check_heads(N, n, "ulysses_attention")
    k, v = mask_leaves.split_kv_heads(k, v, n)  # whole kv heads for each device's heads
    alibi = make_alibi(alibi_slopes, alibi_positions, B, N, T, S)
    rel = check_relative_bias(relative_bias, B, N, T, S)
    sinks = check_sinks(sinks, N, "ulysses_attention")
    batch_axes = mask_leaves.resolve_batch_axes(batch_axes, q, mesh, seq_axis,
                                                "ulysses_attention")
    dev = mask_leaves.device_axes(batch_axes, seq_axis)
    leaves, treedef, kinds = mask_leaves.split_mask(mask, alibi, rel)
    leaves = mask_leaves.copy_tables(leaves, kinds, mesh, dev)
    tok, leaf_specs = mask_leaves.token_specs(leaves, kinds, batch_axes, seq_axis)
    platform = device_platform(mesh.devices.flat[0])
    heads = N // n

    def own_heads(x, axis=-1):
        """This device's `heads` of a per-head array (its index on `seq_axis`)."""
        return lax.dynamic_slice_in_dim(x, lax.axis_index(seq_axis) * heads, heads, axis)

    def local(q, k, v, sink_copy, *mleaves):
        # [b, T/n, heads of all, .] -> [b, T, own heads, .] and back
        to_heads = lambda x: lax.all_to_all(x, seq_axis, 2, 1, tiled=True)
        gather = lambda x: lax.all_gather(x, seq_axis, axis=1, tiled=True)
        q, k, v = to_heads(q), to_heads(k), to_heads(v)
        mleaves = [gather(x) if kd in ("q", "kv") else x for x, kd in zip(mleaves, kinds)]
        m, a, rl = mask_leaves.unflatten(treedef, mask_leaves.local_leaves(mleaves, kinds))
        if a is not None:
            a = dataclasses.replace(a, slopes=own_heads(a.slopes))
        if rl is not None:
            rl = dataclasses.replace(rl, table=own_heads(rl.table))
        s = None if sink_copy is None else own_heads(sink_copy[0])
        try:
            with targeting(platform):  # inside shard_map: no per-device runner
                out = dot_product_attention(q, k, v, m, scale=scale, softcap=softcap,
                                            implementation=implementation, sinks=s,
                                            **mask_leaves.bias_kwargs(a, rl))
        except ValueError as e:
            raise ValueError(f"ulysses_attention (per device, the whole sequence for "
                             f"{heads} heads): {e}") from None
        return lax.all_to_all(out, seq_axis, 1, 2, tiled=True)

    sink_spec = None if sinks is None else P(dev)
    fn = mask_leaves.shard_map(local, mesh=mesh, in_specs=(tok, tok, tok, sink_spec, *leaf_specs),
                               out_specs=tok)
    return fn(q, k, v, mask_leaves.device_copies(sinks, mesh, dev), *leaves)



def usp_mesh(mesh, seq_axis: str, ulysses_size: int) -> tuple[Mesh, str, str]:
    """(mesh', ring axis, Ulysses axis): `mesh` with `seq_axis` (n devices) split into
    "<seq_axis>_ring" (n / u groups) and "<seq_axis>_ulysses" (u consecutive devices),
    the same devices in the same order: a sequence split over `seq_axis` is the same
    split over (ring, Ulysses)."""
    names, shape = list(mesh.axis_names), list(mesh.devices.shape)
    i, u = names.index(seq_axis), ulysses_size
    ring, heads = f"{seq_axis}_ring", f"{seq_axis}_ulysses"
    devices = mesh.devices.reshape(shape[:i] + [shape[i] // u, u] + shape[i + 1:])
    kinds = getattr(mesh, "axis_types", None)
    extra = {} if kinds is None else dict(
        axis_types=(*kinds[:i], kinds[i], kinds[i], *kinds[i + 1:]))
    return Mesh(devices, (*names[:i], ring, heads, *names[i + 1:]), **extra), ring, heads


def usp_attention(q, k, v, mask: masks_lib.Mask | None = None, *, mesh,
                  seq_axis: str = "sequence", ulysses_size: int, batch_axes=None,
                  load_balance: str = "zigzag", **ring_kwargs):
    """USP (Fang & Zhao 2024) over the n devices of `seq_axis`: q, k, v resharded from
    the sequence split to (sequence over the n/u groups, heads over the u devices of
    each group: Ulysses' all-to-all inside a group, inserted by XLA at the ring's
    `shard_map`), then `ring_attention` across the groups on each device's heads
    (`load_balance`: zig-zag over the groups' spans, natural order in and out), the
    output resharded back. `ulysses_size` 1 is the ring, n Ulysses. Query heads must
    divide by u (one line naming the fix); kv heads are repeated as needed. Other
    keyword arguments: `ring_attention`'s."""
    n, u = mesh.shape[seq_axis], ulysses_size
    if u < 1 or n % u:
        raise ValueError(f"usp_attention: ulysses_size={u} must divide the {n} devices of "
                         f"{seq_axis!r}; set model.attention.ulysses_size to a divisor of {n}")
    check_heads(q.shape[2], u, "usp_attention",
                f"set model.attention.ulysses_size to a divisor of {q.shape[2]} and {n}")
    batch_axes = mask_leaves.resolve_batch_axes(batch_axes, q, mesh, seq_axis, "usp_attention")
    k, v = mask_leaves.split_kv_heads(k, v, u)
    sub, ring_axis, head_axis = usp_mesh(mesh, seq_axis, u)
    return ring_attention(q, k, v, mask, mesh=sub, seq_axis=ring_axis, head_axis=head_axis,
                          batch_axes=batch_axes or (), load_balance=load_balance,
                          natural_order=True, **ring_kwargs)
