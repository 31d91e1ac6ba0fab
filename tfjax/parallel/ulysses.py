"""Ulysses context parallelism (DeepSpeed-Ulysses, Jacobs et al. 2023) over a mesh axis.

`ulysses_attention(q, k, v, mask, *, mesh, seq_axis="sequence", implementation="auto",
...)`: global q `[B,T,N,H]`, k `[B,S,K,H]`, v `[B,S,K,Hv]` sharded over `seq_axis` ->
`[B,T,N,Hv]`, `attention_reference`'s result. Under `jax.shard_map`, one all-to-all per
tensor trades the sequence shard for a head shard (each of the n devices then holds the
whole sequence for N/n query heads), the layer's own implementation attends there with
every mask at its natural positions, and one all-to-all brings the output back to the
sequence shard. The backward is autodiff's: all-to-alls the other way. K/V are never
all-gathered; GQA with fewer kv heads than n repeats each kv head as few times as it
takes. See docs/long_context.md.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from tfjax.ops import masks as masks_lib
from tfjax.ops.attention import dot_product_attention
from tfjax.ops.reference import RelativeBias, check_relative_bias, make_alibi
from tfjax.ops.sinks import check_sinks
from tfjax.ops.target import device_platform, targeting
from tfjax.parallel import mask_leaves

__all__ = ["ulysses_attention", "ulysses_kv_repeats"]


def ulysses_kv_repeats(num_heads: int, num_kv_heads: int, n: int, where: str = "ulysses") -> int:
    """How many times Ulysses repeats each kv head over `n` devices (1: none): the least r
    with `num_kv_heads * r` divisible by n. Query heads not divisible by n: a one-line
    ValueError naming the fix."""
    if num_heads % n:
        raise ValueError(f"{where}: the {num_heads} query heads do not divide over the {n} "
                         f"devices of the sequence axis (Ulysses gives each device N/n heads); "
                         f"set mesh.sequence to a divisor of {num_heads}, or use "
                         f"model.attention.context_parallel='ring'")
    return n // math.gcd(num_kv_heads, n)


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
    r = ulysses_kv_repeats(N, K, n, "ulysses_attention")
    if r > 1:  # each device needs whole kv heads for its query heads
        k, v = jnp.repeat(k, r, axis=2), jnp.repeat(v, r, axis=2)
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

