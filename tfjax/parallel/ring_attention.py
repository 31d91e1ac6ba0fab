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

Backward: a hand-written `jax.custom_vjp`. The forward saves only the local q, k,
v, the output and the fp32 logsumexp (O(S/n) per device). The backward runs a
second ring: each device's K/V (and kv segment ids) circulate as in the forward,
together with that shard's fp32 dK/dV accumulators; at each step a device adds
the block's contribution from `blockwise_attention_backward` (probabilities
recomputed per tile from the saved global lse, so there is no O(S^2) and no
per-step forward to redo), dQ accumulates locally, and after n moves each dK/dV
is back on its owner. Masked blocks are skipped as in the forward.

Per-block attention (`implementation=`, chosen by `tfjax.ops.attention.
select_ring_block`): `blockwise_attention` / `blockwise_attention_backward` (any
backend), or the Pallas TPU kernels (`flash_attention_tpu(return_lse=True)` /
`flash_attention_tpu_backward`: Mosaic on TPU, interpret mode on CPU); "auto" picks
pallas on TPU meshes. Both take T5's
bias per tile (`relative_bias`: every device holds a copy of the table; the
backward returns each device's partial table gradient, summed over the devices by
the copies' transpose outside shard_map).

Memory. The steps run as a while loop (one K/V block in flight) except on CPU
meshes, where they are unrolled (`unroll=`; XLA's CPU runtime can deadlock a while
loop holding collectives against other collectives, see `ring_attention`). Causal
fwd+bwd, GQA 4/1, H=64, fp32, tiles 256, 1024 tokens per device, 8 devices
(experiments/bench_ring.py): per-device temporaries 11.4 MiB as a while loop and
15.0 MiB unrolled, against 26.8 MiB for single-device blockwise at the same total
length (0.43x / 0.56x); flat in the device count as a while loop. With jax 0.12 the
same while-loop program holds 10.2 MiB against 11.8 MiB (0.86x): its XLA keeps
single-device blockwise in less than half of what 0.10 / 0.11 did, the ring's loop
about as before (a dO input instead of the sum's constant cotangent: 10.7 against
18.1 MiB, 0.59x; 0.10: 11.9 against 36.1, 0.33x). The issue asked
for <= 1/6, which this design cannot reach: per local token the backward must hold
the output, its cotangent and the fp32 dQ accumulator (3 q-sized arrays, as
single-device blockwise does) plus the K/V block being used and the next one and
the fp32 dK/dV accumulator being updated and the one in transit (8 kv-sized fp32
arrays), where single-device blockwise holds 3 q-sized + 2 kv-sized. With GQA 4/1
that is 5 KiB against 3.5 KiB per token, so 8 devices give at best 5 / (8 x 3.5) =
0.18x; with MHA 0.28x. Measured, the while loop holds 6.8 KiB per local token. The
extra 1.8 KiB is not attributed yet: it is not the zig-zag pieces (load_balance=
"none" holds 7.0) nor blockwise's batch vmap (calling it without vmap at B=1 saved
0.2) nor the per-call zero dQ carry (accumulating into the ring's dQ buffer saved
nothing); XLA's buffer assignment dump is the next place to look.

Load balancing (`load_balance="zigzag"`, for causal masks): the sequence is cut into
2n chunks and device i holds chunks i and 2n-1-i, so every device does the same
causal work. `zigzag` / `unzigzag` reorder a global array; `ring_attention` accepts
natural order and undoes the reordering for the caller, inside the shard_map with
half-chunk `ppermute`s (no gather); pass `natural_order=False` when the data
pipeline already produced zig-zag order, which saves those two re-layouts. Masks
are evaluated on global natural positions in both cases (each chunk's global
offset goes to the mask), so causal, sliding-window and segment masks stay exact.

