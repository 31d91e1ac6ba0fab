"""The five-axis mesh from config: sizes, -1 fill, and errors that name the fix."""

import jax
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
