"""Quantized training (`tfjax.nn.quant`): qwix's QT matmuls against a numpy reference
(per-channel absmax, round to nearest, clip), straight-through gradients, the rules by
module path on a built model, and the one-line errors."""

import types

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from qwix._src.core import qarray

from tfjax.models.architectures import build
from tfjax.nn.quant import FORMATS, QuantizedOp, QuantizedOps, check_backend, quantize, quantized_paths

INT8, FP8 = QuantizedOps(*FORMATS["int8"]), QuantizedOps(*FORMATS["fp8"])


def quantize_np(x, axis, fmt):
    """Per-channel symmetric quantization of x over `axis` (the contraction): (q, scale,
    ties), x ~ q * scale. int8: scale absmax / 127.5 (qwix widens the bound by half a
    step), round to nearest, clip to [-128, 127]; fp8 e4m3: scale absmax / 448, cast.
    `ties`: where x / scale is exactly -127.5 (the row's absmax, negative), which f32
    division puts a hair either side of the tie: -127 and -128 are both right there."""
    absmax = np.abs(x).max(axis=axis, keepdims=True).astype(np.float64)
    bound = 127.5 if fmt == "int8" else float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)
    zero = absmax / bound < np.sqrt(np.finfo(np.float32).tiny)
    scale = np.where(zero, 1.0, absmax / bound)
    x = x.astype(np.float64)
    r = np.where(zero, x, x * bound / np.where(zero, 1.0, absmax))  # exact at the absmax
    if fmt == "int8":
        q = np.clip(np.round(r), -128, 127)
    else:
        q = r.astype(np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    ties = (r == -bound) if fmt == "int8" else np.zeros(x.shape, bool)
    return q.astype(np.float32), scale.astype(np.float32), ties


def resolve_ties(q_ref, ties, q_got):
    """q_ref with qwix's choice at the ties, after checking it is one of the two."""
    assert np.all(np.isin(q_got[ties], (-127, -128))), q_got[ties]
    return np.where(ties, q_got, q_ref)


QWIX_HOW = {"int8": "int8", "fp8": "float8_e4m3fn"}


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_quantize_dequantize_match_numpy_reference(fmt):
    """qwix's quantize (what the QT dot runs on each operand) against the reference:
    odd sizes, a zero row (scale 1, not 0/0), one huge entry; dequantize within half a
    step (int8) or e4m3's relative precision of x."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(5, 7)).astype(np.float32)
    x[2] = 0.0
    x[3, 4] = -300.0
    how = qarray.HowToQuantize(qtype=QWIX_HOW[fmt], channelwise_axes=[0])
    qa = qarray.quantize(jnp.asarray(x), how)
    q_ref, s_ref, ties = quantize_np(x, 1, fmt)
    q_got = np.asarray(qa.qvalue).astype(np.float32)
    np.testing.assert_allclose(np.asarray(qa.scale), s_ref, rtol=1e-6)
    np.testing.assert_array_equal(q_got, resolve_ties(q_ref, ties, q_got))
    back = np.asarray(qarray.dequantize(qa))
    np.testing.assert_allclose(back, q_got * s_ref, rtol=1e-6, atol=1e-7)
    if fmt == "int8":
        assert np.all(np.abs(back - x) <= s_ref / 2 * (1 + 1e-5))
    else:
        np.testing.assert_allclose(back, x, rtol=2 ** -3, atol=1e-6)


def dot_np(x, w, fmt, got_x=None, got_w=None):
    """x [M, K] @ w [K, N] quantized per row of x (per token) and per column of w;
    ties resolved as qwix's quantized operands `got_x` / `got_w` resolve them."""
    qx, sx, tx = quantize_np(x, 1, fmt)
    qw, sw, tw = quantize_np(w, 0, fmt)
    if got_x is not None:
        qx, qw = resolve_ties(qx, tx, got_x), resolve_ties(qw, tw, got_w)
    return (qx @ qw) * sx * sw


def qvalues(a, fmt, axis):
    how = qarray.HowToQuantize(qtype=QWIX_HOW[fmt], channelwise_axes=[axis])
    return np.asarray(qarray.quantize(jnp.asarray(a), how).qvalue).astype(np.float32)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_forward_matches_numpy_reference(fmt):
    """Odd sizes, a zero row (scale 1, not 0/0) and one huge entry (its row's scale)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(5, 7)).astype(np.float32)
    x[2] = 0.0
    x[3, 4] = 300.0
    w = rng.normal(size=(7, 3)).astype(np.float32)
    ops = INT8 if fmt == "int8" else FP8
    got = np.asarray(ops.dot_general(jnp.asarray(x), jnp.asarray(w), (((1,), (0,)), ((), ()))))
    want = dot_np(x, w, fmt, qvalues(x, fmt, 0), qvalues(w, fmt, 1))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.all(got[2] == 0)
    # and it is quantized: away from the float product by more than rounding
    assert np.abs(got - x @ w).max() > 1e-3


def test_einsum_matches_dot_general_and_the_reference():
    """The einsum path (nnx.Einsum, MoE experts) quantizes per token and per output
    channel as the dot does: `BTD,DNH->BTNH` against the reference on [B*T, D] @ [D, N*H]."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(2, 3, 6)).astype(np.float32)
    w = rng.normal(size=(6, 2, 5)).astype(np.float32)
    got = np.asarray(INT8.einsum("BTD,DNH->BTNH", jnp.asarray(x), jnp.asarray(w)))
    x2, w2 = x.reshape(6, 6), w.reshape(6, 10)
    want = dot_np(x2, w2, "int8", qvalues(x2, "int8", 0), qvalues(w2, "int8", 1))
    want = want.reshape(2, 3, 2, 5)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_gradients_are_straight_through(fmt):
    """d/dx and d/dw of the quantized product are the float product's (g @ w^T, x^T @ g)
    up to the quantization of g and the residuals: close, nonzero, not equal."""
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.normal(size=(9, 16)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(16, 11)), jnp.float32)
    g = jnp.asarray(rng.normal(size=(9, 11)), jnp.float32)
    ops = INT8 if fmt == "int8" else FP8
    dims = (((1,), (0,)), ((), ()))

    def f(dot):
        return lambda x, w: jnp.sum(dot(x, w, dims) * g)

    gq = jax.jit(jax.grad(f(ops.dot_general), argnums=(0, 1)))(x, w)
    gf = jax.grad(f(jax.lax.dot_general), argnums=(0, 1))(x, w)
    tol = 0.03 if fmt == "int8" else 0.15  # e5m2 gradients: 2 mantissa bits
    for a, b in zip(gq, gf):
        rel = float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
        assert 0 < rel < tol, rel


