"""The image-prefix decoder (tfjax.models.vision_language) without transformers:
the image features land at the image tokens in order, the cached prefill equals the
whole-sequence call, and the config and input errors (PaliGemma's parity:
tests/interop/test_hf_paligemma.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tfjax import interp
from tfjax.config import model_config
from tfjax.models import ImagePrefixLM, build

VISION = dict(image_size=8, patch_size=4, d_model=16, num_layers=1, num_heads=2, d_ff=16,
              image_token_id=63)
CFG = dict(vocab_size=64, d_model=32, num_layers=2, num_heads=4, d_ff=48, prefix_lm=True,
           vision=VISION)


@pytest.fixture(scope="module")
def model():
    return build(CFG, rngs=nnx.Rngs(0))


def _inputs():
    ids = jnp.asarray([[63, 63, 63, 63, 5, 6, 7], [8, 63, 63, 63, 63, 9, 10]])
    return ids, jax.random.normal(jax.random.key(0), (2, 3, 8, 8))


def test_features_replace_the_image_tokens_in_order(model):
    assert isinstance(model, ImagePrefixLM)
    ids, pixels = _inputs()
    x = model.embed_inputs(ids, jnp.broadcast_to(jnp.arange(7), ids.shape), pixels)
    feats = model.image_features(pixels)
    np.testing.assert_allclose(x[0, :4], feats[0], rtol=1e-6)
    np.testing.assert_allclose(x[1, 1:5], feats[1], rtol=1e-6)
    np.testing.assert_allclose(x[0, 4:], model.embed(ids, jnp.arange(7)[None])[0, 4:], rtol=1e-6)


def test_cached_prefill_equals_the_whole_sequence(model):
    ids, pixels = _inputs()
    want = model(ids, pixel_values=pixels, token_type_ids=jnp.zeros_like(ids))
    logits, _ = model.step(ids, model.init_cache(2, 12), pixel_values=pixels, all_logits=True)
    np.testing.assert_allclose(logits, want, rtol=2e-5, atol=2e-5)
    causal = model(ids, pixel_values=pixels)  # no token types: causal, so different
    assert np.abs(np.asarray(causal - want)).max() > 1e-4


def test_a_decode_step_takes_no_images(model):
    ids, pixels = _inputs()
    _, cache = model.step(ids, model.init_cache(2, 12), pixel_values=pixels)
    with pytest.raises(ValueError, match="^pixel_values: a decode step"):
        model.step(ids[:, :1], cache, pixel_values=pixels)


def test_a_tower_activation_is_checked_by_name():
    with pytest.raises(ValueError, match="^model.vision.activation: got 'gelu_quick'; allowed"):
        build(dict(CFG, vision=dict(VISION, activation="gelu_quick")))


def test_prefix_lm_is_required():
    with pytest.raises(ValueError, match="^model.prefix_lm: a decoder whose image and prompt"):
        build(dict(CFG, prefix_lm=False))
    with pytest.raises(ValueError, match="^model.prefix_lm: image blocks"):
        build(dict(CFG, vision=dict(VISION, image_attention="blocks")))


GEMMA3 = dict(CFG, prefix_lm=False, layer_pattern=("local", "global"),
              attention=dict(sliding_window=2),
              vision=dict(VISION, image_size=16, projector="pooled", tokens_per_image=4,
                          image_attention="blocks"))


def test_image_blocks_pooled_features_and_the_cached_prefill():
    """Gemma 3's way: a 4 x 4 patch grid pooled to 2 x 2 tokens, the image mid-row
    bidirectional within itself (also in the sliding layers, window 2), the text causal;
    the cached prefill and a decode step equal the whole-sequence call."""
    model = build(GEMMA3, rngs=nnx.Rngs(1))
    ids = jnp.asarray([[5, 6, 63, 63, 63, 63, 7, 8, 9], [63, 63, 63, 63, 5, 9, 9, 4, 2]])
    pixels = jax.random.normal(jax.random.key(1), (2, 3, 16, 16))
    tower = model.vision(pixels).reshape(2, 2, 2, 2, 2, -1).mean((2, 4)).reshape(2, 4, -1)
    np.testing.assert_allclose(model.image_features(pixels),
                               model.projector.linear(model.projector.norm(tower)), rtol=1e-5)
    want = model(ids, pixel_values=pixels)
    logits, cache = model.step(ids[:, :8], model.init_cache(2, 12), pixel_values=pixels,
                               all_logits=True)
    np.testing.assert_allclose(logits, want[:, :8], rtol=2e-5, atol=2e-5)
    last, _ = model.step(ids[:, 8:], cache)
    np.testing.assert_allclose(last[:, 0], want[:, 8], rtol=2e-5, atol=2e-5)
    # an image token sees the tokens after it in its image (even 3 on, past the window)
    other = pixels.at[:, :, 8:, 8:].add(1.0)  # the image's last pooled token only
    moved = model(ids, pixel_values=other)
    assert np.abs(np.asarray(moved[0, 2] - want[0, 2])).max() > 1e-4
    np.testing.assert_allclose(moved[0, :2], want[0, :2], atol=1e-6)  # text before: causal


@pytest.mark.parametrize("fields,match", [
    (dict(vision=dict(VISION, image_token_id=-1)), r"model.vision.image_token_id: a decoder"),
    (dict(vision=dict(image_token_id=3)), r"model.vision.image_token_id: an image token needs"),
    (dict(arch="encoder", prefix_lm=False), r"model.vision.image_size: images go into"),
    (dict(vision=dict(VISION, projector="pooled", tokens_per_image=3)),
     r"model.vision.tokens_per_image: the pooled projector averages the 2 x 2 patch grid"),
    (dict(vision=dict(VISION, projector="conv")), r"model.vision.projector: got 'conv'"),
])
def test_config_errors(fields, match):
    with pytest.raises(ValueError, match=match) as e:
        model_config(dict(CFG, **fields))
    assert "\n" not in str(e.value)


def test_hook_names_keep_the_tower_apart(model):
    """The tower's hooks are `vision.*`, the decoder's `blocks.*`: one session sees both
    stacks' layer 0 once each, with their own widths."""
    ids, pixels = _inputs()
    _, cache = interp.run_with_cache(model, ids, names=lambda n: n.endswith("hook_resid_post"),
                                     pixel_values=pixels)
    assert cache["vision.blocks.0.hook_resid_post"].shape == (2, 4, 16)
    assert cache["blocks.0.hook_resid_post"].shape == (2, 7, 32)
    assert cache["blocks.1.hook_resid_post"].shape == (2, 7, 32)
