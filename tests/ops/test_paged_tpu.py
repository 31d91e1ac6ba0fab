"""The Pallas TPU paged attention kernel (`tfjax.ops.pallas.paged_tpu`, interpret mode
here; real Mosaic compilation in test_paged_tpu_aot.py): its blocks of pages and
query tiles, its logsumexp and gradients against the reference on the gathered
pages, the live pages it walks, empty calls, and what it refuses (with the reason)."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paged_cases import PagedCase, build, paged_request

from tfjax.ops import attention_reference, dot_product_attention
from tfjax.ops import masks as M
from tfjax.ops.paged import Paged
from tfjax.ops.pallas import paged_tpu
from tfjax.ops.pallas.paged_tpu import live_pages, paged_attention_tpu

# a ring under a window (row 1 wraps within the step, row 3 empty), 5 pages of 4
RING = PagedCase("ring", T=3, heads=(8, 2), H=8, page=4, n=5, old=(45, 19, 2, 0),
                 new=(3, 3, 3, 0), window=9, softcap=5.0)
# global pages of 3 shared by rows 0 and 1, a chunk of 40 tokens: 160 query rows per
# kv head (G = 4), two row tiles of 128
LONG = PagedCase("long-chunk", T=40, heads=(8, 2), H=16, page=3, n=20, old=(9, 12, 0),
                 new=(40, 25, 0), share=3)


def _reference(c, q, k_dense, v_dense, mask, sinks=None):
    return attention_reference(q, k_dense, v_dense, mask, softcap=c.softcap, sinks=sinks,
                               return_lse=True)


@pytest.mark.parametrize("c,pages_per_block,block_rows", [
    (RING, 1, 256), (RING, 3, 256), (RING, 5, 256), (LONG, 4, 128)],
    ids=["ring-1-page-blocks", "ring-3-page-blocks-last-short", "ring-all-pages", "long-row-tiles"])
def test_blocks_of_pages_and_row_tiles_equal_the_reference(c, pages_per_block, block_rows):
    """Out and logsumexp (-inf for rows that see nothing) whatever the pages per DMA
    block (one, a block the table's 5 pages do not fill, all) and the query tiles."""
    q, k, v, mask, k_dense, v_dense, _ = build(c)[:7]
    out, lse = jax.jit(lambda q, k, v, mask: paged_attention_tpu(
        q, k, v, mask, softcap=c.softcap, return_lse=True, pages_per_block=pages_per_block,
        block_rows=block_rows, interpret=True))(q, k, v, mask)
    want, want_lse = _reference(c, q, k_dense, v_dense, mask)
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(want_lse))
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(want_lse)[finite], atol=2e-5)
    assert np.isinf(want_lse).any() and finite.any()  # both kinds of rows occur


def test_gradients_are_the_references_on_the_gathered_pages():
    """Through the dispatch with sinks: d q, d pools (shared pages take both rows'
    gradients) and d sinks equal the reference's through `Paged.dense`."""
    c = PagedCase("grad", T=2, heads=(4, 2), H=8, page=3, n=4, old=(6, 7, 0), new=(2, 1, 0),
                  share=2, sinks=True, softcap=7.0)
    q, k, v, mask, _, _, sinks = build(c)[:7]

    def loss(impl, q, k_pool, v_pool, sinks):
        kp, vp = Paged(k_pool, k.table), Paged(v_pool, v.table)
        if impl == "reference":
            kp, vp = kp.dense(), vp.dense()
        out = dot_product_attention(q, kp, vp, mask, softcap=c.softcap, sinks=sinks,
                                    implementation=impl)
        return jnp.sum(out * jnp.cos(out))

    grads = {impl: jax.jit(jax.grad(loss, (1, 2, 3, 4)), static_argnums=0)(
        impl, q, k.pool, v.pool, sinks) for impl in ("paged_tpu", "reference")}
    for name, got, want in zip(("dq", "dk_pool", "dv_pool", "dsinks"), grads["paged_tpu"],
                               grads["reference"]):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4, err_msg=name)
    assert np.abs(grads["reference"][1][k.table[0, 0]]).sum() > 0  # a shared page's


def test_bfloat16_pages_and_queries():
    c = dataclasses.replace(RING, dtype="bfloat16", sinks=True)
    q, k, v, mask, k_dense, v_dense, sinks = build(c)[:7]
    out = jax.jit(lambda q, k, v, mask, s: dot_product_attention(
        q, k, v, mask, softcap=c.softcap, sinks=s, implementation="paged_tpu"))(
        q, k, v, mask, sinks)
    want = _reference(c, q, k_dense, v_dense, mask, sinks)[0]
    assert out.dtype == jnp.bfloat16
    err = np.linalg.norm(np.asarray(out, np.float32) - np.asarray(want, np.float32))
    assert err / np.linalg.norm(np.asarray(want, np.float32)) < 2e-2


