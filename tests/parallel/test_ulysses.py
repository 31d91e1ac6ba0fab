"""Ulysses attention on simulated CPU devices: forward and gradients against the
single-device reference for every mask kind at global positions, GQA with fewer kv heads
than devices, ALiBi / T5 positions, sinks and the implementations it runs per device;
the compiled program's all-to-alls (and no all-gather of K/V); the one-line errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from test_ring_attention import MASKS, SINKS, _alibi, _inputs, _out_and_grads, _rb, _relative

from tfjax.ops import masks
from tfjax.ops.reference import attention_reference
from tfjax.parallel.ulysses import ulysses_attention, ulysses_kv_repeats

ALL_MASKS = {**MASKS, "chunked": lambda: masks.chunked_causal(12),
             "window_segments": lambda: masks.sliding_window(9) & MASKS["segments"]()}


def _mesh(shape, names):
    n = int(np.prod(shape))
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names),
                         devices=jax.devices()[:n])


@pytest.fixture(scope="module")
def mesh2x4():
    return _mesh((2, 4), ("data", "sequence"))


def _compare(mesh, mask=None, *, kv_heads=2, Hv=16, alibi=None, relative=None, sinks=None,
             batch_axes="data", **kwargs):
    """ulysses_attention against the reference: out, dq, dk, dv (T5's dtable, the sinks'
    gradient); returns the jitted Ulysses call and its arguments."""
    q, k, v, ct = _inputs(kv_heads=kv_heads, Hv=Hv)
    alibi = alibi or {}
    table = None if relative is None else relative["table"]

    def ulysses(q, k, v, t, s):
        return ulysses_attention(q, k, v, mask, mesh=mesh, batch_axes=batch_axes,
                                 relative_bias=_rb(relative, t), sinks=s, **alibi, **kwargs)

    args = (q, k, v, table, sinks, ct)
    got = jax.jit(lambda *a: _out_and_grads(ulysses, *a))(*args)
    want = jax.jit(lambda *a: _out_and_grads(
        lambda q, k, v, t, s: attention_reference(
            q, k, v, mask, relative_bias=_rb(relative, t), sinks=s, **alibi,
            **{n: kwargs[n] for n in ("scale", "softcap") if n in kwargs}),
        *a))(*args)
    np.testing.assert_allclose(got[0], want[0], atol=1e-5, rtol=1e-5)
    for name, g, w in zip(["q", "k", "v", "table", "sinks"], got[1:], want[1:]):
        if w is not None:
            np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-4, err_msg=f"d{name}")
    return jax.jit(lambda *a: _out_and_grads(ulysses, *a)), args


@pytest.mark.parametrize("mask_name", sorted(ALL_MASKS))
def test_every_mask_kind_matches_the_reference(mesh2x4, mask_name):
    """Each device attends the whole sequence for its heads: causal, windows, chunks,
    prefixes and packed documents (segment ids gathered) at their natural positions."""
    _compare(mesh2x4, ALL_MASKS[mask_name]())


@pytest.mark.parametrize("kv_heads", [1, 2, 4, 8])
def test_gqa_repeats_kv_heads_only_as_needed(mesh2x4, kv_heads):
    """8 query heads over 4 devices: 1 or 2 kv heads are repeated (to 4), 4 and 8
    split as they are; the result is the reference's either way."""
    assert ulysses_kv_repeats(8, kv_heads, 4) == {1: 4, 2: 2, 4: 1, 8: 1}[kv_heads]
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
                                         r"over the 4 devices .*set mesh.sequence to a divisor "
                                         r"of 6, or use model.attention.context_parallel='ring'"):
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
