"""AOT compilation for several TPU slices (`--compile_only --topology ... --num_slices
N`, `tfjax.train.aot`): per-chip memory, the collectives that cross slices, and the
one-line errors for slices that do not fit."""

import io

import pytest

from tiny_setup import tiny_config
from tfjax.train import aot


def tiny(batch, **mesh):
    return tiny_config(train=dict(batch_size=batch, microbatches=1), mesh=mesh).validate()


@pytest.mark.slow
def test_data_parallel_across_slices_is_one_slice_with_the_batch_divided():
    """dcn_data=2 over two v5p:2x2x1 slices with a global batch of 16 gives each chip
    what one slice with batch 8 gives it: the same parameters, optimizer state and
    inputs (state plus its 2 rows); the gradients cross slices as all-reduces of at
    least each chip's quarter of them (reduced within the slice first), nothing else
    does, and one slice alone has no DCN traffic. Temporaries grow by the buffers XLA
    adds around the cross-slice transfers (bounded here at a quarter)."""
    pytest.importorskip("libtpu")
    figures, dcn = {}, {}
    for slices, cfg in ((1, tiny(8, data=4)), (2, tiny(16, data=4, dcn_data=2))):
        compiled, p, mesh, _ = aot.compile_step(cfg, "v5p:2x2x1", num_slices=slices)
        assert dict(mesh.shape)["data"] == 4 * slices
        figures[slices] = aot.step_figures(compiled, p)
        dcn[slices] = aot.dcn_collectives(compiled, mesh, cfg)
    one, two = figures[1], figures[2]
    for k in ("params", "opt", "arguments"):
        assert one[k] == two[k], (k, one, two)
    assert one["temp"] <= two["temp"] <= 1.25 * one["temp"], (one, two)
    assert dcn[1] == {} and list(dcn[2]) == ["all-reduce"], dcn
    assert dcn[2]["all-reduce"][1] >= one["params"] / 4, (dcn, one)


@pytest.mark.slow
def test_fsdp_across_slices_gathers_parameters_over_dcn():
    """dcn_fsdp=2: the parameters are sharded over both slices, so each chip holds an
    eighth of them and gathers the rest across slices (the CLI prints it)."""
    pytest.importorskip("libtpu")
    out = io.StringIO()
    cfg = tiny(16, data=1, fsdp=4, dcn_fsdp=2)
    assert aot.compile_only(cfg, "v5p:2x2x1", out=out, num_slices=2) == 0
    text = out.getvalue()
    assert "compiled train step for 2 slices of v5p:2x2x1" in text, text
    assert "'fsdp': 8" in text and "2 slices of 4 chips, dcn_data=1 x dcn_fsdp=2" in text, text
    line = next(x for x in text.splitlines() if "across slices (DCN)" in x)
    assert "all-gather" in line and "all-reduce" in line, text


@pytest.mark.parametrize("mesh,slices,message", [
    (dict(data=4, dcn_data=2), 1, r"mesh.dcn_data: dcn_data=2 x dcn_fsdp=1 makes 2 slice"),
    (dict(data=-1), 2, r"devices form 2; set the dcn_\* sizes so their product is 2"),
    (dict(data=8, dcn_data=2), 2, r"mesh: data=8 makes 8 devices but there are 4 per slice"),
])
def test_slices_that_do_not_fit_the_mesh_are_one_line(mesh, slices, message):
    pytest.importorskip("libtpu")
    with pytest.raises(ValueError, match=message):
        aot.compile_step(tiny(16, **mesh), "v5p:2x2x1", num_slices=slices)


def test_num_slices_needs_tpu_slices():
    with pytest.raises(ValueError, match="--num_slices 2: several slices are TPU slices; "
                                         "--topology h200:8 is one host of GPUs"):
        aot.topology_devices("h200:8", 2)
    with pytest.raises(ValueError, match="--num_slices: must be >= 1, got 0"):
        aot.topology_devices("v5p:2x2x1", 0)
    with pytest.raises(ValueError, match="--num_slices: needs --topology"):
        aot.compile_step(tiny(8), None, num_slices=2)