def test_live_pages_come_first_and_the_rest_is_masked():
    """Row 0: a ring (window 2) whose queries see pages 0 and 2 only (positions 8, 9 and
    6, 7); row 1: the first 1.5 pages of a global cache; row 2: no query position
    (nothing live). Page ids past the pool are clipped into it."""
    table = jnp.array([[7, 8, 9], [4, 5, 99], [1, 2, 3]], jnp.int32)
    kv = jnp.array([[8, 9, 4, 5, 6, 7], [0, 1, 2, -1, -1, -1], [0, 1, 2, 3, 4, 5]], jnp.int32)
    q = jnp.array([[8, 9], [1, 2], [-1, -1]], jnp.int32)
    pages, positions, count = live_pages(table, q, kv, page=2, window=2, num_pages=50, slots=4)
    np.testing.assert_array_equal(count, [2, 2, 0])
    np.testing.assert_array_equal(pages[0, :2], [7, 9])  # table order: pages 0 then 2
    np.testing.assert_array_equal(pages[1, :2], [4, 5])
    assert (pages >= 0).all() and (pages < 50).all()
    np.testing.assert_array_equal(positions[0, :2], [[8, 9], [6, 7]])
    np.testing.assert_array_equal(positions[:, 2:], -1)  # past the live pages
    np.testing.assert_array_equal(positions[2], -1)
    np.testing.assert_array_equal(positions[1, 1], [2, -1])
    # a page id past the pool is clipped into it: the copies never read outside it
    q_late = jnp.array([[9, 9], [5, 5], [0, 0]], jnp.int32)
    pages, _, count = live_pages(table.at[0, 2].set(99), q_late, kv, page=2, window=0,
                                 num_pages=50, slots=3)
    np.testing.assert_array_equal(count, [3, 2, 1])
    np.testing.assert_array_equal(pages[0], [7, 8, 49])


def test_empty_calls_return_zeros_and_no_key():
    """No query tokens, or no pages in the table: zeros, logsumexp -inf, no kernel."""
    pool = jnp.ones((4, 2, 1, 8))
    k = Paged(pool, jnp.zeros((2, 3), jnp.int32))
    q = jnp.ones((2, 0, 2, 8))
    out, lse = paged_attention_tpu(q, k, k, M.positions(jnp.zeros((2, 0), jnp.int32),
                                                        jnp.zeros((2, 6), jnp.int32)),
                                   return_lse=True, interpret=True)
    assert out.shape == (2, 0, 2, 8) and lse.shape == (2, 2, 0)
    k0 = Paged(pool, jnp.zeros((2, 0), jnp.int32))
    q = jnp.ones((2, 3, 2, 8))
    out, lse = paged_attention_tpu(q, k0, k0, M.positions(jnp.zeros((2, 3), jnp.int32),
                                                          jnp.zeros((2, 0), jnp.int32)),
                                   return_lse=True, interpret=True)
    assert (np.asarray(out) == 0).all() and np.isneginf(np.asarray(lse)).all()


def test_what_it_refuses_and_why():
    """Explicitly asked for a call it cannot serve, the dispatch raises with the
    kernel's reason; `auto` passes it over. Bad arguments raise before tracing."""
    q, k, v, mask, k_dense, v_dense, _ = build(RING)[:7]
    req = paged_request(RING, mask, "tpu")
    assert paged_tpu.supports(req) is None
    reasons = {
        "arrays": dataclasses.replace(req, paged=False),
        "GPU": dataclasses.replace(req, backend="gpu"),
        "Positions mask.*got a Causal mask": dataclasses.replace(req, mask=M.causal()),
        "Positions mask.*got no mask": dataclasses.replace(req, mask=None),
        "no additive bias": dataclasses.replace(req, has_bias=True),
        "ALiBi": dataclasses.replace(req, has_alibi=True),
        "float32/bfloat16/float16": dataclasses.replace(req, dtype="float64"),
    }
    for match, r in reasons.items():
        reason = paged_tpu.supports(r)
        assert reason is not None and re.search(match, reason), (match, reason)
    with pytest.raises(ValueError, match="paged_tpu.*reads K/V from pages"):
        dot_product_attention(q, k_dense, v_dense, mask, implementation="paged_tpu")
    with pytest.raises(ValueError, match="paged_tpu.*no additive bias"):
        dot_product_attention(q, k, v, mask, bias=jnp.zeros((1, 1, RING.T, RING.S)),
                              implementation="paged_tpu")
    with pytest.raises(ValueError, match="pages_per_block must be a positive int"):
        paged_attention_tpu(q, k, v, mask, pages_per_block=0)
    with pytest.raises(ValueError, match="block_rows must be a positive multiple of 128"):
        paged_attention_tpu(q, k, v, mask, block_rows=100)
    with pytest.raises(TypeError, match="mask must be the cache's"):
        paged_attention_tpu(q, k, v, M.causal())
    with pytest.raises(TypeError, match="k and v must be tfjax.ops.paged.Paged"):
        paged_attention_tpu(q, k_dense, v, mask)
    with pytest.raises(ValueError, match="share pages and table"):
        paged_attention_tpu(q, k, Paged(v.pool, v.table[:, :2]), mask)
    with pytest.raises(ValueError, match="page table has 2 rows, q 4"):
        paged_attention_tpu(q, Paged(k.pool, k.table[:2]), Paged(v.pool, v.table[:2]), mask)
    with pytest.raises(ValueError, match=r"positions must be \[B, T\]"):
        paged_attention_tpu(q, k, v, M.positions(mask.q_positions, mask.kv_positions[:, :5]))


def test_default_pages_per_block_fills_128_keys_within_the_buffer_budget():
    def paged(P, page, K, H, n, dtype=jnp.bfloat16):
        return Paged(jax.ShapeDtypeStruct((P, page, K, H), dtype),
                     jax.ShapeDtypeStruct((2, n), jnp.int32))

    assert paged_tpu.default_pages_per_block(paged(8, 16, 2, 128, 64), paged(8, 16, 2, 128, 64)) == 8
    assert paged_tpu.default_pages_per_block(paged(8, 16, 2, 128, 3), paged(8, 16, 2, 128, 3)) == 3
    assert paged_tpu.default_pages_per_block(paged(8, 256, 2, 128, 9), paged(8, 256, 2, 128, 9)) == 1
    # 64 kv heads of 256 lanes: 8 pages of 16 would be 16 MiB; 4 MiB holds 2
    big = paged(8, 16, 64, 256, 64)
    assert paged_tpu.default_pages_per_block(big, big) == 2
