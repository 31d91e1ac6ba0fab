"""tfjax.nn.ffn against plain float64 numpy formulas: every activation, gated and
plain, forward and gradients, bf16, initialisation, logical axis names, errors.

The reference and its gradients are written out by hand (chain rule in numpy),
so they share nothing with the module or with jax's autodiff, and cost no
compiles: this file's run time is the module's compiles."""

import math

import numpy as np
import pytest
from scipy.special import erf

import jax
import jax.numpy as jnp
from flax import nnx

from tfjax.nn.ffn import ACTIVATIONS, FeedForward

from module_vjp import run_module

GATED = {"reglu", "geglu", "geglu_tanh", "swiglu"}
PLAIN = {"relu", "gelu", "gelu_tanh", "silu"}
ALL = sorted(GATED | PLAIN)
D, F = 5, 12  # D not a multiple of 8; one shape everywhere so eager compiles are reused


# --- reference activations and their derivatives ----------------------------------------

_C = math.sqrt(2.0 / math.pi)


def _sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


def _gelu_erf(z):  # Hendrycks & Gimpel 2016, exact
    return 0.5 * z * (1.0 + erf(z / math.sqrt(2.0)))


def _gelu_erf_grad(z):  # Phi(z) + z phi(z)
    return 0.5 * (1.0 + erf(z / math.sqrt(2.0))) + z * np.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)


def _gelu_tanh(z):  # the tanh approximation from the same paper
    return 0.5 * z * (1.0 + np.tanh(_C * (z + 0.044715 * z**3)))


def _gelu_tanh_grad(z):
    t = np.tanh(_C * (z + 0.044715 * z**3))
    return 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * _C * (1.0 + 3 * 0.044715 * z * z)


REF = {  # name -> (f, f')
    "relu": (lambda z: np.maximum(z, 0.0), lambda z: (z > 0).astype(z.dtype)),
    "gelu": (_gelu_erf, _gelu_erf_grad),
    "gelu_tanh": (_gelu_tanh, _gelu_tanh_grad),
    "silu": (lambda z: z * _sigmoid(z), lambda z: _sigmoid(z) * (1.0 + z * (1.0 - _sigmoid(z)))),
}
REF.update(reglu=REF["relu"], geglu=REF["gelu"], geglu_tanh=REF["gelu_tanh"], swiglu=REF["silu"])


def ref_ffn(activation, params, x, cotangent):
    """Forward and hand-derived backward of the FFN in float64.

    params: {"wi" | "wi_gate", "wi_up", "wo": {"kernel", ["bias"]}} as numpy.
    Returns (y, grads with params' structure, dx) for loss = sum(y * cotangent)."""
    p = {m: {k: np.asarray(v, np.float64) for k, v in sub.items()} for m, sub in params.items()}
    x = np.asarray(x, np.float64)
    ct = np.asarray(cotangent, np.float64)
    f, df = REF[activation]
    lin = lambda m, v: v @ p[m]["kernel"] + p[m].get("bias", 0.0)  # noqa: E731

    if activation in GATED:
        zg, zu = lin("wi_gate", x), lin("wi_up", x)
        h = f(zg) * zu
    else:
        z = lin("wi", x)
        h = f(z)
    y = lin("wo", h)

    flat_in = lambda v: v.reshape(-1, v.shape[-1])  # noqa: E731
    grads = {}

    def dense_grads(m, v_in, dv_out):
        grads[m] = {"kernel": flat_in(v_in).T @ flat_in(dv_out)}
        if "bias" in p[m]:
            grads[m]["bias"] = flat_in(dv_out).sum(0)
        return dv_out @ p[m]["kernel"].T

    dh = dense_grads("wo", h, ct)
    if activation in GATED:
        dx = dense_grads("wi_gate", x, dh * zu * df(zg)) + dense_grads("wi_up", x, dh * f(zg))
    else:
        dx = dense_grads("wi", x, dh * df(z))
    return y, grads, dx


# --- helpers ------------------------------------------------------------------------


def randomise_params(module, seed):
    """Unit-scale kernels (1/sqrt(fan_in)) and nonzero biases, so pre-activations
    are O(1): there exact and tanh gelu differ by ~1e-4, far above fp32 noise."""
    rng = np.random.default_rng(seed)
    state = nnx.state(module, nnx.Param)
    leaves, treedef = jax.tree.flatten(state)
    new = []
    for leaf in leaves:
        std = 1.0 / math.sqrt(leaf.shape[0]) if leaf.ndim == 2 else 0.5
        new.append(jnp.asarray(std * rng.standard_normal(leaf.shape), leaf.dtype))
    nnx.update(module, jax.tree.unflatten(treedef, new))


