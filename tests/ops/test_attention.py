"""`dot_product_attention` and the dispatch (`tfjax.ops.attention`): input checks and
their messages, "auto" never changing semantics, the fixed table and the literal
"auto" orders, what each platform's "auto" picks, the ring's block
choice. The implementations against the reference: test_implementations.py."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import inputs, refusal, request

from tfjax.ops import IMPLEMENTATIONS, AttentionRequest, attention_reference, dot_product_attention
from tfjax.ops import masks as M
from tfjax.ops import select_implementation


def rand(shape, seed):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


@pytest.mark.bad_input
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


@pytest.mark.bad_input
@pytest.mark.parametrize("impl", [*IMPLEMENTATIONS.names(), "auto"])
def test_per_token_masks_and_dtypes_are_checked_in_every_implementation(impl):
    """A segment-id / position array one token short (or long) would be silently
    clamped by indexing; integer q/k/v would return integers. Both raise, naming the
    array and both lengths, before any implementation runs."""
    q, k = rand((1, 4, 4, 8), 0), rand((1, 6, 2, 8), 1)
    ids = np.zeros((1, 4), np.int32)
    cases = {
        r"q_segment_ids has length 3 but the queries \(T\) have length 4":
            M.segments(ids[:, :3], np.zeros((1, 6), np.int32)),
        r"kv_segment_ids has length 5 but the keys \(S\) have length 6":
            M.causal() & M.segments(ids, np.zeros((1, 5), np.int32)),
        r"kv_positions has length 7 but the keys \(S\) have length 6":
            M.positions(ids, np.zeros((1, 7), np.int32)) | M.causal(),
    }
    for message, mask in cases.items():
        with pytest.raises(ValueError, match=message):
            dot_product_attention(q, k, k, mask, implementation=impl)
    with pytest.raises(TypeError, match="q, k, v must be floating point.*int32"):
        dot_product_attention(*(x.astype(jnp.int32) for x in (q, k, k)), implementation=impl)
    with pytest.raises(TypeError, match="^dot_product_attention: v must be floating point"):
        dot_product_attention(q, k, k.astype(jnp.int8), implementation=impl)


def test_auto_never_changes_semantics():
    q, k = rand((1, 4, 4, 8), 0), rand((1, 4, 2, 8), 1)
    out = dot_product_attention(q, k, k, M.causal(), softcap=3.0)  # auto must honour softcap
    want = attention_reference(q, k, k, M.causal(), softcap=3.0)
    np.testing.assert_allclose(out, want, atol=1e-5)


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


@pytest.mark.parametrize("impl", IMPLEMENTATIONS.names())
def test_sinks_through_the_dispatch_equal_the_reference(impl):
    """`dot_product_attention(sinks=)`: the dispatch adds them to the implementation's
    (out, lse) (the reference has its own softmax column). Output, logsumexp and the
    gradients of q, k, v and the sinks match; a row that sees no key returns zeros
    (example 0) and its lse is its head's sink."""
    q, k, v, _ = inputs(2, 40, 50, 4, 2, 16, Hv=8)
    sinks = jnp.array([4.0, -1.0, 0.5, 0.0])
    mask = M.causal() & M.padding(np.array([0, 35]))
    reason = refusal(impl, request(q, k, v, mask, softcap=5.0, return_lse=True, sinks=True))
    if reason:
        pytest.skip(reason)

    def f(impl, q, k, v, sinks):
        out, lse = dot_product_attention(q, k, v, mask, sinks=sinks, softcap=5.0,
                                         implementation=impl, return_lse=True)
        return jnp.sum(jnp.sin(out)) + jnp.sum(jnp.cos(lse)), (out, lse)

    grad = lambda impl: jax.jit(jax.grad(functools.partial(f, impl), (0, 1, 2, 3),
                                         has_aux=True))(q, k, v, sinks)
    (g, (out, lse)), (rg, (r_out, r_lse)) = grad(impl), grad("reference")
    assert out.shape == (2, 40, 4, 8)
    np.testing.assert_array_equal(out[0], 0.0)
    np.testing.assert_allclose(lse[0], jnp.broadcast_to(sinks[:, None], (4, 40)), rtol=1e-6)
    np.testing.assert_allclose(out, r_out, atol=1e-5)
    np.testing.assert_allclose(lse, r_lse, atol=1e-5)
    for name, a, b in zip(("dq", "dk", "dv", "dsinks"), g, rg):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4, err_msg=name)
    assert float(jnp.abs(g[3]).min()) > 0  # every head's sink gets a gradient


