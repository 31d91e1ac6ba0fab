"""Run an attention implementation XLA cannot partition once per device.

XLA's SPMD partitioner cannot split a custom call (the Pallas kernels): under a mesh it
would run the whole call on the gathered global batch on every device.
`batch_sharded_attention` runs it under `shard_map` instead, each device on its own
examples and, where the head axes divide them, its query heads. It is the per-device
runner of `tfjax.ops.target` (`per_device`), which
`tfjax.parallel.sharding.use_rules(mesh, rules)` binds to the mesh and to the mesh axes
the rules give "batch" and "heads". See docs/long_context.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from tfjax.ops.paged import Paged
from tfjax.parallel import mask_leaves

__all__ = ["batch_sharded_attention"]

_ABSENT = object()


def batch_sharded_attention(fn, q, k, v, mask, *, mesh, batch_axes, head_axes, bias=None,
                            alibi=None, relative_bias=_ABSENT, **kw):
    """`fn(q, k, v, mask, bias=, alibi=, [relative_bias=], **kw)`, one attention
    implementation (`Implementation.fn`), run per device under shard_map over `mesh`:
    examples split over `batch_axes`, and heads over `head_axes` when they divide the
    query heads (each a mesh axis name, a tuple of them or None; axes of size 1 are
    dropped). `relative_bias` is passed to `fn` only when given (an implementation
    whose record says `relative_bias=True` takes it). Returns `fn`'s result (out, or
    `(out, lse)` with `return_lse`), or None (the caller runs `fn` as is) when the
    call is already inside shard_map or nothing splits."""
    if jax.sharding.get_abstract_mesh().manual_axes:
        return None

    def axes_of(axes, size):
        axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
        axes = tuple(a for a in axes if mesh.shape[a] > 1)
        n = int(np.prod([mesh.shape[a] for a in axes]))
        return (axes, n) if axes and size % n == 0 else ((), 1)

    N, K = q.shape[2], k.shape[2]
    paged = isinstance(k, Paged)
    b_axes, _ = axes_of(batch_axes, q.shape[0])
    h_axes, _ = axes_of(head_axes, N)
    h_axes = tuple(a for a in h_axes if a not in b_axes)
    if paged and K % int(np.prod([mesh.shape[a] for a in h_axes])):
        h_axes = ()  # repeating a pool's kv heads would copy the pool: heads stay whole
    if not b_axes and not h_axes:
        return None
    Dh = int(np.prod([mesh.shape[a] for a in h_axes]))
    # MQA, or GQA with fewer kv heads than head devices: kv heads repeated as needed
    if not paged:
        k, v = mask_leaves.split_kv_heads(k, v, Dh)
    b, h = b_axes or None, h_axes or None
    takes_relative = relative_bias is not _ABSENT  # fn's signature has relative_bias=
    rel = None if relative_bias is _ABSENT else relative_bias
    leaves, treedef, kinds = mask_leaves.split_mask(mask, alibi, rel)
    slopes = None if alibi is None else alibi.slopes
    # one table copy per batch device (its gradient)
    leaves = mask_leaves.copy_tables(leaves, kinds, mesh, b_axes)

    def leaf_spec(x, kind):
        if kind == "table":  # [D, nb, N]
            return P(b, None, h)
        bx = b if x.shape[0] != 1 else None
        if x is slopes:  # [B|1, N]
            return P(bx, h)
        return P(*([bx] + [None] * (x.ndim - 1)))

    tok = P(b, None, h, None)
    bias_spec = None if bias is None else P(b if bias.shape[0] != 1 else None,
                                            h if bias.shape[1] != 1 else None, None, None)
    offsets = [kw.get("q_offset", 0), kw.get("kv_offset", 0)]
    static = [isinstance(o, int) for o in offsets]
    dynamic = [jnp.asarray(o) for o, st in zip(offsets, static) if not st]
    args = [q, k, v, bias, *dynamic, *leaves]
    kv = Paged(P(None, None, h, None), P(b, None)) if paged else tok  # pool [P, page, K, H]
    specs = [tok, kv, kv, bias_spec, *[P() for _ in dynamic],
             *[leaf_spec(x, kd) for x, kd in zip(leaves, kinds)]]

    def local(q, k, v, bias, *rest):
        it = iter(rest[:len(dynamic)])
        offs = [o if st else next(it) for o, st in zip(offsets, static)]
        m, a, rl = mask_leaves.unflatten(
            treedef, mask_leaves.local_leaves(rest[len(dynamic):], kinds))
        extra = dict(relative_bias=rl) if takes_relative else {}
        return fn(q, k, v, m, bias=bias, alibi=a, **{**kw, "q_offset": offs[0],
                                                      "kv_offset": offs[1]}, **extra)

    out_specs = (tok, P(b, h, None)) if kw.get("return_lse") else tok
    return mask_leaves.shard_map(local, mesh=mesh, in_specs=tuple(specs),
                                 out_specs=out_specs)(*args)
