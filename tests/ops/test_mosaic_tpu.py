"""The Mosaic TPU kernels (`tfjax.ops.pallas.mosaic_tpu`) beyond the shared suite:
under the TPU-semantics interpreter (`pltpu.InterpretParams`: memory spaces,
DMAs, semaphores), T5's table row across two 128-lane pieces. Real Mosaic
compiles: test_mosaic_tpu_aot.py; against the reference: test_implementations.py."""

import jax
import jax.numpy as jnp
import numpy as np
from attention_cases import check_against_reference, inputs
from jax.experimental.pallas import tpu as pltpu

from tfjax.ops import masks as M
from tfjax.ops.pallas import BlockSizes, flash_attention

BS = BlockSizes(block_q=64, block_kv=128, block_q_dq=64, block_kv_dq=128, block_q_dkv=128,
                block_kv_dkv=128)


def test_tpu_semantics_interpreter_small_case():
    """pltpu.InterpretParams() simulates TPU memory spaces, DMAs and semaphores."""
    q, k, v, _ = inputs(1, 40, 136, 2, 1, 32)
    mask = M.causal() & M.segments(np.array([[0] * 20 + [1] * 20]),
                                   np.array([[0] * 60 + [1] * 76]))
    check_against_reference(flash_attention, q, k, v, mask, q_offset=96, softcap=10.0,
                            block_sizes=BlockSizes(16, 128, 16, 128, 128, 128),
                            interpret=pltpu.InterpretParams())


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


def test_the_packed_tile_table_holds_columns_and_codes_and_sizes_its_scalar_memory():
    """One int32 table (`column | code << 16`) stands for `order` and `code`; its bytes
    (`table_bytes`) decide whether the kernels fit a core's 1 MiB of scalar memory: a
    128k causal call does (it did not with two tables), 256k goes to another
    implementation with the reason."""
    from tfjax.ops.implementation import AttentionRequest
    from tfjax.ops.pallas import mosaic_tpu, supports
    from tfjax.ops.tiles import tile_tables

    tab = tile_tables(M.causal(), 300, 520, 64, 128, q_offset=220)
    packed = mosaic_tpu._packed(tab)
    assert packed.dtype == jnp.int32
    np.testing.assert_array_equal(mosaic_tpu._column(packed), tab.order)
    np.testing.assert_array_equal(mosaic_tpu._code(packed), tab.code)
    assert len(set(np.asarray(tab.code).ravel().tolist())) > 1  # FULL and PARTIAL tiles
    T, S, qt = 300, 520, lambda block: mosaic_tpu._query_tile(block, 300)  # noqa: E731
    grids = ((qt(BS.block_q), BS.block_kv, False), (qt(BS.block_q_dq), BS.block_kv_dq, False),
             (qt(BS.block_q_dkv), BS.block_kv_dkv, True))  # dk/dv: transposed
    tables = [tile_tables(M.causal(), T, S, bq, bk, transpose=tr) for bq, bk, tr in grids]
    assert mosaic_tpu.table_bytes(T, S, block_sizes=BS) == max(
        mosaic_tpu._packed(t).nbytes + t.count.nbytes for t in tables)

    def request(T):
        return AttentionRequest(q_shape=(1, T, 8, 128), k_shape=(1, T, 8, 128),
                                dtype="bfloat16", backend="tpu", mask=M.causal(),
                                has_bias=False, softcap=None, offsets=False, return_lse=False)

    assert supports(request(131072)) is None
    reason = supports(request(262144))
    assert "2052 KiB" in reason and "1 MiB of scalar memory" in reason