Also here: `all_gather_attention`, the simple baseline (each device gathers the
whole K/V over the axis; O(S) per device), and `context_parallel_attention`, which
`MultiHeadAttention` calls under an active mesh (`sharding.use_rules`, set by the
trainer) whose rules split "length" over a mesh axis of size > 1: it runs ring
or all-gather attention, as `ModelConfig.context_parallel` says. Ring is zig-zag
balanced (mask given, T % 2n == 0) as `ModelConfig.zigzag` says: "data" (default;
the trainer reorders each batch's tokens, positions, segment ids and loss weights
once on the host and traces its steps under `zigzag_data(n)`, so every layer runs
`natural_order=False`; sampling and other callers stay in natural order), "layer"
(natural order, four half-chunk ppermutes per tensor per layer) or "none".
"""

from __future__ import annotations

import contextlib
import math
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from tfjax.ops import masks as masks_lib
from tfjax.ops.attention import select_ring_block
from tfjax.ops.blockwise import DEFAULT_BLOCK, blockwise_attention
from tfjax.ops.reference import Alibi, RelativeBias, check_relative_bias, make_alibi

__all__ = ["CONTEXT_PARALLEL_MODES", "ZIGZAG_MODES", "all_gather_attention",
           "batch_sharded_attention", "context_parallel_attention", "ring_attention", "unzigzag",
           "zigzag", "zigzag_data", "zigzag_data_devices", "zigzag_order"]

# Per-token leaves of the mask / ALiBi / T5-bias pytree: sharded like the tokens; kv
# ones rotate. T5's table is one copy per device (its gradient is a per-device sum).
_Q_LEAVES, _KV_LEAVES = ("q_segment_ids", "q_positions"), ("kv_segment_ids", "kv_positions")
_TABLE_LEAVES = ("table",)


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
    if name in _Q_LEAVES:
        return "q"
    if name in _KV_LEAVES:
        return "kv"
    if name in _TABLE_LEAVES:
        return "table"
    return "other"


def _split_mask(mask, alibi=None, rel=None):
    """Leaves, treedef and leaf kinds of the pytree `(mask, alibi, rel)` (a treedef of
    None when all are None)."""
    if mask is None and alibi is None and rel is None:
        return [], None, []
    leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path((mask, alibi, rel))
    kinds = [_leaf_kind(p) for p, _ in leaves_with_path]
    return [leaf for _, leaf in leaves_with_path], treedef, kinds


def _bias_kwargs(alibi, rel) -> dict:
    """The ALiBi / T5-bias keyword arguments of the per-block attention."""
    return {**Alibi.kwargs(alibi), **({} if rel is None else dict(relative_bias=rel))}


def _device_axes(batch_axes, seq_axis) -> tuple:
    """The mesh axes the tokens are split over (batch axes, then seq_axis)."""
    b = () if batch_axes is None else (batch_axes,) if isinstance(batch_axes, str) else \
        tuple(batch_axes)
    return (*b, seq_axis)


def _copy_tables(leaves, kinds, mesh, axes):
    """T5's table as one copy per device of `axes` (`[D, nb, N]`, split over them):
    each device's copy receives that device's partial gradient, summed outside
    shard_map by the broadcast's transpose."""
    D = int(np.prod([mesh.shape[a] for a in axes]))
    return [jnp.broadcast_to(x[None], (D, *x.shape)) if kd == "table" else x
            for x, kd in zip(leaves, kinds)]


def _zero_cotangent(x):
    x = jnp.asarray(x)
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.zeros_like(x)
    return np.zeros(x.shape, jax.dtypes.float0)


