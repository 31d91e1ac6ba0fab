"""Gated cross-attention layers (layer kind "cross", Llama-3.2-Vision): a decoder whose
pattern interleaves them with self-attention, against a plain jnp reference written
from the parameters (forward and gradients), on GQA, odd lengths, rows without an
image and a text-only input; the cached decode (the context's K/V written once, at the
prefill) against the full forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tfjax import models
from tfjax.config import model_config
from tfjax.nn.attention import CrossKVCache
from tfjax.ops import masks

TINY = dict(vocab_size=37, d_model=24, num_heads=4, num_kv_heads=2, head_dim=6, d_ff=40,
            max_len=32, norm="rmsnorm", activation="swiglu", ffn_bias=False, init_std=0.5,
            tie_embeddings=False, num_layers=5,
            layer_pattern=("global", "cross", "global", "global", "cross"),
            attention=dict(qkv_bias=False, out_bias=False))
NEG = jnp.finfo(jnp.float32).min


def _model(scan=True, seed=0):
    cfg = model_config(dict(TINY, scan_layers=scan))
    model = models.build(cfg, rngs=nnx.Rngs(seed))
    # the gates start at 0 (the identity); open them so the test sees the layer
    state = nnx.state(model, nnx.Param)
    flat = dict(nnx.to_flat_state(state))
    for k, v in flat.items():
        if k[-1] in ("attn_gate", "ffn_gate"):
            v.value = jnp.full(v.value.shape, 0.7 if k[-1] == "attn_gate" else -0.4)
    nnx.update(model, state)
    return cfg, model


@nnx.jit
def _call(model, tokens, context):
    return model(tokens, **context)


@nnx.jit
def _step(model, tokens, cache, context):
    return model.step(tokens, cache, all_logits=True, **context)


def _inputs(B=2, T=7, S=5, seed=1):
    r = np.random.default_rng(seed)
    tokens = jnp.asarray(r.integers(0, TINY["vocab_size"], (B, T)))
    context = jnp.asarray(r.normal(size=(B, S, TINY["d_model"])), jnp.float32)
    allowed = r.random((B, T, S)) < 0.6
    allowed[0, 2] = False  # a row that sees no image
    allowed[1, 0] = False
    return tokens, context, jnp.asarray(allowed)


def context_inputs(allowed):
    """HF's cross_attention_mask rule: a row with no allowed key attends to every key
    (bias 0) and its ffn residual is dropped (rows = 0)."""
    rows = allowed.any(-1)
    bias = jnp.where(allowed | ~rows[..., None], 0.0, NEG)[:, None]
    return bias, rows.astype(jnp.float32)


def _rms(x, w, eps):
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + eps) * w


def reference_cross(block, x, context, bias, rows, eps):
    """x + tanh(a) o(attn(qnorm(q(rms(x))), knorm(k(ctx)), v(ctx))), then
    x + tanh(m) rows swiglu(rms(x)), from the block's parameters."""
    a = block.attn
    h = _rms(x, block.attn_norm.scale[...], eps)
    q = jnp.einsum("btd,dnh->btnh", h, a.q.kernel[...])
    k = jnp.einsum("bsd,dkh->bskh", context, a.k.kernel[...])
    v = jnp.einsum("bsd,dkh->bskh", context, a.v.kernel[...])
    q, k = _rms(q, a.q_norm.scale[...], eps), _rms(k, a.k_norm.scale[...], eps)
    G = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)
    s = jnp.einsum("btnh,bsnh->bnts", q, k) * q.shape[-1] ** -0.5 + bias
    o = jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s, -1), v)
    x = x + jnp.tanh(block.attn_gate[...]) * jnp.einsum("btnh,nhd->btd", o, a.o.kernel[...])
    f = block.ffn
    h = _rms(x, block.ffn_norm.scale[...], eps)
    g = jax.nn.silu(h @ f.wi_gate.kernel[...]) * (h @ f.wi_up.kernel[...])
    return x + jnp.tanh(block.ffn_gate[...]) * rows[..., None] * (g @ f.wo.kernel[...])


