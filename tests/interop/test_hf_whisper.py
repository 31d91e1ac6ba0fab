"""The `whisper` family against transformers: a random tiny
WhisperForConditionalGeneration (d_model 36, 3 encoder layers of 3 heads and ffn 40,
2 decoder layers of 2 heads and ffn 56, scale_embedding set (which transformers' Whisper
never applies), biases and norms perturbed)
loads with fp32 logits within 1e-4, greedy tokens equal to transformers' generate and
a round trip through export."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from tfjax.interop import hf
from tfjax.models import SpeechEncoderDecoderModel
from tfjax.models.speech import generate
from tests.interop.hf_parity import assert_logits_close

V, MELS, SRC = 61, 10, 12  # 2 * SRC = 24 frames: transformers takes exactly that many


def _config(**kw):
    return transformers.WhisperConfig(
        vocab_size=V, num_mel_bins=MELS, d_model=36, encoder_layers=3, decoder_layers=2,
        encoder_attention_heads=3, decoder_attention_heads=2, encoder_ffn_dim=40,
        decoder_ffn_dim=56, max_source_positions=SRC, max_target_positions=40,
        scale_embedding=True, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        decoder_start_token_id=1, suppress_tokens=None, begin_suppress_tokens=None, **kw)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("whisper")
    torch.manual_seed(0)
    ref = transformers.WhisperForConditionalGeneration._from_config(
        _config(), attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "embed_positions" in name and "encoder" in name:
                continue  # the fixed sinusoids
            if p.ndim == 1:  # biases start at 0 and norm weights at 1: a swapped or
                p.add_(0.1 * torch.randn_like(p))  # dropped one would go unnoticed
            else:
                p.normal_(0.0, 0.2)
    ref.save_pretrained(path)
    return ref, str(path)


def _features(batch=2, frames=2 * SRC, seed=0):
    return np.random.default_rng(seed).normal(size=(batch, MELS, frames)).astype(np.float32)


def test_config_sizes_and_class(saved):
    _, path = saved
    model, cfg = hf.load(path)
    assert isinstance(model, SpeechEncoderDecoderModel)
    assert (cfg.d_model, cfg.num_layers, cfg.encoder_layers, cfg.num_heads) == (36, 2, 3, 2)
    assert (cfg.audio.n_mels, cfg.audio.num_heads, cfg.audio.d_ff, cfg.d_ff) == (MELS, 3, 40, 56)
    assert not cfg.attention.k_bias and cfg.attention.qkv_bias


def test_logits(saved):
    ref, path = saved
    model, _ = hf.load(path)
    feats = _features()
    dec = np.random.default_rng(1).integers(0, V, size=(2, 9))
    with torch.no_grad():
        theirs = ref(input_features=torch.tensor(feats), decoder_input_ids=torch.tensor(dec)).logits
    assert_logits_close(model(dec, input_features=feats), theirs)
    # the encoder alone (unscanned layers: the same function)
    with torch.no_grad():
        enc = ref.model.encoder(torch.tensor(feats)).last_hidden_state
    assert_logits_close(model.encode(feats), enc)


def test_greedy_equals_transformers_generate(saved):
    """transformers' generic `generate` (GenerationMixin's: Whisper's own adds language /
    task / timestamp logic this tiny model has no tokens for) from the same forced
    decoder prompt, greedy, no EOS stop."""
    ref, path = saved
    model, _ = hf.load(path, scan_layers=False)
    feats = _features(seed=3)
    prompt = np.array([[1, 5, 7], [1, 9, 4]])
    n = 12
    with torch.no_grad():
        theirs = transformers.GenerationMixin.generate(
            ref, input_features=torch.tensor(feats), decoder_input_ids=torch.tensor(prompt),
            max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0,
            suppress_tokens=None, begin_suppress_tokens=None, forced_decoder_ids=None)
    ours = generate(model, feats, prompt, max_new_tokens=n)
    np.testing.assert_array_equal(np.asarray(ours), theirs[:, prompt.shape[1]:].numpy())
    # and the cached steps agree with the full forward at every position
    full = np.asarray(model(np.concatenate([prompt, np.asarray(ours)[:, :-1]], 1),
                            input_features=feats)).argmax(-1)[:, prompt.shape[1] - 1:]
    np.testing.assert_array_equal(full, np.asarray(ours))


def test_export_round_trip(saved, tmp_path):
    ref, path = saved
    model, _ = hf.load(path)
    hf.export(model, str(tmp_path))
    back = transformers.WhisperForConditionalGeneration.from_pretrained(
        str(tmp_path), attn_implementation="eager").eval()
    feats = _features(seed=5)
    dec = np.random.default_rng(6).integers(0, V, size=(2, 6))
    args = dict(input_features=torch.tensor(feats), decoder_input_ids=torch.tensor(dec))
    with torch.no_grad():
        assert_logits_close(back(**args).logits.detach().numpy(), ref(**args).logits)
    again, _ = hf.load(str(tmp_path))
    np.testing.assert_allclose(np.asarray(again(dec, input_features=feats)),
                               np.asarray(model(dec, input_features=feats)), atol=1e-5)
