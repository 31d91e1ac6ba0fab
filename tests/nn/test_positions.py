"""Position encodings against plain references written here (numpy loops, complex
numbers, the published formulas), forward and gradients."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from tfjax.config import RopeConfig, T5Config
from tfjax.nn import positions as pos
from tfjax.nn.positions import (
    POSITIONS,
    ROPE_SCALINGS,
    LearnedPositions,
    RotaryEmbedding,
    T5RelativeBias,
    alibi_bias,
    alibi_slopes,
    relative_position_bucket,
    sinusoidal_embedding,
)


def _rng(seed=0):
    return np.random.default_rng(seed)


# One compile per (rope config, shape) instead of eager op-by-op dispatch; the rope is a
# hashable dataclass, so it can be a static argument.
_apply = jax.jit(lambda rope, x, p: rope(x, p), static_argnums=0)


# ----------------------------------------------------------------------------- registries


def test_registries():
    assert {n: POSITIONS.get(n) for n in POSITIONS} == {
        "none": "none", "sinusoidal": "embedding", "learned": "embedding",
        "rope": "rotary", "alibi": "bias", "t5": "bias"}
    assert set(ROPE_SCALINGS.names()) == {"none", "linear", "ntk", "dynamic_ntk", "yarn", "llama3",
                                          "longrope"}


# ----------------------------------------------------------------------------- sinusoidal


def test_sinusoidal_matches_paper():
    p = np.array([[0, 1, 2, 7], [3, 50, 999, 4]])
    d = 6
    ref = np.zeros(p.shape + (d,))
    for b in range(p.shape[0]):
        for t in range(p.shape[1]):
            for i in range(d // 2):
                angle = p[b, t] / 10000 ** (2 * i / d)
                ref[b, t, 2 * i] = math.sin(angle)
                ref[b, t, 2 * i + 1] = math.cos(angle)
    out = sinusoidal_embedding(jnp.asarray(p), d)
    assert out.shape == (2, 4, d) and out.dtype == jnp.float32
    np.testing.assert_allclose(out, ref, atol=2e-5)
    # traced positions, other dtype and timescale
    jitted = jax.jit(lambda q: sinusoidal_embedding(q, d, max_timescale=100.0, dtype=jnp.bfloat16))
    out = jitted(jnp.asarray(p))
    assert out.dtype == jnp.bfloat16
    expected = math.sin(1 / 100 ** (2 / 6))  # position 1, pair i=1, sin slot
    np.testing.assert_allclose(out.astype(np.float32)[0, 1, 2], expected, atol=1e-2)


def test_sinusoidal_odd_dim_raises():
    with pytest.raises(ValueError, match="dim"):
        sinusoidal_embedding(jnp.zeros((1, 2), jnp.int32), 5)


# ----------------------------------------------------------------------------- learned


def test_learned_positions_forward_and_grad():
    m = LearnedPositions(6, 3, rngs=nnx.Rngs(0))
    p = np.array([[0, 5, 2, 2], [1, 1, 4, 0]])
    table = np.asarray(m.embedding[...])
    out = m(jnp.asarray(p))
    ref = np.stack([[table[p[b, t]] for t in range(4)] for b in range(2)])
    np.testing.assert_array_equal(out, ref)
    np.testing.assert_allclose(jax.jit(lambda q: m(q))(jnp.asarray(p)), ref)
    assert nnx.get_partition_spec(nnx.state(m))["embedding"].get_value() == P("max_len", "embed")

    w = _rng().normal(size=out.shape).astype(np.float32)

    def loss(table):
        return jnp.sum(jnp.take(table, jnp.asarray(p), axis=0) * w)

    def module_loss(model):
        return jnp.sum(model(jnp.asarray(p)) * w)

    grads = nnx.jit(nnx.grad(module_loss))(m)
    ref_grad = np.zeros_like(table)
    for b in range(2):
        for t in range(4):
            ref_grad[p[b, t]] += w[b, t]
    np.testing.assert_allclose(grads.embedding[...], ref_grad, atol=1e-6)
    np.testing.assert_allclose(jax.jit(jax.grad(loss))(jnp.asarray(table)), ref_grad, atol=1e-6)


def test_learned_positions_too_long_raises():
    m = LearnedPositions(4, 2, rngs=nnx.Rngs(0))
    m(jnp.zeros((1, 4), jnp.int32))  # exactly max_len is fine
    with pytest.raises(ValueError, match="max_len"):
        m(jnp.zeros((1, 5), jnp.int32))
    with pytest.raises(ValueError, match="max_len"):
        LearnedPositions(0, 2, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="dim"):
        LearnedPositions(4, 0, rngs=nnx.Rngs(0))


# ----------------------------------------------------------------------------- rotary


def _rope_ref(x, p, *, layout, rotary_dim, inv_freq, scale=1.0):
    """Complex-number reference: pair -> complex, multiply by scale * e^{i p f}."""
    x = np.asarray(x, np.float64)
    r = rotary_dim
    out = x.copy()
    B, T, N, _ = x.shape
    for b in range(B):
        for t in range(T):
            for n in range(N):
                for i in range(r // 2):
                    j, k = (i, i + r // 2) if layout == "half" else (2 * i, 2 * i + 1)
                    z = complex(x[b, t, n, j], x[b, t, n, k])
                    z *= scale * np.exp(1j * float(p[b, t]) * inv_freq[i])
                    out[b, t, n, j], out[b, t, n, k] = z.real, z.imag
    return out


def _plain_inv_freq(theta, r):
    return np.array([theta ** (-2 * i / r) for i in range(r // 2)])


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_rope_matches_complex_reference(layout):
    x = _rng(1).normal(size=(2, 3, 2, 8)).astype(np.float32)
    p = np.array([[0, 1, 5], [7, 3, 100]])
    rope = RotaryEmbedding(8, RopeConfig(theta=10.0, layout=layout))
    out = _apply(rope, jnp.asarray(x), jnp.asarray(p))
    assert out.shape == x.shape and out.dtype == jnp.float32
    ref = _rope_ref(x, p, layout=layout, rotary_dim=8, inv_freq=_plain_inv_freq(10.0, 8))
    np.testing.assert_allclose(out, ref, atol=1e-4)
    other = "interleaved" if layout == "half" else "half"
    wrong = _rope_ref(x, p, layout=other, rotary_dim=8, inv_freq=_plain_inv_freq(10.0, 8))
    assert np.abs(np.asarray(out) - wrong).max() > 1e-2  # the layouts really differ here
    np.testing.assert_allclose(rope.inv_freq(), _plain_inv_freq(10.0, 8), rtol=1e-6)
    # bf16 in -> bf16 out (computed in float32)
    out16 = _apply(rope, jnp.asarray(x, jnp.bfloat16), jnp.asarray(p))
    assert out16.dtype == jnp.bfloat16
    np.testing.assert_allclose(out16.astype(np.float32), ref, atol=5e-2)


def test_rope_explicit_rotation_and_grad():
    # Explicit 2x2 rotation for the half layout; the gradient of a linear map is its
    # transpose, i.e. the rotation by -angle.
    H, r = 6, 4
    x = _rng(2).normal(size=(1, 2, 1, H)).astype(np.float32)
    w = _rng(3).normal(size=x.shape).astype(np.float32)
    p = np.array([[3, 11]])
    rope = RotaryEmbedding(H, RopeConfig(fraction=4 / 6, theta=100.0))
    assert rope.rotary_dim == r
    f = _plain_inv_freq(100.0, r)

    def rot(v, sign):
        out = v.copy()
        for t in range(2):
            for i in range(r // 2):
                a = sign * p[0, t] * f[i]
                R = np.array([[math.cos(a), -math.sin(a)], [math.sin(a), math.cos(a)]])
                out[0, t, 0, [i, i + r // 2]] = R @ v[0, t, 0, [i, i + r // 2]]
        return out

    np.testing.assert_allclose(_apply(rope, jnp.asarray(x), jnp.asarray(p)), rot(x, 1), atol=1e-5)
    g = jax.jit(jax.grad(lambda v: jnp.sum(_apply(rope, v, jnp.asarray(p)) * w)))(jnp.asarray(x))
    np.testing.assert_allclose(g, rot(w, -1), atol=1e-5)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_rope_partial_leaves_tail(layout):
    x = _rng(4).normal(size=(1, 4, 2, 8)).astype(np.float32)
    p = np.array([[2, 9, 4, 1]])
    rope = RotaryEmbedding(8, RopeConfig(fraction=0.25, layout=layout, theta=50.0))
    out = np.asarray(_apply(rope, jnp.asarray(x), jnp.asarray(p)))
    np.testing.assert_array_equal(out[..., 2:], x[..., 2:])
    ref = _rope_ref(x, p, layout=layout, rotary_dim=2, inv_freq=_plain_inv_freq(50.0, 2))
    np.testing.assert_allclose(out, ref, atol=1e-5)
    assert np.abs(out[..., :2] - x[..., :2]).max() > 1e-2


SCALED = {
    "none": dict(),
    "linear": dict(factor=4.0),
    "ntk": dict(factor=4.0),
    "dynamic_ntk": dict(factor=4.0, original_max_len=8),
    "yarn": dict(factor=4.0, original_max_len=8, mscale=0.7),
    "llama3": dict(factor=4.0, original_max_len=8),
}


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("scaling", sorted(SCALED))
def test_rope_scores_depend_only_on_offset(scaling, layout):
    # One q and one k vector placed at every position 0..T-1 (T > original_max_len, so
    # dynamic NTK is active): q_i . k_j must depend on j - i only (Toeplitz).
    T, H = 12, 8
    rope = RotaryEmbedding(H, RopeConfig(fraction=0.5, layout=layout, scaling=scaling,
                                         theta=100.0, **SCALED[scaling]))
    rng = _rng(5)
    q = np.broadcast_to(rng.normal(size=(1, 1, 1, H)), (1, T, 1, H)).astype(np.float32)
    k = np.broadcast_to(rng.normal(size=(1, 1, 1, H)), (1, T, 1, H)).astype(np.float32)
    p = jnp.arange(T)[None]
    qr, kr = np.asarray(_apply(rope, q, p))[:, :, 0], np.asarray(_apply(rope, k, p))[:, :, 0]
    s = qr[0] @ kr[0].T  # [T, S]
    np.testing.assert_allclose(s[1:, 1:], s[:-1, :-1], atol=1e-4)
    assert np.ptp(np.diagonal(s, 3)) < 1e-4 and np.ptp(s[0]) > 1e-2  # offsets matter
    if scaling != "dynamic_ntk":
        # (p, p + d) vs (p + shift, p + shift + d) in separate calls.
        def score(pq, pk):
            qv = _apply(rope, q[:, :1], jnp.array([[pq]]))[0, 0, 0]
            return qv @ _apply(rope, k[:, :1], jnp.array([[pk]]))[0, 0, 0]

        a, b = score(3, 8), score(40, 45)
        np.testing.assert_allclose(a, b, atol=1e-4)


def _x_and_positions(seed, T=5, H=8):
    x = jnp.asarray(_rng(seed).normal(size=(2, T, 2, H)), jnp.float32)
    p = jnp.asarray(_rng(seed + 1).integers(0, 64, size=(2, T)), jnp.int32)
    return x, p


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_rope_linear_is_interpolated_positions(layout):
    x, p = _x_and_positions(6)
    scaled = RotaryEmbedding(8, RopeConfig(scaling="linear", factor=4.0, layout=layout))
    plain = RotaryEmbedding(8, RopeConfig(layout=layout))
    interpolated = _apply(plain, x, p.astype(jnp.float32) / 4.0)
    np.testing.assert_allclose(_apply(scaled, x, p), interpolated, atol=1e-5)
    assert np.abs(np.asarray(_apply(scaled, x, p) - _apply(plain, x, p))).max() > 1e-2


def test_rope_ntk_is_base_change():
    x, p = _x_and_positions(7)
    d, s = 8, 4.0
    ntk = RotaryEmbedding(8, RopeConfig(scaling="ntk", factor=s))
    plain = RotaryEmbedding(8, RopeConfig(theta=10000.0 * s ** (d / (d - 2))))
    np.testing.assert_allclose(_apply(ntk, x, p), _apply(plain, x, p), atol=1e-5)
    # NTK-aware property: the lowest frequency is interpolated by exactly s, the highest kept.
    f, f0 = np.asarray(ntk.inv_freq()), _plain_inv_freq(10000.0, d)
    np.testing.assert_allclose([f[0], f[-1]], [f0[0], f0[-1] / s], rtol=1e-5)


def test_rope_dynamic_ntk():
    d, orig, s, theta = 8, 16, 4.0, 10000.0
    dyn = RotaryEmbedding(d, RopeConfig(scaling="dynamic_ntk", factor=s, original_max_len=orig))
    plain = RotaryEmbedding(d)
    x = jnp.asarray(_rng(8).normal(size=(2, 3, 2, d)), jnp.float32)
    apply = _apply  # traced positions
    for top in (2, orig - 1):  # max length top + 1 <= orig: exactly plain RoPE
        p = jnp.array([[0, 1, top], [2, 0, 1]])
        np.testing.assert_array_equal(apply(dyn, x, p), apply(plain, x, p))
        np.testing.assert_array_equal(dyn.inv_freq(top + 1), plain.inv_freq())
    p = jnp.array([[0, 1, 39], [2, 0, 1]])  # length 40 > 16: HF's dynamic base
    L = 40
    base = theta * ((s * L / orig) - (s - 1)) ** (d / (d - 2))
    ref = RotaryEmbedding(d, RopeConfig(theta=base))
    np.testing.assert_allclose(apply(dyn, x, p), _apply(ref, x, p), atol=1e-5)
    assert np.abs(np.asarray(apply(dyn, x, p) - _apply(plain, x, p))).max() > 1e-2
    np.testing.assert_allclose(dyn.inv_freq(jnp.int32(L)), _plain_inv_freq(base, d), rtol=1e-5)
    np.testing.assert_array_equal(dyn.inv_freq(), plain.inv_freq())  # no length: plain


def _yarn_ref(d, theta, s, L, beta_fast, beta_slow, truncate=True):
    """YaRN NTK-by-parts: pair i rotates L / wavelength_i times over the original context;
    the band edges are the pair indices where that count equals beta_fast / beta_slow,
    widened to whole pairs (unless not `truncate`: gpt-oss); ramp 0 keeps theta_i, ramp 1
    gives theta_i / s."""
    def edge(beta):  # solve L / (2 pi theta^(2i/d)) == beta for i
        return math.log(L / (2 * math.pi * beta)) / math.log(theta) * d / 2
    lo, hi = edge(beta_fast), edge(beta_slow)
    if truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, d - 1)
    out = []
    for i in range(d // 2):
        f = theta ** (-2 * i / d)
        gamma = min(max((i - lo) / (hi - lo), 0.0), 1.0)
        out.append((1 - gamma) * f + gamma * f / s)
    return np.array(out)


@pytest.mark.parametrize("beta_fast,beta_slow", [(32.0, 1.0), (8.0, 2.0)])
def test_rope_yarn_inv_freq_and_mscale(beta_fast, beta_slow):
    d, theta, s, L = 32, 10000.0, 8.0, 2048
    rope = RotaryEmbedding(d, RopeConfig(theta=theta, scaling="yarn", factor=s,
                                         original_max_len=L, beta_fast=beta_fast,
                                         beta_slow=beta_slow, mscale=1.0))
    f = np.asarray(rope.inv_freq())
    np.testing.assert_allclose(f, _yarn_ref(d, theta, s, L, beta_fast, beta_slow), rtol=1e-5)
    # The paper's bands: > beta_fast rotations over the original context: unchanged;
    # < beta_slow rotations: interpolated by s; in between strictly between.
    f0 = _plain_inv_freq(theta, d)
    rotations = L * f0 / (2 * math.pi)
    fast, slow = rotations > beta_fast, rotations < beta_slow
    assert fast.any() and slow.any()
    np.testing.assert_allclose(f[fast], f0[fast], rtol=1e-5)
    np.testing.assert_allclose(f[slow], f0[slow] / s, rtol=1e-5)
    assert np.all((f <= f0 * (1 + 1e-6)) & (f >= f0 / s * (1 - 1e-6)))
    # Attention temperature 0.1 * mscale * ln(s) + 1 on cos and sin: at position 0 the
    # rotated dims are scaled by it, the tail is not.
    for mscale in (1.0, 0.5):
        r = RotaryEmbedding(8, RopeConfig(fraction=0.5, scaling="yarn", factor=s, mscale=mscale))
        x = jnp.asarray(_rng(9).normal(size=(1, 2, 1, 8)), jnp.float32)
        out = _apply(r, x, jnp.array([[0, 0]]))
        m = 0.1 * mscale * math.log(s) + 1
        np.testing.assert_allclose(out[..., :4], x[..., :4] * m, rtol=1e-6)
        np.testing.assert_array_equal(out[..., 4:], x[..., 4:])
        # and at other positions it is the scaled rotation of the yarn frequencies
        p = np.array([[3, 17]])
        ref = _rope_ref(x, p, layout="half", rotary_dim=4, inv_freq=np.asarray(r.inv_freq()),
                        scale=m)
        np.testing.assert_allclose(_apply(r, x, jnp.asarray(p)), ref, atol=1e-5)
    assert RotaryEmbedding(8, RopeConfig(scaling="yarn", factor=1.0)).attention_factor == 1.0


def test_rope_yarn_untruncated_edges():
    # gpt-oss (theta 150k, s 32, 4096 original): the ramp runs between the fractional band
    # edges, which differ from the rounded ones inside the band.
    d, theta, s, L = 64, 150000.0, 32.0, 4096
    kw = dict(theta=theta, scaling="yarn", factor=s, original_max_len=L)
    exact = np.asarray(RotaryEmbedding(d, RopeConfig(truncate=False, **kw)).inv_freq())
    np.testing.assert_allclose(exact, _yarn_ref(d, theta, s, L, 32.0, 1.0, truncate=False),
                               rtol=1e-5)
    rounded = np.asarray(RotaryEmbedding(d, RopeConfig(**kw)).inv_freq())
    assert np.max(np.abs(exact - rounded) / rounded) > 1e-3


def test_rope_llama3_inv_freq():
    # Llama 3.1's published values (theta 500000, factor 8, 8192 original, 1 / 4).
    d, theta, s, L, lo, hi = 64, 500000.0, 8.0, 8192, 1.0, 4.0
    rope = RotaryEmbedding(d, RopeConfig(theta=theta, scaling="llama3", factor=s,
                                         original_max_len=L, low_freq_factor=lo,
                                         high_freq_factor=hi))
    ref, kinds = [], set()
    for i in range(d // 2):
        f = theta ** (-2 * i / d)
        wavelen = 2 * math.pi / f
        if wavelen < L / hi:
            ref.append(f), kinds.add("high")
        elif wavelen > L / lo:
            ref.append(f / s), kinds.add("low")
        else:
            smooth = (L / wavelen - lo) / (hi - lo)
            ref.append((1 - smooth) * f / s + smooth * f), kinds.add("medium")
    assert kinds == {"high", "low", "medium"}
    np.testing.assert_allclose(rope.inv_freq(), ref, rtol=1e-5)


def test_rope_validation_names_field():
    for kwargs, field in [
        (dict(head_dim=8, fraction=0.375), "fraction"),  # 3 rotary dims
        (dict(head_dim=8, fraction=0.0), "fraction"),
        (dict(head_dim=8, fraction=1.5), "fraction"),
        (dict(head_dim=7), "fraction"),
        (dict(head_dim=0), "head_dim"),
        (dict(head_dim=8, theta=0.0), "theta"),
        (dict(head_dim=8, layout="neox"), "layout"),
        (dict(head_dim=8, scaling="magic"), "scaling"),
        (dict(head_dim=8, scaling="linear", factor=0.5), "factor"),
        (dict(head_dim=8, original_max_len=0), "original_max_len"),
        (dict(head_dim=8, scaling="yarn", factor=2.0, beta_fast=1.0, beta_slow=2.0), "beta_fast"),
        (dict(head_dim=8, scaling="llama3", factor=2.0, low_freq_factor=4.0, high_freq_factor=1.0),
         "high_freq_factor"),
    ]:
        head_dim = kwargs.pop("head_dim")
        with pytest.raises(ValueError, match=field):
            RotaryEmbedding(head_dim, RopeConfig(**kwargs))
    with pytest.raises(ValueError, match="head_dim"):
        RotaryEmbedding(8)(jnp.zeros((1, 2, 1, 6)), jnp.zeros((1, 2), jnp.int32))


def test_rope_is_static_module_attribute():
    rope = RotaryEmbedding(8, RopeConfig(scaling="dynamic_ntk", factor=2.0, original_max_len=4))
    same = RotaryEmbedding(8, RopeConfig(scaling="dynamic_ntk", factor=2.0, original_max_len=4))
    assert hash(rope) == hash(same) and rope == same

    class Holder(nnx.Module):
        def __init__(self, rope):
            self.rope = rope

        def __call__(self, x, p):
            return self.rope(x, p)

    h = Holder(rope)
    x, p = _x_and_positions(10)
    out = nnx.jit(lambda m, v, q: m(v, q))(h, x, p)
    np.testing.assert_allclose(out, _apply(rope, x, p), atol=1e-6)


# ----------------------------------------------------------------------------- ALiBi


def test_alibi_slopes_published():
    np.testing.assert_allclose(alibi_slopes(8), [2.0 ** -k for k in range(1, 9)], rtol=1e-7)
    np.testing.assert_allclose(alibi_slopes(16), [2.0 ** (-k / 2) for k in range(1, 17)], rtol=1e-7)
    twelve = [2.0 ** -k for k in range(1, 9)] + [2.0 ** (-k / 2) for k in (1, 3, 5, 7)]
    np.testing.assert_allclose(alibi_slopes(12), twelve, rtol=1e-7)
    np.testing.assert_allclose(alibi_slopes(1), [2.0 ** -8], rtol=1e-7)
    assert alibi_slopes(12).dtype == np.float32 and alibi_slopes(12).shape == (12,)
    with pytest.raises(ValueError, match="num_heads"):
        alibi_slopes(0)


def test_alibi_bias_and_grad():
    qp = np.array([[5, 6, 7], [0, 1, 2]])  # first row: decoding at an offset
    kp = np.array([[0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 3, 4, 5, 6, 7]])
    slopes = alibi_slopes(3)
    out = np.asarray(jax.jit(alibi_bias)(jnp.asarray(qp), jnp.asarray(kp), slopes))
    assert out.shape == (2, 3, 3, 8)
    for b in range(2):
        for n in range(3):
            for t in range(3):
                for j in range(8):
                    d = qp[b, t] - kp[b, j]
                    assert out[b, n, t, j] == pytest.approx(-slopes[n] * abs(d), rel=1e-6)
                    if d >= 0:  # causal ALiBi on every key a causal query sees
                        assert out[b, n, t, j] == pytest.approx(-slopes[n] * d, rel=1e-6)
    w = _rng(11).normal(size=out.shape).astype(np.float32)
    g = jax.jit(jax.grad(lambda m: jnp.sum(alibi_bias(jnp.asarray(qp), jnp.asarray(kp), m) * w)))(
        jnp.asarray(slopes))
    dist = np.abs(qp[:, None, :, None] - kp[:, None, None, :])
    np.testing.assert_allclose(g, -(w * dist).sum(axis=(0, 2, 3)), rtol=1e-5)


# ----------------------------------------------------------------------------- T5


def _t5_bucket_ref(relative_position, bidirectional, num_buckets, max_distance):
    """mesh-tensorflow's _relative_position_bucket, one scalar at a time, float32 math."""
    ret = 0
    n = -relative_position
    if bidirectional:
        num_buckets //= 2
        ret += int(n < 0) * num_buckets
        n = abs(n)
    else:
        n = max(n, 0)
    max_exact = num_buckets // 2
    if n < max_exact:
        return ret + n
    val = np.log(np.float32(n) / np.float32(max_exact))
    val = val / np.float32(math.log(max_distance / max_exact))
    val = max_exact + int(np.float32(val) * np.float32(num_buckets - max_exact))
    return ret + min(val, num_buckets - 1)


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("num_buckets,max_distance", [(32, 128), (8, 20), (11, 40)])
def test_t5_bucket_matches_mesh_tensorflow(bidirectional, num_buckets, max_distance):
    rel = np.arange(-300, 301)
    out = jax.jit(lambda r: relative_position_bucket(
        r, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance))(
        jnp.asarray(rel))
    ref = [_t5_bucket_ref(int(r), bidirectional, num_buckets, max_distance) for r in rel]
    np.testing.assert_array_equal(out, ref)
    assert out.dtype == jnp.int32