def tiny(**model):
    return {**dict(vocab_size=64, d_model=32, num_heads=4, num_kv_heads=2, d_ff=64,
                   num_layers=2, norm="rmsnorm", activation="swiglu"), **model}


def test_rules_select_stack_layers_and_leave_the_rest_float():
    """The default rule: the stack's projections and FFN (in the scanned cycle), not the
    embeddings / head; parameters are the float model's (same paths, shapes, dtypes)."""
    model = nnx.eval_shape(lambda: build(tiny(quant="int8", tie_embeddings=False)))
    paths = quantized_paths(model)
    assert sorted(paths) == sorted(f"layers/cycles/layers/0/{p}" for p in (
        "attn/q", "attn/k", "attn/v", "attn/o", "ffn/wi_gate", "ffn/wi_up", "ffn/wo"))
    assert model.embed.head.dot_general is jax.lax.dot_general
    assert model.layers.cycles.layers[0].ffn.wo.dot_general == QuantizedOp(INT8, "dot_general")
    assert model.layers.cycles.layers[0].attn.q.einsum_op == QuantizedOp(INT8, "einsum")
    plain = nnx.eval_shape(lambda: build(tiny(tie_embeddings=False)))
    shapes = lambda m: jax.tree.map(lambda v: (v.shape, v.dtype), nnx.state(m, nnx.Param))
    assert shapes(model) == shapes(plain)
    # quant none: the very graph of a model built without the field
    assert nnx.graphdef(nnx.eval_shape(lambda: build(tiny(quant="none")))) == \
        nnx.graphdef(nnx.eval_shape(lambda: build(tiny())))


def test_exclude_leaves_out_unrolled_first_and_last_layers():
    """With unrolled layers each has its own path: the first and last stay float."""
    model = nnx.eval_shape(lambda: build(tiny(
        quant="int8", num_layers=4, scan_layers=False, quant_exclude=r"layers/blocks/(0|3)/.*")))
    layers = sorted({p.split("/")[2] for p in quantized_paths(
        model, exclude=model.config.quant_exclude)})
    assert layers == ["1", "2"]
    assert model.layers.blocks[0].ffn.wo.dot_general != QuantizedOp(INT8, "dot_general")
    assert model.layers.blocks[1].ffn.wo.dot_general == QuantizedOp(INT8, "dot_general")


