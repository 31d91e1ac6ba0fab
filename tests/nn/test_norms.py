"""tfjax.nn.norms against plain float64 numpy formulas: forward, gradients,
float32 statistics under bf16, initialisation, logical axis names and errors.

The reference and its gradients are written out by hand (numpy, float64), so
they share nothing with the module or with jax's autodiff and cost no compiles."""

import ml_dtypes
import numpy as np
import pytest

import jax
import jax.numpy as jnp
from flax import nnx

from tfjax.nn.norms import NORMS, make_norm

from module_vjp import run_module

EPS = 1e-5
KINDS = ("layernorm", "rmsnorm", "rmsnorm_plus_one")
D = 13  # not a multiple of 8; one shape for most tests so eager compiles are reused


# --- reference: the papers' formulas and their hand-derived gradients ---------------


def ref_norm(kind, params, x, cotangent=None, eps=EPS):
    """y = norm(x) in float64; with a cotangent also (d/dparams, d/dx) of sum(y * cotangent).

    layernorm: xhat = (x - mean) / sqrt(var + eps), y = xhat * scale (+ bias)
    rmsnorm:   xhat = x / sqrt(mean(x^2) + eps),     y = xhat * scale
    rmsnorm_plus_one:                                  y = xhat * (1 + scale)
    """
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    x = np.asarray(x, np.float64)
    if kind == "layernorm":
        centred = x - x.mean(-1, keepdims=True)
        sigma = np.sqrt((centred**2).mean(-1, keepdims=True) + eps)
        xhat = centred / sigma
    else:
        sigma = np.sqrt((x**2).mean(-1, keepdims=True) + eps)
        xhat = x / sigma
    gain = 1.0 + p["scale"] if kind == "rmsnorm_plus_one" else p["scale"]
    y = xhat * gain + p.get("bias", 0.0)
    if cotangent is None:
        return y

    ct = np.asarray(cotangent, np.float64)
    rows = tuple(range(x.ndim - 1))
    grads = {"scale": (ct * xhat).sum(rows)}
    if "bias" in p:
        grads["bias"] = ct.sum(rows)
    g = ct * gain  # d/dxhat
    # Through xhat: the mean (layernorm only) and the scale statistic both depend on x.
    dx = g - xhat * (g * xhat).mean(-1, keepdims=True)
    if kind == "layernorm":
        dx = dx - g.mean(-1, keepdims=True)
    return y, grads, dx / sigma


# --- helpers --------------------------------------------------------------------


def randomise_params(module, seed):
    """Give every parameter random values so scale/bias are not the identity."""
    rng = np.random.default_rng(seed)
    state = nnx.state(module, nnx.Param)
    leaves, treedef = jax.tree.flatten(state)
    new = [jnp.asarray(rng.standard_normal(leaf.shape), leaf.dtype) for leaf in leaves]
    nnx.update(module, jax.tree.unflatten(treedef, new))


def pure_params(module):
    return {k: np.asarray(v) for k, v in nnx.state(module, nnx.Param).to_pure_dict().items()}


apply = nnx.jit(lambda module, x: module(x))  # one compile per call site beats many eager ones



def assert_dicts_close(actual, expected, **tol):
    assert set(actual) == set(expected), (sorted(actual), sorted(expected))
    for k in expected:
        np.testing.assert_allclose(np.asarray(actual[k], np.float64), expected[k], err_msg=k, **tol)


# --- the reference checks itself -------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_reference_gradients_match_finite_differences(kind):
    rng = np.random.default_rng(0)
    x = 1.0 + rng.standard_normal((3, D))
    ct = rng.standard_normal(x.shape)
    params = {"scale": rng.standard_normal(D), "bias": rng.standard_normal(D)}
    if kind != "layernorm":
        del params["bias"]
    _, grads, dx = ref_norm(kind, params, x, ct)
    loss = lambda p, x: np.sum(ref_norm(kind, p, x) * ct)  # noqa: E731
    h = 1e-6
    v = rng.standard_normal(x.shape)  # directional derivative along v
    fd = (loss(params, x + h * v) - loss(params, x - h * v)) / (2 * h)
    np.testing.assert_allclose(fd, np.sum(dx * v), rtol=1e-6)
    for name in params:
        u = rng.standard_normal(D)
        plus = {**params, name: params[name] + h * u}
        minus = {**params, name: params[name] - h * u}
        fd = (loss(plus, x) - loss(minus, x)) / (2 * h)
        np.testing.assert_allclose(fd, np.sum(grads[name] * u), rtol=1e-6, err_msg=name)


