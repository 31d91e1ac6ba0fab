"""Ring attention (Liu et al. 2023) and the all-gather baseline over a mesh axis.

`ring_attention(q, k, v, mask, *, mesh, seq_axis="sequence", load_balance="zigzag",
implementation="auto", ...)`: global q `[B,T,N,H]`, k `[B,S,K,H]`, v `[B,S,K,Hv]`
sharded over `seq_axis` -> `[B,T,N,Hv]`, exactly `attention_reference`'s result. Under
`jax.shard_map`, K/V blocks travel the ring by `lax.ppermute`, partial results merge in
fp32 through the logsumexp, fully masked blocks are skipped, and a hand-written
`custom_vjp` circulates dK/dV on a second ring (O(S/n) saved per device, no O(S^2)).
`ring_core` is that per-device ring, shared with USP (`tfjax.parallel.ulysses`).
`all_gather_attention` (same arguments) is the baseline: each device gathers the whole
K/V. A layer's choice: `tfjax.parallel.context_parallel`. See docs/long_context.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from tfjax.ops import masks as masks_lib
from tfjax.ops.attention import dot_product_attention, select_ring_block
from tfjax.ops.blockwise import DEFAULT_BLOCK, blockwise_attention
from tfjax.ops.reference import RelativeBias, check_relative_bias, make_alibi
from tfjax.ops.sinks import add_sinks, check_sinks, sinks_gradient
from tfjax.ops.target import device_platform, targeting
from tfjax.ops.vjp import zero_cotangent
from tfjax.parallel import mask_leaves
from tfjax.parallel.zigzag import relayout_local

__all__ = ["all_gather_attention", "ring_attention", "ring_core"]


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
# The per-device ring, shared with USP.
# --------------------------------------------------------------------------- #


def ring_core(*, seq_axis: str, n: int, pieces: int, cq: int, ckv: int, Hv: int, block,
              scale: float, softcap, kinds, treedef, skip_masked_blocks: bool = True,
              unroll: bool = True):
    """The ring's per-device attention, for a function run under `shard_map` over a mesh
    with `seq_axis` (n devices): `core(q, k, v, table, sink, mleaves) -> out`, a
    `custom_vjp` (the module docstring). Device i's local q `[b, pieces*cq, N', H]`,
    k `[b, pieces*ckv, K', H]`, v `[b, pieces*ckv, K', Hv]` hold global chunk i of n
    (`pieces` 1) or chunks i and 2n-1-i of 2n (`pieces` 2, zig-zag), any heads (N' a
    multiple of K'); `mleaves` the local leaves of `mask_leaves.split_mask` (`kinds`,
    `treedef`) laid out like the tokens, the table's slot None; `table` T5's table and
    `sink` `[N']` for these heads, or None. `block`: `select_ring_block`'s per-block
    implementation. Shared by `ring_attention` and `tfjax.parallel.ulysses.usp_attention`
    (the ring across the Ulysses groups)."""
    ti = kinds.index("table") if "table" in kinds else None  # the table's leaf

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
        it_q, it_kv, it_o = iter(qseg), iter(kvseg), iter(other)
        out = [next(it_q) if kd == "q" else next(it_kv) if kd == "kv" else next(it_o)
               for kd in kinds]
        return mask_leaves.unflatten(treedef, out)

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
                qo, ko, bias_kw = q_offs[p], kv_offs[r], mask_leaves.bias_kwargs(a, rl)
                f = lambda st, p=p, r=r, m=m, qo=qo, ko=ko, a=bias_kw: compute(
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
    def fwd_impl(q, k, v, table, sink, mleaves):
        q_seg, kv_leaves, other = local_parts(q, mleaves, table)
        qs = cut(q, cq)
        b = q.shape[0]
        Nd = q.shape[2]  # this device's heads (N / u)
        acc = tuple((jnp.zeros((b, cq, Nd, Hv), jnp.float32),
                     jnp.full((b, Nd, cq), -jnp.inf, jnp.float32)) for _ in range(pieces))

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
        out = jnp.concatenate([o for o, _ in acc], axis=1)
        lse = jnp.concatenate([lse for _, lse in acc], axis=2)
        if sink is not None:  # once per row, on the merged result
            out, lse = add_sinks(out, lse, sink)
        return out.astype(q.dtype), lse

    # ---- backward: a second ring; dK/dV ride with K/V back to their owners ---- #
    def bwd_impl(q, k, v, table, mleaves, out, lse, dout):
        q_seg, kv_leaves, other = local_parts(q, mleaves, table)
        qs, outs, douts = cut(q, cq), cut(out, cq), cut(dout.astype(q.dtype), cq)
        lses = cut(lse, cq, axis=2)
        dq0 = tuple(jnp.zeros(q.shape[:1] + (cq,) + q.shape[2:], jnp.float32)
                    for _ in range(pieces))
        # T5's table: this device's partial gradient, threaded with dQ
        dt0 = None if table is None else jnp.zeros(table.shape, jnp.float32)

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

        dkv0 = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
        (dq, dtable), dkv = ring_backward_loop((dq0, dt0), dkv0, (k, v, list(kv_leaves)), step)
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
    def core(q, k, v, table, sink, mleaves):
        return fwd_impl(q, k, v, table, sink, mleaves)[0]

    def core_fwd(q, k, v, table, sink, mleaves):
        out, lse = fwd_impl(q, k, v, table, sink, mleaves)
        return out, (q, k, v, table, sink, mleaves, out, lse)

    def core_bwd(res, dout):
        # From the final (with-sink) out and lse the blocks' backward is exact for
        # q, k, v; the sinks' own gradient is `sinks_gradient`.
        q, k, v, table, sink, mleaves, out, lse = res
        dq, dk, dv, dtable = bwd_impl(q, k, v, table, mleaves, out, lse, dout)
        dsink = None if sink is None else sinks_gradient(out, lse, dout, sink).astype(sink.dtype)
        return dq, dk, dv, dtable, dsink, [None if x is None else zero_cotangent(x)
                                           for x in mleaves]

    core.defvjp(core_fwd, core_bwd)
    return core


# --------------------------------------------------------------------------- #
# ring_attention.
# --------------------------------------------------------------------------- #


def ring_attention(q, k, v, mask: masks_lib.Mask | None = None, *, mesh, seq_axis: str = "sequence",
                   batch_axes=None, scale=None, softcap=None, load_balance: str = "zigzag",
                   natural_order: bool = True, block_q: int = DEFAULT_BLOCK,
                   block_kv: int = DEFAULT_BLOCK, skip_masked_blocks: bool = True,
                   implementation: str = "auto", block_sizes=None, unroll: bool | None = None,
                   alibi_slopes=None, alibi_positions=None,
                   relative_bias: RelativeBias | None = None, sinks=None):
    """q `[B,T,N,H]`, k `[B,S,K,H]`, v `[B,S,K,Hv]` (global arrays) -> out `[B,T,N,Hv]`.

    Same semantics as `attention_reference(q, k, v, mask, scale=, softcap=,
    alibi_slopes=, alibi_positions=, relative_bias=, sinks=)`; the sequence dims are split
    over `seq_axis` of `mesh` and the batch over `batch_axes` (a mesh axis name, a
    tuple of names, or () to replicate the batch; None, the default: inferred by
    `mask_leaves.infer_batch_axes` from q's sharding, or traced from the mesh's
    data axes, so no device computes examples another one holds). ALiBi's and T5's explicit positions travel like
    segment ids (the kv ones rotate with K/V); index positions come from each
    chunk's global offset. T5's table (`relative_bias`): every device gets a copy and
    returns its partial gradient, summed over the devices; so do learned `sinks`
    `[N]`, which join each query row once, after its ring of blocks is merged
    (`tfjax.ops.sinks`). The per-device ring is `ring_core` (USP runs it too).

    load_balance: "zigzag" (the default: 2n chunks, device i holds chunks i and
    2n-1-i, so causal work is even; needs T == S and T % 2n == 0) or "none" (device i
    holds positions [i*T/n, (i+1)*T/n)).
    With "zigzag" and `natural_order=True` the inputs/outputs are in natural order and
    re-laid out on device (ppermutes of half chunks, no gather); with
    `natural_order=False` they are already in zig-zag order (including the segment
    ids of a `masks.segments` mask) and the output is too.

    implementation: the per-block attention (`tfjax.ops.attention.select_ring_block`
    on the mesh's platform): "blockwise" (`tfjax.ops.blockwise`, any backend; tiles
    `block_q` x `block_kv`), "pallas" (the Pallas TPU kernels: Mosaic on TPU,
    interpret mode on CPU; tiles from `block_sizes`), or "auto" (the ring's order,
    `RING_AUTO_ORDER`: pallas on TPU when the kernels can evaluate the mask, else
    blockwise). Any other implementation, or one that cannot run this mask on this
    platform, raises a ValueError naming what the ring can run.

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
    masks_lib.check_lengths(mask, T, S, "ring_attention")
    pieces = 2 if load_balance == "zigzag" else 1
    if load_balance == "zigzag" and T != S:
        raise ValueError(f"ring_attention: load_balance='zigzag' needs T == S, got T={T}, "
                         f"S={S}; pass load_balance='none'")
    if T % (n * pieces) or S % (n * pieces):
        hint = "; or pass load_balance='none' (T, S divisible by n)" if pieces == 2 else ""
        raise ValueError(f"ring_attention: T={T} and S={S} must be divisible by "
                         f"{n * pieces} ({n} devices on {seq_axis!r} x {pieces} chunks){hint}")
    Hv = v.shape[-1]
    batch_axes = mask_leaves.resolve_batch_axes(batch_axes, q, mesh, seq_axis, "ring_attention")
    scale = float(H ** -0.5 if scale is None else scale)
    sinks = check_sinks(sinks, N, "ring_attention")
    # The mesh's platform, not the default backend: an AOT compile for a TPU topology
    # runs on a CPU host.
    platform = device_platform(mesh.devices.flat[0])
    rel = check_relative_bias(relative_bias, q.shape[0], N, T, S)
    block = select_ring_block(platform, mask, implementation, block_q=block_q, block_kv=block_kv,
                              block_sizes=block_sizes)
    if unroll is None:
        unroll = platform == "cpu"

    alibi = make_alibi(alibi_slopes, alibi_positions, q.shape[0], N, T, S)
    leaves, treedef, kinds = mask_leaves.split_mask(mask, alibi, rel)
    leaves = mask_leaves.copy_tables(leaves, kinds, mesh,
                                      mask_leaves.device_axes(batch_axes, seq_axis))
    ti = kinds.index("table") if "table" in kinds else None  # the table's leaf
    # Natural order in and out under zigzag: re-laid out inside shard_map (ppermutes).
    reorder = load_balance == "zigzag" and natural_order and n > 1

    tok, leaf_specs = mask_leaves.token_specs(leaves, kinds, batch_axes, seq_axis)
    Tl, Sl = T // n, S // n
    cq, ckv = Tl // pieces, Sl // pieces  # piece lengths

    core = ring_core(seq_axis=seq_axis, n=n, pieces=pieces, cq=cq, ckv=ckv, Hv=Hv, block=block,
                     scale=scale, softcap=softcap, kinds=kinds, treedef=treedef,
                     skip_masked_blocks=skip_masked_blocks, unroll=unroll)

    def local(q, k, v, sink_copy, *mleaves):
        if reorder:
            to_zz = lambda x: relayout_local(x, n, seq_axis, "natural", "zigzag")
            q, k, v = to_zz(q), to_zz(k), to_zz(v)
            mleaves = [to_zz(x) if kd in ("q", "kv") else x for x, kd in zip(mleaves, kinds)]
        table = None
        if ti is not None:  # this device's copy; its leaf slot is filled in local_parts
            table, mleaves = mleaves[ti][0], [None if j == ti else x
                                              for j, x in enumerate(mleaves)]
        sink = None if sink_copy is None else sink_copy[0]
        out = core(q, k, v, table, sink, list(mleaves))
        if reorder:
            out = relayout_local(out, n, seq_axis, "zigzag", "natural")
        return out

    dev = mask_leaves.device_axes(batch_axes, seq_axis)
    sink_spec = None if sinks is None else P(dev)
    fn = mask_leaves.shard_map(local, mesh=mesh, in_specs=(tok, tok, tok, sink_spec, *leaf_specs),
                               out_specs=tok)
    return fn(q, k, v, mask_leaves.device_copies(sinks, mesh, dev), *leaves)


# --------------------------------------------------------------------------- #
# The all-gather baseline.
# --------------------------------------------------------------------------- #


def all_gather_attention(q, k, v, mask: masks_lib.Mask | None = None, *, mesh,
                         seq_axis: str = "sequence", batch_axes=None, scale=None, softcap=None,
                         block_q: int = DEFAULT_BLOCK, block_kv: int = DEFAULT_BLOCK,
                         implementation: str = "auto", alibi_slopes=None, alibi_positions=None,
                         relative_bias: RelativeBias | None = None, sinks=None):
    """The simple context-parallel baseline: same arguments and result as
    `ring_attention` (natural order), but each device all-gathers the whole K/V
    (and kv segment ids and positions) over `seq_axis` and attends its own queries
    to it at its global query offset. Per-device memory holds the full K/V, O(S);
    autodiff turns the gather into a reduce-scatter of dK/dV.

    implementation: what each device runs. "auto" and "blockwise":
    `blockwise_attention` (tiles `block_q` x `block_kv`). Any other
    (`tfjax.ops.attention.IMPLEMENTATIONS`): `dot_product_attention(...,
    implementation=, q_offset=<the device's global offset>)` targeting the mesh's
    platform; one that cannot serve that call (e.g. "cudnn", which takes no
    offsets) raises a ValueError with the dispatch's reason while tracing."""
    n = mesh.shape[seq_axis]
    T, S = q.shape[1], k.shape[1]
    masks_lib.check_lengths(mask, T, S, "all_gather_attention")
    if T % n or S % n:
        raise ValueError(f"all_gather_attention: T={T} and S={S} must be divisible by the {n} "
                         f"devices on {seq_axis!r}")
    alibi = make_alibi(alibi_slopes, alibi_positions, q.shape[0], q.shape[2], T, S)
    rel = check_relative_bias(relative_bias, q.shape[0], q.shape[2], T, S)
    sinks = check_sinks(sinks, q.shape[2], "all_gather_attention")
    batch_axes = mask_leaves.resolve_batch_axes(batch_axes, q, mesh, seq_axis,
                                                "all_gather_attention")
    dev = mask_leaves.device_axes(batch_axes, seq_axis)
    leaves, treedef, kinds = mask_leaves.split_mask(mask, alibi, rel)
    leaves = mask_leaves.copy_tables(leaves, kinds, mesh, dev)
    tok, leaf_specs = mask_leaves.token_specs(leaves, kinds, batch_axes, seq_axis)
    platform = device_platform(mesh.devices.flat[0])

    def attend(q, k, v, m, *, q_offset, sinks, **extras):
        if implementation in ("auto", "blockwise"):
            out = blockwise_attention(q, k, v, m, scale=scale, softcap=softcap,
                                      q_offset=q_offset, block_q=block_q, block_kv=block_kv,
                                      return_lse=sinks is not None, **extras)
            return out if sinks is None else add_sinks(*out, sinks)[0].astype(q.dtype)
        try:
            with targeting(platform):  # inside shard_map: no per-device runner
                return dot_product_attention(q, k, v, m, scale=scale, softcap=softcap,
                                             q_offset=q_offset, implementation=implementation,
                                             sinks=sinks, **extras)
        except ValueError as e:
            raise ValueError(f"all_gather_attention (per device, queries at their global "
                             f"offset): {e}") from None

    def local(q, k, v, sink_copy, *mleaves):
        gather = lambda x: lax.all_gather(x, seq_axis, axis=1, tiled=True)
        k, v = gather(k), gather(v)
        mleaves = [gather(x) if kd == "kv" else x for x, kd in zip(mleaves, kinds)]
        m, a, rl = mask_leaves.unflatten(treedef, mask_leaves.local_leaves(mleaves, kinds))
        qo = lax.axis_index(seq_axis) * q.shape[1]
        return attend(q, k, v, m, q_offset=qo, sinks=None if sink_copy is None else sink_copy[0],
                      **mask_leaves.bias_kwargs(a, rl))

    sink_spec = None if sinks is None else P(dev)
    fn = mask_leaves.shard_map(local, mesh=mesh, in_specs=(tok, tok, tok, sink_spec, *leaf_specs),
                               out_specs=tok)
    return fn(q, k, v, mask_leaves.device_copies(sinks, mesh, dev), *leaves)
