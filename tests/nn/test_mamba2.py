"""Mamba-2: the SSD chunked algorithm equals the sequential recurrence, forward and
gradients, on lengths that are not a multiple of the chunk, with groups and
resets; the layer's whole sequence equals step-by-step decoding and
prefill-then-continue; packed documents equal separate ones; a right-padded tail
stays out of the state; the layer equals Hugging Face's Mamba2Mixer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tfjax.config import Mamba2Config
from tfjax.nn.mamba2 import Mamba2, ssd, ssd_reference

B, T, H, P, G, N = 2, 37, 4, 3, 2, 5  # 37 = 4 chunks of 8 + 5
D_MODEL = 16


def ssd_inputs(seed=0):
    ks = jax.random.split(jax.random.key(seed), 7)
    x = jax.random.normal(ks[0], (B, T, H, P))
    dt = jax.nn.softplus(jax.random.normal(ks[1], (B, T, H)))
    A = -jnp.exp(jax.random.normal(ks[2], (H,)))
    Bm = jax.random.normal(ks[3], (B, T, G, N))
    Cm = jax.random.normal(ks[4], (B, T, G, N))
    Dskip = jax.random.normal(ks[5], (H,))
    h0 = jax.random.normal(ks[6], (B, H, P, N))
    return x, dt, A, Bm, Cm, Dskip, h0


# Resets inside a chunk (5, 30), on a chunk's first step (8, 16) and on the last (23).
RESET = jnp.zeros((B, T), bool).at[0, 5].set(True).at[0, 16].set(True).at[1, 8].set(True) \
    .at[1, 23].set(True).at[1, 30].set(True)


@pytest.mark.parametrize("reset", [None, RESET], ids=["plain", "reset"])
def test_chunked_equals_sequential_forward_and_gradients(reset):
    args = ssd_inputs()

    def loss(f, *a):
        y, h = f(*a, reset=reset)
        return jnp.sum(jnp.sin(y)) + jnp.sum(jnp.cos(h))

    chunked = lambda *a, reset: ssd(*a, chunk_size=8, reset=reset)  # noqa: E731
    grads = jax.grad(loss, argnums=tuple(range(1, 8)))
    (y, h), gc = jax.jit(lambda *a: (chunked(*a, reset=reset), grads(chunked, *a)))(*args)
    (want_y, want_h), gr = jax.jit(
        lambda *a: (ssd_reference(*a, reset=reset), grads(ssd_reference, *a)))(*args)
    np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=2e-5)
    np.testing.assert_allclose(h, want_h, rtol=1e-5, atol=2e-5)
    for name, a, b in zip(("x", "dt", "A", "B", "C", "D", "h0"), gc, gr):
        assert np.isfinite(np.asarray(a)).all(), name
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4, err_msg=name)


def make(**kw):
    """A Mamba-2 of d_model D_MODEL; `kw`: fields of its `Mamba2Config`."""
    args = dict(d_state=4, head_dim=8, expand=2, n_groups=2, d_conv=4, chunk=4)
    args.update(kw)
    return Mamba2(D_MODEL, Mamba2Config(**args), init_std=0.3, rngs=nnx.Rngs(0))


def test_layer_chunked_equals_reference_with_parameter_gradients(monkeypatch):
    """The whole layer (conv, gates, norm) on T=11 with chunk 4 and 4 heads in 2
    groups: its parameter and input gradients equal those through `ssd_reference`."""
    from tfjax.nn import mamba2 as mod

    m = make()
    u = jax.random.normal(jax.random.key(1), (B, 11, D_MODEL))
    positions = jnp.array([list(range(7)) + list(range(4)), list(range(11))])

    def run(m, u):
        def loss(m, u):
            return jnp.sum(jnp.sin(m(u, positions=positions)))
        return nnx.value_and_grad(loss, argnums=(0, 1))(m, u)

    (v, (gm, gu)) = nnx.jit(run)(m, u)
    reference = lambda x, dt, A, Bm, Cm, Dk, h0, *, chunk_size, reset: ssd_reference(  # noqa: E731
        x, dt, A, Bm, Cm, Dk, h0, reset=reset)
    monkeypatch.setattr(mod, "ssd", reference)
    (want_v, (want_gm, want_gu)) = nnx.jit(run)(m, u)
    np.testing.assert_allclose(v, want_v, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gu, want_gu, rtol=1e-4, atol=1e-5)
    got, want = (jax.tree_util.tree_leaves_with_path(nnx.state(g, nnx.Param))
                 for g in (gm, want_gm))
    assert len(got) == len(want) == 8  # in_proj, conv w+b, dt_bias, A_log, D, norm, out_proj
    for (path, a), (_, b) in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=jax.tree_util.keystr(path))
    assert float(jnp.abs(gm.A_log[...]).sum()) > 0 and float(jnp.abs(gm.D[...]).sum()) > 0


@pytest.mark.parametrize("kw", [dict(), dict(chunk=3, proj_bias=True, n_groups=1,
                                              norm_groups=2, dt_min_limit=0.01,
                                              dt_max_limit=0.5)])
def test_sequence_equals_steps_and_prefill(kw):
    m = make(**kw)
    T = 10
    u = jax.random.normal(jax.random.key(3), (B, T, D_MODEL))

    @nnx.jit
    def run(m, u):
        y, final = m.forward(u)

        def body(state, u_t):
            y_t, state = m.step(u_t, state)
            return state, y_t
        state, ys = jax.lax.scan(body, m.init_state(B), u.swapaxes(0, 1))
        # Prefill 6 tokens, then continue from the state with the rest.
        y1, s1 = m.forward(u[:, :6])
        y2, s2 = m.forward(u[:, 6:], s1, positions=jnp.broadcast_to(jnp.arange(6, T), (B, T - 6)))
        return y, final, ys.swapaxes(0, 1), state, jnp.concatenate([y1, y2], 1), s2

    y, final, ys, state, y12, s2 = run(m, u)
    np.testing.assert_allclose(ys, y, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(state.ssm, final.ssm, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(state.conv, final.conv, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(y12, y, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(s2.ssm, final.ssm, rtol=1e-4, atol=1e-5)
    assert final.ssm.shape == (B, m.num_heads, 8, 4) and final.ssm.dtype == jnp.float32
    assert final.conv.shape == (B, 3, m.d_inner + 2 * m.n_groups * 4)


def test_packed_documents_equal_separate_documents_and_padding_stays_out():
    m = make(chunk=3)
    T, cut = 10, 4
    u = jax.random.normal(jax.random.key(4), (1, T, D_MODEL))
    positions = jnp.concatenate([jnp.arange(cut), jnp.arange(T - cut)])[None]
    u2 = jnp.concatenate([u, u[:, ::-1]])  # two rows for the padding check
    lengths = jnp.array([6, T])

    @nnx.jit
    def run(m):
        packed = m(u, positions=positions)
        a, b = m(u[:, :cut]), m(u[:, cut:])
        unmarked = m(u)[:, cut:]
        _, padded = m.forward(u2, lengths=lengths)
        _, short = m.forward(u2[:, :6])
        _, full = m.forward(u2)
        return packed, jnp.concatenate([a, b], 1), unmarked, b, padded, short, full

    packed, separate, unmarked, b, padded, short, full = run(m)
    np.testing.assert_allclose(packed, separate, rtol=1e-4, atol=1e-5)
    assert not np.allclose(unmarked, b, atol=1e-4)  # without positions it sees document 1
    for got, want in ((padded.ssm[0], short.ssm[0]), (padded.conv[0], short.conv[0]),
                      (padded.ssm[1], full.ssm[1]), (padded.conv[1], full.conv[1])):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_bad_shapes_are_errors():
    with pytest.raises(ValueError, match="head_dim=5"):
        make(head_dim=5)
    with pytest.raises(ValueError, match="n_groups=3"):
        make(n_groups=3)
    with pytest.raises(ValueError, match="norm_groups=3"):
        make(norm_groups=3)


def test_equals_hugging_face_mamba2_mixer():
    """Random HF `Mamba2Mixer` weights (8 heads of 4 in 2 groups, chunk 8, T = 21)
    loaded into `Mamba2`: the torch reference path and ours agree to 1e-4."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer

    hf_cfg = transformers.Mamba2Config(
        hidden_size=D_MODEL, num_heads=8, head_dim=4, expand=2, n_groups=2, state_size=5,
        chunk_size=8, conv_kernel=4, use_conv_bias=True, use_bias=True, layer_norm_epsilon=1e-5,
        num_hidden_layers=1)
    torch.manual_seed(0)
    mixer = Mamba2Mixer(hf_cfg, 0).eval()
    with torch.no_grad():
        for p in mixer.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    m = Mamba2(D_MODEL, Mamba2Config(d_state=5, head_dim=4, expand=2, n_groups=2, chunk=8,
                                     proj_bias=True), norm_eps=1e-5, rngs=nnx.Rngs(0))

    def t(a):
        return jnp.asarray(a.detach().numpy())

    m.in_proj[...], m.in_bias[...] = t(mixer.in_proj.weight).T, t(mixer.in_proj.bias)
    m.conv_w[...], m.conv_b[...] = t(mixer.conv1d.weight[:, 0, :]).T, t(mixer.conv1d.bias)
    m.dt_bias[...], m.A_log[...], m.D[...] = t(mixer.dt_bias), t(mixer.A_log), t(mixer.D)
    m.norm_w[...] = t(mixer.norm.weight)
    m.out_proj[...], m.out_bias[...] = t(mixer.out_proj.weight).T, t(mixer.out_proj.bias)
    u = np.random.RandomState(0).randn(2, 21, D_MODEL).astype(np.float32)
    with torch.no_grad():
        want = mixer(torch.from_numpy(u)).numpy()
    got = np.asarray(nnx.jit(lambda m, u: m(u))(m, jnp.asarray(u)))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
