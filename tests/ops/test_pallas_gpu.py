"""The GPU (Triton) kernels: against the reference in interpret mode on CPU, and
lowered to Triton for the cuda platform without a GPU (checks the Triton
lowering rules of every kernel; the Triton compiler itself runs only on a GPU,
in the accelerator-marked test)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import check_against_reference, inputs, make_mask

from tfjax.ops import masks as M
from tfjax.ops.pallas import BlockSizes
from tfjax.ops.pallas.gpu import flash_attention_gpu

BS = BlockSizes(32, 64, 32, 64, 64, 32)


@pytest.mark.parametrize("T,S,heads,H,mask_name,extras", [
    (100, 200, (8, 2), 80, "causal&segments", {"softcap": 20.0, "q_offset": 3, "bias": (1, 8),
                                               "alibi": "N"}),
    (128, 100, (4, 1), 32, "padding_fully_masked", {"kv_offset": 2, "alibi": "BN"}),
    (100, 130, (4, 2), 32, "causal&segments", {"alibi": "pos"}),
], ids=["gqa-segments-softcap-bias-alibi-tails", "mqa-fully-masked-rows-alibi",
        "alibi-positions-segments"])
def test_interpret_matches_reference(T, S, heads, H, mask_name, extras):
    extras = dict(extras)
    q, k, v, bias = inputs(2, T, S, *heads, H, bias=extras.pop("bias", None))
    impl = functools.partial(flash_attention_gpu, interpret=True)
    check_against_reference(impl, q, k, v, make_mask(mask_name, 2, T, S), bias, block_sizes=BS,
                            **extras)


def _lower_for_cuda(mask_name, H, dtype, bias, alibi=False):
    B, T, S, N, K = 2, 300, 500, 8, 2
    sds = jax.ShapeDtypeStruct

    def f(q, k, v, qs, ks, b):
        mask = {"causal": M.causal(), "window": M.sliding_window(128),
                "causal&segments": M.causal() & M.segments(qs, ks),
                "prefix|padding": M.prefix_lm(qs[:, 0]) | M.padding(ks[:, 0])}[mask_name]
        slopes = jnp.linspace(0.5, 0.01, N) if alibi else None
        loss = lambda q, k, v, b: flash_attention_gpu(
            q, k, v, mask, bias=b, softcap=30.0, alibi_slopes=slopes).astype(jnp.float32).sum()
        return jax.grad(loss, (0, 1, 2, 3) if bias else (0, 1, 2))(q, k, v, b)

    args = (sds((B, T, N, H), dtype), sds((B, S, K, H), dtype), sds((B, S, K, H), dtype),
            sds((B, T), jnp.int32), sds((B, S), jnp.int32),
            sds((1, N, T, S), jnp.float32) if bias else None)
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("mask_name,H,dtype,bias,alibi", [
    ("causal", 128, jnp.bfloat16, False, False),
    ("causal&segments", 64, jnp.float16, True, False),
    ("window", 256, jnp.bfloat16, False, True),
    ("prefix|padding", 80, jnp.float32, False, False),
])
def test_kernels_lower_to_triton(mask_name, H, dtype, bias, alibi):
    try:
        text = _lower_for_cuda(mask_name, H, dtype, bias, alibi)
    except Exception as e:
        if "cuda" in str(e).lower() and "platform" in str(e).lower():
            pytest.skip(f"this jaxlib cannot lower for cuda: {str(e).splitlines()[0][:120]}")
        raise
    assert text.count("xla.gpu.triton") == 3  # forward, dq, dk/dv


@pytest.mark.accelerator
def test_on_gpu_matches_reference():
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    q, k, v, bias = inputs(2, 1000, 1000, 8, 2, 128, dtype=jnp.bfloat16, bias=(1, 1))
    mask = M.causal() & M.segments(np.repeat(np.arange(4), 250)[None].repeat(2, 0))
    check_against_reference(flash_attention_gpu, q, k, v, mask, bias, softcap=30.0)
