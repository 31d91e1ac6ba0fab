"""PatchEmbedding against a stride-p convolution (lax.conv_general_dilated), odd
grids and non-square images."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tfjax.nn.patch_embedding import PatchEmbedding, patchify


@pytest.mark.parametrize("C,H,W,p", [(3, 12, 12, 4), (1, 15, 9, 3), (4, 8, 16, 8), (2, 5, 5, 5)])
def test_matches_a_strided_convolution(C, H, W, p):
    layer = PatchEmbedding(p, C, 6, init_std=0.5, rngs=nnx.Rngs(0))
    layer.bias[...] = jax.random.normal(jax.random.key(2), (6,))
    x = jax.random.normal(jax.random.key(1), (2, C, H, W))
    conv = jax.lax.conv_general_dilated(x, layer.kernel[...], (p, p), "VALID",
                                        dimension_numbers=("NCHW", "HWIO", "NHWC"))
    want = conv.reshape(2, (H // p) * (W // p), 6) + layer.bias[...]
    np.testing.assert_allclose(layer(x), want, rtol=1e-5, atol=1e-5)


def test_patchify_is_row_major_rows_columns_channels():
    x = jnp.arange(2 * 4 * 6).reshape(1, 2, 4, 6)  # C=2, H=4, W=6, p=2: a 2 x 3 grid
    out = patchify(x, 2)
    assert out.shape == (1, 6, 2, 2, 2)
    # patch 4 is grid row 1, column 1: pixels rows 2-3, columns 2-3 of both channels
    np.testing.assert_array_equal(out[0, 4], np.asarray(x[0, :, 2:4, 2:4]).transpose(1, 2, 0))
