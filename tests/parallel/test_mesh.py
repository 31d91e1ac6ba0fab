"""The five-axis mesh from config: sizes, -1 fill, slices (DCN), and errors that name the fix."""

import jax
import numpy as np
import pytest

from tfjax import config as C
from tfjax.parallel.mesh import MESH_AXES, cpu_device_count, make_mesh, mesh_shape, use_cpu_cores


def mesh_cfg(**axes):
    return C.from_dict(C.MeshConfig, axes, prefix="mesh")


def test_fill_and_axes():
    assert mesh_shape(mesh_cfg(), 8) == (8, 1, 1, 1, 1)
    assert mesh_shape(mesh_cfg(data=-1, fsdp=2, tensor=2), 8) == (2, 2, 1, 2, 1)
    assert mesh_shape(mesh_cfg(data=4, sequence=-1), 8) == (4, 1, 2, 1, 1)
    mesh = make_mesh(mesh_cfg(data=2, fsdp=2, tensor=2))
    assert mesh.axis_names == MESH_AXES
    assert dict(mesh.shape) == dict(data=2, fsdp=2, sequence=1, tensor=2, expert=1)
    assert mesh.devices.size == len(jax.devices()) == 8
    one = make_mesh(mesh_cfg(data=1), devices=jax.devices()[:1])
    assert one.devices.size == 1


@pytest.mark.parametrize("axes,n,message", [
    (dict(data=3), 8, "mesh: data=3 makes 3 devices but there are 8"),
    (dict(data=-1, fsdp=3), 8, "mesh.data: cannot fill the rest"),
    (dict(data=4, fsdp=4), 8, "makes 16 devices but there are 8"),
])
def test_bad_sizes(axes, n, message):
    with pytest.raises(ValueError, match=message):
        mesh_shape(mesh_cfg(**axes), n)


@pytest.mark.parametrize("mesh,message", [
    (dict(data=-1, fsdp=-1), "mesh.fsdp: only one mesh axis may be -1"),
    (dict(tensor=0), "mesh.tensor: must be >= 1, or -1"),
    (dict(rules=(("batch", "data"), ("batch", "fsdp"))), r"mesh.rules\[1\]: logical axis 'batch' appears twice"),
    (dict(rules=(("batch", "dta"),)), r"mesh.rules\[0\]: unknown mesh axis 'dta'"),
])
def test_config_validation(mesh, message):
    with pytest.raises(ValueError, match=message):
        C.run_config({"mesh": mesh})  # the mesh section, validated with the whole run


def test_command_line_style_override():
    cfg = C.default_config()
    cfg.mesh.data = 4
    cfg.mesh.fsdp = 2
    rc = C.from_dict(C.RunConfig, cfg)
    assert mesh_shape(rc.mesh, 8) == (4, 2, 1, 1, 1)


def test_cpu_device_count_gives_each_core_a_device_that_divides_the_batch():
    data = C.MeshConfig()  # data=-1, every other axis 1
    assert cpu_device_count(data, rows=16, cores=2) == 2
    assert cpu_device_count(data, rows=12, cores=8) == 6   # the largest divisor <= cores
    assert cpu_device_count(data, rows=3, cores=2) == 1
    assert cpu_device_count(data, rows=1, cores=4) == 1
    assert cpu_device_count(C.MeshConfig(fsdp=2), rows=16, cores=2) == 1  # sizes named: untouched
    assert cpu_device_count(C.MeshConfig(data=2), rows=16, cores=2) == 1


def test_use_cpu_cores_keeps_a_count_already_chosen():
    # the suite's XLA_FLAGS set 8 devices (conftest), and the backend is running
    assert use_cpu_cores(C.MeshConfig(), 16) is None
    assert len(jax.devices()) == 8


