"""Logical names -> NamedShardings through the rules table (parameters and activations)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from tfjax import config as C
from tfjax.parallel.mesh import make_mesh
from tfjax.parallel.rules import logical_rules, spec_for, tree_shardings
from tfjax.parallel.sharding import logical_to_spec, shard, use_rules

RULES = logical_rules(C.DEFAULT_RULES)


def mesh(**axes):
    return make_mesh(C.from_dict(C.MeshConfig, axes, prefix="mesh"))


def test_default_rules_fsdp_tensor_sequence():
    assert logical_to_spec(("embed", "mlp"), RULES) == P("fsdp", "tensor")
    assert logical_to_spec(("layers", "embed", "heads", "head_dim"), RULES) == P(None, "fsdp", "tensor", None)
    # activations: batch takes data+fsdp(+expert), so embed is not split again
    assert logical_to_spec(("batch", "length", "embed"), RULES) == P(("data", "fsdp", "expert"), "sequence", None)
    assert logical_to_spec(("batch", "length", "heads", "head_dim"), RULES) == P(("data", "fsdp", "expert"), "sequence", "tensor", None)


def test_spec_checks_names_and_divisibility():
    m = mesh(data=2, fsdp=2, tensor=2)
    notes = []
    assert spec_for("w", ("embed", "kv_heads"), (64, 1), m, RULES, notes) == P("fsdp", None)
    assert "kv_heads=1" in notes[0] and "replicated" in notes[0]
    with pytest.raises(ValueError, match=r"mesh.rules: w has logical axis 'experts_typo'"):
        spec_for("w", ("embed", "experts_typo"), (64, 4), m, RULES)


class Lin(nnx.Module):
    def __init__(self, rngs):
        self.w = nnx.Param(jnp.ones((16, 8)), out_sharding=("embed", "mlp"))
        self.b = nnx.Param(jnp.zeros((8,)), out_sharding=("mlp",))
        self.s = nnx.Param(jnp.ones((16,)))  # unannotated: replicated


def test_tree_shardings_create_sharded():
    m = mesh(data=2, fsdp=2, tensor=2)
    with nnx.use_eager_sharding(False):
        abstract = nnx.eval_shape(lambda: Lin(nnx.Rngs(0)))
    _, state = nnx.split(abstract)
    sh = tree_shardings(state, m, RULES)
    assert sh["w"].get_value().spec == P("fsdp", "tensor")
    assert sh["b"].get_value().spec == P("tensor")
    assert sh["s"].get_value().spec == P()

    def create():
        with nnx.use_eager_sharding(False):
            return nnx.split(Lin(nnx.Rngs(0)))[1]

    made = jax.jit(create, out_shardings=sh)()
    w = made["w"].get_value()
    assert w.sharding.spec == P("fsdp", "tensor")
    assert w.addressable_shards[0].data.shape == (8, 4)


def test_shard_constraint_under_rules():
    m = mesh(data=4, sequence=2)
    x = jnp.arange(8 * 4 * 6, dtype=jnp.float32).reshape(8, 4, 6)
    assert shard(x, ("batch", "length", "embed")) is x  # no active mesh: no-op

    @jax.jit
    def f(x):
        with use_rules(m, RULES):
            return shard(x * 2, ("batch", "length", "embed"))

    y = f(x)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x) * 2)
    assert y.sharding.spec == P(("data", "fsdp", "expert"), "sequence", None) or \
        y.sharding.shard_shape(y.shape) == (2, 2, 6)


def test_use_rules_targets_the_mesh_platform_with_a_per_device_runner():
    """`use_rules` enters `tfjax.ops.target.targeting` with its mesh's platform (a
    GPU mesh compiled on a CPU host is "gpu") and the runner of unpartitionable
    implementations over this mesh and the axes its rules give "batch" and "heads";
    on exit the previous target is back."""
    import types

    from tfjax.ops import target

    m = mesh(data=2, fsdp=2, tensor=2)
    rules = [("batch", ("data", "fsdp")), ("heads", "tensor")]
    with use_rules(m, rules):
        assert target.target_platform() == "cpu"
        run = target.per_device()
        assert run.keywords == {"mesh": m, "batch_axes": ("data", "fsdp"), "head_axes": "tensor"}
        fake = types.SimpleNamespace(devices=np.array([types.SimpleNamespace(platform="cuda")]))
        with use_rules(fake, rules):
            assert target.target_platform() == "gpu"
        assert target.target_platform() == "cpu" and target.per_device() is run
    assert target.target_platform() == jax.default_backend() and target.per_device() is None
    with target.targeting("tpu"), use_rules(None, rules):  # no mesh: no platform, no runner
        assert target.target_platform() == jax.default_backend()
        assert target.per_device() is None