def test_moe_rule_takes_the_experts_not_the_router():
    """The MoE module's expert ops are set; its router is a Param of the module, read by
    its own float32 einsum, never an expert op."""
    model = nnx.eval_shape(lambda: build(tiny(
        quant="int8", ffn_pattern=("moe",), moe=dict(num_experts=4, experts_per_token=2))))
    block = model.layers.cycles.layers[0].ffn
    assert block.expert_einsum == QuantizedOp(INT8, "einsum")
    assert block.expert_ragged_dot == QuantizedOp(INT8, "ragged_dot")
    assert type(block).expert_einsum is jnp.einsum  # the class default: float


@pytest.mark.slow
def test_moe_experts_run_quantized_near_float():
    """Both expert dispatches (ragged, dense) run quantized and stay near float."""
    x = jnp.arange(24).reshape(2, 12) % 64
    call = nnx.jit(lambda m: m(x))
    for impl in ("ragged", "dense"):
        moe = dict(num_experts=4, experts_per_token=2, impl=impl)
        a = call(build(tiny(quant="int8", ffn_pattern=("moe",), moe=moe)))
        b = call(build(tiny(ffn_pattern=("moe",), moe=moe)))
        rel = float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
        assert 0 < rel < 0.05, (impl, rel)


@pytest.mark.slow
def test_quantized_model_trains_within_a_bound_of_float():
    """Eight Adam steps of the default preset's shape (tiny dims) on one fixed batch:
    int8's losses follow float's (within 2 %) and both learn."""
    import optax

    tokens = jax.random.randint(jax.random.key(0), (4, 33), 0, 64)

    def losses(quant):
        model = build(tiny(quant=quant), rngs=nnx.Rngs(0))
        opt = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)

        @nnx.jit
        def step(model, opt):
            def loss(model):
                logits = model(tokens[:, :-1])
                return optax.softmax_cross_entropy_with_integer_labels(
                    logits, tokens[:, 1:]).mean()
            value, grads = nnx.value_and_grad(loss)(model)
            opt.update(model, grads)
            return value

        return np.array([step(model, opt) for _ in range(8)])

    f, q = losses("none"), losses("int8")
    assert f[-1] < f[0] - 0.1 and q[-1] < q[0] - 0.1
    np.testing.assert_allclose(q, f, rtol=0.02)


def test_recurrent_layer_is_refused_by_name():
    with pytest.raises(ValueError, match=r"model.quant: layers/cycles/layers/1/attn is a "
                                         r"Mamba2, .* add 'layers/cycles/layers/1/attn' to "
                                         r"model.quant_exclude"):
        nnx.eval_shape(lambda: build(tiny(quant="int8", layer_pattern=("global", "mamba2"))))
    # excluded: the attention layer and both FFNs are quantized, the mamba2 mixer is not
    model = nnx.eval_shape(lambda: build(tiny(
        quant="int8", layer_pattern=("global", "mamba2"),
        quant_exclude=r"layers/cycles/layers/1/attn(/.*)?")))
    paths = quantized_paths(model, exclude=model.config.quant_exclude)
    assert "layers/cycles/layers/0/attn/q" in paths
    assert not any(p.startswith("layers/cycles/layers/1/attn") for p in paths)


@pytest.mark.parametrize("model, message", [
    (dict(quant="int4"), r"model.quant: got 'int4'; allowed: 'none', 'int8', 'fp8'"),
    (dict(quant="int8", quant_paths="layers/(("), r"model.quant_paths: 'layers/\(\(' is not "
                                                 r"a regular expression"),
    (dict(quant="int8", quant_paths="embed/.*", tie_embeddings=True),
     r"model.quant_paths: 'embed/.\*' .* matches no Linear, Einsum or MoE layer"),
])
def test_bad_settings_are_one_line(model, message):
    with pytest.raises(ValueError, match=message):
        nnx.eval_shape(lambda: build(tiny(**model)))


def test_quantize_rejects_unknown_format_directly():
    with pytest.raises(ValueError, match=r"model.quant: 'int4' is not a format"):
        quantize(nnx.eval_shape(lambda: build(tiny())), "int4")


def test_fp8_needs_a_device_with_fp8_matmuls():
    old_gpu = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA A100",
                                    compute_capability="8.0")
    with pytest.raises(ValueError, match=r"model.quant='fp8': NVIDIA A100 \(compute "
                                         r"capability 8.0, fp8 needs >= 8.9\) has no fp8 "
                                         r"matmul; use model.quant='int8'"):
        check_backend("fp8", old_gpu)
    check_backend("int8", old_gpu)
    check_backend("fp8", types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H100",
                                               compute_capability="9.0"))
    check_backend("fp8", jax.devices()[0])  # CPU: converted up
