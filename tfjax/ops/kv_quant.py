"""An 8-bit K/V cache (`model.kv_quant = "int8" | "fp8"`): keys and values stored as
int8 (or float8 e4m3) with one scale per token and kv head, quantized when a step
writes them and dequantized when attention reads them.

`quantize(x, fmt)`: x `[..., H]` -> (values `[..., H]` of `fmt`, scales `[...]` in x's
float dtype), symmetric absmax over the head dim (int8: absmax / 127, round to
nearest; fp8: absmax / 448, e4m3's largest); an all-zero head gets scale 1.
`dequantize(values, scales, dtype)` is its inverse up to rounding. `check_backend`
refuses fp8 on a device without it. See docs/quantization.md ("An 8-bit KV cache").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["KV_FORMATS", "check_backend", "dequantize", "quantize", "storage_dtype"]

# format -> (stored dtype, the largest magnitude it holds)
KV_FORMATS: dict[str, tuple[str, float]] = {
    "int8": ("int8", 127.0),
    "fp8": ("float8_e4m3fn", 448.0),
}


def storage_dtype(fmt: str):
    """The stored values' dtype of `fmt` (one of `KV_FORMATS`)."""
    if fmt not in KV_FORMATS:
        raise ValueError(f"model.kv_quant: {fmt!r} is not a K/V cache format; use one of "
                         f"'none', {', '.join(map(repr, KV_FORMATS))}")
    return jnp.dtype(KV_FORMATS[fmt][0])


def quantize(x: jax.Array, fmt: str, scale_dtype=None) -> tuple[jax.Array, jax.Array]:
    """`x` `[..., H]` -> (values `[..., H]` stored as `fmt`, scales `[...]`)."""
    dtype, bound = storage_dtype(fmt), KV_FORMATS[fmt][1]
    scale_dtype = scale_dtype or (x.dtype if jnp.issubdtype(x.dtype, jnp.floating)
                                  else jnp.float32)
    xf = x.astype(jnp.float32)
    absmax = jnp.max(jnp.abs(xf), axis=-1)
    # the scale is rounded to its stored dtype first, so dequantize's product is the
    # one the values were divided by
    scale = jnp.where(absmax > 0, absmax / bound, 1.0).astype(scale_dtype)
    q = xf / scale.astype(jnp.float32)[..., None]
    if dtype == jnp.int8:
        q = jnp.clip(jnp.round(q), -bound, bound)
    else:
        q = jnp.clip(q, -bound, bound)
    return q.astype(dtype), scale


def dequantize(values: jax.Array, scales: jax.Array, dtype) -> jax.Array:
    """`values` `[..., H]` times `scales` `[...]`, as `dtype`."""
    return (values.astype(jnp.float32) * scales.astype(jnp.float32)[..., None]).astype(dtype)


def check_backend(fmt: str, device) -> None:
    """Raise (one line) when `device` cannot hold a `fmt` K/V cache: fp8 needs NVIDIA
    GPUs of compute capability >= 8.9, TPUs, or a CPU (converted up)."""
    storage_dtype(fmt)
    if fmt != "fp8" or device.platform not in ("gpu", "cuda"):
        return
    cc = getattr(device, "compute_capability", None)
    if cc is not None and tuple(map(int, str(cc).split("."))) < (8, 9):
        raise ValueError(f"model.kv_quant='fp8': {device.device_kind} (compute capability "
                         f"{cc}) has no fp8; use model.kv_quant='int8' there (fp8 K/V runs "
                         f"on NVIDIA GPUs of compute capability >= 8.9, TPUs and CPUs)")