@pytest.mark.bad_input
def test_sinks_and_value_head_dim_errors_and_refusals():
    q, k, v = rand((1, 4, 4, 8), 0), rand((1, 6, 2, 8), 1), rand((1, 6, 2, 12), 2)
    with pytest.raises(ValueError, match=r"sinks must have one logit per query head, shape \[4\]"):
        dot_product_attention(q, k, k, sinks=jnp.zeros(2))
    with pytest.raises(ValueError, match="sinks must be floating"):
        dot_product_attention(q, k, k, sinks=jnp.zeros(4, jnp.int32))
    with pytest.raises(ValueError, match="xla.*no attention sinks"):
        dot_product_attention(q, k, k, sinks=jnp.zeros(4), implementation="xla")
    with pytest.raises(ValueError, match="only the head dim of v may differ"):
        dot_product_attention(q, k, v[:, :5])
    r = AttentionRequest(q_shape=(1, 8, 4, 64), k_shape=(1, 8, 4, 64), dtype="bfloat16",
                         backend="gpu", mask=M.causal(), has_bias=False, softcap=None,
                         offsets=False, return_lse=False)
    with pytest.raises(ValueError, match="cuDNN attention has no attention sinks"):
        select_implementation(dataclasses.replace(r, has_sinks=True), "cudnn")
    with pytest.raises(ValueError, match="v's head dim"):
        select_implementation(dataclasses.replace(r, v_head_dim=32), "cudnn")
    assert select_implementation(dataclasses.replace(r, has_sinks=True, v_head_dim=32)) == "pallas"
    # xla serves Hv != H (zero-padded to one head dim), both ways round
    for vv, kk, qq in ((v, k, q), (k, v, rand((1, 4, 4, 12), 3))):
        got = dot_product_attention(qq, kk, vv, M.causal(), implementation="xla")
        np.testing.assert_allclose(got, attention_reference(qq, kk, vv, M.causal()), atol=1e-6)


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
# The decision: one fixed table, literal orders, each platform's "auto", the ring's
# block choice.
# --------------------------------------------------------------------------- #


def test_auto_picks_blockwise_on_cpu_and_serves_every_request():
    if jax.default_backend() != "cpu":
        pytest.skip("the CPU default")
    r = AttentionRequest(q_shape=(1, 8, 4, 16), k_shape=(1, 8, 2, 16), dtype="float32",
                         backend="cpu", mask=M.causal(), has_bias=True, softcap=30.0,
                         offsets=True, return_lse=True)
    assert select_implementation(r) == "blockwise"
    q, k, v, _ = inputs(1, 8, 8, 4, 2, 16)
    out, lse = dot_product_attention(q, k, v, M.causal(), softcap=30.0, return_lse=True)
    want, want_lse = dot_product_attention(q, k, v, M.causal(), softcap=30.0, return_lse=True,
                                           implementation="reference")
    np.testing.assert_allclose(out, want, atol=1e-5)
    np.testing.assert_allclose(lse, want_lse, atol=1e-5)


