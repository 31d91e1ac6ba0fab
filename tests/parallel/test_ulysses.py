"""Ulysses and USP attention on simulated CPU devices: forward and gradients against the
single-device reference for every mask kind at global positions, GQA with fewer kv heads
than devices, ALiBi / T5 positions, sinks and the implementations it runs per device;
USP on zig-zag ordered data; the compiled programs' all-to-alls (and no all-gather of
K/V); the one-line errors."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_ring_attention import (MASKS, SINKS, _alibi, _inputs, _mesh, _out_and_grads, _rb,
                                 _relative, _segment_ids, mesh2x4)  # noqa: F401 - the fixture

from tfjax.ops import masks
from tfjax.ops.reference import attention_reference
from tfjax.parallel.mask_leaves import split_kv_heads
from tfjax.parallel.ulysses import ulysses_attention, usp_attention
from tfjax.parallel.zigzag import unzigzag, zigzag

ALL_MASKS = {**MASKS, "chunked": lambda: masks.chunked_causal(12),
             "window_segments": lambda: masks.sliding_window(9) & MASKS["segments"]()}


def _check(attention, mask, *, kv_heads=2, Hv=16, alibi=None, relative=None, sinks=None,
           **reference):
    """`attention(q, k, v, mask, relative_bias=, sinks=, **alibi)` against the reference
    (`reference`: its scale / softcap): out, dq, dk, dv (T5's dtable, the sinks'
    gradient); returns the jitted call with its gradients and its arguments."""
    q, k, v, ct = _inputs(kv_heads=kv_heads, Hv=Hv)
    alibi = alibi or {}
    table = None if relative is None else relative["table"]

    def run(q, k, v, t, s):
        return attention(q, k, v, mask, relative_bias=_rb(relative, t), sinks=s, **alibi)

    args = (q, k, v, table, sinks, ct)
    fn = jax.jit(lambda *a: _out_and_grads(run, *a))
    got = fn(*args)
    want = jax.jit(lambda *a: _out_and_grads(
        lambda q, k, v, t, s: attention_reference(q, k, v, mask, relative_bias=_rb(relative, t),
                                                  sinks=s, **alibi, **reference), *a))(*args)
    np.testing.assert_allclose(got[0], want[0], atol=1e-5, rtol=1e-5)
    for name, g, w in zip(["q", "k", "v", "table", "sinks"], got[1:], want[1:]):
        if w is not None:
            np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-4, err_msg=f"d{name}")
    return fn, args


def _compare(mesh, mask=None, *, kv_heads=2, Hv=16, alibi=None, relative=None, sinks=None,
             batch_axes="data", **kwargs):
    """ulysses_attention (`kwargs`: its own) against the reference."""
    reference = {n: kwargs[n] for n in ("scale", "softcap") if n in kwargs}
    return _check(lambda q, k, v, m, **kw: ulysses_attention(
        q, k, v, m, mesh=mesh, batch_axes=batch_axes, **kw, **kwargs), mask, kv_heads=kv_heads,
        Hv=Hv, alibi=alibi, relative=relative, sinks=sinks, **reference)


@pytest.mark.parametrize("mask_name", sorted(ALL_MASKS))
def test_every_mask_kind_matches_the_reference(mesh2x4, mask_name):
    """Each device attends the whole sequence for its heads: causal, windows, chunks,
    prefixes and packed documents (segment ids gathered) at their natural positions."""
    _compare(mesh2x4, ALL_MASKS[mask_name]())


@pytest.mark.parametrize("kv_heads", [1, 2, 4, 8])
def test_gqa_repeats_kv_heads_only_as_needed(mesh2x4, kv_heads):
    """8 query heads over 4 devices: 1 or 2 kv heads are repeated (to 4), 4 and 8
    split as they are; the result is the reference's either way."""
    k = jnp.zeros((1, 4, kv_heads, 2))
    assert split_kv_heads(k, k, 4)[0].shape[2] == {1: 4, 2: 4, 4: 4, 8: 8}[kv_heads]
    _compare(mesh2x4, masks.causal(), kv_heads=kv_heads)


