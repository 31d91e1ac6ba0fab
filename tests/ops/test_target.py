"""What the ops trace for (`tfjax.ops.target`): the target platform, the per-device
runner, and the GPU facts of `gpu_lowering_target`."""

import jax
import pytest

from tfjax.ops import target


def test_targeting_sets_the_platform_and_runner_until_it_exits(monkeypatch):
    """Nothing active: jax's default backend (asked at each call) and no runner.
    Each `targeting` replaces both until it exits, innermost first."""
    assert target.target_platform() == jax.default_backend()
    assert target.per_device() is None
    runner = lambda *a, **kw: None
    with target.targeting("tpu", per_device=runner):
        assert (target.target_platform(), target.per_device()) == ("tpu", runner)
        with target.targeting("gpu"):
            assert (target.target_platform(), target.per_device()) == ("gpu", None)
        with target.targeting(None):  # None: the default backend
            monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
            assert target.target_platform() == "gpu"
            monkeypatch.undo()
        assert (target.target_platform(), target.per_device()) == ("tpu", runner)
    assert target.target_platform() == jax.default_backend()
    assert target.per_device() is None


def test_the_target_decides_the_dispatch():
    """`dot_product_attention` asks the target platform, not the machine: its
    request carries the active targeting's platform."""
    import tfjax.ops.attention as attention_lib

    seen = []
    real = attention_lib.select_implementation

    def spy(request, implementation="auto"):
        seen.append(request.backend)
        return real(request, implementation)

    q = jax.numpy.ones((1, 4, 2, 8))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(attention_lib, "select_implementation", spy)
        attention_lib.dot_product_attention(q, q, q, implementation="reference")
        with target.targeting("tpu"):
            attention_lib.dot_product_attention(q, q, q, implementation="reference")
    assert seen == [jax.default_backend(), "tpu"]


def test_device_platform_names_gpus_gpu():
    class Device:
        def __init__(self, platform):
            self.platform = platform

    assert [target.device_platform(Device(p)) for p in ("cuda", "rocm", "tpu", "cpu")] == \
        ["gpu", "gpu", "tpu", "cpu"]


def test_gpu_facts_follow_the_lowering_target():
    """The SMs and the Hopper question are those of the GPU lowered for, innermost
    target first; an unknown GPU is refused with the known ones."""
    assert not target.is_hopper()  # this machine has no GPU
    with target.gpu_lowering_target("H200"):
        assert target.is_hopper() and target.sm_count() == 132
        with target.gpu_lowering_target("A100"):
            assert not target.is_hopper() and target.sm_count() == 108
        assert target.is_hopper()
    assert not target.is_hopper()
    assert target.GPU_COMPUTE_CAPABILITY["B200"] == 100 and target.GPU_SMS["B200"] == 148
    with pytest.raises(ValueError, match=r"unknown gpu 'V100'; pass one of \['A100', 'B200'"):
        with target.gpu_lowering_target("V100"):
            pass


def test_sm_count_follows_the_lowering_target():
    """The SMs `auto_kv_splits` fills are those of the GPU lowered for."""
    from tfjax.ops.target import gpu_lowering_target, sm_count

    with gpu_lowering_target("A100"):
        assert sm_count() == 108
        with gpu_lowering_target("B200"):
            assert sm_count() == 148
        assert sm_count() == 108


def test_the_traced_mesh_names_the_target():
    """Without a `targeting`, the mesh being traced under names the platform (a
    shard_map over a TPU topology's devices on this CPU host), then an input's
    sharding; nothing named: None, and `target_platform` is the default backend."""
    from jax.sharding import AbstractDevice, AbstractMesh, NamedSharding, PartitionSpec

    tpu = AbstractMesh((2,), ("data",), abstract_device=AbstractDevice(
        device_kind="TPU v5 lite", num_cores=1, platform="tpu"))
    assert target.traced_platform() is None
    assert target.target_platform() == jax.default_backend()
    with jax.sharding.use_abstract_mesh(tpu):
        assert target.traced_platform() == target.target_platform() == "tpu"
        with target.targeting("gpu"):  # an explicit targeting comes first
            assert target.traced_platform() == "gpu"
    seen = []
    x = jax.ShapeDtypeStruct((4,), jax.numpy.float32,
                             sharding=NamedSharding(jax.make_mesh((1,), ("data",)),
                                                    PartitionSpec()))
    jax.jit(lambda x: seen.append((target.traced_platform(), target.traced_platform(x)))
            or x).trace(x)
    assert seen == [(None, jax.default_backend())]