def test_slices_multiply_the_named_axes():
    """dcn_* sizes multiply the same named axis: data = dcn_data * data within a slice,
    and -1 fills a slice's devices, not all of them."""
    assert mesh_shape(mesh_cfg(data=-1, dcn_data=2), 8, 2) == (8, 1, 1, 1, 1)
    assert mesh_shape(mesh_cfg(data=1, fsdp=-1, dcn_fsdp=2), 8, 2) == (1, 8, 1, 1, 1)
    assert mesh_shape(mesh_cfg(data=2, fsdp=2, dcn_data=2, dcn_fsdp=2), 16, 4) == (4, 4, 1, 1, 1)
    assert mesh_shape(mesh_cfg(data=1, tensor=-1, dcn_data=3), 6, 3) == (3, 1, 1, 2, 1)


@pytest.mark.parametrize("axes,n,slices,message", [
    (dict(dcn_data=2), 8, 1, r"mesh.dcn_data: dcn_data=2 x dcn_fsdp=1 makes 2 slice\(s\) but "
                             r"the devices form 1; leave mesh.dcn_data and mesh.dcn_fsdp at 1"),
    (dict(), 8, 2, r"makes 1 slice\(s\) but the devices form 2; .*--config.mesh.dcn_data=2"),
    (dict(dcn_data=2, dcn_fsdp=2), 8, 2, r"makes 4 slice\(s\) but the devices form 2"),
    (dict(dcn_data=2), 9, 2, "9 devices do not split into 2 equal slices"),
    (dict(data=8, dcn_data=2), 8, 2, r"data=8 makes 8 devices but there are 4 per slice \(2 "),
    (dict(data=-1, fsdp=3, dcn_data=2), 8, 2, "mesh.data: cannot fill the rest: .* the 4 "
                                              "devices per slice"),
])
def test_bad_slice_sizes(axes, n, slices, message):
    with pytest.raises(ValueError, match=message):
        mesh_shape(mesh_cfg(**axes), n, slices)


@pytest.mark.parametrize("mesh,message", [
    (dict(dcn_data=0), r"mesh.dcn_data: must be >= 1 \(the slices mesh axis 'data' spans"),
    (dict(dcn_fsdp=-1), "mesh.dcn_fsdp: must be >= 1"),
])
def test_slice_config_validation(mesh, message):
    with pytest.raises(ValueError, match=message):
        C.run_config({"mesh": mesh})


def test_one_cpu_process_is_one_slice():
    """On CPU a process stands for a slice: one process cannot span two."""
    with pytest.raises(ValueError, match="form 1; .*on CPU: one process per slice"):
        make_mesh(mesh_cfg(data=-1, dcn_data=2))


def _tpu_slices(topology, n):
    pytest.importorskip("libtpu")
    from tfjax.train.aot import tpu_devices

    return tpu_devices(topology, n)[0]


def test_tpu_slices_are_contiguous_blocks_of_each_axis():
    """Across TPU slices (libtpu's devices of 2 slices of v5p:2x2x1), the DCN part of
    each axis is outermost: the first half of `data` (dcn_data) or of `fsdp` (dcn_fsdp)
    is slice 0, and a slice's devices are 4 distinct chips of that slice."""
    devices = _tpu_slices("v5p:2x2x1", 2)
    mesh = make_mesh(mesh_cfg(data=4, dcn_data=2), devices)
    assert dict(mesh.shape)["data"] == 8
    slices = np.vectorize(lambda d: d.slice_index)(mesh.devices)
    assert slices.reshape(-1).tolist() == [0] * 4 + [1] * 4
    mesh = make_mesh(mesh_cfg(data=2, fsdp=2, dcn_fsdp=2), devices)
    slices = np.vectorize(lambda d: d.slice_index)(mesh.devices)[:, :, 0, 0, 0]
    assert slices.tolist() == [[0, 0, 1, 1], [0, 0, 1, 1]]
    assert len({d.id for d in mesh.devices.flat}) == 8
    with pytest.raises(ValueError, match=r"makes 1 slice\(s\) but the devices form 2"):
        make_mesh(mesh_cfg(data=-1), devices)  # dcn_* left at 1 on two slices
