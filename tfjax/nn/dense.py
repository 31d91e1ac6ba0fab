"""`dense(x, kernel)`: `x [..., I] @ kernel [I, O] -> [..., O]` with a kernel gradient
laid out for XLA:CPU's fast matmul: the backward transposes the smaller of x and the
output gradient itself, so both operands of `dW` are row-major (the same sum, in
another order). `linear_dot_general`, `FeedForward`'s `nnx.Linear(dot_general=...)`,
uses it when the traced program targets a CPU and is `lax.dot_general` elsewhere (a
`custom_vjp` hides its matmul from remat policies). Measured in
experiments/results/bench_train_cpu.md. See docs/layers.md.
"""

from __future__ import annotations

import jax
from jax import lax

from tfjax.ops.target import target_platform
from tfjax.typing import Array, Float

__all__ = ["dense", "linear_dot_general"]


def _forward(x, kernel):
    return lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))


@jax.custom_vjp
def dense(x: Float[Array, "... I"], kernel: Float[Array, "I O"]) -> Float[Array, "... O"]:
    """`x [..., I] @ kernel [I, O]` in x's leading axes (both of one dtype)."""
    return _forward(x, kernel)


def _dense_fwd(x, kernel):
    return _forward(x, kernel), (x, kernel)


def _kernel_grad(x, g):
    """x^T g over the leading axes, from row-major operands (the smaller one transposed)."""
    x2, g2 = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])  # [M, I], [M, O]
    if x2.shape[1] <= g2.shape[1]:
        return lax.optimization_barrier(x2.T) @ g2  # [I, M] @ [M, O]
    return lax.optimization_barrier(lax.optimization_barrier(g2.T) @ x2).T  # ([O, M] @ [M, I])^T


def _dense_bwd(res, g):
    x, kernel = res
    dx = lax.dot_general(g, kernel, (((g.ndim - 1,), (1,)), ((), ())))
    return dx, _kernel_grad(x, g).astype(kernel.dtype)


dense.defvjp(_dense_fwd, _dense_bwd)


def linear_dot_general(lhs, rhs, dimension_numbers, precision=None,
                       preferred_element_type=None, out_sharding=None):
    """`nnx.Linear(dot_general=linear_dot_general)`: `dense` for the layer's own
    contraction (last axis of the input with the kernel's first, default precision)
    in a program that targets a CPU; any other call is `lax.dot_general`'s."""
    plain = (dimension_numbers == (((lhs.ndim - 1,), (0,)), ((), ())) and rhs.ndim == 2
             and precision is None and preferred_element_type is None and out_sharding is None)
    if plain and target_platform(lhs) == "cpu":
        return dense(lhs, rhs)
    return lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                           preferred_element_type=preferred_element_type, out_sharding=out_sharding)