# --- forward and gradients --------------------------------------------------------


@pytest.mark.parametrize("use_bias", [True, False])
@pytest.mark.parametrize("kind", KINDS)
def test_forward_and_grads_match_reference(kind, use_bias):
    norm = make_norm(kind, D, eps=EPS, use_bias=use_bias, rngs=nnx.Rngs(0))
    randomise_params(norm, seed=1)
    params = pure_params(norm)
    if kind == "layernorm":
        assert set(params) == ({"scale", "bias"} if use_bias else {"scale"})
    else:
        assert set(params) == {"scale"}  # RMSNorm variants never have a bias

    rng = np.random.default_rng(2)
    x = (1.5 + 2.0 * rng.standard_normal((2, 3, D))).astype(np.float32)  # nonzero mean on purpose
    cotangent = rng.standard_normal(x.shape).astype(np.float32)
    y, g_params, g_x = run_module(norm, x, cotangent)
    r_y, r_params, r_x = ref_norm(kind, params, x, cotangent)
    assert y.shape == x.shape and y.dtype == jnp.float32
    np.testing.assert_allclose(y, r_y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(g_x, r_x, rtol=1e-4, atol=1e-5)
    assert_dicts_close(g_params, r_params, rtol=1e-5, atol=1e-5)  # every parameter


@pytest.mark.parametrize("kind", KINDS)
def test_any_leading_shape_under_jit(kind):
    norm = make_norm(kind, D, rngs=nnx.Rngs(0))
    randomise_params(norm, seed=3)
    params = pure_params(norm)
    rng = np.random.default_rng(3)
    for shape in [(D,), (2, 1, 3, D)]:
        x = rng.standard_normal(shape).astype(np.float32)
        y = apply(norm, x)
        assert y.shape == shape
        np.testing.assert_allclose(y, ref_norm(kind, params, x), rtol=1e-5, atol=1e-5)


# --- numerics: float32 statistics whatever the compute dtype ------------------------


BF16_RTOL = 2.0**-8  # twice the bf16 rounding bound (2^-9) of a correctly rounded result


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_uses_float32_statistics(kind):
    """bf16 in, bf16 out, statistics in fp32: within one bf16 rounding of the
    float64 answer. The control shows that bf16 statistics would not pass."""
    d = 203
    rng = np.random.default_rng(0)
    x_bf16 = (3.0 + 0.5 * rng.standard_normal((4, d))).astype(ml_dtypes.bfloat16)
    norm = make_norm(kind, d, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))  # identity scale/bias
    expected = ref_norm(kind, pure_params(norm), x_bf16)

    y = apply(norm, jnp.asarray(x_bf16))
    assert y.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y, np.float64), expected, rtol=BF16_RTOL, atol=1e-6)

    # Control: the same formula with bf16 statistics falls outside that tolerance.
    bf16 = ml_dtypes.bfloat16
    if kind == "layernorm":
        centred = x_bf16 - x_bf16.mean(-1, keepdims=True, dtype=bf16)
        var = (centred * centred).mean(-1, keepdims=True, dtype=bf16)
        naive = centred / np.sqrt(var + bf16(EPS))
    else:
        naive = x_bf16 / np.sqrt((x_bf16 * x_bf16).mean(-1, keepdims=True, dtype=bf16) + bf16(EPS))
    err = np.abs(naive.astype(np.float64) - expected)
    assert np.any(err > BF16_RTOL * np.abs(expected) + 1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_params_and_input_against_full_precision_reference(kind):
    """All bf16 (params, input, compute): within bf16 tolerance of the float64
    reference on the same values, gradients included, outputs in bf16."""
    norm = make_norm(kind, D, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    randomise_params(norm, seed=4)
    rng = np.random.default_rng(5)
    x = jnp.asarray(0.7 + rng.standard_normal((3, 4, D)), jnp.bfloat16)
    cotangent = jnp.asarray(rng.standard_normal(x.shape), jnp.bfloat16)

    y, g_params, g_x = run_module(norm, x, cotangent)
    assert y.dtype == g_x.dtype == jnp.bfloat16
    assert all(g.dtype == jnp.bfloat16 for g in g_params.values())
    params = {k: np.asarray(v, np.float64) for k, v in pure_params(norm).items()}
    r_y, r_params, r_x = ref_norm(kind, params, np.asarray(x, np.float64),
                                  np.asarray(cotangent, np.float64))
    np.testing.assert_allclose(np.asarray(y, np.float64), r_y, rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(np.asarray(g_x, np.float64), r_x, rtol=5e-2, atol=5e-2)
    assert_dicts_close(g_params, r_params, rtol=5e-2, atol=1e-1)


@pytest.mark.parametrize("kind", KINDS)
def test_output_dtype_is_dtype_not_input_dtype(kind):
    x = jnp.ones((2, D), jnp.bfloat16)
    assert apply(make_norm(kind, D, dtype=jnp.float32, rngs=nnx.Rngs(0)), x).dtype == jnp.float32
    x = jnp.ones((2, D), jnp.float32)
    assert apply(make_norm(kind, D, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)), x).dtype == jnp.bfloat16


def test_layernorm_is_stable_under_a_large_mean():
    """A residual stream with mean >> std: the one-pass E[x^2] - E[x]^2 variance
    cancels to garbage in fp32 here; the two-pass variance does not."""
    d = 203
    rng = np.random.default_rng(1)
    x = (1e4 + rng.standard_normal((4, d))).astype(np.float32)
    norm = make_norm("layernorm", d, rngs=nnx.Rngs(0))
    expected = ref_norm("layernorm", pure_params(norm), x)
    np.testing.assert_allclose(apply(norm, x), expected, atol=3e-3)


# --- initialisation and the plus-one layout ------------------------------------------


def test_initial_values():
    ln = pure_params(make_norm("layernorm", D, rngs=nnx.Rngs(0)))
    np.testing.assert_array_equal(ln["scale"], np.ones(D))
    np.testing.assert_array_equal(ln["bias"], np.zeros(D))
    rms = pure_params(make_norm("rmsnorm", D, rngs=nnx.Rngs(0)))
    np.testing.assert_array_equal(rms["scale"], np.ones(D))
    norm = make_norm("rmsnorm_plus_one", D, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    plus = nnx.state(norm, nnx.Param).to_pure_dict()
    assert set(plus) == {"scale"} and plus["scale"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(plus["scale"], np.float32), np.zeros(D))


def test_rmsnorm_plus_one_with_zero_weight_is_plain_normalisation():
    rng = np.random.default_rng(6)
    x = (4.0 * rng.standard_normal((3, D))).astype(np.float32)
    plain = x / np.sqrt(np.mean(np.square(x, dtype=np.float64), -1, keepdims=True) + EPS)
    norm = make_norm("rmsnorm_plus_one", D, rngs=nnx.Rngs(0))
    np.testing.assert_allclose(apply(norm, x), plain, rtol=1e-6, atol=1e-6)
    # and equals an "rmsnorm" whose stored scale is 1 + w: a checkpoint of either
    # layout maps onto the other by adding or removing 1.
    w = rng.standard_normal(D).astype(np.float32)
    nnx.update(norm, {"scale": jnp.asarray(w)})
    rms = make_norm("rmsnorm", D, rngs=nnx.Rngs(0))
    nnx.update(rms, {"scale": jnp.asarray(1.0 + w)})
    np.testing.assert_allclose(apply(norm, x), apply(rms, x), rtol=1e-6, atol=1e-6)


# --- logical axis names and errors -------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_params_carry_logical_axis_names(kind):
    norm = make_norm(kind, 8, rngs=nnx.Rngs(0))  # built with no mesh: names are annotations
    specs = nnx.get_partition_spec(nnx.state(norm, nnx.Param)).to_pure_dict()
    assert specs and all(tuple(s) == ("norm",) for s in specs.values()), specs
    # the same names as raw Variable metadata (flax >= 0.12 calls it out_sharding)
    for _, var in nnx.to_flat_state(nnx.state(norm, nnx.Param)):
        assert tuple(var.get_metadata()["out_sharding"]) == ("norm",)


def test_registry_and_unknown_kind():
    assert NORMS.names() == tuple(sorted(KINDS + ("rmsnorm_unit",)))
    with pytest.raises(ValueError) as err:
        make_norm("batchnorm", 8, rngs=nnx.Rngs(0))
    msg = str(err.value)
    assert "norm='batchnorm'" in msg
    for kind in KINDS:
        assert kind in msg


def test_rmsnorm_unit_has_no_parameters_and_divides_by_the_rms():
    """Llama 4's L2 QK-norm: x / sqrt(mean(x^2) + eps), in float32 then `dtype`."""
    norm = make_norm("rmsnorm_unit", 8, eps=1e-6, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    assert not nnx.state(norm, nnx.Param)
    x = jax.random.normal(jax.random.key(0), (3, 8)) * 5
    want = x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)
    got = norm(x.astype(jnp.bfloat16))
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=2e-2, atol=2e-2)
