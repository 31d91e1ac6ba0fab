"""Shared by the layer tests: a module's output and its exact gradients in one jit."""

from __future__ import annotations

import jax
from flax import nnx


def run_module(module, x, cotangent):
    """(y, d/dparams as a nested dict, d/dx) for loss = sum(y * cotangent), one jit."""
    graphdef, params = nnx.split(module, nnx.Param)

    @jax.jit
    def run(params, x, cotangent):
        y, vjp = jax.vjp(lambda p, x: nnx.merge(graphdef, p)(x), params, x)
        return (y, *vjp(cotangent))

    y, g_params, g_x = run(params, x, cotangent)
    return y, g_params.to_pure_dict(), g_x
