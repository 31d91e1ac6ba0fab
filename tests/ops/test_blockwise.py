"""implementation="blockwise" against the reference: forward, lse and dq/dk/dv
(and dbias) on a covering set of the sizes of issue 4 (T, S in {1, 100, 128,
384, 1000}; (N, K) in {(4,4), (8,2), (8,1)}; H in {32, 64, 80, 128}), every mask
kind and combinations, soft-cap, bias, offsets, fully masked rows, bf16;
dispatch, determinism, O(T) memory, and gradients through a small model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import check_against_reference, inputs, make_mask

from tfjax.ops import blockwise_attention, dot_product_attention, select_implementation
from tfjax.ops import masks as M
from tfjax.ops.attention import AttentionRequest

# (T, S, (N, K), H, mask, extras): each row one compile; blocks of 128 so tails,
# skipped tiles and multi-tile rows all occur.
CASES = [
    (1, 1, (4, 4), 32, "none", {}),
    (1, 1000, (8, 1), 64, "causal", {"q_offset": 999}),  # decoding the last token
    (100, 100, (8, 2), 80, "causal", {"softcap": 20.0, "relative": "causal"}),
    (384, 128, (4, 4), 128, "chunked", {"q_offset": 60, "relative": "bidir"}),
    (1000, 1000, (8, 2), 32, "causal&segments", {"alibi": "N"}),
    (100, 1000, (8, 1), 64, "prefix", {"bias": (1, 8), "relative": "pos"}),
    (384, 384, (4, 4), 32, "window&segments", {"softcap": 5.0, "bias": (2, 1)}),
    (128, 100, (8, 2), 32, "padding_fully_masked", {"bias": (2, 8), "relative": "bidir"}),
    (384, 1000, (8, 2), 128, "prefix|window", {"q_offset": 3, "kv_offset": 7, "alibi": "BN"}),
    (128, 384, (8, 1), 64, "window_lr", {"alibi": "pos"}),
    (100, 300, (4, 2), 32, "positions_window", {}),  # a KV cache's chunked prefill
    # B = 1: the training forward and the backward call the example directly (no vmap)
    (100, 300, (4, 2), 32, "causal&segments", {"bias": (1, 4), "B": 1, "softcap": 5.0,
                                                "alibi": "N", "relative": "pos"}),
]


def _case_id(c):
    return f"T{c[0]}-S{c[1]}-NK{c[2][0]}x{c[2][1]}-H{c[3]}-{c[4]}"


@pytest.mark.parametrize("T,S,heads,H,mask_name,extras", CASES, ids=[_case_id(c) for c in CASES])
def test_matches_reference(T, S, heads, H, mask_name, extras):
    extras = dict(extras)
    B = extras.pop("B", 2)
    q, k, v, bias = inputs(B, T, S, *heads, H, bias=extras.pop("bias", None))
    mask = make_mask(mask_name, B, T, S)
    check_against_reference(blockwise_attention, q, k, v, mask, bias, block_q=128, block_kv=128,
                            **extras)


def test_bf16_within_2e2():
    # ... and off for the other tests on CPU (they compile faster; see tests/conftest.py)
    assert jax.config.values["jax_disable_most_optimizations"] or jax.default_backend() != "cpu"
    q, k, v, _ = inputs(2, 384, 384, 8, 2, 64, dtype=jnp.bfloat16)
    check_against_reference(blockwise_attention, q, k, v, M.causal(), block_q=128, block_kv=128)


def test_fully_masked_rows_are_zero_with_zero_grads():
    q, k, v, _ = inputs(2, 100, 100, 4, 4, 32)
    mask = M.padding(np.array([0, 50]))
    f = lambda q, k, v: blockwise_attention(q, k, v, mask, block_q=32, block_kv=32).sum()
    out, lse = jax.jit(lambda q, k, v: blockwise_attention(q, k, v, mask, return_lse=True,
                                                           block_q=32, block_kv=32))(q, k, v)
    assert (np.asarray(out[0]) == 0).all() and np.isneginf(np.asarray(lse[0])).all()
    grads = jax.jit(jax.grad(f, (0, 1, 2)))(q, k, v)
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)
    assert (np.asarray(grads[0][0]) == 0).all()


def test_traced_offsets_equal_static_offsets():
    """Ring attention passes offsets as traced values: same result, same grads."""
    q, k, v, _ = inputs(1, 100, 200, 4, 2, 32)
    mask = M.causal() & M.sliding_window(64)

    def loss(q, k, v, qo, ko):
        return blockwise_attention(q, k, v, mask, q_offset=qo, kv_offset=ko, block_q=32,
                                   block_kv=64).sum()

    static_loss = lambda q, k, v: loss(q, k, v, 100, 0)
    static = jax.jit(jax.value_and_grad(static_loss, (0, 1, 2)))(q, k, v)
    traced = jax.jit(jax.value_and_grad(loss, (0, 1, 2)))(q, k, v, jnp.int32(100), jnp.int32(0))
    for a, b in zip(jax.tree.leaves(static), jax.tree.leaves(traced)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def test_two_runs_bitwise_equal():
    q, k, v, _ = inputs(2, 200, 200, 8, 2, 32)
    mask = M.causal() & M.segments(np.repeat([[0, 1]], 100, axis=1).reshape(1, -1).repeat(2, 0))
    f = jax.jit(jax.grad(lambda q, k, v: blockwise_attention(q, k, v, mask, block_q=64,
                                                             block_kv=64).sum(), (0, 1, 2)))
    a, b = f(q, k, v), f(q, k, v)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


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


def _temp_bytes(T, grad):
    q = jax.ShapeDtypeStruct((1, T, 4, 64), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, T, 4, 64), jnp.float32)
    f = lambda q, k, v: blockwise_attention(q, k, v, M.causal(), block_q=256, block_kv=256)
    if grad:
        f = jax.grad(lambda q, k, v, f=f: f(q, k, v).sum(), (0, 1, 2))
    return jax.jit(f).lower(q, kv, kv).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.xla_optimized  # compiled memory, as production compiles it
@pytest.mark.parametrize("grad", [False, True], ids=["forward", "backward"])
def test_activation_memory_is_linear_in_T(grad):
    # the marker's fixture (tests/conftest.py) really turns XLA's optimisations on
    assert not jax.config.values["jax_disable_most_optimizations"]
    small, large = _temp_bytes(1024, grad), _temp_bytes(4096, grad)
    assert large < 6 * small, (small, large)  # O(T*S) would be 16x


def test_gradients_through_a_model_equal_the_reference():
    """A one-layer attention block (projections, causal GQA attention, output)."""
    D, N, K, H, T = 32, 4, 2, 8, 50
    keys = jax.random.split(jax.random.key(3), 5)
    params = {"wq": jax.random.normal(keys[0], (D, N, H)) * 0.2,
              "wk": jax.random.normal(keys[1], (D, K, H)) * 0.2,
              "wv": jax.random.normal(keys[2], (D, K, H)) * 0.2,
              "wo": jax.random.normal(keys[3], (N, H, D)) * 0.2}
    x = jax.random.normal(keys[4], (2, T, D))

    def loss(params, impl):
        q = jnp.einsum("BTD,DNH->BTNH", x, params["wq"])
        k = jnp.einsum("BTD,DKH->BTKH", x, params["wk"])
        v = jnp.einsum("BTD,DKH->BTKH", x, params["wv"])
        o = dot_product_attention(q, k, v, M.causal(), implementation=impl)
        return jnp.mean(jnp.einsum("BTNH,NHD->BTD", o, params["wo"]) ** 2)

    want = jax.jit(jax.grad(loss), static_argnums=1)(params, "reference")
    got = jax.jit(jax.grad(loss), static_argnums=1)(params, "blockwise")
    for name in params:
        np.testing.assert_allclose(got[name], want[name], atol=1e-5, rtol=1e-4, err_msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("mask_name,heads", [
    ("window", (4, 4)), ("chunked", (8, 1)), ("segments", (8, 2)),
    ("causal&segments", (8, 1)), ("padding_fully_masked", (4, 4)),
])
def test_sweep_masks_by_heads(mask_name, heads):
    q, k, v, bias = inputs(2, 100, 128, *heads, 32, bias=(1, 1))
    check_against_reference(blockwise_attention, q, k, v, make_mask(mask_name, 2, 100, 128), bias,
                            softcap=10.0, block_q=32, block_kv=64)
