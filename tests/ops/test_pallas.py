"""implementation="pallas" (the TPU kernels, in interpret mode on CPU) against the
reference: forward, lse, dq/dk/dv and dbias on a covering set of issue 4's sizes,
every mask kind in a kernel (iota masks, segment tiles, per-example scalars),
tails, GQA/MQA, head dims padded to 128 lanes, soft-cap, bias, ALiBi, T5's bias
(index and explicit positions, its table gradient), offsets (static:
tables at trace time; traced: tables in the graph), fully masked rows, bf16; one
case under the TPU-semantics interpreter; determinism; dispatch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import check_against_reference, inputs, make_mask
from jax.experimental.pallas import tpu as pltpu

from tfjax.ops import dot_product_attention, select_implementation
from tfjax.ops import masks as M
from tfjax.ops.attention import AttentionRequest
import tfjax.ops.pallas as pallas_lib
from tfjax.ops.pallas import BlockSizes, flash_attention

BS = BlockSizes(block_q=64, block_kv=128, block_q_dq=64, block_kv_dq=128, block_q_dkv=128,
                block_kv_dkv=128)
# dq's kv tile spans 256 lanes (T5's per-bucket sums fold two lane tiles)
BS_WIDE_DQ = BlockSizes(block_q=64, block_kv=128, block_q_dq=64, block_kv_dq=256,
                        block_q_dkv=128, block_kv_dkv=128)

CASES = [
    (1, 1, (4, 4), 32, "none", {}),
    (100, 200, (8, 2), 80, "causal&segments", {"softcap": 20.0, "q_offset": 3, "alibi": "BN",
                                               "relative": "causal"}),
    (384, 128, (8, 1), 64, "window_lr", {"bias": (1, 8), "alibi": "pos", "relative": "pos"}),
    (128, 100, (4, 4), 128, "padding_fully_masked", {"bias": (2, 1), "relative": "bidir"}),
    (1000, 1000, (4, 4), 32, "chunked", {"relative": "causal", "block_sizes": BS_WIDE_DQ}),
    # T5's bias (max distance 24) on whole 384 x 384 grids: at explicit positions
    # index // 12 (bidirectional) tiles far in index hold several buckets; at index
    # positions (unidirectional) far tiles hold one (the past's last, or 0)
    (384, 384, (4, 2), 32, "none", {"relative": "coarse"}),  # explicit positions
    (384, 384, (4, 1), 32, "none", {"relative": "causal", "kv_offset": 9}),
    (100, 384, (8, 2), 32, "prefix|window", {"kv_offset": 5, "alibi": "N", "relative": "bidir"}),
    (200, 300, (8, 2), 64, "bigbird", {"kv_offset": 5}),
    (130, 130, (4, 1), 32, "longformer&causal", {"q_offset": 3, "softcap": 30.0}),
    # a KV cache's masks: chunked prefill over [cache; fresh keys], and decode
    (100, 300, (8, 2), 64, "positions_window", {"softcap": 10.0}),
    (1, 300, (8, 1), 32, "positions", {"alibi": "N"}),
    # decode and speculative steps: query heads packed, keys split into chunks
    # (decode.py; chunks of 100, 65, 75 and 40 keys: never whole tiles)
    (1, 300, (8, 2), 64, "positions", {"softcap": 10.0, "pack_heads": True, "kv_splits": 3}),
    (5, 200, (4, 1), 32, "positions_window", {"bias": (2, 4), "pack_heads": True}),
    (3, 130, (4, 2), 32, "positions", {"bias": (1, 1), "pack_heads": True, "kv_splits": 2}),
    (2, 300, (4, 2), 32, "padding_fully_masked", {"kv_splits": 4, "kv_offset": 7}),
    (4, 200, (8, 2), 32, "segments", {"kv_splits": 5, "alibi": "pos", "bias": (1, 8)}),
]


def _case_id(c):
    return f"T{c[0]}-S{c[1]}-NK{c[2][0]}x{c[2][1]}-H{c[3]}-{c[4]}"


@pytest.mark.parametrize("T,S,heads,H,mask_name,extras", CASES, ids=[_case_id(c) for c in CASES])
def test_matches_reference(T, S, heads, H, mask_name, extras):
    extras = dict(extras)
    B = 1 if T * S > 500_000 else 2  # interpret mode walks every grid step
    q, k, v, bias = inputs(B, T, S, *heads, H, bias=extras.pop("bias", None))
    check_against_reference(flash_attention, q, k, v, make_mask(mask_name, B, T, S), bias,
                            block_sizes=extras.pop("block_sizes", BS), **extras)


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


def test_auto_kv_splits_fill_the_gpu():
    """Two programs per SM: a batch-1 decode step over a 32k cache with 8 kv heads
    (8 programs) splits into 32 chunks of 1k keys (a divisor of S, at most S / 512);
    a grid already two per SM, or a short cache, does not split."""
    from tfjax.ops.pallas.decode import auto_kv_splits
    assert auto_kv_splits(1, 8, 4, 32768, 128, 132) == 32
    assert auto_kv_splits(1, 8, 4, 3000, 128, 132) == 5  # 5 chunks of 600 keys
    assert auto_kv_splits(64, 8, 4, 32768, 128, 132) == 1
    assert auto_kv_splits(1, 8, 4, 1000, 128, 132) == 1
    assert auto_kv_splits(1, 32, 2048, 32768, 128, 132) == 1  # a 2k chunk: 512 programs
    assert auto_kv_splits(1, 32, 1024, 32768, 128, 132) == 2  # 1k: 256 < 264


def test_bf16_within_2e2():
    q, k, v, _ = inputs(1, 256, 256, 8, 2, 64, dtype=jnp.bfloat16)
    check_against_reference(flash_attention, q, k, v, M.causal(), block_sizes=BS)


def test_traced_offsets_build_tables_in_the_graph():
    """Ring attention passes offsets as traced values; the grid then walks every kv
    tile and the tables decide which steps run."""
    q, k, v, _ = inputs(1, 100, 256, 4, 2, 32)
    mask = M.causal() & M.sliding_window(64)

    def loss(q, k, v, qo, ko):
        return flash_attention(q, k, v, mask, q_offset=qo, kv_offset=ko, block_sizes=BS).sum()

    static_loss = lambda q, k, v: loss(q, k, v, 150, 0)
    static = jax.jit(jax.value_and_grad(static_loss, (0, 1, 2)))(q, k, v)
    traced = jax.jit(jax.value_and_grad(loss, (0, 1, 2)))(q, k, v, jnp.int32(150), jnp.int32(0))
    for a, b in zip(jax.tree.leaves(static), jax.tree.leaves(traced)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def test_tpu_semantics_interpreter_small_case():
    """pltpu.InterpretParams() simulates TPU memory spaces, DMAs and semaphores."""
    q, k, v, _ = inputs(1, 40, 136, 2, 1, 32)
    mask = M.causal() & M.segments(np.array([[0] * 20 + [1] * 20]),
                                   np.array([[0] * 60 + [1] * 76]))
    check_against_reference(flash_attention, q, k, v, mask, q_offset=96, softcap=10.0,
                            block_sizes=BlockSizes(16, 128, 16, 128, 128, 128),
                            interpret=pltpu.InterpretParams())


@pytest.mark.parametrize("bidirectional", [False, True])
def test_constant_bucket_tiles_hold_one_bucket(bidirectional):
    """`constant_bucket` (the kernels skip bucketing a tile it names): every entry of
    such a tile has that bucket, at index positions with offsets and at explicit
    positions (their per-tile ranges); and far tiles are found."""
    from tfjax.ops import RelativeBias
    from tfjax.ops.reference import (constant_bucket, relative_position_bucket,
                                     relative_tile_ranges)

    rng = np.random.default_rng(0)
    B, T, S, bq, bk, md = 2, 200, 300, 16, 32, 20
    Tp, Sp = 208, 320
    explicit = (np.sort(rng.integers(0, 400, (B, T)), axis=1).astype(np.int32),
                np.sort(rng.integers(0, 400, (B, S)), axis=1).astype(np.int32))
    found = 0
    for positions, offs in ((None, (7, 90)), (explicit, (0, 0))):
        rel = RelativeBias(jnp.zeros((8, 2)), bidirectional=bidirectional, max_distance=md,
                           q_positions=None if positions is None else jnp.asarray(positions[0]),
                           kv_positions=None if positions is None else jnp.asarray(positions[1]))
        ranges = relative_tile_ranges(rel, bq, bk, Tp, Sp)
        if positions is None:
            qp = np.broadcast_to(np.arange(T) + offs[0], (B, T))
            kp = np.broadcast_to(np.arange(S) + offs[1], (B, S))
        else:
            qp, kp = positions
        buckets = np.asarray(relative_position_bucket(
            kp[:, None, :] - qp[:, :, None], bidirectional=bidirectional, num_buckets=8,
            max_distance=md))
        for b in range(B):
            for i in range(Tp // bq):
                for j in range(Sp // bk):
                    c = int(constant_bucket(rel, bq, bk, b, i, j, offs, ranges))
                    tile = buckets[b, i * bq:(i + 1) * bq, j * bk:(j + 1) * bk]
                    if c >= 0 and tile.size:
                        found += 1
                        assert (tile == c).all(), (b, i, j, c, np.unique(tile))
    assert found > 50, found


def test_relative_bias_with_more_than_128_buckets():
    """T5's table row spans two 128-lane pieces in the kernels' lane gather: buckets
    up to 151 (bidirectional, 160 buckets), forward and the q / table gradients."""
    from tfjax.ops import RelativeBias
    from tfjax.ops.reference import attention_reference

    q, k, v, _ = inputs(1, 200, 200, 2, 1, 32)
    table = jnp.asarray(np.random.default_rng(3).normal(size=(160, 2)), jnp.float32)

    def loss(impl, q, table):
        rb = RelativeBias(table, bidirectional=True, max_distance=300)
        out = impl(q, k, v, M.causal() | M.sliding_window(0, 199), relative_bias=rb)
        return jnp.sum(out * jnp.cos(out)), out

    got = jax.jit(jax.value_and_grad(lambda *a: loss(
        lambda *x, **kw: flash_attention(*x, **kw, block_sizes=BS), *a), (0, 1),
        has_aux=True))(q, table)
    want = jax.jit(jax.value_and_grad(lambda *a: loss(attention_reference, *a), (0, 1),
                                      has_aux=True))(q, table)
    np.testing.assert_allclose(got[0][1], want[0][1], atol=1e-5)
    for g, w in zip(got[1], want[1]):
        np.testing.assert_allclose(g, w, atol=1e-4)
    assert np.abs(np.asarray(want[1][1][128:])).max() > 1e-3  # buckets past 128 are used


def test_auto_on_tpu_leaves_decode_steps_to_xla(monkeypatch):
    """On TPU "auto" tries the implementations after the kernels first for a
    decode-shaped request (T * G < H: the kernels' relayout would copy the whole
    cache): xla, or blockwise where xla cannot serve (soft-cap); the kernels keep
    a chunked prefill over the cache, and serve when nothing after them can."""
    cache = M.positions(np.zeros((1, 1), np.int32), np.arange(1024, dtype=np.int32)[None])
    r = AttentionRequest(q_shape=(1, 1, 8, 128), k_shape=(1, 1024, 2, 128), dtype="bfloat16",
                         backend="tpu", mask=cache, has_bias=False, softcap=None,
                         offsets=False, return_lse=False)
    assert select_implementation(r) == "xla"
    assert select_implementation(r, "pallas") == "pallas"  # deferring is no refusal
    assert select_implementation(AttentionRequest(**{**r.__dict__, "softcap": 30.0})) \
        == "blockwise"
    for change in ({"q_shape": (1, 512, 8, 128)}, {"backend": "gpu", "mask": M.causal() & cache}):
        assert select_implementation(AttentionRequest(**{**r.__dict__, **change})) == "pallas", \
            change
    import tfjax.ops.attention as attention_lib
    # nothing after the kernels that can serve: they do
    monkeypatch.setattr(attention_lib, "AUTO_ORDER", {**attention_lib.AUTO_ORDER,
                                                      "tpu": ("pallas", "xla")})
    assert select_implementation(AttentionRequest(**{**r.__dict__, "softcap": 30.0})) \
        == "pallas"


def test_two_runs_bitwise_equal():
    q, k, v, _ = inputs(1, 200, 200, 4, 2, 32)
    f = jax.jit(jax.grad(lambda q, k, v: flash_attention(q, k, v, M.causal(),
                                                         block_sizes=BS).sum(), (0, 1, 2)))
    for x, y in zip(f(q, k, v), f(q, k, v)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_dispatch():
    q, k, v, _ = inputs(1, 16, 16, 4, 2, 16)
    out = jax.jit(lambda q, k, v: dot_product_attention(q, k, v, M.causal(),
                                                        implementation="pallas"))(q, k, v)
    want = dot_product_attention(q, k, v, M.causal(), implementation="reference")
    np.testing.assert_allclose(out, want, atol=1e-5)

    class Custom(M.Mask):  # a mask kind the kernels do not know
        pass

    r = AttentionRequest(q_shape=(1, 8, 4, 16), k_shape=(1, 8, 2, 16), dtype="float32",
                         backend="tpu", mask=Custom(), has_bias=False, softcap=None,
                         offsets=False, return_lse=False)
    with pytest.raises(ValueError, match="cannot evaluate a Custom mask"):
        select_implementation(r, "pallas")
    assert select_implementation(r) != "pallas"  # auto falls through, it never guesses
    r_ok = AttentionRequest(**{**r.__dict__, "mask": M.causal()})
    assert select_implementation(r_ok) == "pallas"
    # GPU: cuDNN for a plain causal bf16 request, pallas as soon as cuDNN cannot serve it
    gpu = AttentionRequest(**{**r_ok.__dict__, "backend": "gpu", "dtype": "bfloat16"})
    assert select_implementation(gpu) == "cudnn"
    for change in ({"softcap": 30.0}, {"mask": M.sliding_window(8)}, {"return_lse": True},
                   {"offsets": True}, {"dtype": "float32"}):
        assert select_implementation(AttentionRequest(**{**gpu.__dict__, **change})) == "pallas"
    with pytest.raises(ValueError, match="no logit soft-cap"):
        select_implementation(AttentionRequest(**{**gpu.__dict__, "softcap": 30.0}), "cudnn")


def test_gradients_through_a_model_equal_the_reference():
    D, N, K, H, T = 32, 4, 2, 8, 50
    keys = jax.random.split(jax.random.key(3), 5)
    params = {"wq": jax.random.normal(keys[0], (D, N, H)) * 0.2,
              "wk": jax.random.normal(keys[1], (D, K, H)) * 0.2,
              "wv": jax.random.normal(keys[2], (D, K, H)) * 0.2,
              "wo": jax.random.normal(keys[3], (N, H, D)) * 0.2}
    x = jax.random.normal(keys[4], (2, T, D))

    def loss(params, impl):
        q = jnp.einsum("BTD,DNH->BTNH", x, params["wq"])
        k = jnp.einsum("BTD,DKH->BTKH", x, params["wk"])
        v = jnp.einsum("BTD,DKH->BTKH", x, params["wv"])
        o = dot_product_attention(q, k, v, M.causal(), implementation=impl)
        return jnp.mean(jnp.einsum("BTNH,NHD->BTD", o, params["wo"]) ** 2)

    want = jax.jit(jax.grad(loss), static_argnums=1)(params, "reference")
    got = jax.jit(jax.grad(loss), static_argnums=1)(params, "pallas")
    for name in params:
        np.testing.assert_allclose(got[name], want[name], atol=1e-5, rtol=1e-4, err_msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("mask_name,H", [("causal", 256), ("window", 64), ("segments", 256),
                                         ("window&segments", 64)])
def test_sweep_masks_by_head_dim(mask_name, H):
    q, k, v, bias = inputs(1, 130, 260, 8, 1, H, bias=(1, 1))
    check_against_reference(flash_attention, q, k, v, make_mask(mask_name, 1, 130, 260), bias,
                            softcap=10.0, block_sizes=BS)


def test_in_kernel_random_block_hash_is_bit_identical_to_the_mask():
    """BigBird's random blocks are drawn in the kernels with int32-only arithmetic;
    it must give the draws of masks.RandomBlocks (uint32 hash) exactly."""
    from tfjax.ops.pallas.common import _draw_random_block

    qb = jnp.arange(0, 5000, 7, dtype=jnp.int32)
    for seed, num_blocks in ((0, 1), (7, 13), (2**31 + 5, 1000), (2**32 - 1, 2**20 + 7)):
        m = M.RandomBlocks(3, 16, num_blocks, seed)
        for r in range(3):
            np.testing.assert_array_equal(_draw_random_block(seed, qb, r, num_blocks),
                                          m._draw(qb, r))
