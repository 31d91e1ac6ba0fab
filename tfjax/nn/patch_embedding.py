"""Patch embedding (Dosovitskiy et al. 2021, ViT): images `[B, C, H, W]` (pixel
values as Hugging Face's processors give them) -> `[B, P, D]`, P = (H/p)(W/p)
patches in row-major order, each patch's p x p x C pixels through one dense layer
(a stride-p convolution, computed as a reshape and a matmul). See docs/multimodal.md.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from tfjax.parallel.sharding import with_logical_axes
from tfjax.typing import Array, Float

__all__ = ["PatchEmbedding", "patchify"]


def patchify(images: Float[Array, "B C H W"], patch: int) -> Float[Array, "B P p p C"]:
    """`[B, C, H, W]` -> `[B, P, p, p, C]`: the patches in row-major order, each as rows,
    columns, channels (the convolution kernel's `[p, p, C, D]` order)."""
    B, C, H, W = images.shape
    x = images.reshape(B, C, H // patch, patch, W // patch, patch)
    x = x.transpose(0, 2, 4, 3, 5, 1)  # [B, H/p, W/p, p, p, C]
    return x.reshape(B, (H // patch) * (W // patch), patch, patch, C)


class PatchEmbedding(nnx.Module):
    """`kernel [p, p, C, D]`, `bias [D]`: each p x p patch of a `[B, C, H, W]` image
    to a D-vector; `__call__` -> `[B, P, D]`. H and W must be multiples of p (the
    model checks the image against its config first)."""

    def __init__(self, patch_size: int, channels: int, d_model: int, *, init_std: float = 0.02,
                 dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.patch_size, self.dtype = patch_size, dtype
        shape = (patch_size, patch_size, channels, d_model)
        init = with_logical_axes(nnx.initializers.normal(init_std), (None, None, None, "embed"))
        self.kernel = nnx.Param(init(rngs.params(), shape, param_dtype))
        zeros = with_logical_axes(nnx.initializers.zeros_init(), ("embed",))
        self.bias = nnx.Param(zeros(rngs.params(), (d_model,), param_dtype))

    def __call__(self, images: Float[Array, "B C H W"]) -> Float[Array, "B P D"]:
        x = patchify(images.astype(self.dtype), self.patch_size)
        kernel = self.kernel[...].astype(self.dtype)
        out = jnp.einsum("bpijc,ijcd->bpd", x, kernel)
        return out + self.bias[...].astype(self.dtype)