def pure_params(module):
    return jax.tree.map(np.asarray, nnx.state(module, nnx.Param).to_pure_dict())


def flat(tree):
    return nnx.traversals.flatten_mapping(tree)


def assert_trees_close(actual, expected, **tol):
    a, e = flat(actual), flat(expected)
    assert set(a) == set(e), (sorted(a), sorted(e))
    for k in e:
        np.testing.assert_allclose(np.asarray(a[k], np.float64), e[k], err_msg=str(k), **tol)



def inputs(shape, seed, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal(shape), dtype) for _ in range(2))


# --- the activation table -----------------------------------------------------------


def test_activation_table():
    assert ACTIVATIONS.names() == tuple(ALL)
    for name in ALL:
        _, gated = ACTIVATIONS.get(name)
        assert gated == (name in GATED), name


def test_activation_functions_match_formulas_and_gelus_differ():
    z = np.linspace(-6.0, 6.0, 2401)
    got = jax.jit(lambda z: {n: ACTIVATIONS.get(n)[0](z) for n in ALL})(jnp.asarray(z, jnp.float32))
    for name in ALL:
        np.testing.assert_allclose(got[name], REF[name][0](z), rtol=1e-6, atol=1e-6, err_msg=name)
    # The exact and tanh gelus are different functions (max gap ~4.7e-4 near |z| ~ 2);
    # the 1e-6 tolerance above cannot confuse them.
    assert 3e-4 < np.max(np.abs(_gelu_erf(z) - _gelu_tanh(z))) < 1e-3
    for exact, approx in [("gelu", "gelu_tanh"), ("geglu", "geglu_tanh")]:
        assert np.max(np.abs(got[exact] - _gelu_tanh(z))) > 3e-4
        assert np.max(np.abs(got[approx] - _gelu_erf(z))) > 3e-4


def test_reference_derivatives_match_finite_differences():
    # Guards the hand-written reference itself (central differences in float64).
    z = np.linspace(-4.0, 4.0, 801) + 1e-3  # keep off relu's kink at 0
    h = 1e-6
    for name, (f, df) in REF.items():
        np.testing.assert_allclose(df(z), (f(z + h) - f(z - h)) / (2 * h), atol=1e-7, err_msg=name)


# --- forward and gradients for every activation, bias on and off ----------------------


FWD_TOL = dict(rtol=1e-5, atol=2e-6)
GRAD_TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("use_bias", [True, False])
@pytest.mark.parametrize("activation", ALL)
def test_forward_and_grads_match_reference(activation, use_bias):
    ffn = FeedForward(D, F, activation=activation, use_bias=use_bias, rngs=nnx.Rngs(0))
    randomise_params(ffn, seed=1)
    x, cotangent = inputs((2, 3, D), seed=2)

    y, g_params, g_x = run_module(ffn, x, cotangent)
    r_y, r_params, r_x = ref_ffn(activation, pure_params(ffn), x, cotangent)
    assert y.shape == x.shape and y.dtype == jnp.float32
    np.testing.assert_allclose(y, r_y, **FWD_TOL)
    np.testing.assert_allclose(g_x, r_x, **GRAD_TOL)
    assert_trees_close(g_params, r_params, **GRAD_TOL)  # every parameter, same structure
    leaves = {k[-1] for k in flat(g_params)}
    assert leaves == ({"kernel", "bias"} if use_bias else {"kernel"})