def _specs(leaves, kinds, batch_axes, seq_axis):
    """shard_map specs: q/k/v `[B,T,.,.]` and the mask leaves (segment ids `[B,T]`
    split like the tokens; per-example leaves over the batch axes only; T5's
    per-device table copies over the batch axes and seq_axis)."""
    def leaf_spec(x, kind):
        if kind == "table":
            return P(_device_axes(batch_axes, seq_axis))
        b = batch_axes if x.shape[0] != 1 else None
        return P(b, seq_axis) if kind != "other" else P(*([b] + [None] * (x.ndim - 1)))

    return (P(batch_axes, seq_axis, None, None),
            [leaf_spec(x, kd) for x, kd in zip(leaves, kinds)])


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
                   batch_axes=None, scale=None, softcap=None, load_balance: str = "zigzag",
                   natural_order: bool = True, block_q: int = DEFAULT_BLOCK,
                   block_kv: int = DEFAULT_BLOCK, skip_masked_blocks: bool = True,
                   implementation: str = "auto", block_sizes=None, unroll: bool | None = None,
                   alibi_slopes=None, alibi_positions=None,
                   relative_bias: RelativeBias | None = None):
    """q `[B,T,N,H]`, k/v `[B,S,K,H]` (global arrays) -> out `[B,T,N,H]`.

    Same semantics as `attention_reference(q, k, v, mask, scale=, softcap=,
    alibi_slopes=, alibi_positions=, relative_bias=)`; the sequence dims are split
    over `seq_axis` of `mesh` (and the batch over `batch_axes`, a mesh axis name or
    tuple of names, if given). ALiBi's and T5's explicit positions travel like
    segment ids (the kv ones rotate with K/V); index positions come from each
    chunk's global offset. T5's table (`relative_bias`): every device gets a copy and returns its partial gradient, summed over the devices.

    load_balance: "zigzag" (the default: 2n chunks, device i holds chunks i and
    2n-1-i, so causal work is even; needs T == S and T % 2n == 0) or "none" (device i
    holds positions [i*T/n, (i+1)*T/n)).
    With "zigzag" and `natural_order=True` the inputs/outputs are in natural order and
    re-laid out on device (ppermutes of half chunks, no gather); with
    `natural_order=False` they are already in zig-zag order (including the segment
    ids of a `masks.segments` mask) and the output is too.

    implementation: the per-block attention (`tfjax.ops.attention.select_ring_block`).
    "blockwise" (`tfjax.ops.blockwise`, any backend; tiles `block_q` x `block_kv`),
    "pallas" (the Pallas TPU kernels of `tfjax.ops.pallas.tpu`: Mosaic on TPU,
    interpret mode on CPU; tiles from `block_sizes`), or "auto" (pallas on TPU,
    blockwise elsewhere); another implementation raises.

    unroll: unroll the ring's steps (`lax.scan(unroll=True)`) or run them as a while
    loop. None: unrolled on CPU meshes only. XLA's CPU runtime may run a while loop that
    holds collectives concurrently with other collectives (e.g. the data-parallel
    gradient all-reduce), in a different order on each device, and deadlock;
    unrolled, the collective-permutes are ordered like every other collective. The
    while loop keeps one K/V block in flight; unrolled, XLA's CPU scheduler issues
    the transfers early and holds more blocks (see the module docstring).
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
        raise ValueError(f"ring_attention: load_balance='zigzag' needs T == S, got T={T}, "
                         f"S={S}; pass load_balance='none'")
    if T % (n * pieces) or S % (n * pieces):
        hint = "; or pass load_balance='none' (T, S divisible by n)" if pieces == 2 else ""
        raise ValueError(f"ring_attention: T={T} and S={S} must be divisible by "
                         f"{n * pieces} ({n} devices on {seq_axis!r} x {pieces} chunks){hint}")
    scale = float(H ** -0.5 if scale is None else scale)
    # The mesh's platform, not the default backend: an AOT compile for a TPU topology
    # runs on a CPU host.
    platform = mesh.devices.flat[0].platform
    rel = check_relative_bias(relative_bias, q.shape[0], N, T, S)
    block = select_ring_block(platform, mask, implementation, block_q=block_q, block_kv=block_kv,
                              block_sizes=block_sizes)
    if unroll is None:
        unroll = platform == "cpu"

    alibi = make_alibi(alibi_slopes, alibi_positions, q.shape[0], N, T, S)
    leaves, treedef, kinds = _split_mask(mask, alibi, rel)
    leaves = _copy_tables(leaves, kinds, mesh, _device_axes(batch_axes, seq_axis))
    ti = kinds.index("table") if "table" in kinds else None  # the table's leaf
    # Natural order in and out under zigzag: re-laid out inside shard_map (ppermutes).
    reorder = load_balance == "zigzag" and natural_order and n > 1

    tok, leaf_specs = _specs(leaves, kinds, batch_axes, seq_axis)
    Tl, Sl = T // n, S // n
    cq, ckv = Tl // pieces, Sl // pieces  # piece lengths

    def piece_offsets(dev, c):
        if pieces == 1:
            return [dev * c]
        return [dev * c, (2 * n - 1 - dev) * c]

    perm = [(j, (j + 1) % n) for j in range(n)]

    def split_leaves(mleaves):
        by = {"q": [], "kv": [], "other": []}
        for x, kd in zip(mleaves, kinds):
            by[kd if kd != "table" else "other"].append(x)
        return by["q"], by["kv"], by["other"]

    def build_mask(qseg, kvseg, other):
        """(mask, alibi, relative bias) of a block from its leaves (the table is an
        "other" leaf)."""
        if treedef is None:
            return None, None, None
        it_q, it_kv, it_o = iter(qseg), iter(kvseg), iter(other)
        out = [next(it_q) if kd == "q" else next(it_kv) if kd == "kv" else next(it_o)
               for kd in kinds]
        return jax.tree_util.tree_unflatten(treedef, out)

    def cut(x, c, axis=1):
        return [lax.slice_in_dim(x, p * c, (p + 1) * c, axis=axis) for p in range(pieces)]

    def visit(state, blk_kv_leaves, src, q_seg, other, compute):
        """Run `compute(state, p, r, mask, q_off, kv_off, alibi_kw)` for every (q piece
        p, kv piece r) pair of this step, skipping (lax.cond) the pairs whose whole
        block is masked; `state` is threaded through."""
        i = lax.axis_index(seq_axis)
        q_offs, kv_offs = piece_offsets(i, cq), piece_offsets(src, ckv)
        kv_seg = [cut(x, ckv) for x in blk_kv_leaves]
        for p in range(pieces):
            for r in range(pieces):
                m, a, rl = build_mask(q_seg[p], [x[r] for x in kv_seg], other)
                qo, ko = q_offs[p], kv_offs[r]
                f = lambda st, p=p, r=r, m=m, qo=qo, ko=ko, a=_bias_kwargs(a, rl): compute(
                    st, p, r, m, qo, ko, a)
                if m is None or not skip_masked_blocks:
                    state = f(state)
                else:
                    code = m.blocks(cq, ckv, cq, ckv, q_offset=qo, kv_offset=ko)
                    state = lax.cond(jnp.all(code == masks_lib.EMPTY), lambda st: st, f, state)
        return state

    def ring_loop(carry, blk, step):
        """The forward's n steps; step s holds the block that started on device
        (i - s) mod n. `blk` moves with one ppermute per step, issued before the
        step's compute so XLA can overlap them; the last step sends nothing."""
        i = lax.axis_index(seq_axis)
        if n > 1:
            def body(c, s):
                carry, blk = c
                nxt = lax.ppermute(blk, seq_axis, perm)
                return (step(carry, blk, (i - s) % n), nxt), None

            # Steps 0..n-2, unrolled: XLA's CPU runtime may otherwise run a while loop
            # holding collectives concurrently with other collectives in a different
            # order on each device and deadlock (seen with the data-parallel gradient
            # all-reduce on a data x sequence mesh); unrolled, the collective-permutes
            # are ordered like every other collective, and the scheduler sees them all.
            (carry, blk), _ = lax.scan(body, (carry, blk), jnp.arange(n - 1, dtype=jnp.int32),
                                       unroll=unroll)
        return step(carry, blk, (i - (n - 1)) % n)

    def local_parts(q, mleaves, table):
        if ti is not None:  # the (differentiable) table back in its leaf's place
            mleaves = [table if j == ti else x for j, x in enumerate(mleaves)]
        q_leaves, kv_leaves, other = split_leaves(mleaves)
        q_seg = [[x[p] for x in [cut(y, cq) for y in q_leaves]] for p in range(pieces)]
        return q_seg, kv_leaves, other

    # ---- forward: saves only q, k, v, out and the fp32 lse --------------------- #
    def fwd_impl(q, k, v, table, mleaves):
        q_seg, kv_leaves, other = local_parts(q, mleaves, table)
        qs = cut(q, cq)
        b = q.shape[0]
        acc = tuple((jnp.zeros((b, cq, N, H), jnp.float32),
                     jnp.full((b, N, cq), -jnp.inf, jnp.float32)) for _ in range(pieces))

        def step(acc, blk, src):
            kb, vb, kvl = blk
            ks, vs = cut(kb, ckv), cut(vb, ckv)

            def compute(acc, p, r, m, qo, ko, alibi_kw):
                o2, l2 = block.forward(qs[p], ks[r], vs[r], m, scale=scale, softcap=softcap,
                                       q_offset=qo, kv_offset=ko, **alibi_kw)
                acc = list(acc)
                acc[p] = _merge(*acc[p], o2, l2)
                return tuple(acc)

            return visit(acc, kvl, src, q_seg, other, compute)

        acc = ring_loop(acc, (k, v, list(kv_leaves)), step)
        out = jnp.concatenate([o for o, _ in acc], axis=1).astype(q.dtype)
        lse = jnp.concatenate([lse for _, lse in acc], axis=2)
        return out, lse

    # ---- backward: a second ring; dK/dV ride with K/V back to their owners ---- #
    def bwd_impl(q, k, v, table, mleaves, out, lse, dout):
        q_seg, kv_leaves, other = local_parts(q, mleaves, table)
        qs, outs, douts = cut(q, cq), cut(out, cq), cut(dout.astype(q.dtype), cq)
        lses = cut(lse, cq, axis=2)
        dq0 = tuple(jnp.zeros((q.shape[0], cq, N, H), jnp.float32) for _ in range(pieces))
        # T5's table: this device's partial gradient, threaded with dQ
        dt0 = None if table is None else jnp.zeros(table.shape, jnp.float32)
        zkv = jnp.zeros(k.shape, jnp.float32)

        def step(carry, blk, src):
            dq, dtable = carry
            kb, vb, kvl, dk, dv = blk
            ks, vs = cut(kb, ckv), cut(vb, ckv)
            state = (dq, tuple(cut(dk, ckv)), tuple(cut(dv, ckv)), dtable)

            def compute(state, p, r, m, qo, ko, alibi_kw):
                dq, dk, dv = (list(x) for x in state[:3])
                dtable = state[3]
                a, b, c, *dt = block.backward(qs[p], ks[r], vs[r], m, outs[p], lses[p],
                                              douts[p], scale=scale, softcap=softcap,
                                              q_offset=qo, kv_offset=ko, **alibi_kw)
                if dt:
                    dtable = dtable + dt[0]
                dq[p], dk[r], dv[r] = dq[p] + a, dk[r] + b, dv[r] + c
                return tuple(dq), tuple(dk), tuple(dv), dtable

            dq, dks, dvs, dtable = visit(state, kvl, src, q_seg, other, compute)
            return (dq, dtable), (jnp.concatenate(dks, axis=1), jnp.concatenate(dvs, axis=1))

        (dq, dtable), dkv = ring_backward_loop((dq0, dt0), (zkv, zkv), (k, v, list(kv_leaves)),
                                               step)
        dq = jnp.concatenate(dq, axis=1).astype(q.dtype)
        dtable = None if table is None else dtable.astype(table.dtype)
        return dq, dkv[0].astype(k.dtype), dkv[1].astype(v.dtype), dtable

    def ring_backward_loop(dq, dkv, blk, step):
        """The backward's n steps: K/V (and kv ids) move before each compute as in
        the forward; the fp32 dK/dV accumulators move after it, n times in all, so
        each arrives back on its owner."""
        i = lax.axis_index(seq_axis)

        def one(dq, blk, dkv, s, last):
            nxt = None if last else lax.ppermute(blk, seq_axis, perm)
            kb, vb, kvl = blk
            dq, dkv = step(dq, (kb, vb, kvl, *dkv), (i - s) % n)
            if n > 1:  # after its n-th move a dK/dV accumulator is back on its owner
                dkv = lax.ppermute(dkv, seq_axis, perm)
            return dq, nxt, dkv

        if n > 1:
            def body(c, s):
                dq, blk, dkv = one(*c, s, False)
                return (dq, blk, dkv), None

            (dq, blk, dkv), _ = lax.scan(body, (dq, blk, dkv), jnp.arange(n - 1, dtype=jnp.int32),
                                       unroll=unroll)
        dq, _, dkv = one(dq, blk, dkv, n - 1, True)
        return dq, dkv

    @jax.custom_vjp
    def core(q, k, v, table, mleaves):
        return fwd_impl(q, k, v, table, mleaves)[0]

    def core_fwd(q, k, v, table, mleaves):
        out, lse = fwd_impl(q, k, v, table, mleaves)
        return out, (q, k, v, table, mleaves, out, lse)

    def core_bwd(res, dout):
        q, k, v, table, mleaves, out, lse = res
        dq, dk, dv, dtable = bwd_impl(q, k, v, table, mleaves, out, lse, dout)
        return dq, dk, dv, dtable, [None if x is None else _zero_cotangent(x) for x in mleaves]

    core.defvjp(core_fwd, core_bwd)

    def local(q, k, v, *mleaves):
        if reorder:
            to_zz = lambda x: _relayout_local(x, n, seq_axis, "natural", "zigzag")
            q, k, v = to_zz(q), to_zz(k), to_zz(v)
            mleaves = [to_zz(x) if kd in ("q", "kv") else x for x, kd in zip(mleaves, kinds)]
        table = None
        if ti is not None:  # this device's copy; its leaf slot is filled in local_parts
            table, mleaves = mleaves[ti][0], [None if j == ti else x
                                              for j, x in enumerate(mleaves)]
        out = core(q, k, v, table, list(mleaves))
        if reorder:
            out = _relayout_local(out, n, seq_axis, "zigzag", "natural")
        return out

    fn = _shard_map(local, mesh=mesh, in_specs=(tok, tok, tok, *leaf_specs), out_specs=tok)
    return fn(q, k, v, *leaves)


