"""Differential attention (Ye et al. 2024) and value-residual learning (Zhou et al.
2024, ResFormer) against references written out from the papers' equations:
forward and gradients, GQA 4/2, lengths that are no multiple of any tile, a fully
masked row; the layer alone, then a whole scanned decoder (layer indices traced
in the scan, the first layer's values carried through it)."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tfjax import models
from tfjax.config import AttentionConfig, model_config
from tfjax.nn.attention import MultiHeadAttention, diff_lambda_init
from tfjax.nn.positions import RotaryEmbedding
from tfjax.ops import masks as M

B, T, D, N, K, H = 2, 13, 24, 4, 2, 8


def rand(shape, seed, scale=1.0):
    return scale * jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def rope_half(x, positions, theta=10000.0):
    """RoPE, "half" layout, over the last axis of x `[B, T, n, d]`."""
    d = x.shape[-1]
    inv = theta ** (-jnp.arange(0, d, 2, dtype=jnp.float32) / d)
    ang = positions[:, :, None, None].astype(jnp.float32) * inv  # [B, T, 1, d/2]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return jnp.concatenate([x1 * jnp.cos(ang) - x2 * jnp.sin(ang),
                            x2 * jnp.cos(ang) + x1 * jnp.sin(ang)], -1)


def softmax_map(q, k, allowed, scale):
    """softmax(scale q k^T) `[B, n, T, S]` over the allowed keys (K heads repeated for
    GQA); a row with no allowed key is all zeros."""
    k = jnp.repeat(k, q.shape[2] // k.shape[2], axis=2)
    s = jnp.where(allowed[:, None], jnp.einsum("btnh,bsnh->bnts", q, k) * scale, -jnp.inf)
    m = jnp.max(s, -1, keepdims=True)
    e = jnp.where(allowed[:, None], jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    z = jnp.sum(e, -1, keepdims=True)
    return e / jnp.where(z > 0, z, 1.0)


def rms(x, w, eps):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * w


def diff_heads(q, k, v, allowed, lam_params, norm_scale, layer, eps):
    """The paper's eqs. (1)-(3) per head: [softmax(Q1 K1^T / sqrt d) - lam softmax(Q2 K2^T
    / sqrt d)] V, RMSNorm per head, times (1 - lam_init); -> `[B, T, n, Hv]`."""
    d = q.shape[-1] // 2
    a1 = softmax_map(q[..., :d], k[..., :d], allowed, d ** -0.5)
    a2 = softmax_map(q[..., d:], k[..., d:], allowed, d ** -0.5)
    lam_init = 0.8 - 0.6 * np.exp(-0.3 * layer)  # the paper's l - 1 = 0-based layer
    lq1, lk1, lq2, lk2 = lam_params
    lam = jnp.exp(jnp.dot(lq1, lk1)) - jnp.exp(jnp.dot(lq2, lk2)) + lam_init
    v = jnp.repeat(v, q.shape[2] // v.shape[2], axis=2)
    o = jnp.einsum("bnts,bsnh->btnh", a1 - lam * a2, v)
    return rms(o, norm_scale, eps) * (1 - lam_init)


# A fully masked query row (row 0, query 3: a segment of its own among the keys'),
# documents packed in row 0, right padding in row 1.
Q_SEG = np.array([[1] * 8 + [2] * 5, [1] * 10 + [0] * 3])
KV_SEG = Q_SEG.copy()
Q_SEG[0, 3] = 9
MASK = M.causal() & M.segments(jnp.asarray(Q_SEG), jnp.asarray(KV_SEG))
ALLOWED = np.asarray(MASK.dense(T, T))
assert not ALLOWED[0, 3].any()


@pytest.mark.parametrize("implementation", ["reference", "blockwise", "xla"])
def test_differential_attention_layer_forward_and_grads(implementation):
    layer_index = 3
    attn = MultiHeadAttention(D, N, num_kv_heads=K, head_dim=H,
                              attention=AttentionConfig(differential=True, impl=implementation),
                              rope=RotaryEmbedding(H // 2), init_std=0.4, norm_eps=1e-5,
                              rngs=nnx.Rngs(0))
    assert attn.diff_lambda.shape == (4, H // 2) and attn.diff_norm.scale.shape == (H,)
    attn.diff_norm.scale[...] = 1.0 + rand((H,), 7, 0.3)  # not the identity
    x, cot = rand((B, T, D), 1), rand((B, T, D), 2)
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    graphdef, params = nnx.split(attn, nnx.Param)

    def run(params, x):
        m = nnx.merge(graphdef, params)
        return m(x, mask=MASK, positions=pos, layer=layer_index)

    def reference(p, x):
        q = jnp.einsum("btd,dnh->btnh", x, p["q"]["kernel"])
        k = jnp.einsum("bsd,dkh->bskh", x, p["k"]["kernel"])
        v = jnp.einsum("bsd,dkh->bskh", x, p["v"]["kernel"])
        d = H // 2  # each half-head rotated on its own
        q = jnp.concatenate([rope_half(q[..., :d], pos), rope_half(q[..., d:], pos)], -1)
        k = jnp.concatenate([rope_half(k[..., :d], pos), rope_half(k[..., d:], pos)], -1)
        o = diff_heads(q, k, v, ALLOWED, p["diff_lambda"], p["diff_norm"]["scale"],
                       layer_index, 1e-5)
        return jnp.einsum("btnh,nhd->btd", o, p["o"]["kernel"])

    want_p = params.to_pure_dict()
    got, vjp = jax.jit(lambda p, x: jax.vjp(run, p, x))(params, x)
    g_params, g_x = vjp(cot)
    want, ref_vjp = jax.jit(lambda p, x: jax.vjp(reference, p, x))(want_p, x)
    w_params, w_x = ref_vjp(cot)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)
    np.testing.assert_array_equal(got[0, 3], 0.0)  # the fully masked row: zeros, no NaN
    np.testing.assert_allclose(g_x, w_x, atol=5e-5, rtol=1e-4)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=5e-5, rtol=1e-4),
                 g_params.to_pure_dict(), w_params)
    assert np.abs(w_params["diff_lambda"]).max() > 1e-3  # lam gets a gradient


def test_lambda_init_follows_the_paper():
    # lambda_init = 0.8 - 0.6 exp(-0.3 (l - 1)) for l = 1..L: 0.2 at the first layer.
    np.testing.assert_allclose(diff_lambda_init(0), 0.2, rtol=1e-6)
    np.testing.assert_allclose([diff_lambda_init(i) for i in range(1, 4)],
                               [0.8 - 0.6 * np.exp(-0.3 * i) for i in range(1, 4)], rtol=1e-6)


def reference_decoder(p, tokens, allowed, *, diff, value_residual, L, cycle, eps):
    """A pre-RMSNorm decoder without position encoding written out: layer l's values
    v_l <- l1 v_l + l2 v_1 for l > 0 (ResFormer), differential or plain heads; layer
    l's parameters are cycle c = l // cycle, position l % cycle of the stacked ones,
    then the unrolled blocks."""
    x = p["embed"]["tokens"]["embedding"][tokens]
    stacked, blocks = p["layers"]["cycles"]["layers"], p["layers"]["blocks"]
    n_scanned = (L // cycle) * cycle
    v1 = None
    for l in range(L):
        lp = (jax.tree.map(lambda a: a[l // cycle], stacked[l % cycle]) if l < n_scanned
              else blocks[l - n_scanned])
        a = lp["attn"]
        h = rms(x, lp["attn_norm"]["scale"], eps)
        q = jnp.einsum("btd,dnh->btnh", h, a["q"]["kernel"])
        k = jnp.einsum("bsd,dkh->bskh", h, a["k"]["kernel"])
        v = jnp.einsum("bsd,dkh->bskh", h, a["v"]["kernel"])
        if value_residual != "none":
            if l == 0:
                v1 = v
            else:
                l1, l2 = (0.5, 0.5) if value_residual == "fixed" else a["value_lambda"]
                v = l1 * v + l2 * v1
        if diff:
            o = diff_heads(q, k, v, allowed, a["diff_lambda"], a["diff_norm"]["scale"], l, eps)
        else:
            w = softmax_map(q, k, allowed, q.shape[-1] ** -0.5)
            o = jnp.einsum("bnts,bsnh->btnh", w, jnp.repeat(v, q.shape[2] // K, axis=2))
        x = x + jnp.einsum("btnh,nhd->btd", o, a["o"]["kernel"])
        f = lp["ffn"]
        h = rms(x, lp["ffn_norm"]["scale"], eps)
        h = jax.nn.relu(h @ f["wi"]["kernel"] + f["wi"]["bias"])
        x = x + h @ f["wo"]["kernel"] + f["wo"]["bias"]
    x = rms(x, p["final_norm"]["scale"], eps)
    return x @ p["embed"]["tokens"]["embedding"].T


@pytest.mark.parametrize("diff,value_residual", [(True, "none"), (False, "learned"),
                                                 (True, "fixed")])
def test_scanned_decoder_matches_the_written_out_reference(diff, value_residual):
    """5 layers = 2 scanned cycles of 2 + 1 unrolled block: the traced layer index
    (lam_init) and the carried first-layer values reach every layer."""
    L = 5
    cfg = model_config(dict(vocab_size=37, d_model=D, num_layers=L, num_heads=N,
                            num_kv_heads=K, head_dim=H, d_ff=32, norm="rmsnorm",
                            activation="relu", position="none", init_std=0.3,
                            layer_pattern=("global", "global"),
                            attention=dict(differential=diff, value_residual=value_residual)))
    model = models.build(cfg, rngs=nnx.Rngs(0))
    assert model.layers.layout.num_cycles == 2 and len(model.layers.blocks) == 1
    if value_residual == "learned":  # lambdas away from 0.5 so the test sees them
        for j, layer in enumerate(model.layers.cycles.layers):
            layer.attn.value_lambda[...] = rand((2, 2), 5 + j, 0.3) + 0.5
        model.layers.blocks[0].attn.value_lambda[...] = jnp.array([0.7, 0.2])
    graphdef, params = nnx.split(model, nnx.Param)
    tokens = jax.random.randint(jax.random.key(1), (B, T), 0, 37)
    seg = jnp.asarray(KV_SEG)
    allowed = np.asarray((M.causal() & M.segments(seg)).dense(T, T))
    cot = rand((B, T, 37), 3)

    def run(params):
        return nnx.merge(graphdef, params)(tokens, segment_ids=seg)

    def reference(p):
        return reference_decoder(p, tokens, allowed, diff=diff, value_residual=value_residual,
                                 L=L, cycle=2, eps=cfg.norm_eps)

    got, vjp = jax.jit(lambda p: jax.vjp(run, p))(params)
    (g,) = vjp(cot)
    want, ref_vjp = jax.vjp(reference, params.to_pure_dict())
    (w,) = ref_vjp(cot)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-3),
                 g.to_pure_dict(), w)


@pytest.mark.parametrize("fields,field", [
    (dict(attention=dict(differential=True, sinks=True)), "model.attention.sinks"),
    (dict(attention=dict(differential=True, qk_norm=True)), "model.attention.qk_norm"),
    (dict(d_model=24, num_heads=8,
          attention=dict(differential=True)), "model.attention.differential"),  # head_dim 3
    (dict(arch="encoder", attention=dict(differential=True)), "model.attention.differential"),
    (dict(attention=dict(value_residual="yes")), "model.attention.value_residual"),
    (dict(arch="encoder_decoder",
          attention=dict(value_residual="fixed")), "model.attention.value_residual"),
])
def test_config_errors_name_the_field(fields, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        model_config(fields)


@pytest.mark.parametrize("switch", [dict(attention=dict(differential=True)),
                                    dict(attention=dict(value_residual="fixed"))])
def test_layer_kinds_that_cannot_carry_a_variant_are_refused_by_name(switch):
    with pytest.raises(ValueError, match=r"model\.[\w.]+: 'mamba' layers cannot carry it"):
        models.build(model_config(dict(layer_pattern=("global", "mamba"), **switch)))


def test_module_refuses_what_differential_attention_cannot_carry():
    with pytest.raises(ValueError, match="even head_dim"):
        MultiHeadAttention(24, 8, head_dim=3, attention=AttentionConfig(differential=True),
                           rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="no sinks"):
        MultiHeadAttention(16, 2, attention=AttentionConfig(differential=True, sinks=True),
                           rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="value_residual"):
        MultiHeadAttention(16, 2, attention=AttentionConfig(value_residual="maybe"),
                           rngs=nnx.Rngs(0))


def test_both_variants_run_as_ring_attention_on_a_sequence_mesh(monkeypatch):
    """Differential attention's two calls and the value residual under a sequence=4
    mesh (ring attention, blockwise blocks): loss and gradients equal one device."""
    from tfjax.config import DEFAULT_RULES, MeshConfig
    from tfjax.parallel.mesh import make_mesh
    from tfjax.parallel.rules import logical_rules, tree_shardings
    from tfjax.parallel.sharding import use_rules

    cfg = model_config(dict(vocab_size=61, d_model=32, num_layers=2, num_heads=4,
                            num_kv_heads=2, d_ff=48, max_len=64, init_std=0.3,
                            attention=dict(differential=True, value_residual="fixed",
                                           impl="blockwise", context_parallel="ring",
                                           zigzag="none")))
    model = models.build(cfg, rngs=nnx.Rngs(3))
    x = jax.random.randint(jax.random.key(0), (2, 32), 0, 61)

    def loss(m, x):
        return m(x).astype(jnp.float32).mean()

    want_l, want_g = nnx.jit(nnx.value_and_grad(loss))(model, x)
    mesh = make_mesh(MeshConfig(data=1, sequence=4), jax.devices()[:4])
    rules = logical_rules(DEFAULT_RULES)
    state = nnx.state(model)
    nnx.update(model, jax.device_put(state, tree_shardings(state, mesh, rules)))

    @nnx.jit
    def sharded(m, x):
        with use_rules(mesh, rules):
            return nnx.value_and_grad(loss)(m, x)

    cp_lib = sys.modules["tfjax.parallel.context_parallel"]
    calls, real = [], cp_lib.ring_attention
    monkeypatch.setattr(cp_lib, "ring_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    got_l, got_g = sharded(model, x)
    assert len(calls) == 2  # the two maps, traced once in the scanned layer body
    np.testing.assert_allclose(got_l, want_l, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(
        a, b, atol=1e-4 * float(jnp.max(jnp.abs(b)))), nnx.state(got_g), nnx.state(want_g))


def test_output_gate_matches_the_written_out_reference():
    """Gated attention (Qwen3-Next): o(attention(q, k, v) * sigmoid(x W_gate)), per
    head and channel; forward and gradients, GQA 4/2, T=13 with padding, x given to
    `attend` by every caller (the layer, the KV caches)."""
    B, T, D, N, K, H = 2, 13, 24, 4, 2, 8
    attn = MultiHeadAttention(D, N, num_kv_heads=K, head_dim=H,
                              attention=AttentionConfig(output_gate=True, impl="blockwise"),
                              rngs=nnx.Rngs(3))
    x = jax.random.normal(jax.random.key(0), (B, T, D))
    lengths = jnp.array([T, 9])
    valid = jnp.arange(T)[None] < lengths[:, None]  # [B, S]: the keys that are not padding
    mask = M.causal() & M.padding(lengths)

    def reference(params, x):
        q = jnp.einsum("btd,dnh->btnh", x, params["q"]["kernel"])
        k = jnp.einsum("btd,dkh->btkh", x, params["k"]["kernel"])
        v = jnp.einsum("btd,dkh->btkh", x, params["v"]["kernel"])
        k, v = jnp.repeat(k, N // K, 2), jnp.repeat(v, N // K, 2)
        s = jnp.einsum("btnh,bsnh->bnts", q, k) * H ** -0.5
        keep = jnp.tril(jnp.ones((T, T), bool))[None, None] & valid[:, None, None, :]
        p = jnp.where(keep, jax.nn.softmax(jnp.where(keep, s, -1e30), -1), 0.0)
        out = jnp.einsum("bnts,bsnh->btnh", p, v)
        out = out * jax.nn.sigmoid(jnp.einsum("btd,dnh->btnh", x, params["gate"]["kernel"]))
        return jnp.einsum("btnh,nhd->btd", out, params["o"]["kernel"])

    graphdef, params = nnx.split(attn)
    plain = jax.tree.map(lambda v: v, nnx.to_pure_dict(params))

    def ours(params, x):
        return nnx.merge(graphdef, params)(x, mask=mask)

    np.testing.assert_allclose(ours(params, x), reference(plain, x), rtol=1e-5, atol=1e-5)
    g = jax.grad(lambda p: (ours(p, x) ** 2).sum())(params)
    g_ref = jax.grad(lambda p: (reference(p, x) ** 2).sum())(plain)
    np.testing.assert_allclose(nnx.to_pure_dict(g)["gate"]["kernel"], g_ref["gate"]["kernel"],
                               rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(nnx.to_pure_dict(g)["q"]["kernel"], g_ref["q"]["kernel"],
                               rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="output gate needs attend"):
        attn.attend(*attn.project(x), mask)
