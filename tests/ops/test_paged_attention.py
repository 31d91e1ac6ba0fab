"""Paged attention in the one dispatch: `dot_product_attention(q, Paged k, Paged v,
Positions mask)` with every implementation of the table that serves it here (those
that read pages get them, the others the gathered arrays) equals the reference on the
logical arrays the pages stand for (`paged_cases.build`: the step's keys written at
`flat_index`, the arrays computed independently in numpy): GQA (N/K = 1, 2, 4), MQA
with a value head dim of its own (MLA's absorbed shape), a sliding window over a ring
of pages (positions wrapping, also within the step), learned sinks, soft-cap, ragged
rows (an empty one, a full one, padding queries), page sizes that divide nothing,
page tables sharing pages between rows, decode (T = 1) and chunks (T > 1). Each
(implementation, case) compiles once. Kernel specifics: test_paged_tpu.py; "paged"
(plain JAX, CPU's first for paged calls): its refusals, no mask, offsets, below."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paged_cases import PagedCase, build, paged_request, slot_positions

from tfjax.ops import IMPLEMENTATIONS, attention_reference, dot_product_attention
from tfjax.ops import masks as M
from tfjax.ops import paged as paged_lib
from tfjax.ops.paged import Paged
from tfjax.ops import select_implementation
from tfjax.ops.target import target_platform

CASES = (
    # rows 0 and 1 share a two-page prefix; row 2 is empty (nothing cached, no new
    # token: fully masked), row 1 ends full; pages of 5 slots, 7 per row
    PagedCase("decode-gqa2-global-shared-ragged", T=1, heads=(4, 2), H=16, page=5, n=7,
              old=(12, 34, 0, 20), new=(1, 1, 0, 1), share=2),
    # a ring of 5 pages of 4 under a window of 9: row 0 long wrapped, row 1 wraps
    # within the step, row 3 is empty
    PagedCase("chunk-gqa4-ring-window-softcap", T=3, heads=(8, 2), H=8, page=4, n=5,
              old=(45, 19, 2, 0), new=(3, 3, 3, 0), window=9, softcap=5.0),
    # multi-head (G = 1), the chunk ending row 0 full, padding queries in row 1
    PagedCase("chunk-mha-sinks-full", T=4, heads=(3, 3), H=12, page=6, n=4,
              old=(20, 5, 0), new=(4, 2, 4), sinks=True),
    # MLA's absorbed shape: one kv head, q/k of rope + latent dims, v of the latent's
    PagedCase("decode-mqa-hv-of-its-own-shared", T=1, heads=(4, 1), H=24, Hv=16, page=3,
              n=9, old=(26, 9, 0), new=(1, 1, 0), share=3),
    # a chunk longer than a page (pages of 3), softcap and sinks together
    PagedCase("chunk-gqa2-long-chunk-softcap-sinks", T=7, heads=(6, 3), H=16, page=3, n=6,
              old=(11, 0, 4), new=(7, 5, 0), softcap=20.0, sinks=True),
)
TOL = 2e-5


def _params():
    return [pytest.param(name, c, id=f"{name}-{c.name}")
            for name in IMPLEMENTATIONS.names() for c in CASES]


@pytest.mark.parametrize("name,c", _params())
def test_paged_equals_the_reference_on_the_arrays_the_pages_hold(name, c):
    q, k, v, mask, k_dense, v_dense, sinks = build(c)[:7]
    reason = IMPLEMENTATIONS.get(name).supports(paged_request(c, mask, target_platform()))
    if reason:
        pytest.skip(f"{name}: {reason}")

    @jax.jit
    def attend(q, k, v, mask, sinks):
        return dot_product_attention(q, k, v, mask, softcap=c.softcap, sinks=sinks,
                                     implementation=name)

    got = attend(q, k, v, mask, sinks)
    want = attention_reference(q, k_dense, v_dense, mask, softcap=c.softcap, sinks=sinks)
    assert got.shape == want.shape == (c.B, c.T, c.heads[0], c.Hv or c.H)
    np.testing.assert_allclose(got, want, atol=TOL, rtol=TOL)
    # a row that sees nothing (no cached or new token) is zeros
    empty = [b for b in range(c.B) if c.old[b] + c.new[b] == 0]
    assert all((np.asarray(got[b]) == 0).all() for b in empty)


@pytest.mark.parametrize("c", CASES, ids=[c.name for c in CASES])
def test_the_pages_hold_what_the_numpy_writes_say(c):
    """`flat_index` and `write` put the step's keys where pages and offsets by hand do
    (every page, those of no row and the padding tokens' untouched), and `Paged.dense`
    gathers the rows' slots in order: the arrays compared with above are what the
    cache holds. A latent pool (`[P, page, D]`, MLA's) is written the same way."""
    built = build(c)
    np.testing.assert_array_equal(built.k.pool, built.k_pool)
    np.testing.assert_array_equal(built.v.pool, built.v_pool)
    np.testing.assert_array_equal(built.k.dense(), built.k_dense)
    np.testing.assert_array_equal(built.v.dense(), built.v_dense)
    assert built.k.shape == (c.B, c.S, c.heads[1], c.H) and built.v.shape[-1] == (c.Hv or c.H)
    P, page, K, H = built.k_pool.shape
    latent = paged_lib.write(jnp.asarray(built.k_before.reshape(P, page, K * H)), built.index,
                             jnp.asarray(built.k_new.reshape(c.B, c.T, K * H)))
    np.testing.assert_array_equal(latent, built.k_pool.reshape(P, page, K * H))


def test_auto_reads_pages_on_tpu_and_cpu_and_gathers_them_elsewhere():
    """"auto": on TPU the paged kernel serves a paged call under the cache's Positions
    mask; any other mask (or arrays) goes to the gathering order ("pallas" first); on
    CPU "paged" reads the pages (any mask), and a call with a bias, or arrays, goes to
    the usual order; on GPU the pages are gathered for the usual order."""
    c = CASES[1]
    mask = build(c)[3]
    tpu = paged_request(c, mask, "tpu")
    assert select_implementation(tpu) == "paged_tpu"
    assert select_implementation(dataclasses.replace(tpu, mask=M.causal())) == "pallas"
    assert select_implementation(dataclasses.replace(tpu, paged=False)) == "pallas"
    cpu = dataclasses.replace(tpu, backend="cpu")
    assert select_implementation(cpu) == "paged"
    assert select_implementation(dataclasses.replace(cpu, mask=M.causal())) == "paged"
    assert select_implementation(dataclasses.replace(cpu, has_bias=True)) == "blockwise"
    assert select_implementation(dataclasses.replace(cpu, paged=False)) == "blockwise"
    gpu = dataclasses.replace(tpu, backend="gpu", dtype="bfloat16")
    assert select_implementation(gpu) == "pallas"


def test_what_paged_refuses_and_why():
    """"paged" serves paged calls only, without a bias or ALiBi; each refusal says so."""
    c = CASES[0]
    request = paged_request(c, build(c)[3], "cpu")
    assert paged_lib.supports(request) is None
    assert "this call's k and v are arrays" in paged_lib.supports(
        dataclasses.replace(request, paged=False))
    for field in ("has_bias", "has_alibi"):
        assert "no additive bias, ALiBi" in paged_lib.supports(
            dataclasses.replace(request, **{field: True}))
    assert "[P, page, K, H] pages" in paged_lib.supports(
        dataclasses.replace(request, k_shape=request.k_shape[:3]))
    q, k, v, mask = build(c)[:4]
    with pytest.raises(ValueError, match="implementation='paged' cannot serve this call: "
                                         "reads K/V from pages"):
        dot_product_attention(q, k.dense(), v.dense(), mask, implementation="paged")


def test_paged_without_a_mask_and_with_offsets_equals_the_reference():
    """No mask: every slot of every row's pages is seen (the gathered arrays' whole
    attention); a mask's offsets move the pages' positions as the gathered arrays'."""
    c = CASES[2]
    q, k, v, _, k_dense, v_dense = build(c)[:6]
    got = jax.jit(lambda q, k, v: dot_product_attention(q, k, v, implementation="paged"))(q, k, v)
    np.testing.assert_allclose(got, attention_reference(q, k_dense, v_dense), atol=TOL, rtol=TOL)
    mask = M.causal()
    attend = jax.jit(lambda q, k, v: dot_product_attention(
        q, k, v, mask, q_offset=c.S - c.T - 2, implementation="paged", return_lse=True))
    want = attention_reference(q, k_dense, v_dense, mask, q_offset=c.S - c.T - 2,
                               return_lse=True)
    for g, w in zip(attend(q, k, v), want):
        np.testing.assert_allclose(g, w, atol=TOL, rtol=TOL)


def test_paged_and_array_k_v_do_not_mix():
    q, k, v, mask, k_dense, _, _ = build(CASES[0])[:7]
    with pytest.raises(TypeError, match="k and v must both be tfjax.ops.paged.Paged"):
        dot_product_attention(q, k, k_dense[..., :16], mask)


@pytest.mark.parametrize("name", ["paged", "paged_tpu"])
@pytest.mark.parametrize("c", [CASES[1], CASES[4]], ids=[CASES[1].name, CASES[4].name])
def test_runs_of_one_sequence_equal_the_rows_they_come_from(c, name):
    """The engine's ragged step: every query its own row (a table row and, as the
    engine labels them, the slot positions after its own token), rows 0 and 1's
    queries as two runs of T (`Paged.runs`: their pages read once), the other rows'
    queries single; the real queries' outputs and lse equal the reference's on the rows
    they come from (GQA, a ring under a window, soft-cap, sinks; "paged" on the dense
    mask, "paged_tpu" through `paged.by_runs`)."""
    q, k, v, mask, k_dense, v_dense, sinks = build(c)[:7]
    B, T = c.B, c.T
    flat = lambda x: x.reshape(B * T, 1, *x.shape[2:])  # noqa: E731
    table = jnp.repeat(k.table, T, axis=0)
    old, new = np.asarray(c.old), np.asarray(c.new)
    own = (old[:, None] + np.arange(T) + (np.arange(T) < new[:, None])).reshape(-1)
    ragged = M.positions(flat(mask.q_positions), slot_positions(own, c.S), window=mask.window)

    @jax.jit
    def attend(q, k_pool, v_pool, mask, sinks):
        return dot_product_attention(
            q, Paged(k_pool, table, runs=(2, T)), Paged(v_pool, table, runs=(2, T)), mask,
            softcap=c.softcap, sinks=sinks, implementation=name, return_lse=True)

    out, lse = attend(flat(q), k.pool, v.pool, ragged, sinks)
    want, want_lse = attention_reference(q, k_dense, v_dense, mask, softcap=c.softcap,
                                         sinks=sinks, return_lse=True)
    real = np.arange(T)[None, :] < new[:, None]  # [B, T]
    np.testing.assert_allclose(np.asarray(out).reshape(want.shape)[real], np.asarray(want)[real],
                               atol=TOL, rtol=TOL)
    lse = np.swapaxes(np.asarray(lse)[..., 0].reshape(B, T, -1), 1, 2)  # [B, N, T]
    np.testing.assert_allclose(np.moveaxis(lse, 2, 1)[real],
                               np.moveaxis(np.asarray(want_lse), 2, 1)[real], atol=TOL, rtol=TOL)
    with pytest.raises(ValueError, match=r"runs \(2, 3\) need one query a row"):
        dot_product_attention(q, Paged(k.pool, k.table, runs=(2, 3)), v, mask,
                              implementation="paged")