@pytest.mark.parametrize("exact, approx", [("gelu", "gelu_tanh"), ("geglu", "geglu_tanh")])
def test_exact_and_tanh_gelu_blocks_are_told_apart(exact, approx):
    """Same weights, the two gelus: each block matches its own formula at the
    forward tolerance, and the exact one misses the tanh formula by far more."""
    x, cotangent = inputs((2, 3, D), seed=3)
    out = {}
    for name in (exact, approx):
        ffn = FeedForward(D, F, activation=name, rngs=nnx.Rngs(0))
        randomise_params(ffn, seed=4)  # same weights for both
        params = pure_params(ffn)
        out[name] = np.asarray(nnx.jit(lambda m, x: m(x))(ffn, x))
        np.testing.assert_allclose(out[name], ref_ffn(name, params, x, cotangent)[0], **FWD_TOL)
    other = ref_ffn(approx, params, x, cotangent)[0]
    gap = np.max(np.abs(out[exact] - other))
    assert gap > 20 * (FWD_TOL["atol"] + FWD_TOL["rtol"] * np.max(np.abs(other))), gap


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_bf16_compute_against_fp32_reference(activation):
    """Mixed precision (fp32 params, bf16 compute and input) stays within bf16
    tolerance of the full-precision reference on the same values; gradients
    come back in the params' dtype."""
    ffn = FeedForward(D, F, activation=activation, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    randomise_params(ffn, seed=5)
    x, cotangent = inputs((2, 4, D), seed=6, dtype=jnp.bfloat16)

    y, g_params, g_x = run_module(ffn, x, cotangent)
    assert y.dtype == g_x.dtype == jnp.bfloat16
    assert all(g.dtype == jnp.float32 for g in flat(g_params).values())
    r_y, r_params, r_x = ref_ffn(activation, pure_params(ffn), x.astype(jnp.float32),
                                 cotangent.astype(jnp.float32))
    np.testing.assert_allclose(np.asarray(y, np.float64), r_y, rtol=3e-2, atol=3e-2)
    np.testing.assert_allclose(np.asarray(g_x, np.float64), r_x, rtol=3e-2, atol=3e-2)
    assert_trees_close(g_params, r_params, rtol=3e-2, atol=5e-2)


def test_param_dtype():
    # nnx.eval_shape: an abstract build, nothing compiled or run
    ffn = nnx.eval_shape(
        lambda: FeedForward(D, F, activation="swiglu", param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    )
    params = flat(nnx.state(ffn, nnx.Param).to_pure_dict())
    assert len(params) == 6 and all(v.dtype == jnp.bfloat16 for v in params.values())


# --- structure, initialisation, sharding names -------------------------------------


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_submodule_names_and_logical_axes(activation):
    ffn = nnx.eval_shape(lambda: FeedForward(D, F, activation=activation, rngs=nnx.Rngs(0)))
    specs = nnx.get_partition_spec(nnx.state(ffn, nnx.Param)).to_pure_dict()
    wi = ["wi_gate", "wi_up"] if activation in GATED else ["wi"]
    assert set(specs) == {*wi, "wo"}
    for name in wi:
        assert tuple(specs[name]["kernel"]) == ("embed", "mlp")
        assert tuple(specs[name]["bias"]) == ("mlp",)
    assert tuple(specs["wo"]["kernel"]) == ("mlp", "embed")
    assert tuple(specs["wo"]["bias"]) == ("embed",)
    # the same names as raw Variable metadata (flax >= 0.12 calls it out_sharding)
    assert tuple(ffn.wo.kernel.get_metadata()["out_sharding"]) == ("mlp", "embed")


@pytest.mark.parametrize(
    "init_std, out_init_std, want_in, want_out",
    [(0.02, None, 0.02, 0.02), (0.05, 0.01, 0.05, 0.01)],
)
def test_init(init_std, out_init_std, want_in, want_out):
    # Pool 40 small layers (same shapes, so one compile): 2400 draws per kernel
    # estimate the std to ~1.5%.
    draws = {"wi_gate": [], "wi_up": [], "wo": []}
    for seed in range(40):
        ffn = FeedForward(D, F, activation="swiglu", init_std=init_std,
                          out_init_std=out_init_std, rngs=nnx.Rngs(seed))
        params = pure_params(ffn)
        for name in draws:
            draws[name].append(params[name]["kernel"].ravel())
            np.testing.assert_array_equal(params[name]["bias"], 0.0)
        assert not np.allclose(params["wi_gate"]["kernel"], params["wi_up"]["kernel"])
    for name, want in [("wi_gate", want_in), ("wi_up", want_in), ("wo", want_out)]:
        k = np.concatenate(draws[name])
        assert abs(k.std() / want - 1) < 0.06, (name, k.std(), want)
        assert abs(k.mean()) < 4 * want / math.sqrt(k.size), name


# --- errors -----------------------------------------------------------------------


def test_unknown_activation():
    with pytest.raises(ValueError) as err:
        FeedForward(D, F, activation="tanh", rngs=nnx.Rngs(0))
    msg = str(err.value)
    assert "activation='tanh'" in msg
    for name in ALL:
        assert name in msg


@pytest.mark.parametrize("d_model, d_ff, field", [(0, 8, "d_model"), (4, -3, "d_ff")])
def test_bad_dims(d_model, d_ff, field):
    with pytest.raises(ValueError, match=field):
        FeedForward(d_model, d_ff, rngs=nnx.Rngs(0))