# --------------------------------------------------------------------------- #
# The all-gather baseline and the layer-level entry point.
# --------------------------------------------------------------------------- #


def all_gather_attention(q, k, v, mask: masks_lib.Mask | None = None, *, mesh,
                         seq_axis: str = "sequence", batch_axes=None, scale=None, softcap=None,
                         block_q: int = DEFAULT_BLOCK, block_kv: int = DEFAULT_BLOCK,
                         alibi_slopes=None, alibi_positions=None,
                         relative_bias: RelativeBias | None = None):
    """The simple context-parallel baseline: same arguments and result as
    `ring_attention` (natural order), but each device all-gathers the whole K/V
    (and kv segment ids) over `seq_axis` and attends its own queries to it with
    `blockwise_attention` at its global query offset. Per-device memory holds the
    full K/V, O(S); autodiff turns the gather into a reduce-scatter of dK/dV."""
    n = mesh.shape[seq_axis]
    T, S = q.shape[1], k.shape[1]
    if T % n or S % n:
        raise ValueError(f"all_gather_attention: T={T} and S={S} must be divisible by the {n} "
                         f"devices on {seq_axis!r}")
    alibi = make_alibi(alibi_slopes, alibi_positions, q.shape[0], q.shape[2], T, S)
    rel = check_relative_bias(relative_bias, q.shape[0], q.shape[2], T, S)
    leaves, treedef, kinds = _split_mask(mask, alibi, rel)
    leaves = _copy_tables(leaves, kinds, mesh, _device_axes(batch_axes, seq_axis))
    tok, leaf_specs = _specs(leaves, kinds, batch_axes, seq_axis)

    def local(q, k, v, *mleaves):
        gather = lambda x: lax.all_gather(x, seq_axis, axis=1, tiled=True)
        k, v = gather(k), gather(v)
        mleaves = [gather(x) if kd == "kv" else x[0] if kd == "table" else x
                   for x, kd in zip(mleaves, kinds)]
        m, a, rl = ((None, None, None) if treedef is None else
                    jax.tree_util.tree_unflatten(treedef, mleaves))
        qo = lax.axis_index(seq_axis) * q.shape[1]
        return blockwise_attention(q, k, v, m, scale=scale, softcap=softcap, q_offset=qo,
                                   block_q=block_q, block_kv=block_kv, **_bias_kwargs(a, rl))

    fn = _shard_map(local, mesh=mesh, in_specs=(tok, tok, tok, *leaf_specs), out_specs=tok)
    return fn(q, k, v, *leaves)