def test_positions_biases_sinks_and_value_head_dim(mesh2x4):
    """ALiBi and T5's bias at packed positions (per-token, gathered), their per-head
    slopes / table and the sinks sliced to each device's heads (the table's and the
    sinks' gradients summed over the devices), a value head dim unlike q's, softcap."""
    _compare(mesh2x4, MASKS["segments_causal"](), alibi=_alibi(True),
             relative=_relative(True), sinks=SINKS, Hv=8, softcap=2.0, scale=1.0)
    _compare(mesh2x4, masks.causal(), alibi=_alibi(False, per_example=True))


@pytest.mark.parametrize("implementation", ["xla", "blockwise", "pallas"])
def test_it_runs_the_layers_implementation(mesh2x4, implementation):
    _compare(mesh2x4, MASKS["segments_causal"](), implementation=implementation)


def test_sequence_only_mesh_and_replicated_batch():
    _compare(_mesh((4,), ("sequence",)), masks.causal(), batch_axes=())


@pytest.mark.xla_optimized  # compiled HLO
def test_hlo_moves_kv_by_all_to_all_never_all_gather(mesh2x4):
    """Forward and backward: q, k, v and the output move by all-to-alls; nothing is
    all-gathered without a per-token mask leaf, and with packed documents only the
    int32 segment ids are."""
    fn, args = _compare(mesh2x4, masks.causal())
    hlo = fn.lower(*args).compile().as_text()
    assert hlo.count("all-to-all") >= 4 and "all-gather" not in hlo
    assert "collective-permute" not in hlo
    fn, args = _compare(mesh2x4, MASKS["segments_causal"]())
    gathers = [line for line in fn.lower(*args).compile().as_text().splitlines()
               if " all-gather(" in line or "all-gather-start(" in line]
    assert gathers and all("s32[" in line and "f32[" not in line for line in gathers), gathers


def test_bad_arguments(mesh2x4):
    q, k, v, _ = _inputs()
    with pytest.raises(ValueError, match=r"^ulysses_attention: the 6 query heads do not divide "
                                         r"over the 4 Ulysses devices .*set mesh.sequence to a "
                                         r"divisor of 6, or use model.attention.context_parallel"
                                         r"='ring' or 'usp'$"):
        ulysses_attention(q[:, :, :6], k, v, mesh=mesh2x4)
    with pytest.raises(ValueError, match=r"T=62 and S=62 must be divisible by the 4 devices"):
        ulysses_attention(q[:, :62], k[:, :62], v[:, :62], mesh=mesh2x4)
    with pytest.raises(ValueError, match=r"^ulysses_attention: batch_axes .* include the "
                                         r"sequence axis"):
        ulysses_attention(q, k, v, mesh=mesh2x4, batch_axes=("data", "sequence"))
    with pytest.raises(ValueError, match=r"^ulysses_attention \(per device, the whole sequence "
                                         r"for 2 heads\): "):
        jax.jit(lambda q, k, v: ulysses_attention(q, k, v, mesh=mesh2x4,
                                                  implementation="cudnn"))(q, k, v)


# --------------------------------------------------------------------------- #
# USP: Ulysses inside groups, the ring across them.
# --------------------------------------------------------------------------- #


def _compare_usp(mesh, mask, *, ulysses_size, load_balance="zigzag", batch_axes="data",
                 **check):
    """usp_attention against the reference (`check`: `_check`'s)."""
    return _check(lambda q, k, v, m, **kw: usp_attention(
        q, k, v, m, mesh=mesh, ulysses_size=ulysses_size, batch_axes=batch_axes,
        load_balance=load_balance, block_q=8, block_kv=8, **kw), mask, **check)


