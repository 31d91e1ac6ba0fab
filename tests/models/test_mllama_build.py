"""Llama-3.2-Vision from the model config: `tfjax.models.build` makes an `MllamaModel`
for a decoder with images (`model.vision`) and "cross" layers, its tiled tower resolved
from `model.vision` (0 / "": the model's field); inconsistent settings are one line
naming the field. (Parity with transformers: tests/interop/test_hf_mllama.py, whose
family builds through the same `build`.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tfjax import models
from tfjax.config import model_config
from tfjax.config.mllama import MllamaVisionConfig, aspect_ratios
from tfjax.models.mllama import MllamaModel

CFG = dict(vocab_size=40, d_model=32, num_layers=3, num_heads=4, num_kv_heads=2, d_ff=48,
           norm="rmsnorm", activation="swiglu", ffn_bias=False, tie_embeddings=False,
           layer_pattern=("global", "cross"),
           vision=dict(image_size=24, patch_size=8, num_layers=2, num_heads=2, d_ff=32,
                       activation="gelu", num_global_layers=1, intermediate_layers=(1, 0),
                       max_num_tiles=2, image_token_rows=3))


@nnx.jit
def _call(model, tokens, images):
    return model(tokens, **images)


def _cfg(**vision):
    return dict(CFG, vision=dict(CFG["vision"], **vision))


def test_build_makes_mllama_with_the_tower_of_model_vision():
    cfg = model_config(CFG)
    assert models.model_class(cfg) is MllamaModel
    model = models.build(cfg, rngs=nnx.Rngs(0))
    v = model.vision_config
    assert v == MllamaVisionConfig.of(cfg)
    # 0 / "" take the model's; the aspect ratios of 2 tiles: (1, 1), (1, 2), (2, 1)
    assert (v.d_model, v.num_heads, v.norm_eps, v.text_dim) == (32, 2, cfg.norm_eps, 32)
    assert v.max_aspect_ratio_id == 3 == len(aspect_ratios(2))
    assert v.output_dim == 32 * 3 and model.text_vocab == 37
    assert len(model.vision.transformer) == 2 and len(model.vision.global_transformer) == 1
    B, T = 2, 5
    r = np.random.default_rng(0)
    pixels = jnp.asarray(r.normal(size=(B, 1, 2, 3, 24, 24)), jnp.float32)
    ids = jnp.asarray([[1], [3]])
    tokens = jnp.asarray(r.integers(0, 37, (B, T)))
    logits = _call(model, tokens, dict(pixel_values=pixels, aspect_ratio_ids=ids,
                                       aspect_ratio_mask=jnp.asarray([[[1, 1]], [[1, 0]]])))
    assert logits.shape == (B, T, 37) and bool(jnp.isfinite(logits).all())
    # the cross layers start as the identity (gates at 0): the images change nothing yet
    np.testing.assert_allclose(logits, _call(model, tokens, {}), atol=1e-5)
    # without cross layers the decoder with images is the image-prefix model
    prefix = model_config(dict(CFG, layer_pattern=("global",), prefix_lm=True,
                               vision=dict(image_size=24, patch_size=8, image_token_id=39)))
    assert models.model_class(prefix) is models.ImagePrefixLM


def test_no_intermediate_layers_and_one_tile():
    cfg = model_config(_cfg(intermediate_layers=(), max_num_tiles=0, num_global_layers=0))
    model = models.build(cfg, rngs=nnx.Rngs(0))
    v = model.vision_config
    assert (v.max_num_tiles, v.max_aspect_ratio_id, v.output_dim) == (1, 1, 32)
    out = _call(model, jnp.zeros((1, 3), jnp.int32), dict(
        pixel_values=jnp.zeros((1, 1, 1, 3, 24, 24)), aspect_ratio_ids=jnp.ones((1, 1), jnp.int32)))
    assert out.shape == (1, 3, 37)


@pytest.mark.parametrize("change, match", [
    (dict(CFG, layer_pattern=("global",), prefix_lm=True,
          vision=dict(CFG["vision"], image_token_id=39)), "model.vision.num_global_layers"),
    (dict(CFG, prefix_lm=True), "model.prefix_lm"),
    (_cfg(intermediate_layers=(2,)), "model.vision.intermediate_layers"),
    (_cfg(image_width=16), "model.vision.image_width"),
    (_cfg(image_size=20), "model.vision.image_size"),
    (_cfg(pooling="cls"), "model.vision.pooling"),
    (_cfg(image_token_rows=40), "model.vision.image_token_rows"),
    (_cfg(num_heads=3), "model.vision.num_heads"),
    (_cfg(max_num_tiles=-1), "model.vision.max_num_tiles"),
    (_cfg(activation="swish"), "model.vision.activation"),
    (_cfg(projector="pooled", tokens_per_image=4), "model.vision.projector"),
])
def test_inconsistent_settings_raise_one_line(change, match):
    with pytest.raises(ValueError, match=match) as e:
        models.build(change)
    assert "\n" not in str(e.value)


def test_cache_bytes_counts_the_text_cache_and_the_images_kv():
    """`cache_bytes` of a model built from the config equals the float bytes of its
    decoder's real cache (self-attention K/V of the tokens, cross K/V of the images)."""
    cfg = model_config(CFG)
    model = nnx.eval_shape(lambda: models.build(cfg, rngs=nnx.Rngs(0)))
    tiles = MllamaVisionConfig.of(cfg)
    S = tiles.max_num_tiles * tiles.patches
    cache = jax.eval_shape(lambda: model.text.init_cache(2, 16, context_len=S))
    real = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(cache)
               if jnp.issubdtype(x.dtype, jnp.floating))
    assert models.cache_bytes(cfg, 2, 16, encoder_len=S) == real
    image_kv = 2 * S * cfg.kv_heads * (cfg.head_size + cfg.value_head_size) * 4  # 1 cross layer
    assert models.cache_bytes(cfg, 2, 16) == real - image_kv  # no images: the text only
