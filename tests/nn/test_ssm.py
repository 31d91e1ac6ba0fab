"""Mamba: the parallel and chunked scans equal the sequential loop; a whole
sequence equals step-by-step decoding and prefill-then-continue; packed
documents equal separate ones."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tfjax.config import SSMConfig
from tfjax.nn.ssm import Mamba, selective_scan, selective_scan_reference

B, T, Di, N = 2, 10, 6, 4


def scan_inputs(seed=0):
    ks = jax.random.split(jax.random.key(seed), 7)
    u = jax.random.normal(ks[0], (B, T, Di))
    dt = jax.nn.softplus(jax.random.normal(ks[1], (B, T, Di)))
    A = -jnp.exp(jax.random.normal(ks[2], (Di, N)))
    Bm = jax.random.normal(ks[3], (B, T, N))
    Cm = jax.random.normal(ks[4], (B, T, N))
    Dskip = jax.random.normal(ks[5], (Di,))
    h0 = jax.random.normal(ks[6], (B, Di, N))
    return u, dt, A, Bm, Cm, Dskip, h0


@pytest.mark.parametrize("chunk", [0, 3])
def test_scan_matches_sequential_loop(chunk):
    args = scan_inputs()
    reset = jnp.zeros((B, T), bool).at[1, 6].set(True)
    want_y, want_h = selective_scan_reference(*args, reset=reset)
    y, h = jax.jit(lambda *a: selective_scan(*a, chunk_size=chunk, reset=reset))(*args)
    np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(h, want_h, rtol=1e-5, atol=1e-5)


def test_chunked_gradients_equal_unchunked():
    args = scan_inputs(1)

    def loss(chunk, *a):
        y, h = selective_scan(*a, chunk_size=chunk)
        return jnp.sum(jnp.sin(y)) + jnp.sum(h)

    g0 = jax.jit(jax.grad(lambda *a: loss(0, *a), argnums=tuple(range(7))))(*args)
    g4 = jax.jit(jax.grad(lambda *a: loss(4, *a), argnums=tuple(range(7))))(*args)
    for a, b in zip(g0, g4):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def make(**kw):
    """A Mamba of d_model 8; `kw`: fields of its `SSMConfig`."""
    args = dict(d_state=N, d_conv=4, expand=2)
    args.update(kw)
    return Mamba(8, SSMConfig(**args), init_std=0.3, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("kw", [dict(), dict(chunk=4, inner_norm=True, proj_bias=True)])
def test_sequence_equals_steps_and_prefill(kw):
    m = make(**kw)
    u = jax.random.normal(jax.random.key(3), (B, T, 8))
    y, final = nnx.jit(lambda m, u: m.forward(u))(m, u)

    @nnx.jit
    def decode(m, u):
        def body(state, u_t):
            y_t, state = m.step(u_t, state)
            return state, y_t
        state, ys = jax.lax.scan(body, m.init_state(B), u.swapaxes(0, 1))
        return ys.swapaxes(0, 1), state

    ys, state = decode(m, u)
    np.testing.assert_allclose(ys, y, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(state.ssm, final.ssm, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(state.conv, final.conv, rtol=1e-5, atol=1e-6)
    # Prefill 6 tokens, then continue from the state with the rest.
    fwd = nnx.jit(lambda m, u, s, p: m.forward(u, s, positions=p))
    y1, s1 = fwd(m, u[:, :6], None, None)
    y2, s2 = fwd(m, u[:, 6:], s1, jnp.broadcast_to(jnp.arange(6, T), (B, T - 6)))
    np.testing.assert_allclose(jnp.concatenate([y1, y2], 1), y, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(s2.ssm, final.ssm, rtol=1e-4, atol=1e-5)


def test_packed_documents_equal_separate_documents():
    m = make(chunk=3)
    u = jax.random.normal(jax.random.key(4), (1, T, 8))
    cut = 4
    positions = jnp.concatenate([jnp.arange(cut), jnp.arange(T - cut)])[None]
    call = nnx.jit(lambda m, u, p: m(u, positions=p))
    packed = call(m, u, positions)
    a, b = call(m, u[:, :cut], None), call(m, u[:, cut:], None)
    np.testing.assert_allclose(packed, jnp.concatenate([a, b], 1), rtol=1e-4, atol=1e-5)
    # Without positions the second document sees the first.
    assert not np.allclose(call(m, u, None)[:, cut:], b, atol=1e-4)


def test_layer_is_causal_and_differentiable():
    m = make()
    u = jax.random.normal(jax.random.key(5), (B, T, 8))
    v = u.at[:, 7:].add(1.0)
    yu, yv = jnp.split(nnx.jit(lambda m, x: m(x))(m, jnp.concatenate([u, v])), 2)
    np.testing.assert_allclose(yu[:, :7], yv[:, :7], rtol=1e-5, atol=1e-6)
    assert not np.allclose(yu[:, 7:], yv[:, 7:], atol=1e-4)
    g = nnx.jit(nnx.grad(lambda m: jnp.sum(m(u) ** 2)))(m)
    leaves = jax.tree.leaves(nnx.state(g, nnx.Param))
    assert all(np.isfinite(np.asarray(x)).all() for x in leaves)
    assert float(jnp.abs(g.A_log[...]).sum()) > 0 and float(jnp.abs(g.dt_proj[...]).sum()) > 0


def test_right_padded_prefill_state_is_the_state_after_the_real_tokens():
    m = make(chunk=4)
    u = jax.random.normal(jax.random.key(6), (B, T, 8))
    lengths = jnp.array([6, T])
    fwd = nnx.jit(lambda m, u, n: m.forward(u, lengths=n))
    _, padded = fwd(m, u, lengths)
    _, short = fwd(m, u[:, :6], None)
    _, full = fwd(m, u, None)
    for got, want in ((padded.ssm[0], short.ssm[0]), (padded.conv[0], short.conv[0]),
                      (padded.ssm[1], full.ssm[1]), (padded.conv[1], full.conv[1])):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
