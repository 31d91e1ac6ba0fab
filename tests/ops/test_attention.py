"""dot_product_attention: the reference against a numpy loop, "xla" against the
reference (forward and gradients), fully masked rows, dispatch errors; the
dispatch itself (the fixed table, the literal "auto" orders, the ring's block
choice)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tfjax.ops import AttentionRequest, attention_reference, dot_product_attention, masks as M
from tfjax.ops import select_implementation


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


@pytest.mark.parametrize("mask_name", ["none", "segments&causal", "fully_masked_rows", "window"])
def test_xla_matches_reference_forward_and_grads(mask_name):
    q, k, v = rand((2, 7, 6, 16), 7), rand((2, 7, 2, 16), 8), rand((2, 7, 2, 16), 9)
    mask = MASKS[mask_name]
    bias = 0.1 * rand((1, 6, 7, 7), 10)

    def loss(impl, q, k, v, bias):
        out = dot_product_attention(q, k, v, mask, bias=bias, implementation=impl)
        return jnp.sum(out * jnp.cos(out)), out

    (lr, out_r), g_r = jax.value_and_grad(loss, argnums=(1, 2, 3, 4), has_aux=True)(
        "reference", q, k, v, bias)
    (lx, out_x), g_x = jax.value_and_grad(loss, argnums=(1, 2, 3, 4), has_aux=True)(
        "xla", q, k, v, bias)
    np.testing.assert_allclose(out_x, out_r, atol=1e-5)
    for a, b in zip(g_x, g_r):
        assert np.isfinite(np.asarray(a)).all()
        np.testing.assert_allclose(a, b, atol=1e-4)


def test_fully_masked_rows_give_zero_output_and_zero_grads():
    q, k, v = rand((2, 4, 2, 8), 11), rand((2, 4, 2, 8), 12), rand((2, 4, 2, 8), 13)
    mask = M.padding(np.array([0, 4]))
    for impl in ("reference", "xla"):
        out = dot_product_attention(q, k, v, mask, implementation=impl)
        assert np.all(np.asarray(out[0]) == 0)
        g = jax.grad(lambda q: dot_product_attention(q, k, v, mask, implementation=impl).sum())(q)
        assert np.isfinite(np.asarray(g)).all() and np.all(np.asarray(g[0]) == 0)


def test_gqa_equals_mha_with_repeated_kv():
    q, k, v = rand((1, 5, 6, 8), 14), rand((1, 5, 2, 8), 15), rand((1, 5, 2, 8), 16)
    gqa = dot_product_attention(q, k, v, M.causal(), implementation="reference")
    mha = dot_product_attention(q, jnp.repeat(k, 3, axis=2), jnp.repeat(v, 3, axis=2), M.causal(),
                                implementation="reference")
    np.testing.assert_allclose(gqa, mha, atol=1e-6)


def test_errors_name_the_problem():
    q, k = rand((1, 4, 3, 8), 0), rand((1, 4, 2, 8), 1)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        dot_product_attention(q, k, k)
    q = rand((1, 4, 4, 8), 0)
    with pytest.raises(ValueError, match="head dim"):
        dot_product_attention(q, rand((1, 4, 2, 4), 1), rand((1, 4, 2, 4), 1))
    with pytest.raises(ValueError, match="soft-cap"):
        dot_product_attention(q, k, k, softcap=5.0, implementation="xla")
    with pytest.raises(ValueError, match="allowed"):
        dot_product_attention(q, k, k, implementation="nope")
    with pytest.raises(ValueError, match="bias"):
        dot_product_attention(q, k, k, bias=jnp.zeros((1, 4, 4, 5)))
    with pytest.raises(ValueError, match="batch"):
        dot_product_attention(q, k, k, M.padding(np.array([1, 2])))
    with pytest.raises(TypeError, match="Mask"):
        dot_product_attention(q, k, k, jnp.ones((1, 4, 4), bool))


def test_auto_never_changes_semantics():
    q, k = rand((1, 4, 4, 8), 0), rand((1, 4, 2, 8), 1)
    out = dot_product_attention(q, k, k, M.causal(), softcap=3.0)  # auto must honour softcap
    want = attention_reference(q, k, k, M.causal(), softcap=3.0)
    np.testing.assert_allclose(out, want, atol=1e-5)


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


def test_alibi_slopes_equal_the_explicit_alibi_bias():
    """`alibi_slopes` is ALiBi at global index positions (offsets included) or at
    `alibi_positions`, the same as the layer-level `alibi_bias` passed as a bias;
    "reference" and "xla" agree, forward and gradients; the slopes take no
    gradient. (The tiled implementations are checked against the same explicit
    bias in their own tests.)"""
    from tfjax.nn.positions import alibi_bias, alibi_slopes

    q, k, v = rand((2, 5, 4, 8), 30), rand((2, 7, 2, 8), 31), rand((2, 7, 2, 8), 32)
    slopes = jnp.asarray(alibi_slopes(4))
    per_example = jnp.stack([slopes, 3.0 * slopes])  # [B, N]
    qo, ko = 4, 1
    index = (jnp.broadcast_to(jnp.arange(5) + qo, (2, 5)), jnp.broadcast_to(jnp.arange(7) + ko,
                                                                             (2, 7)))
    packed = (jnp.array([[0, 1, 2, 0, 1], [3, 4, 5, 6, 7]]), jnp.array([[0, 1, 2, 0, 1, 2, 3]]))

    @jax.jit
    def explicit(sl, pos):  # the layer's bias from position arrays, through `bias=`
        qp, kp = jnp.broadcast_to(pos[0], (2, 5)), jnp.broadcast_to(pos[1], (2, 7))
        sl = jnp.broadcast_to(sl, (2, 4))
        bias = jax.vmap(lambda a, b, s: alibi_bias(a[None], b[None], s)[0])(qp, kp, sl)
        return attention_reference(q, k, v, M.causal(), bias=bias, q_offset=qo, kv_offset=ko)

    def loss(impl, q, k, sl, pos):
        out = dot_product_attention(q, k, v, M.causal(), alibi_slopes=sl, alibi_positions=pos,
                                    q_offset=qo, kv_offset=ko, implementation=impl)
        return jnp.sum(out * jnp.cos(out)), out

    vg = jax.jit(jax.value_and_grad(loss, (1, 2, 3), has_aux=True), static_argnums=0)
    for sl, pos in ((slopes, None), (per_example, None), (per_example, packed)):
        want = explicit(sl, index if pos is None else pos)
        grads = {}
        for impl in ("reference", "xla"):
            (_, out), g = vg(impl, q, k, sl, pos)
            np.testing.assert_allclose(out, want, atol=1e-5, err_msg=impl)
            assert not np.asarray(g[2]).any()  # fixed slopes: no gradient
            grads[impl] = g
        for a, b in zip(grads["xla"][:2], grads["reference"][:2]):
            np.testing.assert_allclose(a, b, atol=1e-4)
    # the cases differ from each other and from no ALiBi (the checks above can fail)
    outs = [explicit(s, p) for s, p in ((0 * slopes, index), (slopes, index),
                                         (per_example, index), (per_example, packed))]
    for x, y in zip(outs, outs[1:]):
        assert np.abs(np.asarray(x - y)).max() > 1e-2


def test_alibi_slopes_shape_error_and_cudnn_declines():
    from tfjax.ops import select_implementation
    from tfjax.ops.attention import AttentionRequest

    q, k = rand((2, 4, 4, 8), 0), rand((2, 4, 2, 8), 1)
    with pytest.raises(ValueError, match=r"alibi_slopes must be \[N\] or \[B\|1, N\]"):
        dot_product_attention(q, k, k, alibi_slopes=jnp.ones((2,)))
    with pytest.raises(ValueError, match="alibi_slopes"):
        dot_product_attention(q, k, k, alibi_slopes=jnp.ones((3, 4)))
    with pytest.raises(ValueError, match="without alibi_slopes"):
        dot_product_attention(q, k, k, alibi_positions=(jnp.zeros((2, 4), int),) * 2)
    with pytest.raises(ValueError, match=r"kv_positions must be \[B\|1, 4\]"):
        dot_product_attention(q, k, k, alibi_slopes=jnp.ones(4),
                              alibi_positions=(jnp.zeros((2, 4), int), jnp.zeros((2, 5), int)))
    with pytest.raises(ValueError, match="q_positions must be integers"):
        dot_product_attention(q, k, k, alibi_slopes=jnp.ones(4),
                              alibi_positions=(jnp.zeros((2, 4)), jnp.zeros((2, 4), int)))
    r = AttentionRequest(q_shape=(1, 8, 4, 64), k_shape=(1, 8, 4, 64), dtype="bfloat16",
                         backend="gpu", mask=M.causal(), has_bias=False, softcap=None,
                         offsets=False, return_lse=False, has_alibi=True)
    with pytest.raises(ValueError, match="cuDNN attention takes no ALiBi"):
        select_implementation(r, "cudnn")
    assert select_implementation(r) == "pallas"  # auto passes cuDNN over for ALiBi
    cpu = dataclasses.replace(r, backend="cpu", dtype="float32")
    assert select_implementation(cpu) == "blockwise"


def test_relative_bias_equals_the_explicit_t5_bias():
    """`relative_bias` (T5's bucketed bias) at index positions (offsets included) or
    explicit ones equals the table gathered at the bucketed relative positions,
    passed as `bias=`: "reference" and "xla" (materialised by the dispatch),
    "blockwise" (per tile, tiny tiles) and "pallas" (per tile in the TPU kernels,
    interpreted) agree, forward and gradients, the table's included. (Awkward
    shapes: tests/ops/test_blockwise.py, tests/ops/test_pallas.py.)"""
    from tfjax.nn.positions import relative_position_bucket
    from tfjax.ops import RelativeBias

    q, k, v = rand((2, 5, 4, 8), 40), rand((2, 7, 2, 8), 41), rand((2, 7, 2, 8), 42)
    table = rand((8, 4), 43)
    qo, ko = 4, 1
    index = (jnp.arange(5)[None] + qo, jnp.arange(7)[None] + ko)
    packed = (jnp.array([[0, 1, 2, 0, 1], [3, 5, 7, 9, 11]]), jnp.array([[0, 2, 4, 0, 3, 6, 9]]))

    def explicit(table, pos, bidirectional):  # [B, N, T, S], gathered from the whole matrix
        qp, kp = jnp.broadcast_to(pos[0], (2, 5)), jnp.broadcast_to(pos[1], (2, 7))
        rel = kp[:, None, :] - qp[:, :, None]
        b = relative_position_bucket(rel, bidirectional=bidirectional, num_buckets=8,
                                     max_distance=10)
        return jnp.moveaxis(table[b], -1, 1)

    def loss(impl, q, k, table, pos, bidirectional):
        if impl == "explicit":
            out = attention_reference(q, k, v, M.causal(), q_offset=qo, kv_offset=ko,
                                      bias=explicit(table, index if pos is None else pos,
                                                    bidirectional))
        else:
            rb = RelativeBias(table, bidirectional=bidirectional, max_distance=10,
                              q_positions=None if pos is None else pos[0],
                              kv_positions=None if pos is None else pos[1])
            if impl == "attention_reference":
                out = attention_reference(q, k, v, M.causal(), relative_bias=rb, q_offset=qo,
                                          kv_offset=ko)
            else:
                out = dot_product_attention(q, k, v, M.causal(), relative_bias=rb, q_offset=qo,
                                            kv_offset=ko, implementation=impl)
        return jnp.sum(out * jnp.cos(out)), out

    vg = jax.jit(jax.value_and_grad(loss, (1, 2, 3), has_aux=True), static_argnums=(0, 5))
    outs = []
    for pos, bidirectional in ((None, False), (None, True), (packed, True)):
        (_, want), g_want = vg("explicit", q, k, table, pos, bidirectional)
        assert np.abs(np.asarray(g_want[2])).max() > 1e-3  # the table is learned
        for impl in ("reference", "xla", "blockwise", "pallas", "attention_reference"):
            (_, out), g = vg(impl, q, k, table, pos, bidirectional)
            np.testing.assert_allclose(out, want, atol=1e-5, err_msg=impl)
            for a, b in zip(g, g_want):
                np.testing.assert_allclose(a, b, atol=1e-4, err_msg=impl)
        outs.append(want)
    # the cases differ from each other and from no bias (the checks above can fail)
    outs.append(attention_reference(q, k, v, M.causal(), q_offset=qo, kv_offset=ko))
    for x, y in zip(outs, outs[1:]):
        assert np.abs(np.asarray(x - y)).max() > 1e-2


def test_relative_bias_errors_and_dispatch():
    from tfjax.ops import IMPLEMENTATIONS, RelativeBias, select_implementation
    from tfjax.ops.attention import AttentionRequest

    q, k = rand((2, 4, 4, 8), 0), rand((2, 4, 2, 8), 1)
    rb = lambda table, **kw: RelativeBias(table, bidirectional=True, max_distance=8, **kw)
    with pytest.raises(ValueError, match=r"relative_bias.table must be \[num_buckets, N\]"):
        dot_product_attention(q, k, k, relative_bias=rb(jnp.ones((8, 2))))
    with pytest.raises(ValueError, match="num_buckets=2 is too small"):
        dot_product_attention(q, k, k, relative_bias=rb(jnp.ones((2, 4))))
    with pytest.raises(ValueError, match="give both q_positions and kv_positions"):
        dot_product_attention(q, k, k, relative_bias=rb(jnp.ones((8, 4)),
                                                        q_positions=jnp.zeros((2, 4), int)))
    with pytest.raises(ValueError, match=r"kv_positions must be \[B\|1, 4\]"):
        dot_product_attention(q, k, k, relative_bias=rb(
            jnp.ones((8, 4)), q_positions=jnp.zeros((2, 4), int),
            kv_positions=jnp.zeros((2, 5), int)))
    with pytest.raises(TypeError, match="an additive array goes to bias="):
        dot_product_attention(q, k, k, relative_bias=jnp.ones((2, 4, 4, 4)))
    # blockwise takes it per tile; the others get it materialised as a bias
    assert IMPLEMENTATIONS.get("blockwise").relative_bias
    assert IMPLEMENTATIONS.get("pallas").relative_bias  # per tile on TPU; dense for Triton
    assert not any(IMPLEMENTATIONS.get(n).relative_bias for n in ("reference", "xla"))
    r = AttentionRequest(q_shape=(2, 4, 4, 8), k_shape=(2, 4, 2, 8), dtype="float32",
                         backend="cpu", mask=None, has_bias=True, softcap=None, offsets=False,
                         return_lse=False, has_relative_bias=True)
    assert select_implementation(r) == "blockwise"


# --------------------------------------------------------------------------- #
# The decision: one fixed table, literal orders, the ring's block choice.
# --------------------------------------------------------------------------- #


def test_the_table_is_fixed_and_the_auto_orders_are_written_out():
    """Five implementations in one fixed table, "auto" orders per platform as they
    are written in ops/attention.py (these orders are the contract: the GPU puts
    cuDNN before the kernels, blockwise goes first on CPU and just before the
    reference elsewhere), every ordered name in the table; nothing registers itself:
    the table refuses additions, and re-running an implementation module changes
    neither the table nor the orders."""
    import importlib

    from tfjax.ops import AUTO_ORDER, IMPLEMENTATIONS, cudnn, xla
    from tfjax.ops import attention as attention_lib

    assert IMPLEMENTATIONS.names() == ("blockwise", "cudnn", "pallas", "reference", "xla")
    assert dict(AUTO_ORDER) == {
        "cpu": ("blockwise", "xla", "reference"),
        "gpu": ("cudnn", "pallas", "xla", "blockwise", "reference"),
        "tpu": ("pallas", "xla", "blockwise", "reference"),
    }
    assert all(name in IMPLEMENTATIONS for order in AUTO_ORDER.values() for name in order)
    assert sorted(IMPLEMENTATIONS) == list(IMPLEMENTATIONS.names())
    with pytest.raises(TypeError, match="fixed"):
        IMPLEMENTATIONS.register("mine", IMPLEMENTATIONS.get("xla"))
    with pytest.raises(TypeError):
        AUTO_ORDER["cpu"] = ("xla",)
    before = ({n: IMPLEMENTATIONS.get(n) for n in IMPLEMENTATIONS}, dict(AUTO_ORDER))
    for module in (cudnn, xla):
        importlib.reload(module)
    assert ({n: IMPLEMENTATIONS.get(n) for n in IMPLEMENTATIONS}, dict(AUTO_ORDER)) == before
    assert attention_lib.IMPLEMENTATIONS is IMPLEMENTATIONS
    # an unknown platform takes the CPU order
    r = AttentionRequest(q_shape=(1, 4, 2, 8), k_shape=(1, 4, 2, 8), dtype="float32",
                         backend="metal", mask=None, has_bias=False, softcap=None,
                         offsets=False, return_lse=False)
    assert select_implementation(r) == "blockwise"


def test_select_ring_block_picks_per_platform_and_refuses_what_the_ring_cannot_run():
    """Ring attention's per-block attention: "auto" is the Pallas TPU kernels on a TPU
    mesh when they evaluate the mask, else blockwise (CPU, GPU, other platforms);
    explicit "pallas" refuses GPU meshes and masks the kernels cannot evaluate,
    naming the fix; an implementation without a ring block (xla, reference, cudnn)
    or an unknown name raises one line naming what the ring runs. The tile options
    reach the family that takes them (pallas interprets on CPU meshes only)."""
    from tfjax.ops.attention import RING_AUTO_ORDER, RING_BLOCKS, select_ring_block
    from tfjax.ops.pallas import BlockSizes

    class Custom(M.Mask):  # a mask kind the kernels do not know
        pass

    assert dict(RING_AUTO_ORDER) == {"cpu": ("blockwise",), "gpu": ("blockwise",),
                                     "tpu": ("pallas", "blockwise")}
    assert tuple(RING_BLOCKS) == ("blockwise", "pallas")
    for backend, mask, want in (("tpu", None, "pallas"), ("tpu", M.causal(), "pallas"),
                                ("tpu", Custom(), "blockwise"), ("cpu", M.causal(), "blockwise"),
                                ("gpu", None, "blockwise"), ("metal", None, "blockwise")):
        assert select_ring_block(backend, mask).name == want, (backend, mask)
    for backend in ("cpu", "gpu", "tpu"):
        assert select_ring_block(backend, Custom(), "blockwise").name == "blockwise"
    assert select_ring_block("cpu", M.causal(), "pallas").name == "pallas"
    with pytest.raises(ValueError, match=r"^ring_attention: implementation='pallas' runs the "
                       r"Pallas TPU kernels \(Mosaic on TPU, interpret mode on CPU\); on GPU use "
                       r"implementation='blockwise'$"):
        select_ring_block("gpu", None, "pallas")
    with pytest.raises(ValueError, match="implementation='pallas' cannot run this mask: .*Custom"
                       ".*; use implementation='blockwise'"):
        select_ring_block("tpu", Custom(), "pallas")
    for name in ("xla", "reference", "cudnn"):
        with pytest.raises(ValueError, match=f"implementation='{name}' has no ring block.*"
                           "implementation must be one of 'auto', 'blockwise', 'pallas'$"):
            select_ring_block("tpu", None, name)
    with pytest.raises(ValueError, match="implementation must be one of 'auto', 'blockwise', "
                       "'pallas', got 'nope'"):
        select_ring_block("cpu", None, "nope")
    bs = BlockSizes(8, 128, 8, 128, 8, 128)
    tiles = dict(block_q=16, block_kv=32, block_sizes=bs)
    blk = select_ring_block("cpu", None, "blockwise", **tiles)
    assert blk.forward.keywords == {"return_lse": True, "block_q": 16, "block_kv": 32}
    assert blk.backward.keywords == {"block_q": 16, "block_kv": 32}
    for backend, interpret in (("cpu", True), ("tpu", False)):
        blk = select_ring_block(backend, None, "pallas", **tiles)
        assert blk.forward.keywords == {"return_lse": True, "block_sizes": bs,
                                        "interpret": interpret}
        assert blk.backward.keywords == {"block_sizes": bs, "interpret": interpret}
    # the block's forward returns (out, lse) and its backward the block's gradients
    q, k = rand((1, 8, 4, 8), 0), rand((1, 8, 2, 8), 1)
    for name in ("blockwise", "pallas"):
        blk = select_ring_block("cpu", M.causal(), name, block_q=8, block_kv=8, block_sizes=bs)
        out, lse = blk.forward(q, k, k, M.causal(), scale=None, softcap=None, q_offset=0,
                               kv_offset=0)
        want, want_lse = attention_reference(q, k, k, M.causal(), return_lse=True)
        np.testing.assert_allclose(out, want, atol=1e-5)
        np.testing.assert_allclose(lse, want_lse, atol=1e-5)
        dq, dk, dv = blk.backward(q, k, k, M.causal(), out, lse, jnp.ones_like(out), scale=None,
                                  softcap=None, q_offset=0, kv_offset=0)
        g = jax.grad(lambda q: attention_reference(q, k, k, M.causal()).sum())(q)
        np.testing.assert_allclose(dq, g, atol=1e-4)
