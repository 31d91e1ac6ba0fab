"""The Mosaic GPU kernels (`tfjax.ops.pallas.mosaic_gpu`, `mosaic_gpu_backward`):
lowered for the cuda platform without a GPU (the Pallas -> Mosaic GPU lowering,
including its shared memory budget, runs in Python), their shared-memory counts,
refusals, the in-place accumulation of the compiled forward, and on a Hopper GPU
when there is one (accelerator-marked). Against the reference in Pallas' GPU
interpret mode: test_implementations.py."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import check_against_reference, inputs, lower_for_cuda
from jaxpr_walk import of_primitive

from tfjax.ops import masks as M
from tfjax.ops import sparse_masks as SM
from tfjax.ops.pallas import flash_attention_gpu
from tfjax.ops.target import gpu_lowering_target
from tfjax.ops.pallas.mosaic_gpu import HopperConfig, flash_forward_hopper, supports
from tfjax.ops.pallas.mosaic_gpu_backward import HopperBackwardConfig, flash_backward_hopper

HC, HB = HopperConfig, HopperBackwardConfig


def _lower(mask, H, dtype, grad, backward):
    sds = jax.ShapeDtypeStruct
    q, kv = sds((2, 1000, 8, H), dtype), sds((2, 1000, 2, H), dtype)
    cfg = HopperConfig.default(H)
    if not grad:  # the intra-warpgroup overlap (wgmma_accumulator_load with wait_n=1)
        cfg = HopperConfig(block_kv=cfg.block_kv, overlap=True)

    def f(q, k, v):
        # ALiBi (index positions: the wgmma-layout iota) in the forward-only case and
        # in the Hopper backward's
        alibi = dict(alibi_slopes=jnp.linspace(0.5, 0.01, 8)) \
            if not grad or backward == "hopper" else {}
        out = flash_attention_gpu(q, k, v, mask, forward="hopper", backward=backward,
                                  hopper_config=cfg,
                                  softcap=30.0 if backward == "hopper" else None, **alibi)
        return out.astype(jnp.float32).sum()

    return lower_for_cuda(jax.grad(f, (0, 1, 2)) if grad else f, q, kv, kv)


@pytest.mark.parametrize("mask_name,H,dtype,grad,backward", [
    ("causal", 128, jnp.bfloat16, True, "triton"),
    ("causal&segments", 64, jnp.float16, True, "hopper"),
    ("window", 256, jnp.bfloat16, False, "auto"),
])
def test_lowers_to_mosaic_gpu(mask_name, H, dtype, grad, backward):
    """Compiled-path code the interpreter does not run (the in-place wgmma
    accumulation of the backward, `run_state`) is lowered here."""
    qs = ks = np.repeat(np.arange(4), 250)[None].repeat(2, 0)
    mask = {"causal": M.causal(), "window": M.sliding_window(128),
            "causal&segments": M.causal() & M.segments(qs, ks)}[mask_name]
    try:
        text = _lower(mask, H, dtype, grad, backward)
    except Exception as e:
        if "cuda" in str(e).lower() and "platform" in str(e).lower():
            pytest.skip(f"this jaxlib cannot lower for cuda: {str(e).splitlines()[0][:120]}")
        raise
    hopper_bwd = grad and backward == "hopper"
    # the forward, and the Hopper dq and dk/dv, or the Triton ones
    assert text.count("stablehlo.custom_call @mosaic_gpu") == (3 if hopper_bwd else 1)
    assert text.count("xla.gpu.triton") == (2 if grad and not hopper_bwd else 0)


def test_shared_memory_estimates_are_mosaics_count(monkeypatch):
    """`HopperConfig.smem_bytes` / `HopperBackwardConfig.smem_bytes` (each buffer
    rounded to 1 KiB, mbarriers, segment/position slots) equal what Mosaic GPU
    allocates, read from its own count while lowering; so the kernels refuse a
    config that does not fit, with the fix, before Mosaic does. 128-key tiles in 3
    stages at H=128 fit only without segment operands (within 2 KiB of the limit:
    the forward reserves no cross-warp reduction scratch)."""
    mosaic = pytest.importorskip("jax.experimental.mosaic.gpu.core")
    if not hasattr(mosaic, "_smem_tree_size"):
        pytest.skip("this jax counts Mosaic GPU's shared memory elsewhere")
    counted = []
    count = mosaic._smem_tree_size
    monkeypatch.setattr(mosaic, "_smem_tree_size", lambda t: counted.append(count(t)) or count(t))
    sds = jax.ShapeDtypeStruct
    T = 1024
    segs = M.causal() & M.segments(np.repeat(np.arange(4), T // 4)[None])

    def lower(H, fwd, bwd=None, mask=M.causal(), **kw):
        counted.clear()
        q, kv = sds((1, T, 4, H), jnp.bfloat16), sds((1, T, 2, H), jnp.bfloat16)
        f = lambda q, k, v: flash_attention_gpu(
            q, k, v, mask, forward="hopper", hopper_config=fwd,
            backward="hopper" if bwd else "triton", hopper_backward_config=bwd,
            **kw).astype(jnp.float32).sum()
        lower_for_cuda(jax.grad(f, (0, 1, 2)) if bwd else f, q, kv, kv)
        return counted[0], max(counted[1:], default=None)

    big = HC(block_kv=128, stages=3)
    assert big.smem_bytes(128) > 225 * 1024
    assert lower(128, big)[0] == big.smem_bytes(128)
    one = HC(block_kv=64, compute_warpgroups=1, pingpong=False)
    slopes = jnp.linspace(0.5, 0.1, 4)
    pos = (np.arange(T)[None], np.arange(T)[None])
    bwd = HB(64, 128)
    fwd_bytes, bwd_bytes = lower(80, one, bwd, mask=segs, alibi_slopes=slopes, alibi_positions=pos)
    assert fwd_bytes == one.smem_bytes(80, slots=2)
    assert bwd_bytes == bwd.smem_bytes(80, slots=2)
    assert lower(128, HC(block_kv=64), HB())[1] == HB().smem_bytes(128)
    with pytest.raises(ValueError, match="with 1 segment/position operand.*lower block_kv"):
        lower(128, big, mask=segs)

def test_refusals_name_the_fix():
    q = jnp.zeros((1, 64, 2, 64), jnp.float32)
    with pytest.raises(ValueError, match="forward='triton'"):
        flash_attention_gpu(q, q, q, forward="hopper")
    qb = q.astype(jnp.bfloat16)
    with pytest.raises(ValueError, match="bias"):
        flash_attention_gpu(qb, qb, qb, bias=jnp.zeros((1, 1, 64, 64)), forward="hopper")
    with pytest.raises(ValueError, match="forward must be one of"):
        flash_attention_gpu(qb, qb, qb, forward="mosaic")
    with pytest.raises(ValueError, match="v's head dim equal to q/k's.*forward='triton'"):
        flash_attention_gpu(qb, qb, qb[..., :32], forward="hopper")
    with pytest.raises(ValueError, match="lower block_kv or stages"):
        flash_forward_hopper(jnp.zeros((1, 64, 2, 256), jnp.bfloat16),
                             jnp.zeros((1, 64, 1, 256), jnp.bfloat16),
                             jnp.zeros((1, 64, 1, 256), jnp.bfloat16), None, scale=1.0,
                             softcap=None, config=HopperConfig(block_kv=128, stages=2))
    assert "Longformer" in supports(jnp.bfloat16, 64, SM.longformer(4, (0,)), False)
    assert supports(jnp.bfloat16, 64, M.causal() & M.segments(np.zeros((1, 8))), False) is None
    with pytest.raises(ValueError, match="block_kv"):
        HopperConfig(block_kv=96)
    with pytest.raises(ValueError, match="compute_warpgroups"):
        HopperConfig(compute_warpgroups=3)
    with pytest.raises(ValueError, match="pingpong"):
        HopperConfig(compute_warpgroups=1, pingpong=True)
    with pytest.raises(ValueError, match="stages >= 2"):
        HopperConfig(overlap=True, stages=1)
    with pytest.raises(ValueError, match="pingpong=None"):
        HopperConfig(overlap=True, pingpong=True)
    with pytest.raises(ValueError, match="HopperConfig.order must be 'head' or 'lpt'"):
        HopperConfig(order="reversed")
    q256 = jnp.zeros((1, 64, 2, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match="backward='triton'"):  # the forward would take it
        flash_attention_gpu(q256, q256, q256, forward="hopper", backward="hopper")
    with pytest.raises(ValueError, match="lower the blocks or stages"):
        q128 = jnp.zeros((1, 64, 2, 128), jnp.bfloat16)
        flash_backward_hopper(q128, q128, q128, q128, jnp.zeros((1, 2, 64)),
                              jnp.zeros((1, 2, 64)), None, scale=1.0, softcap=None,
                              config=HopperBackwardConfig(128, 128, stages=4))
    with pytest.raises(ValueError, match="block_q_dkv"):
        HopperBackwardConfig(block_q_dkv=96)
    with pytest.raises(ValueError, match="compute_warpgroups"):
        HopperBackwardConfig(compute_warpgroups=0)


@pytest.mark.accelerator
def test_on_hopper_matches_reference():
    dev = jax.devices()[0]
    if dev.platform != "gpu" or not str(getattr(dev, "compute_capability", "")).startswith("9."):
        pytest.skip("needs a Hopper GPU")
    q, k, v, _ = inputs(2, 1000, 1000, 8, 2, 128, dtype=jnp.bfloat16)
    mask = M.causal() & M.segments(np.repeat(np.arange(4), 250)[None].repeat(2, 0))
    for backward, cfg in (("hopper", None), ("triton", HopperConfig(overlap=True)),
                          ("hopper", HopperConfig(compute_warpgroups=1, pingpong=False))):
        impl = functools.partial(flash_attention_gpu, forward="hopper", backward=backward,
                                 hopper_config=cfg)
        check_against_reference(impl, q, k, v, mask, softcap=30.0)
    # every per-tile extra at once (the forward adds ALiBi after the mask's branch;
    # the overlap schedule accumulates P V in place; dk/dv folds the soft-cap's
    # derivative into P), and H = 256 (Hopper forward, Triton backward)
    window = M.sliding_window(300) & M.segments(np.repeat(np.arange(4), 250)[None].repeat(2, 0))
    for H, cfg in ((128, None), (128, HopperConfig(overlap=True)), (256, None)):
        q, k, v, _ = inputs(2, 1000, 1000, 8, 2, H, dtype=jnp.bfloat16)
        impl = functools.partial(flash_attention_gpu, forward="hopper", hopper_config=cfg,
                                 backward="hopper" if H <= 128 else "triton")
        check_against_reference(impl, q, k, v, window, softcap=30.0, alibi="BN")


@pytest.mark.parametrize("overlap", [False, True], ids=["pingpong", "overlap"])
def test_forward_accumulates_pv_into_the_output_in_place(overlap):
    """ptxas (experiments/gpu_registers.py, an H200 compile without a GPU) spilled 828
    B per thread in the H=256 forward while P V went to a second fp32 accumulator
    beside the output (the FA3 overlap schedule: 332 B at H=128); compiled, the
    kernel now accumulates P V into the rescaled output (`mma`: run_state over an
    ACC initialised with it), one per kv step (overlap: one in the loop, whose body
    also hands out the softmax's results, and one for the last step) and none
    elsewhere; interpret mode, which has no run_state, forms the same sum from a
    fresh accumulator."""
    q = jnp.zeros((1, 128, 2, 256), jnp.bfloat16)
    cfg = HopperConfig(block_kv=64, overlap=overlap)

    def count(interpret):
        f = lambda q: flash_forward_hopper(q, q, q, M.causal(), scale=0.1, softcap=None,
                                           config=cfg, interpret=interpret)
        with gpu_lowering_target("H200"):
            return len(of_primitive(jax.make_jaxpr(f)(q).jaxpr, "run_state"))

    assert count(False) == (2 if overlap else 1)
    assert count(True) == 0
