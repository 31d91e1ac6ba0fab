"""Shared by the attention tests: inputs, masks by name, the request an
implementation's `supports()` judges (`request`, `refusal`), and one check of an
implementation against `attention_reference` (forward, lse, dq, dk, dv, dbias,
T5's table, the sinks, all under one jit so each case compiles once)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from tfjax.ops import IMPLEMENTATIONS, AttentionRequest, attention_reference
from tfjax.ops import masks as M
from tfjax.ops import sparse_masks as SM
from tfjax.ops.sinks import add_sinks
from tfjax.ops.target import target_platform

TOL = {  # forward, grads (fp32: absolute + relative; bf16: relative error of the whole tensor)
    "float32": (1e-5, 1e-4),
    "bfloat16": (2e-2, 2e-2),
}


def inputs(B, T, S, N, K, H, dtype=jnp.float32, seed=0, bias=None, Hv=None):
    """q `[B,T,N,H]`, k `[B,S,K,H]`, v `[B,S,K,Hv]` (Hv default H), bias `[*bias, T, S]`."""
    ks = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(ks[0], (B, T, N, H), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (B, S, K, H), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (B, S, K, Hv or H), jnp.float32).astype(dtype)
    b = None
    if bias is not None:  # bias = (Bb, Nb)
        b = jax.random.normal(ks[3], (*bias, T, S), jnp.float32)
    return q, k, v, b


def request(q, k, v=None, mask=None, *, backend=None, bias=False, softcap=None, offsets=False,
            return_lse=False, alibi=False, relative=False, sinks=False) -> AttentionRequest:
    """The `AttentionRequest` `dot_product_attention` makes of such a call (q, k, v:
    arrays or ShapeDtypeStructs; the flags say which extras it carries), for
    `backend` (default: the platform this host traces for)."""
    v = k if v is None else v
    return AttentionRequest(
        q_shape=tuple(q.shape), k_shape=tuple(k.shape), dtype=str(q.dtype),
        backend=backend or target_platform(), mask=mask, has_bias=bool(bias or relative),
        softcap=float(softcap) if softcap else None, offsets=bool(offsets),
        return_lse=return_lse, has_alibi=bool(alibi), has_relative_bias=bool(relative),
        v_head_dim=v.shape[-1], has_sinks=bool(sinks))


def refusal(name: str, req: AttentionRequest) -> str | None:
    """Why implementation `name` of the table cannot serve `req` (its own `supports()`
    reason, prefixed with its name), or None."""
    reason = IMPLEMENTATIONS.get(name).supports(req)
    return reason and f"{name}: {reason}"


def lower_for_cuda(f, *args, gpu="H200"):
    """`jax.jit(f)` traced and lowered for the cuda platform as for `gpu`, on this
    machine without one (`gpu_lowering_target`); the lowered module's text."""
    from tfjax.ops.target import gpu_lowering_target

    with gpu_lowering_target(gpu):
        return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def segment_ids(B, L, seed, n=3):
    """Sorted random segment ids: packed sequences of random lengths."""
    rng = np.random.default_rng(seed)
    return np.sort(rng.integers(0, n, (B, L)), axis=1).astype(np.int32)


