"""PaliGemma 2 against transformers: a random tiny
`PaliGemmaForConditionalGeneration` (SigLIP tower of 3 x 3 patches, GQA Gemma 2,
a prefix of image + prompt and a causal suffix by token types): fp32 logits within
1e-4, greedy tokens of `tfjax.inference.generate` (the image encoded once by the
prefill, the prefix in the cache) equal to HF `generate`, and export back."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the hf extra (torch) is not installed")
transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not "
                                   "installed")

from hf_parity import assert_logits_close  # noqa: E402
from tfjax.inference import generate  # noqa: E402
from tfjax.interop import hf  # noqa: E402
from tfjax.models import ImagePrefixLM  # noqa: E402

IMAGE = 95  # the <image> token id


def _config(**text):
    vision = dict(hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
                  image_size=12, patch_size=4, vision_use_head=False, layer_norm_eps=1e-5,
                  hidden_act="gelu")
    text = dict(dict(model_type="gemma2", vocab_size=96, hidden_size=32, intermediate_size=48,
                     num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=8, layer_types=["full_attention"] * 3, sliding_window=64,
                     max_position_embeddings=128), **text)
    return transformers.PaliGemmaConfig(vision_config=vision, text_config=text,
                                        image_token_index=IMAGE, projection_dim=32,
                                        hidden_size=32, vocab_size=96)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("paligemma") / "hf"
    torch.manual_seed(0)
    model = transformers.PaliGemmaForConditionalGeneration(_config())
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    model.save_pretrained(path)
    ref = transformers.PaliGemmaForConditionalGeneration.from_pretrained(
        path, attn_implementation="eager").eval()  # eager: the mask as given, never is_causal
    ours, _ = hf.load(str(path))
    return path, ref, ours


def _inputs(prompt=6, seed=0):
    rng = np.random.default_rng(seed)
    ids = np.concatenate([np.full((2, 9), IMAGE), rng.integers(3, 90, (2, prompt))], axis=1)
    pixels = rng.normal(size=(2, 3, 12, 12)).astype(np.float32)
    return ids, pixels


def _hf_logits(ref, ids, pixels, types):
    with torch.no_grad():
        return ref(input_ids=torch.tensor(ids), pixel_values=torch.tensor(pixels),
                   token_type_ids=torch.tensor(types)).logits


def test_logits_with_a_prefix_and_a_suffix(checkpoint):
    _, ref, ours = checkpoint
    assert isinstance(ours, ImagePrefixLM)
    ids, pixels = _inputs()
    types = np.zeros_like(ids)
    types[:, 12:] = 1  # image + 3 prompt tokens bidirectional, 3 suffix tokens causal
    logits = ours(ids, pixel_values=pixels, token_type_ids=types)
    assert_logits_close(logits, _hf_logits(ref, ids, pixels, types))
    # the prefix is bidirectional: a later prefix token changes an earlier one's logits
    changed = ids.copy()
    changed[:, 11] = 3 + (ids[:, 11] - 2) % 80
    moved = ours(changed, pixel_values=pixels, token_type_ids=types)
    assert np.abs(np.asarray(moved[:, 10] - logits[:, 10])).max() > 1e-3
    np.testing.assert_allclose(ours(ids, pixel_values=pixels)[:, :12],  # no types: causal
                               _hf_logits(ref, ids, pixels, np.ones_like(ids)).numpy()[:, :12],
                               atol=1e-4 * float(np.abs(logits).max()))


def test_greedy_tokens_equal_transformers_generate(checkpoint):
    _, ref, ours = checkpoint
    ids, pixels = _inputs(prompt=4, seed=1)
    ref.generation_config.eos_token_id = None
    with torch.no_grad():
        theirs = ref.generate(input_ids=torch.tensor(ids), pixel_values=torch.tensor(pixels),
                              token_type_ids=torch.zeros(ids.shape, dtype=torch.long),
                              max_new_tokens=16, do_sample=False, pad_token_id=0)
    ours_tokens = np.asarray(generate(ours, jnp.asarray(ids), max_new_tokens=16,
                                      pixel_values=pixels))
    np.testing.assert_array_equal(ours_tokens, theirs[:, ids.shape[1]:].numpy())
    assert len(np.unique(ours_tokens)) > 2  # a continuation that depends on its context


def test_export_round_trip(checkpoint, tmp_path):
    path, ref, ours = checkpoint
    hf.export(ours, str(tmp_path / "out"))
    back = transformers.PaliGemmaForConditionalGeneration.from_pretrained(
        str(tmp_path / "out"), attn_implementation="eager").eval()
    for name, p in ref.state_dict().items():
        torch.testing.assert_close(back.state_dict()[name], p)
    ids, pixels = _inputs()
    types = np.zeros_like(ids)
    assert_logits_close(ours(ids, pixel_values=pixels, token_type_ids=types),
                        _hf_logits(back, ids, pixels, types))


@pytest.mark.parametrize("ids,pixels,match", [
    (np.full((2, 12), 5), "ok", r"^input_ids: row 0 has 0 image tokens \(id 95\), expected 9"),
    (np.concatenate([np.full((2, 9), IMAGE), np.full((2, 3), 5)], 1), None,
     r"^input_ids: holds image tokens \(id 95\) but no pixel_values"),
    (np.concatenate([np.full((2, 8), IMAGE), np.full((2, 3), 5)], 1), "ok",
     r"^input_ids: row 0 has 8 image tokens"),
    (np.concatenate([np.full((2, 9), IMAGE), np.full((2, 3), 5)], 1), "small",
     r"^pixel_values: expected images \[batch, 3 channels, 12, 12\]"),
])
def test_bad_inputs_are_one_line_errors(checkpoint, ids, pixels, match):
    _, _, ours = checkpoint
    pixels = {"ok": np.zeros((2, 3, 12, 12), np.float32),
              "small": np.zeros((2, 3, 8, 8), np.float32), None: None}[pixels]
    for call in (lambda: ours(ids, pixel_values=pixels),
                 lambda: generate(ours, jnp.asarray(ids), max_new_tokens=2, pixel_values=pixels)
                 if pixels is not None else ours.check_inputs(ids)):
        with pytest.raises(ValueError, match=match) as e:
            call()
        assert "\n" not in str(e.value)


def test_paligemma_1_is_refused_by_name():
    cfg = _config().to_dict()
    cfg["text_config"]["model_type"] = "gemma"
    with pytest.raises(NotImplementedError, match="text_config.model_type='gemma'"):
        hf.config_from_hf(cfg)


def test_sliding_layers_under_the_prefix(tmp_path):
    """Gemma 2's sliding layers with a window shorter than the image + prompt prefix:
    transformers' mask and ours agree, prefill and greedy decoding."""
    torch.manual_seed(1)
    model = transformers.PaliGemmaForConditionalGeneration(_config(
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], sliding_window=5))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    model.save_pretrained(tmp_path / "hf")
    ref = transformers.PaliGemmaForConditionalGeneration.from_pretrained(
        tmp_path / "hf", attn_implementation="eager").eval()
    ours, _ = hf.load(str(tmp_path / "hf"))
    ids, pixels = _inputs(prompt=7, seed=2)
    for split in (12, 16):  # the prefix ends mid-prompt, or covers it all
        types = np.zeros_like(ids)
        types[:, split:] = 1
        assert_logits_close(ours(ids, pixel_values=pixels, token_type_ids=types),
                            _hf_logits(ref, ids, pixels, types))
    ref.generation_config.eos_token_id = None
    with torch.no_grad():
        theirs = ref.generate(input_ids=torch.tensor(ids), pixel_values=torch.tensor(pixels),
                              token_type_ids=torch.zeros(ids.shape, dtype=torch.long),
                              max_new_tokens=10, do_sample=False, pad_token_id=0)
    np.testing.assert_array_equal(
        np.asarray(generate(ours, jnp.asarray(ids), max_new_tokens=10, pixel_values=pixels)),
        theirs[:, ids.shape[1]:].numpy())
