"""Weight-only quantization for decoding (`tfjax.nn.quant.quantize_weights`): int8 per
channel and int4 per group against a numpy reference (symmetric absmax, qwix's bound
qmax + 0.5, round to nearest, clip), the rules by path on a built model, the bytes of
the quantized state, and the one-line errors."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tfjax import models
from tfjax.config import model_config
from qwix._src.core import qarray

from tfjax.nn.quant import (QuantizedParam, quantize_for_serving, quantize_weights,
                            weight_bytes)
from tfjax.ops import kv_quant

TINY = dict(vocab_size=61, d_model=64, num_layers=2, num_heads=4, d_ff=96, max_len=64,
            num_kv_heads=2, tie_embeddings=False)


def quantize_np(w, contracted: tuple, fmt: str, group: int | None):
    """(q, scale broadcast to w) of `w` with one scale per output channel (reduced over
    `contracted`) or per `group` consecutive entries of the last contracted axis."""
    qmax = 127 if fmt == "int8" else 7
    w = np.asarray(w, np.float64)
    if group is None:
        absmax = np.abs(w).max(axis=contracted, keepdims=True)
        absmax = np.broadcast_to(absmax, w.shape)
    else:
        axis = contracted[-1]
        moved = np.moveaxis(w, axis, -1)
        blocks = moved.reshape(*moved.shape[:-1], -1, group)
        absmax = np.abs(blocks).max(axis=-1, keepdims=True)
        absmax = np.moveaxis(np.broadcast_to(absmax, blocks.shape).reshape(moved.shape), -1, axis)
    scale = absmax / (qmax + 0.5)
    return np.clip(np.round(w / scale), -qmax - 1, qmax), scale


def linear(shape, seed=0):
    layer = nnx.Linear(shape[-2], shape[-1], rngs=nnx.Rngs(seed))
    layer.kernel.set_value(jax.random.normal(jax.random.key(seed), shape, jnp.float32))
    return layer


@pytest.mark.parametrize("fmt,group", [("int8", None), ("int4", 32), ("int8", 64),
                                       ("int4", None)])
def test_weights_match_a_numpy_reference(fmt, group):
    layer = linear((128, 24))  # odd output width: 24
    w = np.asarray(layer.kernel[...])
    quantize_weights(layer, fmt, group=group, paths=".*")
    stored = layer.kernel.get_value()
    assert isinstance(layer.kernel, QuantizedParam)
    assert stored.qvalue.dtype == jnp.dtype(fmt) and stored.qvalue.shape == w.shape
    assert stored.scale.shape == ((1, 24) if group is None else (128 // group, 24))
    q, scale = quantize_np(w, (0,), fmt, group)
    got = np.asarray(stored.qvalue, np.int32)
    # an entry at x / scale = +-(qmax + 0.5) (the block's absmax) may round either way
    tie = np.isclose(np.abs(w / scale), (127.5 if fmt == "int8" else 7.5), atol=1e-4)
    np.testing.assert_array_equal(got[~tie], q[~tie])
    assert np.all(np.abs(got[tie] - q[tie]) <= 1)
    q = np.where(tie, got, q)
    assert isinstance(layer.kernel[...], qarray.QArray)  # the matmul takes the QArray
    deq = np.asarray(layer.kernel.dequantized())
    assert np.all(np.abs(deq - w) <= 0.5 * scale * (1 + 1e-5) + 1e-7)
    x = np.asarray(jax.random.normal(jax.random.key(1), (3, 128)))
    np.testing.assert_allclose(np.asarray(layer(jnp.asarray(x))), x @ (q * scale),
                               rtol=1e-4, atol=1e-4 * np.abs(x @ w).max())


def test_a_scanned_einsum_stack_groups_across_heads():
    # the output projection [L, N, H, D] contracts N x H: a group of 32 over H = 16
    # spans two heads; the leading layer axis keeps its own scales
    model = models.build(model_config({**TINY, "head_dim": 16}), rngs=nnx.Rngs(0))
    o = model.layers.cycles.layers[0].attn.o
    w = np.asarray(o.kernel[...])
    quantize_weights(model, "int4", group=32)
    stored = o.kernel.get_value()
    assert w.shape == (2, 4, 16, 64) and stored.scale.shape == (2, 2, 1, 64)
    blocks = w.reshape(2, 2, 32, 64)  # heads (0,1) and (2,3) share a scale per layer
    scale = np.abs(blocks).max(axis=2) / 7.5
    np.testing.assert_allclose(np.asarray(stored.scale)[:, :, 0], scale, rtol=1e-6)


@pytest.mark.parametrize("fmt,group,head_dim", [("int8", None, 16), ("int4", 32, 16),
                                                ("int4", 32, 32)])
def test_the_quantized_matmuls_equal_float_matmuls_on_the_dequantized_weights(fmt, group,
                                                                              head_dim):
    # the scanned model's matmuls take the QArrays (scales applied to the products, per
    # group summed after; a group of 32 over H = 32 gives the output projection a scale
    # per head, dequantized first): the logits of the model holding the dequantized weights
    cfg = model_config({**TINY, "head_dim": head_dim})
    model = quantize_weights(models.build(cfg, rngs=nnx.Rngs(0)), fmt, group=group)
    reference = models.build(cfg, rngs=nnx.Rngs(0))
    quantized = dict(nnx.iter_modules(model))
    for path, module in nnx.iter_modules(reference):
        for name in ("kernel", "wi_gate", "wi_up", "wo"):
            param = getattr(quantized[path], name, None)
            if isinstance(param, QuantizedParam):
                getattr(module, name).set_value(param.dequantized())
    x = jax.random.randint(jax.random.key(2), (2, 11), 0, 61)
    want = np.asarray(reference(x))
    np.testing.assert_allclose(np.asarray(model(x)), want, rtol=1e-5,
                               atol=1e-5 * np.abs(want).max())


def test_the_rule_keeps_head_embeddings_and_router_float_and_the_bytes_shrink():
    cfg = model_config({**TINY, "ffn_pattern": ("moe",),
                        "moe": dict(num_experts=4, experts_per_token=2)})
    model = models.build(cfg, rngs=nnx.Rngs(0))
    before = weight_bytes(model)
    quantize_weights(model, "int8")
    params = nnx.to_flat_state(nnx.state(model, nnx.Param))
    kinds = {"/".join(map(str, p)): type(v).__name__ for p, v in params}
    assert all(k == "Param" for p, k in kinds.items() if not p.startswith("layers/"))
    assert "embed/tokens/embedding" in kinds and "embed/head/kernel" in kinds
    router = [p for p in kinds if p.endswith("router")]
    assert router and all(kinds[p] == "Param" for p in router)
    quantized = [p for p, k in kinds.items() if k in ("QuantizedParam", "QuantizedKernel")]
    assert any(p.endswith("attn/q/kernel") for p in quantized)
    assert any(p.endswith("ffn/wo") for p in quantized)  # the MoE experts
    float_bytes = sum(v.get_value().qvalue.nbytes for p, v in params
                      if isinstance(v, QuantizedParam)) * 4
    after = weight_bytes(model)
    # int8 values (a quarter of float32) plus per-channel scales; float rest unchanged
    assert before - after > 0.7 * float_bytes, (before, after, float_bytes)
    int4 = models.build(cfg, rngs=nnx.Rngs(0))
    quantize_weights(int4, "int4", group=32)
    assert weight_bytes(int4) < after  # int4 values count half a byte


def test_bad_input_is_one_line_naming_it_and_what_can():
    model = models.build(model_config(TINY), rngs=nnx.Rngs(0))
    errors = {
        "int2": dict(fmt="int2"),
        "--quantize_group: 48": dict(fmt="int8", group=48),
        "matches no Linear": dict(fmt="int8", paths="nothing"),
        "embed/tokens is an embedding": dict(fmt="int4", paths="embed/tokens"),
    }
    for want, kw in errors.items():
        with pytest.raises(ValueError, match=want) as e:
            quantize_weights(model, kw.pop("fmt"), **kw)
        assert "\n" not in str(e.value)
    odd = linear((96, 8))  # 96 inputs: groups of 64 do not tile them, 32 does
    with pytest.raises(ValueError, match=r"contracts 96 inputs .*use quantize_group 32 or"):
        quantize_weights(odd, "int4", group=64, paths=".*")
    quantize_weights(odd, "int8", paths=".*")
    with pytest.raises(ValueError, match="quantized already"):
        quantize_weights(odd, "int8", paths=".*")


def test_fp8_kv_is_refused_where_the_device_has_no_fp8():
    a100 = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA A100",
                                 compute_capability="8.0")
    with pytest.raises(ValueError, match=r"NVIDIA A100 \(compute capability 8.0\) has no fp8; "
                                         r"use model.kv_quant='int8'"):
        kv_quant.check_backend("fp8", a100)
    kv_quant.check_backend("int8", a100)
    kv_quant.check_backend("fp8", jax.devices()[0])  # CPU: converted up
    model = models.build(model_config(TINY), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="has no fp8"):
        quantize_for_serving(model, kv="fp8", device=a100)
    with pytest.raises(ValueError, match="'int3' is not a K/V cache format"):
        kv_quant.storage_dtype("int3")


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_kv_quantize_per_token_and_head_against_numpy(fmt):
    x = np.array(jax.random.normal(jax.random.key(0), (2, 5, 3, 16)) * 3, np.float32)
    x[0, 1, 2] = 0.0  # an all-zero head: scale 1, values 0
    q, s = kv_quant.quantize(jnp.asarray(x), fmt)
    assert q.dtype == kv_quant.storage_dtype(fmt) and s.shape == (2, 5, 3)
    bound = 127.0 if fmt == "int8" else 448.0
    absmax = np.abs(x).max(-1)
    want = np.where(absmax > 0, absmax / bound, 1.0)
    np.testing.assert_allclose(np.asarray(s), want, rtol=1e-6)
    back = np.asarray(kv_quant.dequantize(q, s, jnp.float32))
    if fmt == "int8":
        np.testing.assert_array_equal(np.asarray(q), np.round(x / want[..., None]))
        assert np.all(np.abs(back - x) <= want[..., None] * 0.5 + 1e-6)
    else:  # e4m3: 3 mantissa bits, relative error <= 2^-4
        assert np.all(np.abs(back - x) <= np.abs(x) * 2 ** -4 + want[..., None] * 2 ** -9)
    assert np.all(back[0, 1, 2] == 0) and np.asarray(s)[0, 1, 2] == 1.0