@pytest.mark.parametrize("mask_name,load_balance", [
    ("causal", "zigzag"), ("segments_causal", "zigzag"), ("window", "none"),
    ("prefix_lm", "zigzag"), ("chunked", "none")])
def test_usp_matches_the_reference(mesh2x4, mask_name, load_balance):
    """sequence=4 as 2 ring groups x 2 Ulysses devices; 2 kv heads over 2: as they are."""
    _compare_usp(mesh2x4, ALL_MASKS[mask_name](), ulysses_size=2, load_balance=load_balance)


def test_usp_heads_and_biases_split_over_the_groups(mesh2x4):
    """1 kv head repeated to 2; ALiBi's slopes, T5's table and the sinks split by head
    over the Ulysses devices (their gradients gathered back), packed positions."""
    _compare_usp(mesh2x4, MASKS["segments_causal"](), ulysses_size=2, kv_heads=1, Hv=8,
                 alibi=_alibi(True), relative=_relative(True), sinks=SINKS)


@pytest.mark.parametrize("ulysses_size", [1, 4])
def test_usp_ends_are_the_ring_and_ulysses(mesh2x4, ulysses_size):
    _compare_usp(mesh2x4, masks.causal(), ulysses_size=ulysses_size)


@pytest.mark.xla_optimized  # compiled HLO
def test_usp_hlo_has_all_to_all_and_the_ring(mesh2x4):
    """From q, k, v split over the sequence as a layer holds them: all-to-alls inside
    the Ulysses groups (forward and backward), the ring's collective-permutes across
    them, and no all-gather of K/V."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    q, k, v, ct = _inputs()
    split = NamedSharding(mesh2x4, P("data", "sequence"))

    def usp(q, k, v):
        return usp_attention(q, k, v, masks.causal(), mesh=mesh2x4, ulysses_size=2,
                             batch_axes="data", block_q=8, block_kv=8)

    fn = jax.jit(lambda *a: _out_and_grads(usp, *a), in_shardings=(split,) * 4,
                 out_shardings=(split,) * 4)
    hlo = fn.lower(q, k, v, ct).compile().as_text()
    assert "all-to-all" in hlo and "collective-permute" in hlo
    gathers = [line for line in hlo.splitlines() if " all-gather(" in line]
    assert not gathers, gathers


@pytest.mark.parametrize("ulysses_size", [1, 2, 4])
def test_usp_zigzag_ordered_inputs(mesh2x4, ulysses_size):
    """natural_order=False: q, k, v, the segment ids and the packed positions in zig-zag
    order over the 4 devices (the trainer's order); inside each group the all-to-all
    leaves the second halves' chunks in reverse member order, which USP undoes before
    the ring: out and gradients, unzigzagged, equal the reference. With ALiBi and T5 at
    the packed positions, the sinks, 1 kv head (repeated to 2 and 4); 1 group (u=4),
    2 or 4 (u=1: the ring alone)."""
    q, k, v, ct = _inputs(kv_heads=1)
    zz = lambda x: zigzag(x, 4, axis=1)
    ids, alibi, rel = _segment_ids(), _alibi(True), _relative(True)
    alibi_zz = dict(alibi, alibi_positions=tuple(map(zz, alibi["alibi_positions"])))
    rel_zz = dict(rel, q_positions=zz(rel["q_positions"]), kv_positions=zz(rel["kv_positions"]))

    def usp(q, k, v, t, s):
        return usp_attention(q, k, v, masks.segments(zz(ids)) & masks.causal(), mesh=mesh2x4,
                             ulysses_size=ulysses_size, batch_axes="data", natural_order=False,
                             block_q=8, block_kv=8, relative_bias=_rb(rel_zz, t), sinks=s,
                             **alibi_zz)

    got = jax.jit(lambda *a: _out_and_grads(usp, *a))(zz(q), zz(k), zz(v), rel["table"], SINKS,
                                                      zz(ct))
    want = _out_and_grads(lambda q, k, v, t, s: attention_reference(
        q, k, v, masks.segments(ids) & masks.causal(), relative_bias=_rb(rel, t), sinks=s,
        **alibi), q, k, v, rel["table"], SINKS, ct)
    for name, g, w in zip(["out", "dq", "dk", "dv"], got, want):
        np.testing.assert_allclose(unzigzag(g, 4, axis=1), w, atol=1e-4, rtol=1e-4,
                                   err_msg=name)
    for name, g, w in zip(["dtable", "dsinks"], got[4:], want[4:]):
        np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-4, err_msg=name)


def _collectives(hlo: str, kind: str) -> list[str]:
    """The compiled program's `kind` instructions (sync or async start)."""
    return [line for line in hlo.splitlines()
            if f" {kind}(" in line or f" {kind}-start(" in line]


@pytest.mark.xla_optimized  # compiled HLO
def test_usp_moves_heads_by_its_own_all_to_alls(mesh2x4):
    """The reshard into the Ulysses groups is USP's own: the program's all-to-alls are
    exactly the 8 of its shard_map (q, k, v and the output forward, their cotangents
    backward), each inside a group of 2 consecutive devices, none inserted by XLA's
    partitioner; no all-gather (no per-token mask leaf: none of anything). Every
    collective-permute moves between the groups, member r to member r (the ring, and
    with natural-order data the re-layout of each group's span to zig-zag and back);
    zig-zag ordered data (natural_order=False) needs the ring's alone."""
    q, k, v, ct = _inputs()
    permutes = {}
    for natural_order in (True, False):
        def usp(q, k, v):
            return usp_attention(q, k, v, masks.causal(), mesh=mesh2x4, ulysses_size=2,
                                 batch_axes="data", natural_order=natural_order, block_q=8,
                                 block_kv=8)

        hlo = jax.jit(lambda *a: _out_and_grads(usp, *a)).lower(q, k, v, ct).compile().as_text()
        a2a = _collectives(hlo, "all-to-all")
        assert len(a2a) == 8, a2a
        assert all("shard_map/all_to_all" in line and "replica_groups={{0,1},{2,3},{4,5},{6,7}}"
                   in line for line in a2a), a2a
        assert not _collectives(hlo, "all-gather")
        permutes[natural_order] = _collectives(hlo, "collective-permute")
        for line in permutes[natural_order]:  # devices 4 d + 2 group + member
            pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", line).group(1)
            for a, b in re.findall(r"(\d+),(\d+)", pairs):
                assert int(a) // 4 == int(b) // 4 and int(a) % 2 == int(b) % 2, line
    assert 0 < len(permutes[False]) < len(permutes[True])


def test_usp_bad_arguments(mesh2x4):
    q, k, v, _ = _inputs()
    with pytest.raises(ValueError, match=r"^usp_attention: ulysses_size=3 must divide the 4 "
                                         r"devices of 'sequence'"):
        usp_attention(q, k, v, mesh=mesh2x4, ulysses_size=3)
    with pytest.raises(ValueError, match=r"^usp_attention: the 6 query heads do not divide over "
                                         r"the 4 Ulysses devices .*ulysses_size to a divisor"):
        usp_attention(q[:, :, :6], k, v, mesh=mesh2x4, ulysses_size=4)
    with pytest.raises(ValueError, match=r"^usp_attention: load_balance='zigzag' needs T == S"):
        usp_attention(q, k[:, :32], v[:, :32], mesh=mesh2x4, ulysses_size=2)
    with pytest.raises(ValueError, match=r"^usp_attention: T=36 and S=36 must be divisible by 8 "
                                         r"\(4 devices on 'sequence' x 2 chunks\); or pass "
                                         r"load_balance='none'"):
        usp_attention(q[:, :36], k[:, :36], v[:, :36], mesh=mesh2x4, ulysses_size=2)
    with pytest.raises(ValueError, match=r"^usp_attention: load_balance must be"):
        usp_attention(q, k, v, mesh=mesh2x4, ulysses_size=2, load_balance="striped")
