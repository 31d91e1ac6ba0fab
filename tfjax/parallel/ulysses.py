"""Ulysses context parallelism (DeepSpeed-Ulysses, Jacobs et al. 2023) and USP (Fang &
Zhao 2024) over a mesh's sequence axis.

`ulysses_attention(q, k, v, mask, *, mesh, seq_axis, implementation, ...)`: q, k, v split
over `seq_axis` -> `attention_reference`'s result. Under `jax.shard_map` an all-to-all
per tensor trades the sequence shard for a head shard (the whole sequence, N/n heads a
device), the layer's implementation attends with every mask at natural positions, and
an all-to-all brings the output back; kv heads are repeated as needed, never gathered.
`usp_attention(..., ulysses_size=u)`: one `shard_map` too, an all-to-all inside groups of
u consecutive devices, the ring's per-device attention (`ring_core`) across the groups on
each device's heads, and the all-to-all back. See docs/long_context.md.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from tfjax.ops import masks as masks_lib
from tfjax.ops.attention import dot_product_attention, select_ring_block
from tfjax.ops.blockwise import DEFAULT_BLOCK
from tfjax.ops.reference import RelativeBias, check_relative_bias, make_alibi
from tfjax.ops.sinks import check_sinks
from tfjax.ops.target import device_platform, targeting
from tfjax.parallel import mask_leaves
from tfjax.parallel.ring_attention import ring_core
from tfjax.parallel.zigzag import relayout_local

__all__ = ["check_heads", "ulysses_attention", "usp_attention", "usp_mesh"]


def check_heads(num_heads: int, n: int, where: str, fix: str = "") -> None:
    """Query heads that do not divide over Ulysses' n devices: a one-line ValueError
    naming the fix (default: for Ulysses over the whole sequence axis)."""
    if num_heads % n:
        fix = fix or (f"set mesh.sequence to a divisor of {num_heads}, or use "
                      f"model.attention.context_parallel='ring' or 'usp'")
        raise ValueError(f"{where}: the {num_heads} query heads do not divide over the {n} "
                         f"Ulysses devices (each gets N/{n} heads); {fix}")


def _own_heads(x, axis_name, heads: int):
    """This device's `heads` of a per-head array (last axis): its index on `axis_name`."""
    return lax.dynamic_slice_in_dim(x, lax.axis_index(axis_name) * heads, heads, -1)