_ABSENT = object()


def batch_sharded_attention(fn, q, k, v, mask, *, mesh, batch_axes, head_axes, bias=None,
                            alibi=None, relative_bias=_ABSENT, **kw):
    """`fn(q, k, v, mask, bias=, alibi=, [relative_bias=], **kw)`, one attention
    implementation (`Implementation.fn`), run per device under shard_map over `mesh`
    (the per-device runner `sharding.use_rules` gives `tfjax.ops.target`, with the
    mesh axes its rules give "batch" and "heads": `batch_axes`, `head_axes`, each a
    mesh axis name, a tuple of them or None): examples split over `batch_axes`, and
    heads over `head_axes` when they divide the query
    heads (each device gets whole GQA groups; where the axes do not divide the kv
    heads, as MQA's one kv head on tensor=4, each kv head is repeated so every device
    holds those of its query heads; ALiBi slopes, T5's table and a bias array follow
    their head axis); tokens and every other axis replicated. For
    kernels XLA cannot partition (Pallas custom calls), which its SPMD partitioner
    would otherwise run on the gathered global batch on every device. None (the
    caller runs `fn` as is) when the call is already inside shard_map or nothing
    splits."""
    if jax.sharding.get_abstract_mesh().manual_axes:
        return None

    def axes_of(axes, size):
        axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
        axes = tuple(a for a in axes if mesh.shape[a] > 1)
        n = int(np.prod([mesh.shape[a] for a in axes]))
        return (axes, n) if axes and size % n == 0 else ((), 1)

    N, K = q.shape[2], k.shape[2]
    b_axes, D = axes_of(batch_axes, q.shape[0])
    h_axes, _ = axes_of(head_axes, N)
    h_axes = tuple(a for a in h_axes if a not in b_axes)
    if not b_axes and not h_axes:
        return None
    Dh = int(np.prod([mesh.shape[a] for a in h_axes]))
    if K % Dh:
        # The head axes split the query heads but not the kv heads (MQA, or GQA with
        # fewer kv heads than devices): each kv head is repeated r times, so that every
        # device holds the kv heads of its own query heads (K*r = lcm(K, Dh) divides N,
        # so query head n still reads copy n // (N / (K*r)) of kv head n // G). The
        # repeat's transpose sums the copies' gradients.
        r = Dh // math.gcd(K, Dh)
        k, v = jnp.repeat(k, r, axis=2), jnp.repeat(v, r, axis=2)
    b, h = b_axes or None, h_axes or None
    takes_relative = relative_bias is not _ABSENT  # fn's signature has relative_bias=
    rel = None if relative_bias is _ABSENT else relative_bias
    leaves, treedef, kinds = _split_mask(mask, alibi, rel)
    slopes = None if alibi is None else alibi.slopes
    leaves = [jnp.broadcast_to(x[None], (D, *x.shape)) if kd == "table" else x
              for x, kd in zip(leaves, kinds)]  # one table copy per batch device (its grad)

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
    specs = [tok, tok, tok, bias_spec, *[P() for _ in dynamic],
             *[leaf_spec(x, kd) for x, kd in zip(leaves, kinds)]]

    def local(q, k, v, bias, *rest):
        it = iter(rest[:len(dynamic)])
        offs = [o if st else next(it) for o, st in zip(offsets, static)]
        mleaves = [x[0] if kd == "table" else x for x, kd in zip(rest[len(dynamic):], kinds)]
        m, a, rl = ((None, None, None) if treedef is None else
                    jax.tree_util.tree_unflatten(treedef, mleaves))
        extra = dict(relative_bias=rl) if takes_relative else {}
        return fn(q, k, v, m, bias=bias, alibi=a, **{**kw, "q_offset": offs[0],
                                                      "kv_offset": offs[1]}, **extra)

    out_specs = (tok, P(b, h, None)) if kw.get("return_lse") else tok
    return _shard_map(local, mesh=mesh, in_specs=tuple(specs), out_specs=out_specs)(*args)


