"""Ulysses attention on simulated CPU devices: forward and gradients against the
single-device reference for every mask kind at global positions, GQA with fewer kv heads
than devices, ALiBi / T5 positions, sinks and the implementations it runs per device;
the compiled program's all-to-alls (and no all-gather of K/V); the one-line errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_ring_attention import (MASKS, SINKS, _alibi, _inputs, _mesh, _out_and_grads, _rb,
                                 _relative, mesh2x4)  # noqa: F401 - the fixture

from tfjax.ops import masks
from tfjax.ops.reference import attention_reference
from tfjax.parallel.mask_leaves import split_kv_heads
from tfjax.parallel.ulysses import ulysses_attention, usp_attention

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


def test_usp_bad_arguments(mesh2x4):
    q, k, v, _ = _inputs()
    with pytest.raises(ValueError, match=r"^usp_attention: ulysses_size=3 must divide the 4 "
                                         r"devices of 'sequence'"):
        usp_attention(q, k, v, mesh=mesh2x4, ulysses_size=3)
    with pytest.raises(ValueError, match=r"^usp_attention: the 6 query heads do not divide over "
                                         r"the 4 Ulysses devices .*ulysses_size to a divisor"):
        usp_attention(q[:, :, :6], k, v, mesh=mesh2x4, ulysses_size=4)
