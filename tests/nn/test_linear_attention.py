"""Linear attention: the O(T) forms equal the quadratic form; the recurrent
state equals the causal form; GQA groups share a kv head."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tfjax.config import LinearConfig
from tfjax.nn.linear_attention import (LinearAttention, LinearAttentionState,
                                       causal_linear_attention, linear_attention,
                                       linear_attention_reference, linear_attention_step)

B, T, N, K, H = 2, 10, 4, 2, 5


def qkv(seed=0, S=T):
    ks = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(ks[0], (B, T, N, H)), jax.random.normal(ks[1], (B, S, K, H)),
            jax.random.normal(ks[2], (B, S, K, H + 1)))


@pytest.mark.parametrize("fm", ["elu_plus_one", "relu"])
def test_noncausal_matches_quadratic(fm):
    q, k, v = qkv(S=7)
    want = linear_attention_reference(q, k, v, causal=False, feature_map=fm)
    got = jax.jit(lambda q, k, v: linear_attention(q, k, v, causal=False, feature_map=fm))(q, k, v)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert got.shape == (B, T, N, H + 1)


@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_causal_chunked_matches_quadratic(chunk):
    q, k, v = qkv(1)
    want = linear_attention_reference(q, k, v, causal=True)
    got = jax.jit(lambda q, k, v: linear_attention(q, k, v, chunk_size=chunk))(q, k, v)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_causal_gradients_match_quadratic():
    q, k, v = qkv(2)
    w = jax.random.normal(jax.random.key(9), (B, T, N, H + 1))

    def loss(f):
        return lambda q, k, v: jnp.sum(f(q, k, v) * w)

    g_ref = jax.jit(jax.grad(loss(linear_attention_reference), (0, 1, 2)))(q, k, v)
    g = jax.jit(jax.grad(loss(lambda q, k, v: linear_attention(q, k, v, chunk_size=3)),
                         (0, 1, 2)))(q, k, v)
    for a, b in zip(g, g_ref):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_recurrent_state_equals_causal_form():
    q, k, v = qkv(3)
    want, final = causal_linear_attention(q, k, v, chunk_size=4)

    @jax.jit
    def decode(q, k, v):
        S = jnp.zeros((B, K, H, H + 1))
        z = jnp.zeros((B, K, H))

        def body(state, xs):
            out, state = linear_attention_step(*xs, state)
            return state, out

        state, outs = jax.lax.scan(body, LinearAttentionState(S, z),
                                   (q.swapaxes(0, 1), k.swapaxes(0, 1), v.swapaxes(0, 1)))
        return outs.swapaxes(0, 1), state

    outs, state = decode(q, k, v)
    np.testing.assert_allclose(outs, want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(state.S, final.S, rtol=1e-4, atol=1e-5)
    # Prefill 6, then continue from the state.
    a, s = causal_linear_attention(q[:, :6], k[:, :6], v[:, :6], chunk_size=4)
    b, _ = causal_linear_attention(q[:, 6:], k[:, 6:], v[:, 6:], chunk_size=4, state=s)
    np.testing.assert_allclose(jnp.concatenate([a, b], 1), want, rtol=1e-4, atol=1e-5)


def test_layer_forward_equals_steps_and_is_causal():
    m = LinearAttention(12, N, LinearConfig(chunk=3), num_kv_heads=K, head_dim=H, init_std=0.3,
                        rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(4), (B, T, 12))
    y = nnx.jit(lambda m, x: m(x))(m, x)

    @nnx.jit
    def decode(m, x):
        def body(state, x_t):
            y_t, state = m.step(x_t, state)
            return state, y_t
        return jax.lax.scan(body, m.init_state(B), x.swapaxes(0, 1))[1].swapaxes(0, 1)

    np.testing.assert_allclose(decode(m, x), y, rtol=1e-4, atol=1e-5)
    x2 = x.at[:, 7:].add(1.0)
    y2 = nnx.jit(lambda m, x: m(x))(m, x2)
    np.testing.assert_allclose(y2[:, :7], y[:, :7], rtol=1e-5, atol=1e-6)
    assert not np.allclose(y2[:, 7:], y[:, 7:], atol=1e-4)


@pytest.mark.parametrize("chunk", [3, 64])
def test_document_resets_match_quadratic_and_separate_documents(chunk):
    q, k, v = qkv(5)
    positions = jnp.array([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2], [5, 6, 7, 0, 1, 2, 3, 4, 5, 6]])
    want = linear_attention_reference(q, k, v, positions=positions)
    got = jax.jit(lambda q, k, v, p: linear_attention(q, k, v, chunk_size=chunk,
                                                      positions=p))(q, k, v, positions)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    # Row 0 holds three documents: each equals the document alone.
    for a, b in ((0, 4), (4, 7), (7, 10)):
        alone = linear_attention_reference(q[:1, a:b], k[:1, a:b], v[:1, a:b])
        np.testing.assert_allclose(got[:1, a:b], alone, rtol=1e-4, atol=1e-5)


def test_right_padded_prefill_state_is_the_state_after_the_real_tokens():
    q, k, v = qkv(6)
    f = jax.jit(lambda q, k, v, n: causal_linear_attention(q, k, v, chunk_size=4, lengths=n)[1])
    padded = f(q, k, v, jnp.array([6, T]))
    short = jax.jit(lambda q, k, v: causal_linear_attention(q, k, v, chunk_size=4)[1])(
        q[:, :6], k[:, :6], v[:, :6])
    np.testing.assert_allclose(padded.S[0], short.S[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(padded.z[0], short.z[0], rtol=1e-5, atol=1e-6)
