"""Ring attention (Liu et al. 2023) over a mesh axis with `jax.shard_map`.

Each device of `seq_axis` holds one chunk of the sequence of q, k and v. K/V (only
the K kv heads; never repeated for GQA) and, when the mask has segment ids, the kv
segment ids travel around the ring with `lax.ppermute`; at each of the n steps a
device attends its queries to the block it holds with `blockwise_attention`
(`return_lse=True`, global `q_offset` / `kv_offset`), and the partial results merge
in fp32 through the logsumexp. The transfer of the next block is issued before the
current block's compute so XLA can overlap them. A step whose whole block is masked
(above the causal diagonal, outside a sliding window, other documents) is skipped
with `lax.cond` on the mask's one-tile block view.

Backward: JAX autodiff through the forward. `ppermute` transposes to the reverse
`ppermute`, so dK/dV travel the ring back to their owners; `blockwise_attention`'s
custom_vjp recomputes per tile, so nothing O(S^2) and no all-gather is built.
The ring steps are a `jax.checkpoint`ed scan body, so the backward recomputes each
step's forward (about one extra forward of compute) and keeps only the per-step
carries (the fp32 accumulators and the K/V block): still O(S) per device, not the
O(S/n) a hand-written ring backward (dK/dV riding the ring in a custom_vjp) would
give. On CPU, causal fwd+bwd, 1024 tokens/device, the per-device temporaries are
12 / 22 / 24 / 31 MiB at n = 1 / 2 / 4 / 8 (experiments/bench_ring.py).

Load balancing (`load_balance="zigzag"`, for causal masks): the sequence is cut into
2n chunks and device i holds chunks i and 2n-1-i, so every device does the same
causal work. `zigzag` / `unzigzag` reorder a global array; `ring_attention` accepts
natural order and undoes the reordering for the caller, inside the shard_map with
half-chunk `ppermute`s (no gather); pass `natural_order=False` when the data
pipeline already produced zig-zag order, which saves those two re-layouts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from tfjax.ops import masks as masks_lib
from tfjax.ops.blockwise import DEFAULT_BLOCK, blockwise_attention

__all__ = ["ring_attention", "unzigzag", "zigzag", "zigzag_order"]

_Q_LEAF, _KV_LEAF = "q_segment_ids", "kv_segment_ids"


def _shard_map(f, *, mesh, in_specs, out_specs):
    if hasattr(jax, "shard_map"):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                             check_vma=False)
    from jax.experimental.shard_map import shard_map  # older jax

    return shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


# --------------------------------------------------------------------------- #
# Zig-zag reordering.
# --------------------------------------------------------------------------- #


def zigzag_order(n: int) -> np.ndarray:
    """The chunk order of zig-zag layout over n devices: [0, 2n-1, 1, 2n-2, ...]."""
    return np.asarray([c for i in range(n) for c in (i, 2 * n - 1 - i)], np.int32)


def _reorder_chunks(x, order, axis):
    axis = axis % x.ndim
    L, m = x.shape[axis], len(order)
    if L % m:
        raise ValueError(f"zigzag: length {L} of axis {axis} is not divisible by {m} chunks")
    xs = x.reshape(*x.shape[:axis], m, L // m, *x.shape[axis + 1:])
    xs = jnp.take(xs, jnp.asarray(order), axis=axis)
    return xs.reshape(x.shape)


def zigzag(x, n: int, axis: int = 1):
    """Natural order -> zig-zag order along `axis` (split into 2n chunks; the i-th
    contiguous 1/n of the result holds chunks i and 2n-1-i)."""
    return _reorder_chunks(x, zigzag_order(n), axis)


def unzigzag(x, n: int, axis: int = 1):
    """Inverse of `zigzag`."""
    return _reorder_chunks(x, np.argsort(zigzag_order(n)).astype(np.int32), axis)


def _chunk_of(layout: str, n: int, d: int, h: int) -> int:
    """The global chunk (of 2n) that half h of device d holds in a layout."""
    if layout == "natural":
        return 2 * d + h
    return d if h == 0 else 2 * n - 1 - d


def _relayout_local(x, n: int, axis_name, src: str, dst: str):
    """Inside shard_map: move the two local halves (axis 1) from layout `src` to
    `dst` ("natural" / "zigzag") with four half-size `ppermute`s, no gather."""
    i = lax.axis_index(axis_name)
    c = x.shape[1] // 2
    halves = (x[:, :c], x[:, c:])
    where = {_chunk_of(src, n, d, h): (d, h) for d in range(n) for h in range(2)}
    out = []
    for s in range(2):
        # dest slot s of device e needs chunk _chunk_of(dst, n, e, s), now at where[...].
        need = [where[_chunk_of(dst, n, e, s)] for e in range(n)]
        recv = []
        for h in range(2):
            pairs = [(d, e) for e, (d, hh) in enumerate(need) if hh == h]
            recv.append(lax.ppermute(halves[h], axis_name, pairs) if pairs
                        else jnp.zeros_like(halves[h]))
        from_half = jnp.asarray([hh for _, hh in need], jnp.int32)[i]
        out.append(jnp.where(from_half == 0, recv[0], recv[1]))
    return jnp.concatenate(out, axis=1)


# --------------------------------------------------------------------------- #
# Mask plumbing: segment ids are per token (sharded, kv ids rotate); every other
# array leaf is per example ([B], sharded over the batch axes only).
# --------------------------------------------------------------------------- #


def _leaf_kind(path) -> str:
    name = getattr(path[-1], "name", None) if path else None
    if name == _Q_LEAF:
        return "q"
    if name == _KV_LEAF:
        return "kv"
    return "other"


def _split_mask(mask):
    if mask is None:
        return [], None, []
    leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(mask)
    kinds = [_leaf_kind(p) for p, _ in leaves_with_path]
    return [leaf for _, leaf in leaves_with_path], treedef, kinds


def _merge(o, lse, o_new, lse_new):
    """Merge two normalised partial results (o `[b,T,N,H]` fp32, lse `[b,N,T]` fp32)."""
    m = lax.stop_gradient(jnp.maximum(lse, lse_new))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    w1, w2 = jnp.exp(lse - m), jnp.exp(lse_new - m)
    tot = w1 + w2
    has = tot > 0
    safe = jnp.where(has, tot, 1.0)
    lse_out = jnp.where(has, m + jnp.log(safe), -jnp.inf)
    t = lambda w: (w / safe).transpose(0, 2, 1)[..., None]  # [b,N,T] -> [b,T,N,1]
    return t(w1) * o + t(w2) * o_new.astype(jnp.float32), lse_out


# --------------------------------------------------------------------------- #
# ring_attention.
# --------------------------------------------------------------------------- #


def ring_attention(q, k, v, mask: masks_lib.Mask | None = None, *, mesh, seq_axis: str = "sequence",
                   batch_axes=None, scale=None, softcap=None, load_balance: str = "none",
                   natural_order: bool = True, block_q: int = DEFAULT_BLOCK,
                   block_kv: int = DEFAULT_BLOCK, skip_masked_blocks: bool = True):
    """q `[B,T,N,H]`, k/v `[B,S,K,H]` (global arrays) -> out `[B,T,N,H]`.

    Same semantics as `attention_reference(q, k, v, mask, scale=, softcap=)`; the
    sequence dims are split over `seq_axis` of `mesh` (and the batch over
    `batch_axes`, a mesh axis name or tuple of names, if given).

    load_balance: "none" (device i holds positions [i*T/n, (i+1)*T/n)) or "zigzag"
    (2n chunks, device i holds chunks i and 2n-1-i; needs T == S and T % 2n == 0).
    With "zigzag" and `natural_order=True` the inputs/outputs are in natural order and
    re-laid out on device (ppermutes of half chunks, no gather); with
    `natural_order=False` they are already in zig-zag order (including the segment
    ids of a `masks.segments` mask) and the output is too.
    """
    if load_balance not in ("none", "zigzag"):
        raise ValueError(f"ring_attention: load_balance must be 'none' or 'zigzag', got "
                         f"{load_balance!r}")
    n = mesh.shape[seq_axis]
    _, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    if N % K:
        raise ValueError(f"ring_attention: {N} query heads are not a multiple of {K} kv heads")
    pieces = 2 if load_balance == "zigzag" else 1
    if load_balance == "zigzag" and T != S:
        raise ValueError(f"ring_attention: zigzag needs T == S, got T={T}, S={S}")
    if T % (n * pieces) or S % (n * pieces):
        raise ValueError(f"ring_attention: T={T} and S={S} must be divisible by "
                         f"{n * pieces} ({n} devices on {seq_axis!r} x {pieces} chunks)")
    scale = float(H ** -0.5 if scale is None else scale)

    leaves, treedef, kinds = _split_mask(mask)
    # Natural order in and out under zigzag: re-laid out inside shard_map (ppermutes).
    reorder = load_balance == "zigzag" and natural_order and n > 1

    bspec = batch_axes
    tok = P(bspec, seq_axis, None, None)

    def leaf_spec(x, kind):
        b = bspec if x.shape[0] != 1 else None
        return P(b, seq_axis) if kind != "other" else P(*([b] + [None] * (x.ndim - 1)))

    leaf_specs = [leaf_spec(x, kd) for x, kd in zip(leaves, kinds)]
    Tl, Sl = T // n, S // n
    cq, ckv = Tl // pieces, Sl // pieces  # piece lengths

    def piece_offsets(dev, c):
        if pieces == 1:
            return [dev * c]
        return [dev * c, (2 * n - 1 - dev) * c]

    def local(q, k, v, *mleaves):
        i = lax.axis_index(seq_axis)
        if reorder:
            to_zz = lambda x: _relayout_local(x, n, seq_axis, "natural", "zigzag")
            q, k, v = to_zz(q), to_zz(k), to_zz(v)
            mleaves = [to_zz(x) if kd != "other" else x for x, kd in zip(mleaves, kinds)]
        q_leaves = [x for x, kd in zip(mleaves, kinds) if kd == "q"]
        kv_leaves = [x for x, kd in zip(mleaves, kinds) if kd == "kv"]
        other = [x for x, kd in zip(mleaves, kinds) if kd == "other"]
        q_offs = piece_offsets(i, cq)
        qs = [q[:, p * cq:(p + 1) * cq] for p in range(pieces)]
        q_seg = [[x[:, p * cq:(p + 1) * cq] for x in q_leaves] for p in range(pieces)]
        b = q.shape[0]
        acc = [(jnp.zeros((b, cq, N, H), jnp.float32), jnp.full((b, N, cq), -jnp.inf, jnp.float32))
               for _ in range(pieces)]

        def build_mask(qseg, kvseg):
            if treedef is None:
                return None
            it_q, it_kv, it_o = iter(qseg), iter(kvseg), iter(other)
            out = [next(it_q) if kd == "q" else next(it_kv) if kd == "kv" else next(it_o)
                   for kd in kinds]
            return jax.tree_util.tree_unflatten(treedef, out)

        def step(acc, blk, src):
            kb, vb, kvl = blk
            kv_offs = piece_offsets(src, ckv)
            new = []
            for p in range(pieces):
                o, lse = acc[p]
                for r in range(pieces):
                    kr = kb[:, r * ckv:(r + 1) * ckv]
                    vr = vb[:, r * ckv:(r + 1) * ckv]
                    m = build_mask(q_seg[p], [x[:, r * ckv:(r + 1) * ckv] for x in kvl])
                    qo, ko = q_offs[p], kv_offs[r]

                    def compute(o, lse, qp=qs[p], kr=kr, vr=vr, m=m, qo=qo, ko=ko):
                        o2, l2 = blockwise_attention(qp, kr, vr, m, scale=scale, softcap=softcap,
                                                     q_offset=qo, kv_offset=ko, return_lse=True,
                                                     block_q=block_q, block_kv=block_kv)
                        return _merge(o, lse, o2, l2)

                    if m is None or not skip_masked_blocks:
                        o, lse = compute(o, lse)
                    else:
                        code = m.blocks(cq, ckv, cq, ckv, q_offset=qo, kv_offset=ko)
                        empty = jnp.all(code == masks_lib.EMPTY)
                        o, lse = lax.cond(empty, lambda o, lse: (o, lse), compute, o, lse)
                new.append((o, lse))
            return new

        perm = [(j, (j + 1) % n) for j in range(n)]
        blk = (k, v, kv_leaves)
        # Step s: this device holds the block that started on device (i - s) mod n.
        # Steps 0..n-2 are one scan (the body compiles once whatever n is); each issues
        # the transfer of the next block before computing on the current one. The last
        # step sends nothing.
        if n > 1:
            @jax.checkpoint  # backward recomputes a step: residuals are the carries only
            def body(carry, s):
                acc, blk = carry
                nxt = lax.ppermute(blk, seq_axis, perm)
                return (step(acc, blk, (i - s) % n), nxt), None

            (acc, blk), _ = lax.scan(body, (acc, blk), jnp.arange(n - 1, dtype=jnp.int32))
        acc = step(acc, blk, (i - (n - 1)) % n)
        out = jnp.concatenate([o for o, _ in acc], axis=1).astype(q.dtype)
        if reorder:
            out = _relayout_local(out, n, seq_axis, "zigzag", "natural")
        return out

    fn = _shard_map(local, mesh=mesh, in_specs=(tok, tok, tok, *leaf_specs), out_specs=tok)
    return fn(q, k, v, *leaves)
