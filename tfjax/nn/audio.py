"""Whisper's audio front end (Radford et al. 2022): log-mel features `[B, n_mels, F]`
-> two 1-D convolutions (kernel 3, padding 1; the second stride 2), each with GELU
-> plus Whisper's fixed sinusoidal positions -> `[B, ceil(F / 2), D]`, the encoder's
input. See docs/multimodal.md.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tfjax.parallel.sharding import with_logical_axes

__all__ = ["AudioFrontEnd", "whisper_sinusoids"]


def whisper_sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> np.ndarray:
    """Whisper's encoder positions `[length, channels]`: `[sin | cos]` halves with
    timescales log-spaced over channels / 2 - 1 steps (not the paper's interleaved
    2i / d: `tfjax.nn.positions.sinusoidal_embedding`)."""
    if channels < 4 or channels % 2:
        raise ValueError(f"whisper_sinusoids: channels must be even and >= 4, got {channels}")
    increment = math.log(max_timescale) / (channels // 2 - 1)
    inv = np.exp(-increment * np.arange(channels // 2, dtype=np.float64))
    t = np.arange(length, dtype=np.float64)[:, None] * inv[None]
    return np.concatenate([np.sin(t), np.cos(t)], axis=1).astype(np.float32)


class AudioFrontEnd(nnx.Module):
    """`conv1` `[3, n_mels, D]` and `conv2` `[3, D, D]` (stride 2), with biases; no
    learned positions (the sinusoids are constants, not parameters)."""

    def __init__(self, n_mels: int, d_model: int, *, dtype=jnp.float32,
                 param_dtype=jnp.float32, init_std: float = 0.02, rngs: nnx.Rngs):
        self.n_mels, self.d_model, self.dtype = n_mels, d_model, dtype
        kernel = with_logical_axes(nnx.initializers.normal(init_std), (None, None, "embed"))
        bias = with_logical_axes(nnx.initializers.zeros_init(), ("embed",))

        def conv(d_in, stride):
            return nnx.Conv(d_in, d_model, kernel_size=(3,), strides=(stride,),
                            padding=((1, 1),), dtype=dtype, param_dtype=param_dtype,
                            kernel_init=kernel, bias_init=bias, rngs=rngs)

        self.conv1 = conv(n_mels, 1)
        self.conv2 = conv(d_model, 2)

    def __call__(self, features: jax.Array) -> jax.Array:
        """features `[B, n_mels, F]` (as transformers' feature extractor gives them)
        -> `[B, ceil(F / 2), D]`."""
        x = jnp.swapaxes(features, 1, 2).astype(self.dtype)  # channels last
        x = jax.nn.gelu(self.conv1(x), approximate=False)
        x = jax.nn.gelu(self.conv2(x), approximate=False)
        pos = whisper_sinusoids(x.shape[1], self.d_model)
        return x + jnp.asarray(pos, x.dtype)
