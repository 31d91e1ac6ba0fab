"""Multi-head Latent Attention against DeepSeek's formulas written out per head;
the absorbed (decode) form against the materialised one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tfjax.config import AttentionConfig, MLAConfig, RopeConfig
from tfjax.nn.latent_attention import MultiHeadLatentAttention, mla_scale
from tfjax.nn.positions import RotaryEmbedding
from tfjax.ops import masks as M

D, N, R, DN, DR, DV = 24, 4, 16, 8, 6, 10  # d_model, heads, kv latent, nope, rope, v dims


def layer(q_lora_rank=0, implementation="blockwise", **kw):
    mla = MLAConfig(q_lora_rank=q_lora_rank, kv_lora_rank=R, qk_nope_head_dim=DN,
                    qk_rope_head_dim=DR, v_head_dim=DV)
    return MultiHeadLatentAttention(D, N, mla, rope=RotaryEmbedding(DR, RopeConfig(theta=100.0)),
                                    attention=AttentionConfig(impl=implementation), init_std=0.3,
                                    rngs=nnx.Rngs(0), **kw)


def rms(x, scale, eps=1e-6):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * scale


def reference(m, params, x, allowed):
    """DeepSeek-V2's equations, one head at a time: per-head keys [k_nope; k_pe] and
    values from the normalised latent, the shared rotary key broadcast to every head,
    softmax(q . k * scale) over the allowed keys."""
    p = params
    B, T, _ = x.shape
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    if "q_a" in p:
        q = jnp.einsum("btr,rnh->btnh", rms(x @ p["q_a"], p["q_norm"]), p["q_b"])
    else:
        q = jnp.einsum("btd,dnh->btnh", x, p["q"])
    q_nope, q_pe = q[..., :DN], m.rope(q[..., DN:], pos)
    a = x @ p["kv_a"]
    c, k_pe = rms(a[..., :R], p["kv_norm"]), m.rope(a[..., None, R:], pos)[..., 0, :]
    kv = jnp.einsum("bsr,rnh->bsnh", c, p["kv_b"])
    outs = []
    for n in range(N):
        s = (jnp.einsum("bth,bsh->bts", q_nope[:, :, n], kv[:, :, n, :DN])
             + jnp.einsum("bth,bsh->bts", q_pe[:, :, n], k_pe)) * m.scale
        w = jax.nn.softmax(jnp.where(allowed, s, -1e30), axis=-1)
        outs.append(jnp.einsum("bts,bsh->bth", w, kv[:, :, n, DN:]))
    return jnp.einsum("btnh,nhd->btd", jnp.stack(outs, 2), p["o"])


def params_of(m):
    p = {"kv_a": m.kv_a.kernel[...], "kv_norm": m.kv_norm.scale[...], "kv_b": m.kv_b.kernel[...],
         "o": m.o.kernel[...]}
    if m.q is not None:
        p["q"] = m.q.kernel[...]
    else:
        p.update(q_a=m.q_a.kernel[...], q_norm=m.q_norm.scale[...], q_b=m.q_b.kernel[...])
    return p


@pytest.mark.parametrize("q_lora_rank", [0, 12])
def test_matches_deepseeks_equations_forward_and_grads(q_lora_rank):
    m = layer(q_lora_rank)
    assert m.kv_a.kernel.shape == (D, R + DR) and m.kv_b.kernel.shape == (R, N, DN + DV)
    assert m.o.kernel.shape == (N, DV, D)
    x = jax.random.normal(jax.random.key(1), (2, 9, D))
    mask = M.causal() & M.segments(jnp.array([[0] * 4 + [1] * 5, [0] * 9]))
    allowed = mask.dense(9, 9)
    ref = jax.jit(lambda p: reference(m, p, x, allowed))
    np.testing.assert_allclose(nnx.jit(lambda m: m(x, mask=mask))(m), ref(params_of(m)),
                               atol=2e-5)
    got = nnx.jit(nnx.grad(lambda m: jnp.sum(jnp.sin(m(x, mask=mask)))))(m)
    want = jax.jit(jax.grad(lambda p: jnp.sum(jnp.sin(reference(m, p, x, allowed)))))(
        params_of(m))
    np.testing.assert_allclose(got.kv_b.kernel[...], want["kv_b"], atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(got.kv_a.kernel[...], want["kv_a"], atol=1e-4, rtol=1e-4)
    q_got = got.q.kernel[...] if q_lora_rank == 0 else got.q_b.kernel[...]
    np.testing.assert_allclose(q_got, want["q" if q_lora_rank == 0 else "q_b"], atol=1e-4,
                               rtol=1e-4)


@pytest.mark.parametrize("implementation", ["blockwise", "pallas"])
def test_absorbed_form_equals_the_materialised_form(implementation):
    """Decode over cached latents: the key up-projection folded into the queries and
    MQA over the latents gives the materialised multi-head attention's output, for
    one query at the end (a decode step) and a chunk of three under a positions mask
    with empty slots."""
    m = layer(12, implementation)
    B, S = 2, 11
    x = jax.random.normal(jax.random.key(2), (B, S, D))
    pos = jnp.broadcast_to(jnp.arange(S), (B, S))
    latent = m.latent(x, pos)
    assert latent.shape == (B, S, R + DR)
    q_nope, q_pe = m.queries(x, pos)
    kv_pos = jnp.where(jnp.arange(S)[None] == 4, -1, pos)  # slot 4 empty
    absorbed = nnx.jit(lambda m, *a: m.attend_absorbed(*a))
    materialised = nnx.jit(lambda m, *a: m.attend(*a))
    for t in (slice(S - 1, S), slice(S - 3, S)):
        mask = M.positions(pos[:, t], kv_pos)
        args = (q_nope[:, t], q_pe[:, t], latent, mask)
        np.testing.assert_allclose(absorbed(m, *args), materialised(m, *args), atol=2e-5)


def test_refusals_and_the_yarn_scale():
    with pytest.raises(ValueError, match="rope.head_dim=8 must be qk_rope_head_dim=6"):
        MultiHeadLatentAttention(D, N, MLAConfig(kv_lora_rank=R, qk_nope_head_dim=DN,
                                                 qk_rope_head_dim=DR, v_head_dim=DV),
                                 rope=RotaryEmbedding(8), rngs=nnx.Rngs(0))
    m = layer()
    x = jnp.zeros((1, 3, D))
    with pytest.raises(ValueError, match="no attention bias"):
        m(x, bias=jnp.zeros((1, 1, 3, 3)))
    with pytest.raises(ValueError, match="takes no context"):
        m(x, x)
    assert mla_scale(192) == 192 ** -0.5
    # DeepSeek-V3: YaRN factor 40, mscale_all_dim 1: scale * (0.1 ln 40 + 1)^2
    want = 192 ** -0.5 * (0.1 * np.log(40.0) + 1.0) ** 2
    assert np.isclose(mla_scale(192, rope_scaling="yarn", rope_factor=40.0, mscale_all_dim=1.0),
                      want)
    assert mla_scale(192, rope_scaling="linear", rope_factor=40.0, mscale_all_dim=1.0) == \
        192 ** -0.5
