"""Blockwise attention (`tfjax.ops.blockwise`) beyond the shared suite: its compiled
activation memory is O(T) forward and backward, as production compiles it. Against
the reference (every mask kind, GQA, fully masked rows, the B = 1 direct path,
bf16): test_implementations.py; its ring block: tests/parallel."""

import jax
import jax.numpy as jnp
import pytest

from tfjax.ops import blockwise_attention
from tfjax.ops import masks as M


def _temp_bytes(T, grad):
    q = jax.ShapeDtypeStruct((1, T, 4, 64), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, T, 4, 64), jnp.float32)
    f = lambda q, k, v: blockwise_attention(q, k, v, M.causal(), block_q=256, block_kv=256)
    if grad:
        f = jax.grad(lambda q, k, v, f=f: f(q, k, v).sum(), (0, 1, 2))
    return jax.jit(f).lower(q, kv, kv).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.xla_optimized  # compiled memory, as production compiles it
@pytest.mark.parametrize("grad", [False, True], ids=["forward", "backward"])
def test_activation_memory_is_linear_in_T(grad):
    # the marker's fixture (tests/conftest.py) really turns XLA's optimisations on
    assert not jax.config.values["jax_disable_most_optimizations"]
    small, large = _temp_bytes(1024, grad), _temp_bytes(4096, grad)
    assert large < 6 * small, (small, large)  # O(T*S) would be 16x
