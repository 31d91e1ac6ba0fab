"""Gemma 3 with images against transformers: a random tiny
`Gemma3ForConditionalGeneration` (SigLIP tower of 4 x 4 patches pooled to 2 x 2 image
tokens, GQA Gemma 3 with a sliding layer shorter than the image): fp32 logits within
1e-4 with the image in the middle of the prompt, greedy tokens equal to HF `generate`,
and export back."""

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

BOI, EOI, IMAGE = 93, 94, 95


def _config():
    vision = dict(hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
                  image_size=16, patch_size=4, vision_use_head=False, layer_norm_eps=1e-5,
                  hidden_act="gelu_pytorch_tanh")
    text = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=3,
                layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                max_position_embeddings=128, query_pre_attn_scalar=16)
    return transformers.Gemma3Config(vision_config=vision, text_config=text, mm_tokens_per_image=4,
                                     image_token_index=IMAGE, boi_token_index=BOI,
                                     eoi_token_index=EOI)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3") / "hf"
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(_config())
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    model.save_pretrained(path)
    ref = transformers.Gemma3ForConditionalGeneration.from_pretrained(
        path, attn_implementation="eager").eval()
    ours, _ = hf.load(str(path))
    return path, ref, ours


def _inputs(before=3, after=5, seed=0):
    """Rows of text, <start_of_image>, 4 image tokens, <end_of_image>, text."""
    rng = np.random.default_rng(seed)
    ids = np.concatenate([rng.integers(3, 90, (2, before)), np.full((2, 1), BOI),
                          np.full((2, 4), IMAGE), np.full((2, 1), EOI),
                          rng.integers(3, 90, (2, after))], axis=1)
    pixels = rng.normal(size=(2, 3, 16, 16)).astype(np.float32)
    return ids, pixels


def _hf_logits(ref, ids, pixels):
    with torch.no_grad():
        return ref(input_ids=torch.tensor(ids), pixel_values=torch.tensor(pixels),
                   token_type_ids=torch.tensor((ids == IMAGE).astype(np.int64))).logits


def test_logits_with_an_image_block_mid_prompt(checkpoint):
    _, ref, ours = checkpoint
    assert isinstance(ours, ImagePrefixLM)
    ids, pixels = _inputs()
    logits = ours(ids, pixel_values=pixels)  # token types default to the image tokens
    assert_logits_close(logits, _hf_logits(ref, ids, pixels))
    types = (ids == IMAGE).astype(np.int32)
    np.testing.assert_array_equal(ours(ids, pixel_values=pixels, token_type_ids=types), logits)
    # the image block is bidirectional: its last pixel token changes its first's logits
    other = pixels.copy()
    other[:, :, 12:, 12:] += 1.0
    moved = ours(ids, pixel_values=other)
    assert np.abs(np.asarray(moved[:, 4] - logits[:, 4])).max() > 1e-3
    np.testing.assert_allclose(moved[:, :4], logits[:, :4], atol=1e-6)  # text before: causal


def test_greedy_tokens_equal_transformers_generate(checkpoint):
    _, ref, ours = checkpoint
    ids, pixels = _inputs(before=2, after=3, seed=1)
    ref.generation_config.eos_token_id = None
    with torch.no_grad():
        theirs = ref.generate(input_ids=torch.tensor(ids), pixel_values=torch.tensor(pixels),
                              token_type_ids=torch.tensor((ids == IMAGE).astype(np.int64)),
                              max_new_tokens=12, do_sample=False, pad_token_id=0)
    ours_tokens = np.asarray(generate(ours, jnp.asarray(ids), max_new_tokens=12,
                                      pixel_values=pixels))
    np.testing.assert_array_equal(ours_tokens, theirs[:, ids.shape[1]:].numpy())
    assert len(np.unique(ours_tokens)) > 2


def test_export_round_trip(checkpoint, tmp_path):
    path, ref, ours = checkpoint
    hf.export(ours, str(tmp_path / "out"))
    back = transformers.Gemma3ForConditionalGeneration.from_pretrained(
        str(tmp_path / "out"), attn_implementation="eager").eval()
    for name, p in ref.state_dict().items():
        torch.testing.assert_close(back.state_dict()[name], p)
    ids, pixels = _inputs()
    assert_logits_close(ours(ids, pixel_values=pixels), _hf_logits(back, ids, pixels))


def test_wrong_image_token_count_is_one_line():
    path_free = hf.config_from_hf(_config().to_dict())
    assert path_free.vision.image_tokens == 4
    with pytest.raises(ValueError, match=r"tokens_per_image: the pooled projector averages"):
        hf.config_from_hf(dict(_config().to_dict(), mm_tokens_per_image=9))
