"""SigLIP's vision tower against transformers: `last_hidden_state` and `pooler_output`
of random tiny `SiglipVisionModel`s (an odd patch count, each activation, with and
without the head, the vision half of a `SiglipModel`) within 1e-4 fp32, and export
back."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the hf extra (torch) is not installed")
transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not "
                                   "installed")

from hf_parity import assert_logits_close  # noqa: E402
from tfjax.interop import hf  # noqa: E402
from tfjax.models import VisionEncoder  # noqa: E402


def _vision(**kw):
    base = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                num_channels=3, image_size=30, patch_size=6, layer_norm_eps=1e-5)
    return transformers.SiglipVisionConfig(**{**base, **kw})


def _save(model, path):
    torch.manual_seed(0)
    with torch.no_grad():  # a random init far from the default one (zero biases)
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.eval()
    model.save_pretrained(path)
    return model


def _images(cfg, batch=2, seed=0):
    size = cfg.image_size
    return np.random.default_rng(seed).normal(size=(batch, cfg.num_channels, size, size)).astype(
        np.float32)


def _check(ours, ref_vision, pixels, head):
    with torch.no_grad():
        out = ref_vision(pixel_values=torch.tensor(pixels))
    hidden = ours(jnp.asarray(pixels))
    assert_logits_close(hidden, out.last_hidden_state)
    if head:
        assert_logits_close(ours.pool(hidden), out.pooler_output)
    else:
        with pytest.raises(ValueError, match="model.vision.pooling"):
            ours.pool(hidden)


@pytest.mark.parametrize("act,head,channels", [("gelu_pytorch_tanh", True, 3),
                                               ("gelu", False, 1), ("silu", True, 4)])
def test_vision_model_parity_and_export(act, head, channels, tmp_path):
    cfg = _vision(hidden_act=act, vision_use_head=head, num_channels=channels)
    ref = _save(transformers.SiglipVisionModel(cfg), tmp_path / "hf")
    ours, ours_cfg = hf.load(str(tmp_path / "hf"))
    assert isinstance(ours, VisionEncoder)
    assert ours_cfg.vision.num_patches == 25 and ours_cfg.vision.channels == channels
    pixels = _images(cfg)
    _check(ours, ref, pixels, head)

    hf.export(ours, str(tmp_path / "out"))
    back = transformers.SiglipVisionModel.from_pretrained(str(tmp_path / "out")).eval()
    _check(ours, back, pixels, head)
    for name, p in ref.state_dict().items():
        torch.testing.assert_close(back.state_dict()[name], p)


def test_siglip_model_loads_its_vision_half(tmp_path):
    text = transformers.SiglipTextConfig(vocab_size=50, hidden_size=16, intermediate_size=24,
                                         num_hidden_layers=1, num_attention_heads=2,
                                         max_position_embeddings=8)
    cfg = transformers.SiglipConfig(text_config=text.to_dict(),
                                    vision_config=_vision(image_size=24, patch_size=8).to_dict())
    ref = _save(transformers.SiglipModel(cfg), tmp_path / "hf")
    ours, _ = hf.load(str(tmp_path / "hf"))
    _check(ours, ref.vision_model, _images(cfg.vision_config, batch=1), head=True)


def test_wrong_images_are_one_line_errors(tmp_path):
    cfg = _vision()
    _save(transformers.SiglipVisionModel(cfg), tmp_path / "hf")
    ours, _ = hf.load(str(tmp_path / "hf"))
    for shape in ((2, 1, 30, 30), (2, 3, 24, 30), (3, 30, 30)):
        with pytest.raises(ValueError, match=r"^pixel_values: expected images \[batch, 3 "
                                              r"channels, 30, 30\].*got shape") as e:
            ours(jnp.zeros(shape))
        assert "\n" not in str(e.value)


def test_refused_options_name_the_key():
    with pytest.raises(NotImplementedError, match="hidden_act='quick_gelu'"):
        hf.config_from_hf(dict(_vision(hidden_act="quick_gelu").to_dict(),
                               model_type="siglip_vision_model"))
    with pytest.raises(NotImplementedError, match="image_size"):
        hf.config_from_hf(dict(_vision().to_dict(), model_type="siglip_vision_model",
                               image_size=[30, 24]))
