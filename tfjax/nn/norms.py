"""Normalisation layers, chosen by name through the `NORMS` registry: "layernorm",
"rmsnorm", "rmsnorm_plus_one" (Gemma's `(1 + w)` scale), "rmsnorm_unit" (no scale).

`make_norm(kind, dim, eps=, use_bias=, dtype=)`: `norm(x [..., D]) -> [..., D]` in
`dtype`. Statistics, scale and bias are computed in float32 (at least) and cast once
at the end; LayerNorm's variance is two-pass. See docs/layers.md.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from tfjax.nn.hooks import active, hook
from tfjax.parallel.sharding import with_logical_axes
from tfjax.registry import Registry
from tfjax.typing import Array, DType, Float

NORM_AXES = ("norm",)


def _annotated(init: Any) -> Any:
    return with_logical_axes(init, NORM_AXES)


class NormBuilder(Protocol):
    def __call__(
        self,
        dim: int,
        *,
        eps: float = 1e-5,
        use_bias: bool = True,
        dtype: DType = jnp.float32,
        param_dtype: DType = jnp.float32,
        rngs: nnx.Rngs,
    ) -> nnx.Module: ...


NORMS: Registry[NormBuilder] = Registry("norm")


def _promote_to_float32(args: tuple[Any, ...], *, dtype: DType = None) -> tuple[Any, ...]:
    """Flax `promote_dtype` hook: compute in at least float32, whatever `dtype`.

    Flax casts the result to `dtype` itself, so the output dtype is unchanged.
    float64 (x64 mode) is kept, never narrowed.
    """
    del dtype
    return tuple(
        None if a is None else jnp.asarray(a, jnp.promote_types(jnp.result_type(a), jnp.float32))
        for a in args
    )


@NORMS.register("layernorm")
def layer_norm(
    dim: int,
    *,
    eps: float = 1e-5,
    use_bias: bool = True,
    dtype: DType = jnp.float32,
    param_dtype: DType = jnp.float32,
    rngs: nnx.Rngs,
) -> nnx.LayerNorm:
    return nnx.LayerNorm(
        dim,
        epsilon=eps,
        use_bias=use_bias,
        dtype=dtype,
        param_dtype=param_dtype,
        scale_init=_annotated(nnx.initializers.ones_init()),
        bias_init=_annotated(nnx.initializers.zeros_init()),
        use_fast_variance=False,
        promote_dtype=_promote_to_float32,
        rngs=rngs,
    )


@NORMS.register("rmsnorm")
def rms_norm(
    dim: int,
    *,
    eps: float = 1e-5,
    use_bias: bool = True,
    dtype: DType = jnp.float32,
    param_dtype: DType = jnp.float32,
    rngs: nnx.Rngs,
) -> nnx.RMSNorm:
    del use_bias  # RMSNorm has no bias; accepted so all kinds share one signature.
    return nnx.RMSNorm(
        dim,
        epsilon=eps,
        dtype=dtype,
        param_dtype=param_dtype,
        scale_init=_annotated(nnx.initializers.ones_init()),
        promote_dtype=_promote_to_float32,
        rngs=rngs,
    )


class RMSNormPlusOne(nnx.Module):
    """RMSNorm whose learned parameter `scale` is stored as an offset from 1.

    y = x / sqrt(mean(x^2) + eps) * (1 + scale), computed in float32, cast to
    `dtype`. `scale` starts at 0, so a fresh layer is plain RMS normalisation.
    """

    def __init__(
        self,
        dim: int,
        *,
        eps: float = 1e-5,
        dtype: DType = jnp.float32,
        param_dtype: DType = jnp.float32,
        rngs: nnx.Rngs,
    ):
        init = _annotated(nnx.initializers.zeros_init())
        self.scale = nnx.Param(init(rngs.params(), (dim,), param_dtype))
        # Flax's RMSNorm without a scale does the normalisation; its output stays
        # float32 so that (1 + scale) is applied before the one cast to `dtype`.
        self.norm = nnx.RMSNorm(
            dim,
            epsilon=eps,
            use_scale=False,
            dtype=jnp.float32,
            param_dtype=param_dtype,
            promote_dtype=_promote_to_float32,
            rngs=rngs,
        )
        self.dtype = dtype

    def __call__(self, x: Float[Array, "... D"]) -> Float[Array, "... D"]:
        y = self.norm(x)  # float32 (or float64 under x64)
        (scale,) = _promote_to_float32((self.scale[...],))
        return jnp.asarray(y * (1.0 + scale), self.dtype)


@NORMS.register("rmsnorm_unit")
def rms_norm_unit(
    dim: int,
    *,
    eps: float = 1e-5,
    use_bias: bool = True,
    dtype: DType = jnp.float32,
    param_dtype: DType = jnp.float32,
    rngs: nnx.Rngs,
) -> nnx.RMSNorm:
    """RMS normalisation without a learned scale, x / sqrt(mean(x^2) + eps): Llama 4's
    L2 QK-norm (`Llama4TextL2Norm`). No parameters."""
    del use_bias
    return nnx.RMSNorm(dim, epsilon=eps, use_scale=False, dtype=dtype, param_dtype=param_dtype,
                       promote_dtype=_promote_to_float32, rngs=rngs)


@NORMS.register("rmsnorm_plus_one")
def rms_norm_plus_one(
    dim: int,
    *,
    eps: float = 1e-5,
    use_bias: bool = True,
    dtype: DType = jnp.float32,
    param_dtype: DType = jnp.float32,
    rngs: nnx.Rngs,
) -> RMSNormPlusOne:
    del use_bias  # as for "rmsnorm"
    return RMSNormPlusOne(dim, eps=eps, dtype=dtype, param_dtype=param_dtype, rngs=rngs)


def make_norm(
    kind: str,
    dim: int,
    *,
    eps: float = 1e-5,
    use_bias: bool = True,
    dtype: DType = jnp.float32,
    param_dtype: DType = jnp.float32,
    rngs: nnx.Rngs,
) -> nnx.Module:
    """Builds the norm named `kind` over the last axis: `norm(x [..., D]) -> [..., D]` in `dtype`.

    Raises ValueError naming the field ("norm") and the allowed kinds if `kind`
    is unknown.
    """
    builder = NORMS.get(kind, field="norm")
    return builder(dim, eps=eps, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)


__all__ = ["NORMS", "RMSNormPlusOne", "hooked_norm", "make_norm"]


def hooked_norm(name: str, norm: nnx.Module, x: jax.Array) -> jax.Array:
    """`norm(x)` with the hook point `{name}.hook_normalized` (`tfjax.nn.hooks`): as
    TransformerLens has it, the normalised x before the learned scale and bias, fp32,
    which then apply to what the hook gives back. Without a session: `norm(x)`."""
    if not active(f"{name}.hook_normalized"):
        return norm(x)
    y, affine = _split(norm, x)
    return affine(hook(f"{name}.hook_normalized", y))


def _split(norm, x):
    """(x normalised `[..., D]` fp32, the function applying `norm`'s scale and bias)."""
    (x,) = _promote_to_float32((x,))
    if isinstance(norm, RMSNormPlusOne):
        (scale,) = _promote_to_float32((norm.scale[...],))
        return norm.norm(x), lambda y: jnp.asarray(y * (1.0 + scale), norm.dtype)
    if not isinstance(norm, (nnx.LayerNorm, nnx.RMSNorm)):
        raise TypeError(f"hook_normalized: no split of a {type(norm).__name__} into its "
                        f"normalisation and its scale")
    centred = isinstance(norm, nnx.LayerNorm)
    if centred:
        x = x - jnp.mean(x, axis=-1, keepdims=True)
    y = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + norm.epsilon)
    scale = _promote_to_float32((norm.scale[...],))[0] if norm.scale else None
    bias = _promote_to_float32((norm.bias[...],))[0] if centred and norm.bias else None

    def affine(y):
        y = y if scale is None else y * scale
        y = y if bias is None else y + bias
        return jnp.asarray(y, norm.dtype)

    return y, affine
