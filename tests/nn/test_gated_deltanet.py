"""Gated DeltaNet: the chunked (WY) form equals the sequential recurrence, forward
and gradients, with more value heads than key heads, a length that is not a
multiple of the chunk, an initial state and document resets; the layer's decode
steps equal its forward; packed documents equal separate ones; a padded tail stays
out of the state; random Hugging Face Qwen3NextGatedDeltaNet weights give HF's
outputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tfjax.config import GatedDeltaNetConfig, model_config
from tfjax.nn.gated_deltanet import (GatedDeltaNet, gated_delta_rule,
                                     gated_delta_rule_reference, l2_normalize)

B, T, CHUNK = 2, 37, 8
HK, HV, DK, DV, D = 2, 4, 8, 6, 16  # Hv = 2 Hk
GDN = GatedDeltaNetConfig(num_k_heads=HK, num_v_heads=HV, head_k_dim=DK, head_v_dim=DV,
                          chunk=CHUNK)
# Row 0 packs three documents (boundaries inside chunks); row 1 continues a state.
POSITIONS = jnp.array([list(range(10)) + list(range(20)) + list(range(7)), list(range(3, 40))])


def kernel_inputs(seed=0):
    ks = jax.random.split(jax.random.key(seed), 6)
    return dict(q=jax.random.normal(ks[0], (B, T, HK, DK)),
                k=jax.random.normal(ks[1], (B, T, HK, DK)),
                v=jax.random.normal(ks[2], (B, T, HV, DV)),
                a=jax.random.normal(ks[3], (B, T, HV)),
                b=jax.random.normal(ks[4], (B, T, HV)),
                state=jax.random.normal(ks[5], (B, HV, DK, DV)))


def run(rule, q, k, v, a, b, state, reset):
    q = l2_normalize(q) * DK ** -0.5
    return rule(q, l2_normalize(k), v, -jax.nn.softplus(a), jax.nn.sigmoid(b), state=state,
                reset=reset)


def close(a, b, tol=1e-4):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


def test_chunked_equals_sequential_forward_and_gradients():
    x = kernel_inputs()
    w = jax.random.normal(jax.random.key(7), (B, T, HV, DV))
    reset = POSITIONS == 0
    chunked = lambda *a, **kw: gated_delta_rule(*a, chunk_size=CHUNK, **kw)

    def loss(rule):
        def f(x):
            o, S = run(rule, **x, reset=reset)
            return jnp.sum(o * w) + jnp.sum(S ** 2), (o, S)
        return jax.jit(jax.value_and_grad(f, has_aux=True))

    (_, (o_ref, S_ref)), g_ref = loss(gated_delta_rule_reference)(x)
    (_, (o, S)), g = loss(chunked)(x)
    assert o.shape == (B, T, HV, DV) and S.shape == (B, HV, DK, DV)
    close(o, o_ref)
    close(S, S_ref)
    for name in x:
        assert float(jnp.abs(g_ref[name]).max()) > 0, name
        close(g[name], g_ref[name])
    # Without resets or a state (one chunk larger than T too).
    want = run(gated_delta_rule_reference, **dict(x, state=None), reset=None)[0]
    for c in (CHUNK, 64):
        got = run(lambda *a, **kw: gated_delta_rule(*a, chunk_size=c, **kw),
                  **dict(x, state=None), reset=None)[0]
        close(got, want)


@pytest.fixture(scope="module")
def layer():
    m = GatedDeltaNet(D, GDN, init_std=0.3, rngs=nnx.Rngs(0))
    return m, jax.random.normal(jax.random.key(1), (B, T, D))


forward = nnx.jit(lambda m, x, s, p, n: m.forward(x, s, positions=p, lengths=n))


@nnx.jit
def decode(m, x, state):
    def body(state, x_t):
        y_t, state = m.step(x_t, state)
        return state, y_t
    state, ys = jax.lax.scan(body, state, x.swapaxes(0, 1))
    return ys.swapaxes(0, 1), state


def test_layer_forward_equals_decode_steps_and_prefill_continues(layer):
    m, x = layer
    y, final = forward(m, x, None, None, None)
    ys, state = decode(m, x, m.init_state(B))
    close(ys, y)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(final)):
        close(a, b)
    # Prefill 20 tokens, then continue from the state (positions from 20).
    t = 20
    a, s = forward(m, x[:, :t], None, None, None)
    b, s2 = forward(m, x[:, t:], s, jnp.broadcast_to(jnp.arange(t, T), (B, T - t)), None)
    close(jnp.concatenate([a, b], 1), y)
    close(s2.S, final.S)
    # Causal: changing the future leaves the past alone.
    y2 = forward(m, x.at[:, 30:].add(1.0), None, None, None)[0]
    close(y2[:, :30], y[:, :30], 1e-6)
    assert not np.allclose(y2[:, 30:], y[:, 30:], atol=1e-4)


def test_layer_gradients_chunked_equal_sequential(layer):
    m, x = layer
    w = jax.random.normal(jax.random.key(2), (B, T, D))

    @nnx.jit
    def grads(m, x):
        def loss(m, x):
            return jnp.sum(m(x, positions=POSITIONS) * w)
        return nnx.grad(loss, argnums=(0, 1))(m, x)

    g_chunk, gx_chunk = grads(m, x)
    seq = nnx.clone(m)
    seq.chunk_size = 0  # the sequential recurrence
    g_seq, gx_seq = grads(seq, x)
    close(gx_chunk, gx_seq)
    flat_c = dict(nnx.to_flat_state(nnx.state(g_chunk, nnx.Param)))
    flat_s = dict(nnx.to_flat_state(nnx.state(g_seq, nnx.Param)))
    assert len(flat_c) == 13
    for path, gc in flat_c.items():
        assert float(jnp.abs(gc[...]).max()) > 0, path
        close(gc[...], flat_s[path][...])


def test_packed_documents_equal_separate_runs(layer):
    m, x = layer
    y = forward(m, x, None, POSITIONS, None)[0]
    for lo, hi in ((0, 10), (10, 30), (30, 37)):
        alone = forward(m, x[:1, lo:hi], None, None, None)[0]
        close(y[:1, lo:hi], alone)


def test_padded_tail_stays_out_of_the_state(layer):
    m, x = layer
    n = 13
    _, padded = forward(m, x, None, None, jnp.array([n, T]))
    _, short = forward(m, x[:1, :n], None, None, None)
    for a, b in zip(jax.tree.leaves(padded), jax.tree.leaves(short)):
        assert a.shape[1:] == b.shape[1:]
        close(a[:1], b)
    # Decoding on from either state gives the same tokens' outputs.
    nxt = x[:1, n:n + 3]
    close(decode(m, nxt, jax.tree.map(lambda a: a[:1], padded))[0], decode(m, nxt, short)[0])


def _hf_layer():
    """A random HF Qwen3NextGatedDeltaNet (torch fallback path), or skip."""
    torch = pytest.importorskip("torch")
    try:
        from transformers.models.qwen3_next import configuration_qwen3_next, modeling_qwen3_next
    except ImportError:
        pytest.skip("transformers without Qwen3-Next")
    cfg = configuration_qwen3_next.Qwen3NextConfig(
        hidden_size=D, linear_num_key_heads=HK, linear_num_value_heads=HV,
        linear_key_head_dim=DK, linear_value_head_dim=DV, linear_conv_kernel_dim=4,
        rms_norm_eps=1e-6, hidden_act="silu", num_hidden_layers=1,
        layer_types=["linear_attention"])
    torch.manual_seed(0)
    hf = modeling_qwen3_next.Qwen3NextGatedDeltaNet(cfg, 0).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        hf.A_log.copy_(torch.log(torch.empty(HV).uniform_(1.0, 16.0)))
        hf.norm.weight.copy_(1 + 0.2 * torch.randn(DV))
    return torch, hf


def _from_hf(hf) -> GatedDeltaNet:
    """HF's fused, per-key-head interleaved projections -> tfjax's separate ones."""
    G = HV // HK
    t = lambda p: jnp.asarray(p.detach().numpy())
    m = GatedDeltaNet(D, GDN, rngs=nnx.Rngs(0))
    qkvz = t(hf.in_proj_qkvz.weight).T.reshape(D, HK, 2 * DK + 2 * G * DV)
    q, k, v, z = jnp.split(qkvz, [DK, 2 * DK, 2 * DK + G * DV], axis=-1)
    ba = t(hf.in_proj_ba.weight).T.reshape(D, HK, 2 * G)
    conv = t(hf.conv1d.weight)[:, 0].T  # [W, C], C = (q, k, v) channels
    cq, ck, cv = jnp.split(conv, [HK * DK, 2 * HK * DK], axis=-1)
    for name, value in dict(
            q_proj=q, k_proj=k, v_proj=v.reshape(D, HV, DV), z_proj=z.reshape(D, HV, DV),
            b_proj=ba[..., :G].reshape(D, HV), a_proj=ba[..., G:].reshape(D, HV),
            conv_q=cq.reshape(-1, HK, DK), conv_k=ck.reshape(-1, HK, DK),
            conv_v=cv.reshape(-1, HV, DV), A_log=t(hf.A_log), dt_bias=t(hf.dt_bias),
            out_proj=t(hf.out_proj.weight).T.reshape(HV, DV, D)).items():
        assert getattr(m, name)[...].shape == value.shape, name
        getattr(m, name)[...] = value
    m.norm.scale[...] = t(hf.norm.weight)
    return m


def test_matches_hugging_face_qwen3_next():
    torch, hf = _hf_layer()
    m = _from_hf(hf)
    x = np.array(jax.random.normal(jax.random.key(3), (B, T, D)))
    with torch.no_grad():
        want = hf(torch.from_numpy(x)).numpy()
    got = nnx.jit(lambda m, x: m(x))(m, jnp.asarray(x))
    assert np.abs(want).max() > 1e-2
    close(got, want)


def test_config_ranges_name_the_field():
    with pytest.raises(ValueError, match="model.gdn.num_v_heads"):
        model_config(dict(layer_pattern=("gated_deltanet",), gdn=dict(num_k_heads=2,
                                                                      num_v_heads=3)))
    with pytest.raises(ValueError, match="model.gdn.d_conv"):
        model_config(dict(layer_pattern=("gated_deltanet",), gdn=dict(d_conv=0)))
    with pytest.raises(ValueError, match="num_v_heads=3 must be a multiple of num_k_heads=2"):
        GatedDeltaNet(D, GatedDeltaNetConfig(num_k_heads=2, num_v_heads=3, head_k_dim=DK),
                      rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"num_k_heads must be >= 1, got 0 \(.*gdn.resolved"):
        GatedDeltaNet(D, GatedDeltaNetConfig(head_k_dim=DK), rngs=nnx.Rngs(0))