def cache_positions(B, T, S):
    """A KV cache's positions (`masks.positions`): even rows a linear cache (slot =
    position) with a run of empty slots (-1) before the last T, odd rows a ring
    buffer (rotated, every 7th slot empty); the T queries are the last positions
    (early ones negative when T > S: fully masked rows)."""
    lin = np.where((np.arange(S) >= S // 3) & (np.arange(S) < S // 2), -1, np.arange(S))
    ring = np.roll(np.arange(S) + 5, S // 3)
    ring[::7] = -1
    kv = np.stack([lin if b % 2 == 0 else ring for b in range(B)]).astype(np.int32)
    q = np.stack([np.arange(T) + S - T + (5 * (b % 2)) for b in range(B)]).astype(np.int32)
    return q, kv


def make_mask(name, B, T, S):
    if name == "none":
        return None
    if name == "causal":
        return M.causal()
    if name == "window":
        return M.sliding_window(17)
    if name == "window_lr":
        return M.sliding_window(9, 40)
    if name == "chunked":
        return M.chunked_causal(50)
    if name == "prefix":
        return M.prefix_lm(np.array([T // 3 + 1] + [1] * (B - 1)))
    if name == "segments":
        return M.segments(segment_ids(B, T, 1), segment_ids(B, S, 2))
    if name == "causal&segments":
        return M.causal() & M.segments(segment_ids(B, T, 1), segment_ids(B, S, 1))
    if name == "window&segments":
        return M.sliding_window(30, 5) & M.segments(segment_ids(B, T, 3), segment_ids(B, S, 3))
    if name == "padding_fully_masked":  # example 0 sees no key: its rows are fully masked
        return M.padding(np.array([0] + [S - S // 3] * (B - 1)))
    if name == "longformer&causal":  # global flags are kernel operands
        return M.causal() & SM.longformer(9, (0, 1, T // 2, T - 1))
    if name == "bigbird":  # window | globals | seeded random blocks (in-kernel hash)
        return SM.bigbird(6, 3, 2, 32, seed=11, seq_len=max(T, S) + 8)
    if name == "positions":  # a KV cache's mask: explicit positions, empty slots
        return M.positions(*cache_positions(B, T, S))
    if name == "positions_window":
        return M.positions(*cache_positions(B, T, S), window=37)
    if name == "prefix|window":
        return M.prefix_lm(np.array([5] * B)) | M.sliding_window(8)
    if name == "windowed(prefix)":  # a prefix-LM's sliding layer: the prefix stays whole
        return M.windowed(M.prefix_lm(np.array([T // 2 + 3] + [2] * (B - 1))), 6)
    if name == "windowed(causal|blocks)":  # Gemma 3's sliding layer over images in a text
        ids = np.full((B, max(T, S)), -1)
        ids[:, 5:40], ids[:, 60:62] = 0, 1
        return M.windowed(M.causal() | M.blocks(ids[:, :T], ids[:, :S]), 9)
    raise ValueError(name)


def _loss(out, lse):
    w = jnp.cos(jnp.arange(out.size, dtype=jnp.float32).reshape(out.shape))
    lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
    return jnp.sum(out.astype(jnp.float32) * w) + 0.5 * jnp.sum(jnp.sin(lse))


def dense_lse(q, k, mask, bias, scale, softcap, q_offset, kv_offset):
    """logsumexp from the dense logits (an independent ground truth for d lse)."""
    B, T, N, H = q.shape
    S, K = k.shape[1:3]
    qf = q.astype(jnp.float32).reshape(B, T, K, N // K, H)
    s = jnp.einsum("BTKGH,BSKH->BKGTS", qf, k.astype(jnp.float32)) * scale
    if softcap:
        s = softcap * jnp.tanh(s / softcap)
    if bias is not None:
        s = s + jnp.broadcast_to(bias, (B, N, T, S)).reshape(B, K, N // K, T, S)
    allowed = M.dense(mask, T, S, q_offset=q_offset, kv_offset=kv_offset)[:, None, None]
    s = jnp.where(allowed, s, -jnp.inf)
    return jax.nn.logsumexp(s, axis=-1).reshape(B, N, T)


def alibi_as_bias(slopes, positions, B, T, S, q_offset, kv_offset):
    """ALiBi as an explicit `[B, N, T, S]` bias, built by the layer-level
    `tfjax.nn.alibi_bias` from position arrays (independent of the ops' per-tile
    arithmetic): `positions` (q `[B, T]`, kv `[B, S]`) or the global indices."""
    from tfjax.nn.positions import alibi_bias
    if positions is None:
        positions = (jnp.arange(T) + jnp.asarray(q_offset), jnp.arange(S) + jnp.asarray(kv_offset))
    qp = jnp.broadcast_to(positions[0], (B, T))
    kp = jnp.broadcast_to(positions[1], (B, S))
    slopes = jnp.broadcast_to(jnp.asarray(slopes, jnp.float32), (B, jnp.shape(slopes)[-1]))
    return jax.vmap(lambda a, b, s: alibi_bias(a[None], b[None], s)[0])(qp, kp, slopes)


def relative_as_bias(rel, B, T, S, q_offset, kv_offset):
    """T5's bias (`relative_for`'s dict) as an explicit `[B, N, T, S]` bias: the
    layer-level bucketing of the whole `[T, S]` relative-position matrix and a
    gather from the table (no tiles, offsets or padding involved)."""
    from tfjax.nn.positions import relative_position_bucket
    positions = rel["positions"]
    if positions is None:
        positions = (jnp.arange(T) + jnp.asarray(q_offset), jnp.arange(S) + jnp.asarray(kv_offset))
    qp = jnp.broadcast_to(positions[0], (B, T))
    kp = jnp.broadcast_to(positions[1], (B, S))
    buckets = relative_position_bucket(kp[:, None, :] - qp[:, :, None],
                                       bidirectional=rel["bidirectional"],
                                       num_buckets=rel["table"].shape[0],
                                       max_distance=rel["max_distance"])
    return jnp.moveaxis(rel["table"][buckets], -1, 1)  # [B, T, S, N] -> [B, N, T, S]


def relative_for(kind, B, T, S, N, seed=5):
    """T5 bias of a test case (16 buckets, max distance 24, a random table):
    "causal" unidirectional at index positions, "bidir" bidirectional at index
    positions, "pos" bidirectional at explicit random positions (`[B, T]`, `[1, S]`,
    distances beyond max_distance included), "coarse" bidirectional at explicit
    positions index // 12 (`[B, T]`, `[1, S]`: far fewer tiles hold one bucket
    than the index positions would say)."""
    rng = np.random.default_rng(seed)
    table = jnp.asarray(rng.normal(size=(16, N)), jnp.float32)
    positions = None
    if kind == "pos":
        positions = (rng.integers(0, 60, (B, T)).astype(np.int32),
                     rng.integers(0, 60, (1, S)).astype(np.int32))
    if kind == "coarse":
        positions = (np.broadcast_to(np.arange(T, dtype=np.int32) // 12, (B, T)),
                     np.arange(S, dtype=np.int32)[None] // 12)
    assert kind in ("causal", "bidir", "pos", "coarse"), kind
    return dict(table=table, bidirectional=kind != "causal", max_distance=24,
                positions=positions)


def sinks_for(N, seed=11):
    """Sink logits `[N]` of a test case: both signs, one far above typical logits
    (that head's rows put most of their weight on the sink)."""
    s = np.random.default_rng(seed).normal(size=N).astype(np.float32)
    s[0] = 4.0
    return jnp.asarray(s)


def run(impl, q, k, v, mask, bias, *, softcap=None, q_offset=0, kv_offset=0, scale=None,
        alibi_slopes=None, alibi_positions=None, relative=None, sinks=None, ref=False,
        primal=False, **kw):
    """(out, lse, grads) of `_loss`, jitted; grads w.r.t. q, k, v (and bias, the T5
    table of `relative`, and `sinks`); `primal`: (out, lse) of the same call left
    undifferentiated instead (a custom VJP's own forward, not its fwd rule). The reference takes ALiBi and T5's bias as
    explicit biases (`alibi_as_bias`, `relative_as_bias`) and the sinks natively
    (a softmax column); `impl` gets them as the dispatch adds them to every other
    implementation (`tfjax.ops.sinks.add_sinks` on its out and lse)."""
    from tfjax.ops import RelativeBias
    B, T, _, H = q.shape
    scale_v = H ** -0.5 if scale is None else scale

    def f(q, k, v, bias, table, sinks):
        rel = None if relative is None else {**relative, "table": table}
        if ref:  # out from the reference, lse from the dense logsumexp
            if alibi_slopes is not None:
                a = alibi_as_bias(alibi_slopes, alibi_positions, B, T, k.shape[1], q_offset,
                                  kv_offset)
                bias = a if bias is None else bias + a
            if rel is not None:
                r = relative_as_bias(rel, B, T, k.shape[1], q_offset, kv_offset)
                bias = r if bias is None else bias + r
            out = attention_reference(q, k, v, mask, bias=bias, scale=scale, softcap=softcap,
                                      q_offset=q_offset, kv_offset=kv_offset, sinks=sinks)
            lse = dense_lse(q, k, mask, bias, scale_v, softcap, q_offset, kv_offset)
            if sinks is not None:
                lse = jnp.logaddexp(lse, sinks[None, :, None])
        else:
            if alibi_slopes is not None:
                kw.update(alibi_slopes=alibi_slopes, alibi_positions=alibi_positions)
            if rel is not None:
                pos = rel["positions"] or (None, None)
                kw["relative_bias"] = RelativeBias(
                    table, bidirectional=rel["bidirectional"], max_distance=rel["max_distance"],
                    q_positions=pos[0], kv_positions=pos[1])
            out, lse = impl(q, k, v, mask, bias=bias, scale=scale, softcap=softcap,
                            q_offset=q_offset, kv_offset=kv_offset, return_lse=True, **kw)
            if sinks is not None:
                out, lse = add_sinks(out, lse, sinks)
                out = out.astype(q.dtype)
        return _loss(out, lse), (out, lse)

    argnums = (0, 1, 2) + ((3,) if bias is not None else ()) + ((4,) if relative else ()) + \
        ((5,) if sinks is not None else ())
    table = None if relative is None else relative["table"]
    if primal:
        return jax.jit(f)(q, k, v, bias, table, sinks)[1]
    (_, (out, lse)), grads = jax.jit(jax.value_and_grad(f, argnums, has_aux=True))(
        q, k, v, bias, table, sinks)
    return out, lse, grads


def assert_close(got, want, dtype, what, kind):
    fwd, grad = TOL[str(dtype)]
    tol = fwd if kind == "fwd" else grad
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got).all() or what == "lse", f"{what}: not finite"
    if str(dtype) == "float32":
        np.testing.assert_allclose(got, want, atol=tol, rtol=tol, err_msg=what)
    else:
        err = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-6)
        assert err < tol, f"{what}: relative error {err:.3g} >= {tol}"


def alibi_for(kind, B, T, S, N):
    """ALiBi arguments of a test case: "N" the paper's per-head slopes `[N]`, "BN" a
    different set per example `[B, N]` (steeper on odd examples), "pos" the
    slopes with explicit positions (random, unordered: `[B, T]`, `[1, S]`)."""
    from tfjax.nn.positions import alibi_slopes
    s = jnp.asarray(alibi_slopes(N))
    if kind == "N":
        return dict(alibi_slopes=s)
    if kind == "BN":
        return dict(alibi_slopes=s[None] * (1.0 + jnp.arange(B, dtype=jnp.float32) % 2)[:, None])
    assert kind == "pos", kind
    # distances up to 48: at |logits| in the hundreds fp32 rounding alone exceeds 1e-5
    rng = np.random.default_rng(7)
    return dict(alibi_slopes=s, alibi_positions=(rng.integers(0, 48, (B, T)).astype(np.int32),
                                                 rng.integers(0, 48, (1, S)).astype(np.int32)))


def check_against_reference(impl, q, k, v, mask, bias=None, alibi=None, relative=None,
                            sinks=False, primal=False, **kw):
    """`alibi`: None, "N", "BN" or "pos" (`alibi_for`); `relative` (T5's bias): None,
    "causal", "bidir" or "pos" (`relative_for`); `sinks`: learned sinks
    (`sinks_for`). v may have a head dim of its own. `primal`: also the forward of
    the call left undifferentiated (inference), which a kernel may run differently
    (the Mosaic TPU kernels' keys on lanes below head dim 128)."""
    if sinks:
        kw["sinks"] = sinks_for(q.shape[2])
    if alibi is not None:
        kw.update(alibi_for(alibi, q.shape[0], q.shape[1], k.shape[1], q.shape[2]))
    if relative is not None:
        kw["relative"] = relative_for(relative, q.shape[0], q.shape[1], k.shape[1], q.shape[2])
    impl_kw = {key: kw.pop(key) for key in list(kw) if key in ("block_q", "block_kv",
                                                               "block_sizes", "interpret")}
    out, lse, grads = run(impl, q, k, v, mask, bias, **kw, **impl_kw)
    r_out, r_lse, r_grads = run(None, q, k, v, mask, bias, ref=True, **kw)
    dtype = q.dtype
    assert out.dtype == q.dtype and out.shape == (*q.shape[:3], v.shape[-1])
    assert lse.dtype == jnp.float32 and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    assert_close(out, r_out, dtype, "out", "fwd")
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(r_lse), err_msg="lse -inf rows")
    assert_close(jnp.where(jnp.isinf(r_lse), 0, lse), jnp.where(jnp.isinf(r_lse), 0, r_lse),
                 dtype, "lse", "fwd")
    names = ("dq", "dk", "dv") + (("dbias",) if bias is not None else ()) + \
        (("dtable",) if relative is not None else ()) + (("dsinks",) if sinks else ())
    assert len(grads) == len(r_grads) == len(names)
    for name, g, rg in zip(names, grads, r_grads):
        assert_close(g, rg, dtype, name, "grad")
    if primal:
        p_out, p_lse = run(impl, q, k, v, mask, bias, primal=True, **kw, **impl_kw)
        assert_close(p_out, r_out, dtype, "undifferentiated out", "fwd")
        np.testing.assert_array_equal(np.isinf(p_lse), np.isinf(r_lse),
                                      err_msg="undifferentiated lse -inf rows")
        assert_close(jnp.where(jnp.isinf(r_lse), 0, p_lse),
                     jnp.where(jnp.isinf(r_lse), 0, r_lse), dtype, "undifferentiated lse", "fwd")
    return out, lse, grads
