"""The materialising reference (`tfjax.ops.reference`), the ground truth of every
other test: against a per-row numpy loop (masks, GQA / MQA, fully masked rows),
bias, soft-cap, scale and offsets, GQA as MHA over repeated K/V, the logsumexp's
gradient; and the T5 bucketing helpers the kernels use per tile
(`constant_bucket`, `relative_tile_ranges`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tfjax.ops import attention_reference, dot_product_attention, masks as M


def numpy_attention(q, k, v, allowed, bias=None, scale=None, softcap=None):
    """Per (b, n, i) loop: the kv head of query head n is n // G."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    scale = H ** -0.5 if scale is None else scale
    out = np.zeros((B, T, N, H))
    lse = np.full((B, N, T), -np.inf)
    allowed = np.broadcast_to(np.asarray(allowed), (B, T, S))
    for b in range(B):
        for n in range(N):
            for i in range(T):
                s = k[b, :, n // G] @ q[b, i, n] * scale
                if softcap:
                    s = softcap * np.tanh(s / softcap)
                if bias is not None:
                    s = s + np.broadcast_to(np.asarray(bias), (B, N, T, S))[b, n, i]
                ok = allowed[b, i]
                if not ok.any():
                    continue
                s = np.where(ok, s, -np.inf)
                m = s.max()
                p = np.exp(s - m)
                out[b, i, n] = p @ v[b, :, n // G] / p.sum()
                lse[b, n, i] = m + np.log(p.sum())
    return out, lse


def rand(shape, seed):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


SEG = np.array([[1, 1, 1, 2, 2, 2, 2], [3, 3, 3, 3, 3, 3, 3]])


MASKS = {
    "none": None,
    "causal": M.causal(),
    "window": M.sliding_window(2),
    "segments&causal": M.segments(SEG) & M.causal(),
    "prefix": M.prefix_lm(np.array([4, 1])),
    "fully_masked_rows": M.padding(np.array([0, 3])),  # batch 0 sees no key at all
}


@pytest.mark.parametrize("mask_name", sorted(MASKS))
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)])
def test_reference_matches_numpy_loop(mask_name, heads):
    N, K = heads
    q, k, v = rand((2, 7, N, 8), 0), rand((2, 7, K, 8), 1), rand((2, 7, K, 8), 2)
    mask = MASKS[mask_name]
    out, lse = attention_reference(q, k, v, mask, return_lse=True)
    want_out, want_lse = numpy_attention(q, k, v, M.dense(mask, 7, 7))
    np.testing.assert_allclose(out, want_out, atol=1e-5)
    np.testing.assert_allclose(lse, want_lse, atol=1e-5)
    assert np.isfinite(np.asarray(out)).all()


def test_reference_bias_softcap_scale_and_offsets():
    q, k, v = rand((1, 5, 4, 8), 3), rand((1, 6, 2, 8), 4), rand((1, 6, 2, 8), 5)
    bias = rand((1, 4, 5, 6), 6)
    mask = M.causal()
    out = attention_reference(q, k, v, mask, bias=bias, scale=0.3, softcap=2.0,
                              q_offset=1, kv_offset=0)
    want, _ = numpy_attention(q, k, v, mask.dense(5, 6, q_offset=1), bias=bias, scale=0.3,
                              softcap=2.0)
    np.testing.assert_allclose(out, want, atol=1e-5)


def test_gqa_equals_mha_with_repeated_kv():
    q, k, v = rand((1, 5, 6, 8), 14), rand((1, 5, 2, 8), 15), rand((1, 5, 2, 8), 16)
    gqa = dot_product_attention(q, k, v, M.causal(), implementation="reference")
    mha = dot_product_attention(q, jnp.repeat(k, 3, axis=2), jnp.repeat(v, 3, axis=2), M.causal(),
                                implementation="reference")
    np.testing.assert_allclose(gqa, mha, atol=1e-6)


def test_reference_lse_gradient_is_the_softmax():
    q, k, v = rand((1, 5, 2, 8), 20), rand((1, 6, 2, 8), 21), rand((1, 6, 2, 8), 22)
    mask = M.causal()

    def lse_ref(q, k):
        return attention_reference(q, k, v, mask, return_lse=True)[1]

    def lse_dense(q, k):
        s = jnp.einsum("btnh,bsnh->bnts", q, k) * 8 ** -0.5
        s = jnp.where(mask.dense(5, 6)[:, None], s, -jnp.inf)
        return jax.nn.logsumexp(s, axis=-1)

    w = rand((1, 2, 5), 23)
    g_ref = jax.grad(lambda q, k: jnp.sum(w * lse_ref(q, k)), argnums=(0, 1))(q, k)
    g_dense = jax.grad(lambda q, k: jnp.sum(w * lse_dense(q, k)), argnums=(0, 1))(q, k)
    for a, b in zip(g_ref, g_dense):
        np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("bidirectional", [False, True])
def test_constant_bucket_tiles_hold_one_bucket(bidirectional):
    """`constant_bucket` (the kernels skip bucketing a tile it names): every entry of
    such a tile has that bucket, at index positions with offsets and at explicit
    positions (their per-tile ranges); and far tiles are found."""
    from tfjax.ops import RelativeBias
    from tfjax.ops.reference import (constant_bucket, relative_position_bucket,
                                     relative_tile_ranges)

    rng = np.random.default_rng(0)
    B, T, S, bq, bk, md = 2, 200, 300, 16, 32, 20
    Tp, Sp = 208, 320
    explicit = (np.sort(rng.integers(0, 400, (B, T)), axis=1).astype(np.int32),
                np.sort(rng.integers(0, 400, (B, S)), axis=1).astype(np.int32))
    found = 0
    for positions, offs in ((None, (7, 90)), (explicit, (0, 0))):
        rel = RelativeBias(jnp.zeros((8, 2)), bidirectional=bidirectional, max_distance=md,
                           q_positions=None if positions is None else jnp.asarray(positions[0]),
                           kv_positions=None if positions is None else jnp.asarray(positions[1]))
        ranges = relative_tile_ranges(rel, bq, bk, Tp, Sp)
        if positions is None:
            qp = np.broadcast_to(np.arange(T) + offs[0], (B, T))
            kp = np.broadcast_to(np.arange(S) + offs[1], (B, S))
        else:
            qp, kp = positions
        buckets = np.asarray(relative_position_bucket(
            kp[:, None, :] - qp[:, :, None], bidirectional=bidirectional, num_buckets=8,
            max_distance=md))
        for b in range(B):
            for i in range(Tp // bq):
                for j in range(Sp // bk):
                    c = int(constant_bucket(rel, bq, bk, b, i, j, offs, ranges))
                    tile = buckets[b, i * bq:(i + 1) * bq, j * bk:(j + 1) * bk]
                    if c >= 0 and tile.size:
                        found += 1
                        assert (tile == c).all(), (b, i, j, c, np.unique(tile))
    assert found > 50, found