def test_t5_bucket_known_values():
    # Hand-computed for T5's defaults (32 buckets, max distance 128); key - query.
    bi = dict(bidirectional=True, num_buckets=32, max_distance=128)
    uni = dict(bidirectional=False, num_buckets=32, max_distance=128)
    rel = jnp.array([0, -1, -7, -8, -200, 1, 8, 200, 5, -20, -16])
    np.testing.assert_array_equal(relative_position_bucket(rel, **bi),
                                  [0, 1, 7, 8, 15, 17, 24, 31, 21, 10, 10])
    # unidirectional: 16 exact buckets; future keys -> 0; n=20 -> 16 + int(ln(1.25)/ln(8)*16)=17
    np.testing.assert_array_equal(relative_position_bucket(rel, **uni),
                                  [0, 1, 7, 8, 31, 0, 0, 0, 0, 17, 16])


def test_t5_relative_bias_forward_and_grad():
    N, nb, md = 3, 8, 20
    m = T5RelativeBias(N, T5Config(num_buckets=nb, max_distance=md), bidirectional=True,
                       rngs=nnx.Rngs(1))
    spec = nnx.get_partition_spec(nnx.state(m))["embedding"].get_value()
    assert spec == P("relpos_buckets", "heads")
    qp = np.array([[10, 11], [0, 1]])
    kp = np.array([[0, 3, 9, 10, 11, 40], [0, 1, 2, 3, 4, 5]])
    table = np.asarray(m.embedding[...])  # [buckets, N]
    out = np.asarray(nnx.jit(lambda mod, a, b: mod(a, b))(m, jnp.asarray(qp), jnp.asarray(kp)))
    assert out.shape == (2, N, 2, 6)
    w = _rng(12).normal(size=out.shape).astype(np.float32)
    ref = np.zeros(out.shape, np.float32)
    ref_grad = np.zeros_like(table)
    for b in range(2):
        for t in range(2):
            for j in range(6):
                k = _t5_bucket_ref(int(kp[b, j] - qp[b, t]), True, nb, md)
                ref[b, :, t, j] = table[k]
                ref_grad[k] += w[b, :, t, j]
    np.testing.assert_array_equal(out, ref)
    grads = nnx.jit(nnx.grad(lambda mod: jnp.sum(mod(jnp.asarray(qp), jnp.asarray(kp)) * w)))(m)
    np.testing.assert_allclose(grads.embedding[...], ref_grad, atol=1e-5)


def test_t5_validation_names_field():
    with pytest.raises(ValueError, match="num_buckets"):
        relative_position_bucket(jnp.arange(3), bidirectional=True, num_buckets=2)
    with pytest.raises(ValueError, match="max_distance"):
        relative_position_bucket(jnp.arange(3), bidirectional=False, num_buckets=32,
                                 max_distance=16)
    with pytest.raises(ValueError, match="num_heads"):
        T5RelativeBias(0, bidirectional=True, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="num_buckets"):
        T5RelativeBias(2, T5Config(num_buckets=3), bidirectional=True, rngs=nnx.Rngs(0))


def test_module_exports():
    assert set(pos.__all__) >= {"POSITIONS", "ROPE_SCALINGS", "RotaryEmbedding", "alibi_bias"}