def reference(model, tokens, context, bias, rows):
    """The decoder with each "cross" layer replaced by `reference_cross` (self-attention
    layers are the model's own blocks)."""
    cfg = model.config
    unrolled = models.unrolled(model)
    x = unrolled.embed(tokens, jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape))
    for i, block in enumerate(unrolled.layers.blocks):
        if cfg.layer_kind(i) == "cross":
            x = reference_cross(block, x, context, bias, rows, cfg.norm_eps)
        else:
            x = block(x, mask=masks.causal())
    return unrolled.embed.logits(unrolled.final_norm(x))


@pytest.mark.parametrize("scan", [pytest.param(True, marks=pytest.mark.slow), False])
def test_forward_matches_reference(scan):
    cfg, model = _model(scan)
    tokens, context, allowed = _inputs()
    bias, rows = context_inputs(allowed)
    got = _call(model, tokens, dict(context=context, context_bias=bias, context_rows=rows))
    want = reference(model, tokens, context, bias, rows)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
    # the image changes the logits; without one, the cross layers are skipped
    text_only = _call(model, tokens, {})
    assert not np.allclose(got, text_only, atol=1e-3)
    plain = models.build(model_config(dict(TINY, layer_pattern=("global",), num_layers=3)),
                         rngs=nnx.Rngs(0))
    assert plain is not None  # the pattern without "cross" still builds


def test_closed_gates_are_the_identity():
    cfg = model_config(dict(TINY, scan_layers=False))
    model = models.build(cfg, rngs=nnx.Rngs(0))
    tokens, context, allowed = _inputs()
    bias, rows = context_inputs(allowed)
    np.testing.assert_allclose(model(tokens, context=context, context_bias=bias,
                                     context_rows=rows), model(tokens), atol=1e-6)


@pytest.mark.slow
def test_gradients_match_reference():
    cfg, model = _model(scan=False)
    tokens, context, allowed = _inputs(T=5, S=3)
    bias, rows = context_inputs(allowed)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params, context, fn):
        m = nnx.merge(graphdef, params, rest)
        return jnp.sum(jnp.sin(fn(m, context)))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)
    got = grad(params, context, lambda m, c: m(tokens, context=c, context_bias=bias,
                                                 context_rows=rows))
    want = grad(params, context, lambda m, c: reference(m, tokens, c, bias, rows))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-4, rtol=2e-4), got, want)
    gates = [v for k, v in nnx.to_flat_state(got[0]) if k[-1] in ("attn_gate", "ffn_gate")]
    assert len(gates) == 4 and all(abs(float(g.value)) > 0 for g in gates)


@pytest.mark.parametrize("scan", [pytest.param(True, marks=pytest.mark.slow), False])
def test_cached_decode_matches_forward(scan):
    cfg, model = _model(scan)
    B, T, S = 2, 6, 5
    tokens, context, allowed = _inputs(B=B, T=T, S=S)
    bias, rows = context_inputs(allowed)
    full = _call(model, tokens, dict(context=context, context_bias=bias, context_rows=rows))
    P = 3
    cache = model.init_cache(B, 16, context_len=S)
    states = jax.tree.leaves(cache.layers, is_leaf=lambda c: isinstance(c, CrossKVCache))
    assert sum(isinstance(s, CrossKVCache) for s in states) == 2
    logits, cache = _step(model, tokens[:, :P], cache, dict(
        context=context, context_bias=bias[:, :, :P], context_rows=rows[:, :P]))
    np.testing.assert_allclose(logits, full[:, :P], atol=2e-5, rtol=2e-5)
    for t in range(P, T):  # the context's K/V from the cache: no context passed
        logits, cache = _step(model, tokens[:, t:t + 1], cache, dict(
            context_bias=bias[:, :, t:t + 1], context_rows=rows[:, t:t + 1]))
        np.testing.assert_allclose(logits[:, 0], full[:, t], atol=2e-5, rtol=2e-5)


def test_cache_needs_the_context_length():
    cfg, model = _model()
    with pytest.raises(ValueError, match="context_len="):
        model.init_cache(2, 16)
    with pytest.raises(ValueError, match="tfjax.inference.generate"):
        model.init_paged_cache(2, 16, page_size=4, chunk=4, num_pages={16: 8})
    with pytest.raises(TypeError, match="context_bias"):
        model(jnp.zeros((1, 3), jnp.int32), image=1)
