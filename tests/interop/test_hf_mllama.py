"""The `mllama` family against transformers: a random tiny
MllamaForConditionalGeneration beyond the defaults (cross-attention layers 1 and 3 of 5,
GQA, two tiles of two aspect ratios, a second image, intermediate layers out of order,
a padding tile, a token that sees no image, every gate opened) loaded into
`tfjax.models.mllama.MllamaModel`: the vision features and the fp32 logits within 1e-4,
greedy tokens equal to `generate`; bad images and masks raise one line before tracing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tfjax.interop import hf as tfjax_hf  # noqa: E402
from tfjax.interop.families import mllama  # noqa: E402

VISION = dict(hidden_size=16, num_hidden_layers=3, num_global_layers=2, attention_heads=2,
              intermediate_size=24, image_size=28, patch_size=14, max_num_tiles=2,
              supported_aspect_ratios=[[1, 1], [1, 2], [2, 1]],
              intermediate_layers_indices=[2, 0], vision_output_dim=48, norm_eps=1e-5)
TEXT = dict(vocab_size=50, hidden_size=32, num_hidden_layers=5, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=40, cross_attention_layers=[1, 3],
            rms_norm_eps=1e-5, max_position_embeddings=64,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0), pad_token_id=None,
            bos_token_id=1, eos_token_id=None)


@pytest.fixture(scope="module")
def pair():
    cfg = transformers.MllamaConfig(vision_config=VISION, text_config=TEXT, image_token_index=49)
    torch.manual_seed(0)
    hf = transformers.MllamaForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # HF initialises every gate at 0 (or pi/4): open them all
        g = torch.Generator().manual_seed(1)
        for name, p in hf.named_parameters():
            if "gate" in name and p.numel() == 1:
                p.copy_(torch.rand(1, generator=g) * 1.6 - 0.8)
    tensors = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    ours = mllama.from_hf(hf.config.to_dict(), tensors, scan_layers=True)
    return hf, ours


def _inputs(T=7):
    r = np.random.default_rng(0)
    B, M, tiles = 2, 2, 2
    pixels = r.normal(size=(B, M, tiles, 3, 28, 28)).astype(np.float32)
    ids = np.array([[2, 1], [3, 2]])
    tile_mask = np.array([[[1, 1], [1, 0]], [[1, 1], [1, 1]]])
    tokens = r.integers(0, TEXT["vocab_size"], (B, T))
    cross = np.zeros((B, T, M, tiles), np.int64)
    cross[0, 2:, 0] = tile_mask[0, 0]
    cross[0, 5:, 1] = tile_mask[0, 1]
    cross[1, 1:, :] = tile_mask[1]  # row 1's token 0 sees no image
    return dict(input_ids=tokens, pixel_values=pixels, aspect_ratio_ids=ids,
                aspect_ratio_mask=tile_mask, cross_attention_mask=cross)


@nnx.jit
def _logits(model, x):
    return model(**x)


def _torch(x):
    return {k: torch.as_tensor(v) for k, v in x.items()}


def _jax(x):
    return {k: jnp.asarray(v) for k, v in x.items()}


def test_hf_load_reads_a_checkpoint_directory(pair, tmp_path):
    hf, ours = pair
    hf.save_pretrained(tmp_path)
    model, cfg = tfjax_hf.load(str(tmp_path))
    assert cfg.layer_pattern == ("global", "cross") and cfg.vocab_size == TEXT["vocab_size"] + 8
    a, b = nnx.state(model, nnx.Param), nnx.state(ours, nnx.Param)
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)
    with pytest.raises(NotImplementedError, match="mesh=None"):
        tfjax_hf.load(str(tmp_path), mesh=object())


def test_export_is_read_back_by_transformers(pair, tmp_path):
    hf, ours = pair
    mllama.export(ours, str(tmp_path))
    back = transformers.MllamaForConditionalGeneration.from_pretrained(str(tmp_path)).eval()
    want, got = hf.state_dict(), back.state_dict()
    assert set(want) == set(got)
    for k in want:
        np.testing.assert_array_equal(got[k].numpy(), want[k].numpy(), err_msg=k)
    assert back.config.text_config.cross_attention_layers == [1, 3]


def test_config_maps_the_cross_layers():
    assert mllama.layer_pattern(5, [1, 3]) == ("global", "cross")  # 2 cycles and a block
    assert mllama.layer_pattern(5, [2, 4]) == ("global", "global", "cross", "global", "cross")
    assert mllama.layer_pattern(40, list(range(3, 40, 5))) == (
        "global", "global", "global", "cross", "global")
    with pytest.raises(ValueError, match="cross_attention_layers"):
        mllama.layer_pattern(4, [4])


def test_vision_features_match(pair):
    hf, ours = pair
    x = _inputs()
    with torch.no_grad():
        want = hf.model.vision_model(**{k: torch.as_tensor(x[k]) for k in (
            "pixel_values", "aspect_ratio_ids", "aspect_ratio_mask")}).last_hidden_state
    got = nnx.jit(lambda m, *a: m(*a))(ours.vision, jnp.asarray(x["pixel_values"]),
                                       jnp.asarray(x["aspect_ratio_ids"]),
                                       jnp.asarray(x["aspect_ratio_mask"]))
    np.testing.assert_allclose(np.asarray(got), want.numpy(), atol=1e-4, rtol=1e-4)


def test_logits_match(pair):
    hf, ours = pair
    x = _inputs()
    with torch.no_grad():
        want = hf(**_torch(x)).logits.numpy()
    got = np.asarray(_logits(ours, _jax(x)))
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    # text only: the cross layers skipped, as transformers skips them
    with torch.no_grad():
        want = hf(input_ids=torch.as_tensor(x["input_ids"])).logits.numpy()
    got = _logits(ours, {"input_ids": jnp.asarray(x["input_ids"])})
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_greedy_tokens_match_generate(pair):
    hf, ours = pair
    x = _inputs()
    with torch.no_grad():
        want = hf.generate(**_torch(x), max_new_tokens=6, do_sample=False,
                           attention_mask=torch.ones(x["input_ids"].shape, dtype=torch.long))
    got = ours.generate(max_new_tokens=6, **_jax(x))
    np.testing.assert_array_equal(np.asarray(got), want[:, x["input_ids"].shape[1]:].numpy())


@pytest.mark.parametrize("change, match", [
    (lambda x: x.update(pixel_values=x["pixel_values"][..., :14, :14]), "28x28 pixels"),
    (lambda x: x.update(pixel_values=x["pixel_values"][:, :, :, :1]), "3 channels"),
    (lambda x: x.update(pixel_values=x["pixel_values"][:, :, :1],
                        aspect_ratio_mask=x["aspect_ratio_mask"][:, :, :1]), "2 tiles"),
    (lambda x: x.update(aspect_ratio_ids=x["aspect_ratio_ids"][:, :1]), "aspect_ratio_ids"),
    (lambda x: x.update(cross_attention_mask=x["cross_attention_mask"][:, :, :1]),
     "cross_attention_mask: expected shape"),
    (lambda x: x.update(cross_attention_mask=x["cross_attention_mask"][:, :3]),
     "cross_attention_mask: expected shape"),
])
def test_bad_images_raise_one_line(pair, change, match):
    _, ours = pair
    x = _inputs()
    change(x)
    with pytest.raises(ValueError, match=match) as e:
        ours(**_jax(x))
    assert "\n" not in str(e.value)
