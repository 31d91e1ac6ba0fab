"""Position-wise feed-forward block, plain `wo(act(wi(x)))` or gated
`wo(act(wi_gate(x)) * wi_up(x))` (ReGLU, GEGLU, SwiGLU; Shazeer 2020).

`FeedForward(d_model, d_ff, activation=, use_bias=, out_init_std=)`: `x [B, T, D] ->
[B, T, D]`. The activation's name alone decides whether it is gated (`ACTIVATIONS`:
name -> `(fn, gated)`); "gelu" is the exact erf form, "gelu_tanh" the tanh one.
Kernels carry logical axes ("embed", "mlp"); the matmul is `tfjax.nn.dense`.
See docs/layers.md.
"""

from __future__ import annotations

import functools
import numbers
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from tfjax.nn.dense import linear_dot_general
from tfjax.nn.hooks import hook
from tfjax.parallel.sharding import with_logical_axes
from tfjax.registry import Registry
from tfjax.typing import Array, DType, Float

Activation = Callable[[jax.Array], jax.Array]

ACTIVATIONS: Registry[tuple[Activation, bool]] = Registry("activation")

_gelu_exact = functools.partial(jax.nn.gelu, approximate=False)
_gelu_tanh = functools.partial(jax.nn.gelu, approximate=True)

ACTIVATIONS.register("relu", (jax.nn.relu, False))
ACTIVATIONS.register("gelu", (_gelu_exact, False))
ACTIVATIONS.register("gelu_tanh", (_gelu_tanh, False))
ACTIVATIONS.register("silu", (jax.nn.silu, False))
ACTIVATIONS.register("reglu", (jax.nn.relu, True))
ACTIVATIONS.register("geglu", (_gelu_exact, True))
ACTIVATIONS.register("geglu_tanh", (_gelu_tanh, True))
ACTIVATIONS.register("swiglu", (jax.nn.silu, True))


class FeedForward(nnx.Module):
    """`[B, T, D] -> [B, T, D]` through a hidden layer of width F.

    Submodules: `wi` (ungated) or `wi_gate` and `wi_up` (gated), then `wo`.
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        *,
        activation: str = "gelu",
        use_bias: bool = True,
        dtype: DType = jnp.float32,
        param_dtype: DType = jnp.float32,
        init_std: float = 0.02,
        out_init_std: float | None = None,
        rngs: nnx.Rngs,
    ):
        _, self.gated = ACTIVATIONS.get(activation, field="activation")
        for field, value in (("d_model", d_model), ("d_ff", d_ff)):
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{field} must be a positive int, got {value!r}")
        for field, value in (("init_std", init_std), ("out_init_std", out_init_std)):
            if value is not None and value < 0:
                raise ValueError(f"{field} must be >= 0, got {value!r}")
        self.activation = activation
        out_std = init_std if out_init_std is None else out_init_std

        def linear(d_in: int, d_out: int, std: float, axes: tuple[str, str]) -> nnx.Linear:
            kernel_init = nnx.initializers.normal(std)
            bias_init = nnx.initializers.zeros_init()
            return nnx.Linear(
                d_in,
                d_out,
                use_bias=use_bias,
                dtype=dtype,
                param_dtype=param_dtype,
                kernel_init=with_logical_axes(kernel_init, axes),
                bias_init=with_logical_axes(bias_init, axes[1:]),
                dot_general=linear_dot_general,
                rngs=rngs,
            )

        if self.gated:
            self.wi_gate = linear(d_model, d_ff, init_std, ("embed", "mlp"))
            self.wi_up = linear(d_model, d_ff, init_std, ("embed", "mlp"))
        else:
            self.wi = linear(d_model, d_ff, init_std, ("embed", "mlp"))
        self.wo = linear(d_ff, d_model, out_std, ("mlp", "embed"))

    def __call__(self, x: Float[Array, "B T D"], adapter=None) -> Float[Array, "B T D"]:
        """`adapter`: a callable x -> deltas added to the input projections' outputs,
        (d_gate, d_up) when gated, (d_wi,) when not (a shared block's per-use
        adapters, `tfjax.nn.shared_block`)."""
        # Looked up by name so the graph's static data holds a string, not a function.
        act, _ = ACTIVATIONS.get(self.activation)
        if self.gated:
            g, u = self.wi_gate(x), self.wi_up(x)  # [B, T, F]
            if adapter is not None:
                dg, du = adapter(x)
                g, u = g + dg.astype(g.dtype), u + du.astype(u.dtype)
            h = act(hook("hook_pre", g)) * hook("hook_pre_linear", u)
        else:
            h = self.wi(x)  # [B, T, F]
            if adapter is not None:
                (d,) = adapter(x)
                h = h + d.astype(h.dtype)
            h = act(hook("hook_pre", h))
        return self.wo(hook("hook_post", h))


__all__ = ["ACTIVATIONS", "Activation", "FeedForward"]
