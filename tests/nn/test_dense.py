"""tfjax.nn.dense against float64 numpy: forward, input and kernel gradients on
awkward shapes (both transposition branches of the CPU kernel gradient), the
non-CPU branch, the nnx.Linear hook, and the compiled CPU layout it exists for."""

import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from flax import nnx

from tfjax.nn import dense as dense_lib
from tfjax.nn.dense import dense, linear_dot_general
from tfjax.ops.target import targeting


def _reference(x, w, g):
    """(y, dx, dw) of y = x @ w with cotangent g, in float64 numpy."""
    x, w, g = (np.asarray(a, np.float64) for a in (x, w, g))
    x2, g2 = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
    return x @ w, g @ w.T, x2.T @ g2


@pytest.mark.parametrize("shape,I,O", [((3, 7), 5, 11),     # I < O: x is transposed
                                       ((2, 3, 5), 13, 6),  # I > O: g is, and dw^T
                                       ((9,), 4, 4)])
def test_forward_and_gradients_match_numpy(shape, I, O):
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (*shape, I))
    w = jax.random.normal(kw, (I, O))
    g = jax.random.normal(kg, (*shape, O))
    y, vjp = jax.vjp(jax.jit(dense), x, w)
    dx, dw = vjp(g)
    ry, rdx, rdw = _reference(x, w, g)
    np.testing.assert_allclose(y, ry, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx, rdx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, rdw, rtol=1e-5, atol=1e-5)


def test_linear_hook_is_plain_dot_general_for_other_targets():
    """On a TPU / GPU target the layer's matmul is lax.dot_general itself (a custom
    VJP would hide it from rematerialisation policies such as dots_saveable)."""
    x, w = jnp.ones((2, 3, 5)), jnp.ones((5, 7))
    dims = (((2,), (0,)), ((), ()))

    def dense_backward(platform):  # dense's backward is the one with barriers
        def f(w):
            with targeting(platform):
                return jnp.sum(linear_dot_general(x, w, dims))
        return "optimization_barrier" in str(jax.make_jaxpr(jax.grad(f))(w))

    assert dense_backward("cpu") and not dense_backward("tpu") and not dense_backward("gpu")


def test_bfloat16_gradient_keeps_the_kernel_dtype():
    x = jnp.ones((4, 8), jnp.bfloat16)
    w = jnp.ones((8, 16), jnp.bfloat16)
    dw = jax.grad(lambda w: dense(x, w).astype(jnp.float32).sum())(w)
    assert dw.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(dw, np.float32), 4.0)


def test_linear_hook_serves_the_layer_and_passes_other_calls_through():
    layer = nnx.Linear(5, 7, dot_general=linear_dot_general, rngs=nnx.Rngs(0))
    plain = nnx.Linear(5, 7, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(3), (2, 3, 5))
    np.testing.assert_allclose(layer(x), plain(x), rtol=1e-6)
    a, b = jnp.ones((2, 4, 5)), jnp.ones((2, 5, 3))  # a batched contraction: not dense's
    out = linear_dot_general(a, b, (((2,), (1,)), ((0,), (0,))))
    np.testing.assert_array_equal(out, jax.lax.dot_general(a, b, (((2,), (1,)), ((0,), (0,)))))


def _lhs_contractions(project):
    """The lhs contracting dims of every dot in the compiled CPU gradient of a
    projection followed by a nonlinearity."""
    x, w = jnp.ones((4, 32, 16)), jnp.ones((16, 48))
    hlo = jax.jit(jax.grad(lambda w: jnp.sum(jnp.tanh(project(x, w))))).lower(w).compile().as_text()
    return re.findall(r"dot\([^)]*\), lhs_contracting_dims=\{([\d,]+)\}", hlo)


def test_cpu_kernel_gradient_contracts_row_major_operands():
    """What the op is for: autodiff's kernel gradient compiles on CPU to a dot that
    contracts its left operand on a leading axis (which XLA:CPU runs outside
    YNNPACK); dense's has none. If the first assertion fails, XLA has changed and
    `dense` may no longer be needed."""
    autodiff = _lhs_contractions(dense_lib._forward)
    assert any("0" in d.split(",") for d in autodiff), autodiff
    ours = _lhs_contractions(dense)
    assert ours and not any("0" in d.split(",") for d in ours), ours