CONTEXT_PARALLEL_MODES = ("ring", "all_gather")
# Zig-zag load balancing of ring attention (`ModelConfig.zigzag`): "data" (the trainer
# puts each batch in zig-zag order once; layers run the ring with natural_order=False),
# "layer" (natural-order data; each layer re-lays out q, k, v, segment ids and the
# output with half-chunk ppermutes), "none" (contiguous chunks, unbalanced).
ZIGZAG_MODES = ("data", "layer", "none")


class _DataLayout(threading.local):
    devices: int = 0  # > 0: the traced step's per-token arrays are in zig-zag order


_DATA_LAYOUT = _DataLayout()


@contextlib.contextmanager
def zigzag_data(n: int):
    """Declare, while tracing a step, that every per-token array of its batch (tokens,
    targets, positions, segment ids, loss weights) was put in zig-zag order over the
    n devices of the sequence axis (`zigzag(x, n, axis=1)`, done by the trainer on the
    host). `context_parallel_attention` then runs the ring with `natural_order=False`
    (no per-layer re-layout) and refuses any attention it cannot evaluate on global
    natural positions. Only the trainer's train/eval steps activate it."""
    saved = _DATA_LAYOUT.devices
    _DATA_LAYOUT.devices = int(n)
    try:
        yield
    finally:
        _DATA_LAYOUT.devices = saved


