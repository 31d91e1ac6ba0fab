"""The Pallas family (`tfjax.ops.pallas`): its plan, the one decision of which
kernels run (Mosaic TPU, Triton, Mosaic GPU forward and backward) and how
(decode-shaped requests: query heads packed, keys split), and `flash_attention`
running what it planned, on CPU and for GPU targets (interpreted, or lowered for a
named GPU). The kernels against the reference: test_implementations.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import inputs, lower_for_cuda, make_mask

import tfjax.ops.pallas as pallas_lib
from tfjax.ops import RelativeBias
from tfjax.ops import masks as M
from tfjax.ops import sparse_masks as SM
from tfjax.ops.pallas import flash_attention, flash_attention_gpu
from tfjax.ops.target import gpu_lowering_target


def test_decode_shaped_requests_pack_query_heads(monkeypatch):
    """By default a GQA request with T * G <= 128 rows and a data-indexed mask (a
    KV cache's `Positions`) reaches the kernels as `[B, T*G, K, H]`; a positional
    mask or ALiBi keeps `[B, T, N, H]`; pack_heads=True that cannot pack raises."""
    import tfjax.ops.pallas as pallas_lib

    shapes = []
    real = pallas_lib._kernels
    monkeypatch.setattr(pallas_lib, "_kernels",
                        lambda how, q, *a, **kw: shapes.append(q.shape) or real(how, q, *a, **kw))
    q, k, v, _ = inputs(2, 1, 40, 8, 2, 32)
    cache = make_mask("positions", 2, 1, 40)
    flash_attention(q, k, v, cache)
    flash_attention(q, k, v, M.causal(), q_offset=39)
    flash_attention(q, k, v, cache, alibi_slopes=jnp.ones(8))
    flash_attention(q, k, v, cache, pack_heads=False)
    flash_attention(q, k, v, cache, kv_splits=5)  # packed, then 5 chunks of 8 keys
    assert shapes == [(2, 4, 2, 32), (2, 1, 8, 32), (2, 1, 8, 32), (2, 1, 8, 32),
                      (10, 4, 2, 32)], shapes
    with pytest.raises(ValueError, match="pack_heads=True.*Causal"):
        flash_attention(q, k, v, M.causal(), pack_heads=True)
    with pytest.raises(ValueError, match="kv_splits must be a positive divisor.*S=40"):
        flash_attention(q, k, v, cache, kv_splits=3)
    with pytest.raises(ValueError, match="kv_splits=2 cannot split.*Causal"):
        flash_attention(q, k, v, M.causal(), kv_splits=2)
    with pytest.raises(ValueError, match="kv_splits=2 cannot split.*ALiBi at index positions"):
        flash_attention(q, k, v, cache, kv_splits=2, alibi_slopes=jnp.ones(8))


def test_plan_decides_kernels_packing_and_splits(monkeypatch):
    """`plan`, the family's one decision: the Mosaic TPU kernels on CPU (interpreted)
    and TPU, the Triton kernels on a GPU target unless interpreting (Mosaic GPU on
    sm_90 when it can); decode-shaped GQA over a cache's mask packs its heads, and
    on GPU a small grid splits the keys (`decode.auto_kv_splits`, on the packed
    rows); explicit choices are validated. `flash_attention` runs what it plans."""
    import dataclasses

    from tfjax.ops import target
    from tfjax.ops.pallas import Plan, plan

    q, k, v, _ = inputs(1, 1, 2048, 8, 2, 32)
    cache = make_mask("positions", 1, 1, 2048)
    assert plan(q, k, v, M.causal()) == Plan("mosaic_tpu")  # positional: not packed
    assert plan(q, k, v) == plan(q, k, v, cache) == Plan("mosaic_tpu", pack_heads=True)
    assert plan(q, k, v, cache, pack_heads=False, kv_splits=4) == Plan("mosaic_tpu", kv_splits=4)
    with target.targeting("tpu"):
        assert plan(q, k, v, M.causal()) == Plan("mosaic_tpu")
    with target.targeting("gpu"):
        # 2 kv heads x 1 tile of 4 packed rows: under two programs per SM, 4 chunks of 512
        assert plan(q, k, v, cache) == Plan("triton", "triton", "triton", True, 4)
        assert plan(q, k, v, cache, pack_heads=False) == Plan("triton", "triton", "triton",
                                                              False, 4)
        assert plan(q, k, v, M.causal()) == Plan("triton", "triton", "triton")  # positional
        assert plan(q, k, v, cache, interpret=True) == Plan("mosaic_tpu", pack_heads=True)
        bf = [x.astype(jnp.bfloat16) for x in (q, k, v)]
        with target.gpu_lowering_target("H200"):
            assert plan(*bf, M.causal()) == Plan("triton", "hopper", "hopper")
        with target.gpu_lowering_target("A100"):
            assert plan(*bf, M.causal()) == Plan("triton", "triton", "triton")
            assert plan(*bf, M.causal(), kv_splits=1) == Plan("triton", "triton", "triton")
    with pytest.raises(ValueError, match="pack_heads=True.*Causal"):
        plan(q, k, v, M.causal(), pack_heads=True)
    with pytest.raises(ValueError, match="kv_splits must be a positive divisor.*S=2048"):
        plan(q, k, v, cache, kv_splits=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan(q, k, v).kv_splits = 2
    # flash_attention executes the plan: the kernels it names see the packed, split rows
    seen = []
    monkeypatch.setattr(pallas_lib, "plan", lambda *a, **kw: Plan("mosaic_tpu", kv_splits=2))
    real = pallas_lib._kernels
    monkeypatch.setattr(pallas_lib, "_kernels", lambda how, q, k, *a, **kw: seen.append(
        (how.kernels, q.shape, k.shape)) or real(how, q, k, *a, **kw))
    flash_attention(q, k, v, cache)
    assert seen == [("mosaic_tpu", (2, 1, 8, 32), (2, 1024, 2, 32))], seen


def test_a_gpu_decode_step_packs_heads_and_splits_the_cache(monkeypatch):
    """`implementation="auto"` on GPU (the backend reported as "gpu", the Triton
    kernels interpreted): a batch-1 GQA decode step over a KV cache's mask reaches
    the kernels with its 4 query heads per kv head packed as rows and the 2048
    keys in 4 chunks of 512 (2 kv heads x 1 tile is under two programs per SM)."""
    import tfjax.ops.pallas.triton as gpu_lib
    from tfjax.ops import dot_product_attention

    seen = []
    kernels = gpu_lib.flash_attention_triton

    def interpreted(q, k, v, *a, **kw):
        seen.append((q.shape, k.shape))
        return kernels(q, k, v, *a, **{**kw, "interpret": True})

    q, k, v, _ = inputs(1, 1, 2048, 8, 2, 32)
    mask = make_mask("positions", 1, 1, 2048)
    want = dot_product_attention(q, k, v, mask, implementation="xla")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(gpu_lib, "flash_attention_triton", interpreted)
    got = dot_product_attention(q, k, v, mask, implementation="auto")
    assert seen == [((4, 4, 2, 32), (4, 512, 2, 32))], seen
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_relative_bias_reaches_the_gpu_kernels_per_tile(monkeypatch):
    """On GPU `dot_product_attention(implementation="pallas")` hands T5's bias to the
    Triton kernels as the `RelativeBias` itself (no `[B, N, T, S]` bias): run on CPU
    with the backend reported as "gpu" and the Triton kernels interpreted."""
    import tfjax.ops.pallas.triton as gpu_lib
    from tfjax.ops import RelativeBias, dot_product_attention

    calls = []
    kernels = gpu_lib.flash_attention_triton

    def interpreted(*a, bias=None, relative_bias=None, **kw):
        calls.append((bias, type(relative_bias).__name__))
        return kernels(*a, bias=bias, relative_bias=relative_bias, **{**kw, "interpret": True})

    q, k, v, _ = inputs(1, 40, 50, 4, 2, 32)
    rb = RelativeBias(jnp.linspace(-1.0, 1.0, 32).reshape(8, 4), bidirectional=True,
                      max_distance=16)
    want = dot_product_attention(q, k, v, M.causal(), relative_bias=rb, implementation="xla")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(gpu_lib, "flash_attention_triton", interpreted)
    got = dot_product_attention(q, k, v, M.causal(), relative_bias=rb, implementation="pallas")
    assert calls == [(None, "RelativeBias")], calls
    np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("gpu,kernels", [("H200", (3, 0)), ("A100", (0, 3))])
def test_auto_lowers_what_the_target_gpu_runs(gpu, kernels):
    """`gpu_lowering_target` lowers as the named GPU would run: `forward="auto"` and
    `backward="auto"` take the Hopper (Mosaic GPU) forward, dq and dk/dv kernels for
    an H200 (sm_90) and the Triton ones for an A100; T5's bias, which the Hopper
    kernels decline, takes Triton on both."""
    sds = jax.ShapeDtypeStruct
    q, kv = sds((1, 256, 4, 128), jnp.bfloat16), sds((1, 256, 2, 128), jnp.bfloat16)

    def grads(relative):
        rb = RelativeBias(jnp.ones((32, 4)), bidirectional=False) if relative else None
        loss = lambda q, k, v: flash_attention_gpu(
            q, k, v, M.causal(), relative_bias=rb).astype(jnp.float32).sum()
        return jax.grad(loss, (0, 1, 2))

    text = lower_for_cuda(grads(False), q, kv, kv, gpu=gpu)
    assert (text.count("stablehlo.custom_call @mosaic_gpu"), text.count("xla.gpu.triton")) \
        == kernels
    text = lower_for_cuda(grads(True), q, kv, kv, gpu=gpu)
    assert (text.count("stablehlo.custom_call @mosaic_gpu"), text.count("xla.gpu.triton")) \
        == (0, 3)
    with pytest.raises(ValueError, match="unknown gpu 'V100'"):
        with gpu_lowering_target("V100"):
            pass


def test_auto_picks_hopper_only_on_sm90_for_what_it_supports(monkeypatch):
    """The family's plan (`tfjax.ops.pallas.plan`) for the GPU kernels: forward and
    backward "auto" take the Hopper (Mosaic GPU) kernels only when compiling for an
    sm_90 GPU (`target.is_hopper`) and they support the request; "hopper" insists."""
    from tfjax.ops import target
    from tfjax.ops.pallas import plan

    def kernel(which, q, k=None, mask=None, bias=None, interpret=False, choice="auto", **kw):
        k = q if k is None else k
        return getattr(plan(q, k, k, mask, bias=bias, interpret=interpret, kernels="triton",
                            **{which: choice}, **kw), which)

    bf, f32 = jnp.zeros((1, 8, 2, 64), jnp.bfloat16), jnp.zeros((1, 8, 2, 64), jnp.float32)
    pick = lambda q, k, mask=None, bias=None, interpret=False: kernel(
        "forward", q, k, mask, bias, interpret)
    assert pick(bf, bf) == "triton"  # this CPU is no Hopper
    monkeypatch.setattr(target, "is_hopper", lambda: True)
    assert pick(bf, bf, M.causal() & M.segments(np.zeros((1, 8)))) == "hopper"
    assert pick(bf, bf, interpret=True) == "triton"  # interpret mode keeps Triton's
    assert pick(f32, f32) == "triton"
    assert pick(bf, f32) == "triton"
    assert pick(bf, bf, bias=jnp.zeros((1, 1, 8, 8))) == "triton"
    assert pick(bf, bf, SM.bigbird(2, 1, 1, 4, seed=0, seq_len=8)) == "triton"
    assert pick(jnp.zeros((1, 8, 2, 320), jnp.bfloat16), jnp.zeros((1, 8, 2, 320),
                                                                   jnp.bfloat16)) == "triton"
    bwd = lambda q: kernel("backward", q)
    h256 = jnp.zeros((1, 8, 2, 256), jnp.bfloat16)
    assert bwd(bf) == "hopper" and pick(h256, h256) == "hopper"
    assert bwd(h256) == "triton"  # dK, dV at H = 256 would not fit the registers
    assert bwd(f32) == "triton"
    slopes = jnp.ones((1, 2))  # ALiBi: the Hopper forward and backward
    rb = RelativeBias(jnp.ones((32, 2)), bidirectional=False)
    for which in ("forward", "backward"):
        assert kernel(which, bf, alibi_slopes=slopes) == "hopper"
    for which in ("forward", "backward"):  # T5's bias: the Triton kernels only
        assert kernel(which, bf, relative_bias=rb) == "triton"
        with pytest.raises(ValueError, match=f"relative_bias.*{which}='triton'"):
            kernel(which, bf, relative_bias=rb, choice="hopper")
    # on a GPU target the family plans the GPU kernels by itself, and
    # flash_attention runs what it planned
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert plan(bf, bf, bf).kernels == "triton" and plan(bf, bf, bf).forward == "hopper"
    assert plan(bf, bf, bf, interpret=True).kernels == "mosaic_tpu"
