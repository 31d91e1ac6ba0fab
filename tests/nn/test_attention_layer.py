"""MultiHeadAttention and TransformerBlock against plain references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tfjax.config import AttentionConfig
from tfjax.nn.attention import MultiHeadAttention
from tfjax.nn.blocks import TransformerBlock
from tfjax.nn.ffn import FeedForward
from tfjax.nn.norms import make_norm
from tfjax.nn.positions import RotaryEmbedding
from tfjax.ops import masks as M


def rand(shape, seed):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def reference_mha(p, x, ctx, N, K, allowed, scale, softcap=None, bias=None):
    """Plain multi-head attention with K/V heads repeated for GQA."""
    q = jnp.einsum("btd,dnh->btnh", x, p["q"]) + p.get("q_b", 0)
    k = jnp.einsum("bsd,dkh->bskh", ctx, p["k"]) + p.get("k_b", 0)
    v = jnp.einsum("bsd,dkh->bskh", ctx, p["v"]) + p.get("v_b", 0)
    k, v = jnp.repeat(k, N // K, axis=2), jnp.repeat(v, N // K, axis=2)
    s = jnp.einsum("btnh,bsnh->bnts", q, k) * scale
    if softcap:
        s = softcap * jnp.tanh(s / softcap)
    if bias is not None:
        s = s + bias
    s = jnp.where(allowed[:, None], s, -1e30)
    w = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bnts,bsnh->btnh", w, v)
    return jnp.einsum("btnh,nhd->btd", o, p["o"]) + p.get("o_b", 0)


def params_of(layer):
    p = {n: getattr(layer, n).kernel[...] for n in "qkvo"}
    for n in "qkvo":
        b = getattr(layer, n).bias
        if b is not None:
            p[f"{n}_b"] = b[...]
    return p


@pytest.mark.parametrize("N,K", [(4, 4), (6, 2), (4, 1)])
@pytest.mark.parametrize("bias", [False, True])
def test_self_attention_matches_reference_forward_and_grads(N, K, bias):
    D, H = 24, 8
    config = AttentionConfig(qkv_bias=bias, out_bias=bias, impl="reference" if bias else "xla",
                             softcap=5.0 if bias else 0.0)
    layer = MultiHeadAttention(D, N, num_kv_heads=K, head_dim=H, attention=config,
                               rngs=nnx.Rngs(0))
    x = rand((2, 7, D), 1)
    mask = M.causal() & M.segments(jnp.array([[1, 1, 1, 2, 2, 2, 2], [1] * 7]))
    allowed = mask.dense(7, 7)
    out = layer(x, mask=mask)
    p = params_of(layer)
    want = reference_mha(p, x, x, N, K, allowed, H ** -0.5, softcap=5.0 if bias else None)
    np.testing.assert_allclose(out, want, atol=1e-5)

    def loss_layer(layer, x):
        return jnp.sum(jnp.sin(layer(x, mask=mask)))

    def loss_ref(p, x):
        return jnp.sum(jnp.sin(reference_mha(p, x, x, N, K, allowed, H ** -0.5,
                                             softcap=5.0 if bias else None)))

    g_layer, g_x = nnx.grad(loss_layer, argnums=(0, 1))(layer, x)
    g_ref, g_xref = jax.grad(loss_ref, argnums=(0, 1))(p, x)
    np.testing.assert_allclose(g_x, g_xref, atol=1e-4)
    for name in "qkvo":
        np.testing.assert_allclose(g_layer[name]["kernel"][...], g_ref[name], atol=1e-4,
                                   err_msg=name)
        if bias:
            np.testing.assert_allclose(g_layer[name]["bias"][...], g_ref[f"{name}_b"], atol=1e-4,
                                       err_msg=name)


def test_sinks_and_value_head_dim():
    """gpt-oss's learned sinks (a softmax column per head with no value) and values of
    a head dim of their own, against the plain reference with the column written
    out; the sinks are `[N]` parameters with logical axis "heads" and get gradients."""
    D, N, K, H, Hv = 24, 4, 2, 8, 12
    layer = MultiHeadAttention(D, N, num_kv_heads=K, head_dim=H, v_head_dim=Hv,
                               attention=AttentionConfig(sinks=True, impl="blockwise"),
                               init_std=0.5, rngs=nnx.Rngs(0))
    assert layer.v.kernel.shape == (D, K, Hv) and layer.o.kernel.shape == (N, Hv, D)
    assert layer.sinks.shape == (N,) and layer.sinks.sharding_names == ("heads",)
    x = rand((2, 7, D), 1)
    allowed = M.causal().dense(7, 7)

    def reference(p, sinks):
        q = jnp.einsum("btd,dnh->btnh", x, p["q"])
        k = jnp.repeat(jnp.einsum("bsd,dkh->bskh", x, p["k"]), N // K, axis=2)
        v = jnp.repeat(jnp.einsum("bsd,dkh->bskh", x, p["v"]), N // K, axis=2)
        s = jnp.where(allowed[:, None], jnp.einsum("btnh,bsnh->bnts", q, k) * H ** -0.5, -1e30)
        s = jnp.concatenate([s, jnp.broadcast_to(sinks[None, :, None, None], (2, N, 7, 1))], -1)
        w = jax.nn.softmax(s, axis=-1)[..., :-1]
        return jnp.einsum("btnh,nhd->btd", jnp.einsum("bnts,bsnh->btnh", w, v), p["o"])

    np.testing.assert_allclose(nnx.jit(lambda m: m(x, mask=M.causal()))(layer),
                               reference(params_of(layer), layer.sinks[...]), atol=1e-5)
    grad = nnx.jit(nnx.grad(lambda m: jnp.sum(m(x, mask=M.causal()) ** 2)))(layer)
    want = jax.grad(lambda s: jnp.sum(reference(params_of(layer), s) ** 2))(layer.sinks[...])
    np.testing.assert_allclose(grad.sinks[...], want, rtol=1e-5)


def test_cross_attention_scale_and_bias():
    D, N = 16, 4
    layer = MultiHeadAttention(D, N, num_kv_heads=2, context_dim=12,
                               attention=AttentionConfig(scale=0.5), rngs=nnx.Rngs(0))
    x, ctx = rand((2, 5, D), 2), rand((2, 9, 12), 3)
    bias = rand((1, N, 5, 9), 4)
    mask = M.padding(jnp.array([9, 4]))
    out = layer(x, ctx, mask=mask, bias=bias)
    want = reference_mha(params_of(layer), x, ctx, N, 2, mask.dense(5, 9), 0.5, bias=bias)
    np.testing.assert_allclose(out, want, atol=1e-5)


def test_gqa_equals_mha_with_repeated_kv_weights():
    D, N, K, H = 16, 4, 2, 4
    gqa = MultiHeadAttention(D, N, num_kv_heads=K, rope=RotaryEmbedding(H), rngs=nnx.Rngs(0))
    mha = MultiHeadAttention(D, N, num_kv_heads=N, rope=RotaryEmbedding(H), rngs=nnx.Rngs(1))
    mha.q.kernel[...] = gqa.q.kernel[...]
    mha.o.kernel[...] = gqa.o.kernel[...]
    mha.k.kernel[...] = jnp.repeat(gqa.k.kernel[...], N // K, axis=1)
    mha.v.kernel[...] = jnp.repeat(gqa.v.kernel[...], N // K, axis=1)
    x = rand((2, 6, D), 5)
    np.testing.assert_allclose(gqa(x, mask=M.causal()), mha(x, mask=M.causal()), atol=1e-5)


def test_qk_norm_normalises_per_head_before_rope():
    D, N, H = 16, 2, 8
    layer = MultiHeadAttention(D, N, attention=AttentionConfig(qk_norm=True),
                               rope=RotaryEmbedding(H), rngs=nnx.Rngs(0))
    x = 100.0 * rand((1, 5, D), 6)
    q, k, _ = layer.project(x)
    # RMSNorm with unit scale then a rotation: every head vector has norm sqrt(H).
    np.testing.assert_allclose(jnp.linalg.norm(q, axis=-1), np.sqrt(H), rtol=1e-3)
    np.testing.assert_allclose(jnp.linalg.norm(k, axis=-1), np.sqrt(H), rtol=1e-3)


def _block(placement, parallel=False, shared=True, cross=False):
    rngs = nnx.Rngs(0)
    D = 16
    attn = MultiHeadAttention(D, 4, rngs=rngs)
    return TransformerBlock(
        attn=attn, ffn=FeedForward(D, 32, activation="gelu", rngs=rngs),
        make_norm=lambda: make_norm("layernorm", D, rngs=rngs),
        cross_attn=MultiHeadAttention(D, 4, rngs=rngs) if cross else None,
        placement=placement, parallel=parallel, parallel_shared_norm=shared)


@pytest.mark.parametrize("kind", ["pre", "post", "sandwich", "output", "parallel_shared",
                                  "parallel_two", "pre_cross", "sandwich_cross"])
def test_block_formulas(kind):
    placement = kind.split("_")[0] if not kind.startswith("parallel") else "pre"
    block = _block(placement, parallel=kind.startswith("parallel"),
                   shared=kind == "parallel_shared", cross=kind.endswith("cross"))
    x, ctx = rand((2, 5, 16), 7), rand((2, 3, 16), 8)
    mask = M.causal()
    a = lambda h: block.attn(h, mask=mask)  # noqa: E731
    c = lambda h: block.cross_attn(h, ctx)  # noqa: E731
    f = block.ffn
    if kind == "pre":
        h = x + a(block.attn_norm(x))
        want = h + f(block.ffn_norm(h))
    elif kind == "post":
        h = block.attn_norm(x + a(x))
        want = block.ffn_norm(h + f(h))
    elif kind == "sandwich":
        h = x + block.post_attn_norm(a(block.attn_norm(x)))
        want = h + block.post_ffn_norm(f(block.ffn_norm(h)))
    elif kind == "output":  # OLMo 2: the norms on the sublayers' outputs
        assert block.post_attn_norm is None
        h = x + block.attn_norm(a(x))
        want = h + block.ffn_norm(f(h))
    elif kind == "parallel_shared":
        assert block.ffn_norm is None
        want = x + a(block.attn_norm(x)) + f(block.attn_norm(x))
    elif kind == "parallel_two":
        want = x + a(block.attn_norm(x)) + f(block.ffn_norm(x))
    elif kind == "pre_cross":
        h = x + a(block.attn_norm(x))
        h = h + c(block.cross_norm(h))
        want = h + f(block.ffn_norm(h))
    else:  # sandwich_cross
        h = x + block.post_attn_norm(a(block.attn_norm(x)))
        h = h + block.post_cross_norm(c(block.cross_norm(h)))
        want = h + block.post_ffn_norm(f(block.ffn_norm(h)))
    got = block(x, mask=mask, context=ctx if block.cross_attn is not None else None)
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_block_errors():
    with pytest.raises(ValueError, match="norm_placement"):
        _block("middle")
    with pytest.raises(ValueError, match="parallel"):
        _block("post", parallel=True)
    with pytest.raises(ValueError, match="context"):
        _block("pre", cross=True)(rand((1, 3, 16), 0))


def test_qk_norm_over_the_projection_and_the_nope_temperature():
    """OLMo 2's QK-norm normalises all heads of q (and of k) at once; Llama 4's NoPE
    layers scale q by 1 + scale * ln(1 + floor((p + 1) / floor)) at position p."""
    D, N, K, H = 24, 4, 2, 8
    config = AttentionConfig(qk_norm=True, qk_norm_over="projection", temperature_floor=3,
                             temperature_scale=0.5)
    layer = MultiHeadAttention(D, N, num_kv_heads=K, head_dim=H, attention=config,
                               rngs=nnx.Rngs(0))
    x = rand((2, 7, D), 1)
    q, k, _ = layer.project(x)
    p = params_of(layer)
    rms = lambda y: y * jax.lax.rsqrt(jnp.mean(y * y, -1, keepdims=True) + 1e-6)
    q_ref = rms(jnp.einsum("btd,dnh->btnh", x, p["q"]).reshape(2, 7, N * H)).reshape(2, 7, N, H)
    k_ref = rms(jnp.einsum("bsd,dkh->bskh", x, p["k"]).reshape(2, 7, K * H)).reshape(2, 7, K, H)
    t = 1.0 + 0.5 * np.log1p(np.floor((np.arange(7) + 1.0) / 3))  # 1, 1, 1+.5 ln 2, ...
    np.testing.assert_allclose(q, q_ref * t[None, :, None, None], atol=1e-5)
    np.testing.assert_allclose(k, k_ref, atol=1e-5)
    with pytest.raises(ValueError, match="qk_norm_over"):
        MultiHeadAttention(D, N, attention=AttentionConfig(qk_norm=True, qk_norm_over="heads"),
                           rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="no RoPE"):
        MultiHeadAttention(D, N,
                           attention=AttentionConfig(temperature_floor=3, temperature_scale=0.5),
                           rope=RotaryEmbedding(6), rngs=nnx.Rngs(0))