def _local_extras(treedef, mleaves, kinds, axis_name, heads: int) -> tuple:
    """Inside shard_map: `(mask, alibi, rel)` from the local leaves, ALiBi's slopes and
    T5's table (the device's copy) cut to the device's `heads` on `axis_name`."""
    m, a, rl = mask_leaves.unflatten(treedef, mask_leaves.local_leaves(mleaves, kinds))
    if a is not None:
        a = dataclasses.replace(a, slopes=_own_heads(a.slopes, axis_name, heads))
    if rl is not None:
        rl = dataclasses.replace(rl, table=_own_heads(rl.table, axis_name, heads))
    return m, a, rl


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

    def local(q, k, v, sink_copy, *mleaves):
        # [b, T/n, heads of all, .] -> [b, T, own heads, .] and back
        to_heads = lambda x: lax.all_to_all(x, seq_axis, 2, 1, tiled=True)
        gather = lambda x: lax.all_gather(x, seq_axis, axis=1, tiled=True)
        q, k, v = to_heads(q), to_heads(k), to_heads(v)
        mleaves = [gather(x) if kd in ("q", "kv") else x for x, kd in zip(mleaves, kinds)]
        m, a, rl = _local_extras(treedef, mleaves, kinds, seq_axis, heads)
        s = None if sink_copy is None else _own_heads(sink_copy[0], seq_axis, heads)
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
                  load_balance: str = "zigzag", natural_order: bool = True, scale=None,
                  softcap=None, implementation: str = "auto", block_q: int = DEFAULT_BLOCK,
                  block_kv: int = DEFAULT_BLOCK, block_sizes=None,
                  skip_masked_blocks: bool = True, unroll: bool | None = None,
                  alibi_slopes=None, alibi_positions=None,
                  relative_bias: RelativeBias | None = None, sinks=None):
    """USP (Fang & Zhao 2024) over the n devices of `seq_axis`, in one `shard_map` over
    them (as the mesh `usp_mesh` names them: g = n/u groups x u devices): an all-to-all
    inside each group trades the device's sequence chunk for the group's span on N/u
    heads (Ulysses), `ring_core` (the ring's per-device attention) runs across the g
    groups on those heads, and an all-to-all brings the output back. `ulysses_size` u
    1 is the ring, n Ulysses. Query heads must divide by u (one line naming the fix);
    kv heads are repeated as needed; sinks, ALiBi's slopes and T5's table are sliced
    to each device's heads. Other arguments as `ring_attention`'s.

    load_balance "zigzag" (T == S, T % 2n == 0): the ring runs zig-zag over the groups
    (group j holds chunks j and 2g-1-j of 2g). With `natural_order=True` the data is
    in natural order, and each group's span is re-laid out over the ring (half-chunk
    ppermutes) after the all-to-all and back before it. With `natural_order=False` the
    data is in zig-zag order over the n devices (`zigzag(x, n)`): device j*u+r holds
    chunks j*u+r and 2n-1-j*u-r of 2n, so after the all-to-all its group holds chunks
    j*u..j*u+u-1 (group chunk j) and 2n-1-j*u-r for r < u (group chunk 2g-1-j, the
    last member first): reversing the second halves' order is the whole re-layout."""
    if load_balance not in ("none", "zigzag"):
        raise ValueError(f"usp_attention: load_balance must be 'none' or 'zigzag', got "
                         f"{load_balance!r}")
    n, u = mesh.shape[seq_axis], ulysses_size
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    if u < 1 or n % u:
        raise ValueError(f"usp_attention: ulysses_size={u} must divide the {n} devices of "
                         f"{seq_axis!r}; set model.attention.ulysses_size to a divisor of {n}")
    check_heads(N, u, "usp_attention",
                f"set model.attention.ulysses_size to a divisor of {N} and {n}")
    if N % K:
        raise ValueError(f"usp_attention: {N} query heads are not a multiple of {K} kv heads")
    masks_lib.check_lengths(mask, T, S, "usp_attention")
    zz = load_balance == "zigzag"
    if zz and T != S:
        raise ValueError(f"usp_attention: load_balance='zigzag' needs T == S, got T={T}, "
                         f"S={S}; pass load_balance='none'")
    pieces = 2 if zz else 1
    if T % (n * pieces) or S % (n * pieces):
        hint = "; or pass load_balance='none' (T, S divisible by n)" if zz else ""
        raise ValueError(f"usp_attention: T={T} and S={S} must be divisible by {n * pieces} "
                         f"({n} devices on {seq_axis!r} x {pieces} chunks){hint}")
    g, heads = n // u, N // u
    batch_axes = mask_leaves.resolve_batch_axes(batch_axes, q, mesh, seq_axis, "usp_attention")
    k, v = mask_leaves.split_kv_heads(k, v, u)  # whole kv heads for each device's heads
    sub, ring_axis, uly_axis = usp_mesh(mesh, seq_axis, u)
    platform = device_platform(mesh.devices.flat[0])
    block = select_ring_block(platform, mask, implementation, block_q=block_q, block_kv=block_kv,
                              block_sizes=block_sizes)
    alibi = make_alibi(alibi_slopes, alibi_positions, B, N, T, S)
    rel = check_relative_bias(relative_bias, B, N, T, S)
    sinks = check_sinks(sinks, N, "usp_attention")
    seq_axes = (ring_axis, uly_axis)  # the same split as seq_axis on mesh
    dev = mask_leaves.device_axes(batch_axes, seq_axes)
    leaves, treedef, kinds = mask_leaves.split_mask(mask, alibi, rel)
    leaves = mask_leaves.copy_tables(leaves, kinds, sub, dev)
    tok, leaf_specs = mask_leaves.token_specs(leaves, kinds, batch_axes, seq_axes)
    ti = kinds.index("table") if "table" in kinds else None
    core = ring_core(seq_axis=ring_axis, n=g, pieces=pieces, cq=u * T // (n * pieces),
                     ckv=u * S // (n * pieces), Hv=v.shape[-1], block=block,
                     scale=float(H ** -0.5 if scale is None else scale), softcap=softcap,
                     kinds=kinds, treedef=treedef, skip_masked_blocks=skip_masked_blocks,
                     unroll=platform == "cpu" if unroll is None else unroll)

    def halves(x):  # [b, u*L, ...] in member order -> [b, u, 2, L/2, ...]
        return x.reshape(x.shape[0], u, 2, x.shape[1] // (2 * u), *x.shape[2:])

    def to_ring_layout(x):
        """The group's tokens in member order (each member's chunk) -> the ring's."""
        if not zz:  # member r holds the group span's r-th chunk: natural
            return x
        if natural_order:
            return relayout_local(x, g, ring_axis, "natural", "zigzag") if g > 1 else x
        y = halves(x)
        return jnp.concatenate([y[:, :, 0], y[:, ::-1, 1]], axis=1).reshape(x.shape)

    def from_ring_layout(x):
        if not zz:
            return x
        if natural_order:
            return relayout_local(x, g, ring_axis, "zigzag", "natural") if g > 1 else x
        y = x.reshape(x.shape[0], 2, u, x.shape[1] // (2 * u), *x.shape[2:])
        return jnp.stack([y[:, 0], y[:, 1, ::-1]], axis=2).reshape(x.shape)

    def local(q, k, v, sink_copy, *mleaves):
        # [b, T/n, all heads, .] -> [b, u T/n, own heads, .]: the group's span
        to_group = lambda x: to_ring_layout(lax.all_to_all(x, uly_axis, 2, 1, tiled=True))
        q, k, v = to_group(q), to_group(k), to_group(v)
        mleaves = [to_ring_layout(lax.all_gather(x, uly_axis, axis=1, tiled=True))
                   if kd in ("q", "kv") else x for x, kd in zip(mleaves, kinds)]
        if treedef is not None:  # per-head leaves: this device's heads
            mleaves = treedef.flatten_up_to(_local_extras(treedef, mleaves, kinds, uly_axis,
                                                          heads))
        table = None
        if ti is not None:  # the (differentiable) table goes to the core by itself
            table, mleaves = mleaves[ti], [None if j == ti else x for j, x in enumerate(mleaves)]
        sink = None if sink_copy is None else _own_heads(sink_copy[0], uly_axis, heads)
        out = from_ring_layout(core(q, k, v, table, sink, list(mleaves)))
        return lax.all_to_all(out, uly_axis, 1, 2, tiled=True)

    sink_spec = None if sinks is None else P(dev)
    fn = mask_leaves.shard_map(local, mesh=sub, in_specs=(tok, tok, tok, sink_spec, *leaf_specs),
                               out_specs=tok)
    return fn(q, k, v, mask_leaves.device_copies(sinks, sub, dev), *leaves)