def zigzag_data_devices() -> int:
    """n when tracing under `zigzag_data(n)`, else 0."""
    return _DATA_LAYOUT.devices


def context_parallel_attention(q, k, v, mask: masks_lib.Mask | None = None, *, mode: str = "ring",
                               zigzag: str = "data", scale=None, softcap=None,
                               alibi: Alibi | None = None,
                               relative_bias: RelativeBias | None = None):
    """Attention for a layer under an active mesh (`sharding.use_rules`, as the trainer
    sets it) whose rules split the logical "length" axis over a mesh axis of size
    n > 1: `ring_attention` (mode "ring") or `all_gather_attention` (mode
    "all_gather"). Returns None when no such mesh is active or the call is not
    sequence-parallel self-attention (T != S, e.g. cross-attention): the caller then
    uses `dot_product_attention`.

    Ring load balancing (`zigzag`, when T % 2n == 0 and there is a mask): under
    `zigzag_data(n)` (the trainer's steps with `zigzag="data"`) q, k, v and the mask's
    segment ids are already in zig-zag order, so the ring runs with
    `natural_order=False` and the output stays in that order; otherwise ("data"
    outside such a step, e.g. sampling, or "layer") the data is in natural order and
    the ring re-lays it out in and out (four half-chunk ppermutes per tensor);
    "none": contiguous chunks, no balancing. Masks are evaluated on global natural
    positions either way (the ring passes each chunk's global offset). `alibi`: a
    `tfjax.ops.Alibi`, `relative_bias` a `tfjax.ops.RelativeBias` (T5; their explicit
    positions are per-token arrays, laid out like the segment ids).
    """
    from tfjax.parallel.sharding import active_mesh, logical_to_spec

    if mode not in CONTEXT_PARALLEL_MODES:
        raise ValueError(f"context_parallel: got {mode!r}; allowed: "
                         f"{', '.join(map(repr, CONTEXT_PARALLEL_MODES))}")
    if zigzag not in ZIGZAG_MODES:
        raise ValueError(f"zigzag: got {zigzag!r}; allowed: {', '.join(map(repr, ZIGZAG_MODES))}")
    data_n = zigzag_data_devices()
    if data_n and (zigzag != "data" or mode != "ring"):
        raise ValueError(f"context_parallel: the batch is in zig-zag order (zigzag_data({data_n}))"
                         f" but this layer has context_parallel={mode!r}, zigzag={zigzag!r}; "
                         f"only context_parallel='ring' with zigzag='data' reads that order")
    mesh = active_mesh()
    seq_axes = ()
    if mesh is not None and q.shape[1] == k.shape[1]:
        batch_axes, seq_axes = tuple(logical_to_spec(("batch", "length")))
        seq_axes = (seq_axes,) if isinstance(seq_axes, str) else tuple(seq_axes or ())
        seq_axes = tuple(a for a in seq_axes if mesh.shape[a] > 1)
    if not seq_axes:
        if data_n:
            raise ValueError(f"context_parallel: the batch is in zig-zag order over {data_n} "
                             f"devices but this attention (q {q.shape}, k {k.shape}) is not "
                             f"sequence-parallel self-attention, so it would read the tokens "
                             f"out of order; use model.zigzag='layer'")
        return None
    if len(seq_axes) > 1:
        raise ValueError(f"context_parallel: the rules split 'length' over several mesh axes "
                         f"{seq_axes}; ring attention runs over one (map 'length' to one axis)")
    seq_axis, n, T = seq_axes[0], mesh.shape[seq_axes[0]], q.shape[1]
    if data_n and (data_n != n or T % (2 * n)):
        raise ValueError(f"context_parallel: the batch is in zig-zag order over {data_n} "
                         f"devices, but {seq_axis!r} has {n} and T={T} (zig-zag needs "
                         f"T % {2 * n} == 0)")
    if mode == "all_gather":
        return all_gather_attention(q, k, v, mask, mesh=mesh, seq_axis=seq_axis,
                                    batch_axes=batch_axes, scale=scale, softcap=softcap,
                                    relative_bias=relative_bias, **Alibi.kwargs(alibi))
    zz = bool(data_n) or (zigzag != "none" and mask is not None and T % (2 * n) == 0)
    return ring_attention(q, k, v, mask, mesh=mesh, seq_axis=seq_axis, batch_axes=batch_axes,
                          scale=scale, softcap=softcap, load_balance="zigzag" if zz else "none",
                          natural_order=not data_n, relative_bias=relative_bias,
                          **Alibi.kwargs(alibi))
