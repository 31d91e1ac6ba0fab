"""The zig-zag layout (`tfjax.parallel.zigzag`): the global reorder, its in-shard_map
form on each device's halves, and the `zigzag_data` trace context."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from tfjax.parallel.mask_leaves import shard_map
from tfjax.parallel.zigzag import (relayout_local, unzigzag, zigzag, zigzag_data,
                                   zigzag_data_devices, zigzag_order)


def test_zigzag_roundtrip_and_layout():
    x = jnp.arange(2 * 16).reshape(2, 16)
    z = zigzag(x, 4, axis=1)
    # 8 chunks of 2; device i (a contiguous quarter) holds chunks i and 7 - i.
    np.testing.assert_array_equal(z[0].reshape(4, 2, 2)[1], [[2, 3], [12, 13]])
    np.testing.assert_array_equal(unzigzag(z, 4, axis=1), x)
    np.testing.assert_array_equal(zigzag_order(4), [0, 7, 1, 6, 2, 5, 3, 4])


def test_relayout_local_moves_the_halves_like_the_global_reorder():
    # Inside shard_map over 4 devices, natural -> zig-zag on the local halves gives
    # each device its quarter of `zigzag(x)`, and zig-zag -> natural undoes it.
    n = 4
    mesh = jax.make_mesh((n,), ("sequence",), axis_types=(AxisType.Auto,),
                         devices=jax.devices()[:n])
    x = jnp.arange(2 * 32 * 3, dtype=jnp.float32).reshape(2, 32, 3)

    def moved(src, dst):
        f = lambda y: relayout_local(y, n, "sequence", src, dst)
        return shard_map(f, mesh=mesh, in_specs=P(None, "sequence"),
                         out_specs=P(None, "sequence"))

    z = jax.jit(moved("natural", "zigzag"))(x)
    np.testing.assert_array_equal(z, zigzag(x, n, axis=1))
    np.testing.assert_array_equal(jax.jit(moved("zigzag", "natural"))(z), x)


def test_zigzag_data_is_a_nested_trace_context():
    assert zigzag_data_devices() == 0
    with zigzag_data(4):
        assert zigzag_data_devices() == 4
        with zigzag_data(2):
            assert zigzag_data_devices() == 2
        assert zigzag_data_devices() == 4
    assert zigzag_data_devices() == 0