def test_auto_on_tpu_gives_decode_steps_to_the_kernels():
    """On TPU "auto" runs a decode step over a KV cache (T * G < H) on the kernels, as
    any other request: the caches are stored heads-major, the kernels' layout, and in
    the compiled decode programs the kernels relay out no more of the cache per step
    than xla (experiments/results/attention_layer_tpu_aot_20261204.md)."""
    cache = M.positions(np.zeros((1, 1), np.int32), np.arange(1024, dtype=np.int32)[None])
    r = AttentionRequest(q_shape=(1, 1, 8, 128), k_shape=(1, 1024, 2, 128), dtype="bfloat16",
                         backend="tpu", mask=cache, has_bias=False, softcap=None,
                         offsets=False, return_lse=False)
    for change in ({}, {"softcap": 30.0}, {"q_shape": (1, 512, 8, 128)}):
        assert select_implementation(AttentionRequest(**{**r.__dict__, **change})) == "pallas", \
            change


def test_dispatch():
    q, k, v, _ = inputs(1, 16, 16, 4, 2, 16)
    out = jax.jit(lambda q, k, v: dot_product_attention(q, k, v, M.causal(),
                                                        implementation="pallas"))(q, k, v)
    want = dot_product_attention(q, k, v, M.causal(), implementation="reference")
    np.testing.assert_allclose(out, want, atol=1e-5)

    class Custom(M.Mask):  # a mask kind the kernels do not know
        pass

    r = AttentionRequest(q_shape=(1, 8, 4, 16), k_shape=(1, 8, 2, 16), dtype="float32",
                         backend="tpu", mask=Custom(), has_bias=False, softcap=None,
                         offsets=False, return_lse=False)
    with pytest.raises(ValueError, match="cannot evaluate a Custom mask"):
        select_implementation(r, "pallas")
    assert select_implementation(r) != "pallas"  # auto falls through, it never guesses
    r_ok = AttentionRequest(**{**r.__dict__, "mask": M.causal()})
    assert select_implementation(r_ok) == "pallas"
    # GPU: cuDNN for a plain causal bf16 request, pallas as soon as cuDNN cannot serve it
    gpu = AttentionRequest(**{**r_ok.__dict__, "backend": "gpu", "dtype": "bfloat16"})
    assert select_implementation(gpu) == "cudnn"
    for change in ({"softcap": 30.0}, {"mask": M.sliding_window(8)}, {"return_lse": True},
                   {"offsets": True}, {"dtype": "float32"}):
        assert select_implementation(AttentionRequest(**{**gpu.__dict__, **change})) == "pallas"
    with pytest.raises(ValueError, match="no logit soft-cap"):
        select_implementation(AttentionRequest(**{**gpu.__dict__, "softcap": 30.0}), "cudnn")


def test_the_table_is_fixed_and_the_auto_orders_are_written_out():
    """Seven implementations in one fixed table, "auto" orders per platform as they
    are written in ops/attention.py (these orders are the contract: the GPU puts
    cuDNN before the kernels, the TPU its paged kernel (paged calls only) before
    them, the CPU its plain-JAX paged attention (paged calls only) before blockwise,
    which goes first on CPU for other calls and just before the reference elsewhere),
    every ordered name in the table; nothing registers itself:
    the table refuses additions, and re-running an implementation module changes
    neither the table nor the orders."""
    import importlib

    from tfjax.ops import AUTO_ORDER, IMPLEMENTATIONS, cudnn, xla
    from tfjax.ops import attention as attention_lib

    assert IMPLEMENTATIONS.names() == ("blockwise", "cudnn", "paged", "paged_tpu", "pallas",
                                       "reference", "xla")
    assert dict(AUTO_ORDER) == {
        "cpu": ("paged", "blockwise", "xla", "reference"),
        "gpu": ("cudnn", "pallas", "xla", "blockwise", "reference"),
        "tpu": ("paged_tpu", "pallas", "xla", "blockwise", "reference"),
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
                                        "interpret": interpret,
                                        "keys_on_lanes": False}  # the backward's row tiles
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
