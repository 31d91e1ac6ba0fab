"""The vision encoder (tfjax.models.vision): shapes and pooling of each kind,
bidirectional attention, non-square images, gradients, the tower of a decoder's
config, and the one-line errors of model.vision and of bad images."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tfjax.config import model_config
from tfjax.models import VisionEncoder, build
from tfjax.models.vision import tower_config

BASE = dict(arch="vision", d_model=16, num_layers=2, num_heads=2, d_ff=24, position="learned")


def _model(**vision):
    return build(dict(BASE, vision=dict(dict(image_size=12, patch_size=4), **vision)),
                 rngs=nnx.Rngs(0))


@pytest.mark.parametrize("pooling,tokens", [("none", 9), ("cls", 10), ("map", 9)])
def test_shapes_and_pooling(pooling, tokens):
    model = _model(pooling=pooling)
    assert isinstance(model, VisionEncoder)
    hidden = model(jnp.ones((2, 3, 12, 12)))
    assert hidden.shape == (2, tokens, 16)
    if pooling == "none":
        with pytest.raises(ValueError, match="model.vision.pooling"):
            model.pool(hidden)
    else:
        pooled = model.pool(hidden)
        assert pooled.shape == (2, 16) and np.all(np.isfinite(pooled))
    if pooling == "cls":
        np.testing.assert_array_equal(model.pool(hidden), hidden[:, 0])


def test_attention_is_bidirectional_and_images_independent():
    model = _model(image_width=8, channels=1)  # a 3 x 2 grid, one channel
    x = jax.random.normal(jax.random.key(0), (2, 1, 12, 8))
    base = model(x)
    assert base.shape == (2, 6, 16)
    changed = model(x.at[0, 0, 8:, 4:].add(1.0))  # the last patch of image 0
    assert np.abs(changed[0, 0] - base[0, 0]).max() > 1e-4  # the first patch sees it
    np.testing.assert_allclose(changed[1], base[1], rtol=1e-6, atol=1e-6)


def test_gradients_reach_every_parameter():
    model = _model(pooling="map")
    x = jax.random.normal(jax.random.key(0), (2, 3, 12, 12))

    def loss(m):
        return jnp.sum(m.pool(m(x)) ** 2)

    grads = nnx.grad(loss)(model)
    for path, g in nnx.to_flat_state(grads):
        assert np.abs(np.asarray(g.get_value())).max() > 0, path


def test_tower_of_a_decoder_config():
    cfg = model_config(dict(d_model=32, num_heads=4, norm="rmsnorm", position="rope",
                            prefix_lm=True,
                            vision=dict(image_size=8, patch_size=4, d_model=16, num_layers=3,
                                        num_heads=2, d_ff=20, activation="gelu_tanh",
                                        image_token_id=5)))
    t = tower_config(cfg)
    assert (t.arch, t.d_model, t.num_layers, t.num_heads, t.d_ff) == ("vision", 16, 3, 2, 20)
    assert (t.norm, t.position, t.activation, t.attention.qkv_bias) == (
        "layernorm", "learned", "gelu_tanh", True)
    tower = VisionEncoder(cfg, rngs=nnx.Rngs(0))
    assert tower(jnp.ones((1, 3, 8, 8))).shape == (1, 4, 16)


@pytest.mark.parametrize("shape", [(2, 1, 12, 12), (2, 3, 12, 16), (2, 3, 16, 12), (3, 12, 12)])
def test_wrong_images(shape):
    with pytest.raises(ValueError, match=r"^pixel_values: expected images \[batch, 3 channels, "
                                          r"12, 12\]") as e:
        _model()(jnp.zeros(shape))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("fields,vision,match", [
    ({}, dict(image_size=0), r"model.vision.image_size: arch='vision' needs"),
    ({}, dict(image_size=14, patch_size=4), r"model.vision.image_size: 14 pixels .* patch_size=4"),
    ({}, dict(image_size=12, image_width=10, patch_size=4), r"model.vision.image_width: 10"),
    ({}, dict(image_size=12, pooling="mean"), r"model.vision.pooling: got 'mean'"),
    ({}, dict(image_size=12, channels=0), r"model.vision.channels: must be > 0"),
    ({}, dict(image_size=12, patch_size=4, d_model=8),
     r"model.vision.d_model: arch=.vision. is the tower"),
    (dict(position="rope"), dict(image_size=12), r"model.position: arch='vision' adds a learned"),
])
def test_config_errors(fields, vision, match):
    with pytest.raises(ValueError, match=match) as e:
        model_config(dict(BASE, **fields, vision=vision))
    assert "\n" not in str(e.value)


def test_causal_layer_kinds_are_refused():
    with pytest.raises(ValueError, match="model.layer_pattern: 'mamba' layers are causal"):
        build(dict(BASE, layer_pattern=("mamba",), vision=dict(image_size=12, patch_size=4)))
