"""The speech encoder-decoder (Whisper's shape; `model.audio`): the front end's
shapes and positions, the config's one-line errors, bad `input_features` refused
before anything compiles, the key projection without a bias, and greedy generation
through the caches equal to the full forward's argmax."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tfjax.config import model_config
from tfjax.data.audio import log_mel
from tfjax.models import SpeechEncoderDecoderModel, build, unrolled
from tfjax.models.speech import check_features, generate
from tfjax.nn.audio import AudioFrontEnd, whisper_sinusoids

MELS, SRC = 6, 8


def _cfg(**kw):
    c = dict(arch="encoder_decoder", vocab_size=40, d_model=20, num_layers=2,
             num_encoder_layers=3, num_heads=2, d_ff=28, max_len=24, position="learned",
             attention=dict(qkv_bias=True, k_bias=False, out_bias=True),
             audio=dict(n_mels=MELS, max_source_positions=SRC, num_heads=4, d_ff=36))
    c.update(kw)
    return c


@pytest.fixture(scope="module")
def model():
    m = build(_cfg(), rngs=nnx.Rngs(0))
    # biases start at zero: give them values so that a dropped one shows
    leaves, tree = jax.tree.flatten(nnx.state(m, nnx.Param))
    rng = np.random.default_rng(1)
    nnx.update(m, jax.tree.unflatten(tree, [np.asarray(x) + 0.1 * rng.normal(size=x.shape)
                                            .astype(np.float32) for x in leaves]))
    return m


_forward = nnx.jit(lambda m, ids, f: m(ids, input_features=f))
_encode = nnx.jit(lambda m, f: m.encode(f))


def _features(batch=2, frames=2 * SRC, seed=0):
    return np.random.default_rng(seed).normal(size=(batch, MELS, frames)).astype(np.float32)


def test_sinusoids_are_whispers():
    pe = whisper_sinusoids(5, 8)
    inv = np.exp(-np.log(10000.0) / 3 * np.arange(4))  # channels / 2 - 1 = 3 steps
    t = np.arange(5)[:, None] * inv
    np.testing.assert_allclose(pe, np.concatenate([np.sin(t), np.cos(t)], 1), atol=1e-6)
    for bad in (2, 7):
        with pytest.raises(ValueError, match="channels must be even and >= 4"):
            whisper_sinusoids(3, bad)


@pytest.mark.parametrize("frames,out", [(16, 8), (15, 8), (1, 1), (2, 1)])
def test_front_end_halves_the_frames(frames, out):
    front = AudioFrontEnd(MELS, 12, rngs=nnx.Rngs(0))
    x = front(jnp.asarray(_features(frames=frames)))
    assert x.shape == (2, out, 12)


def test_front_end_is_two_convolutions_and_positions():
    """Against a direct numpy convolution (kernel 3, padding 1; stride 1 then 2)."""
    front = AudioFrontEnd(MELS, 8, rngs=nnx.Rngs(0))
    front.conv1.bias[...] = jnp.full((8,), 0.3)
    f = _features(batch=1, frames=7)

    def conv(x, k, b, stride):  # x [F, C], k [3, C, D]
        xp = np.pad(x, ((1, 1), (0, 0)))
        return np.stack([sum(xp[t + j] @ k[j] for j in range(3)) + b
                         for t in range(0, x.shape[0], stride)])

    gelu = lambda v: np.asarray(jax.nn.gelu(v, approximate=False))
    h = gelu(conv(f[0].T, np.asarray(front.conv1.kernel[...]), np.asarray(front.conv1.bias[...]), 1))
    h = gelu(conv(h, np.asarray(front.conv2.kernel[...]), np.asarray(front.conv2.bias[...]), 2))
    want = h + whisper_sinusoids(4, 8)
    np.testing.assert_allclose(np.asarray(front(jnp.asarray(f)))[0], want, atol=1e-5)


def test_forward_shapes_and_encoder_sizes(model):
    assert isinstance(model, SpeechEncoderDecoderModel)
    logits = _forward(model, np.array([[1, 2, 3], [4, 5, 6]]), _features())
    assert logits.shape == (2, 3, 40) and logits.dtype == jnp.float32
    assert _encode(model, _features(frames=9)).shape == (2, 5, 20)
    enc = model.encoder.cycles.layers[0]
    assert enc.attn.q.kernel.shape == (3, 20, 4, 5)  # audio.num_heads=4: head dim 5
    assert enc.ffn.wi.kernel.shape == (3, 20, 36)
    dec = model.decoder.cycles.layers[0]
    assert dec.attn.q.kernel.shape == (2, 20, 2, 10) and dec.ffn.wi.kernel.shape == (2, 20, 28)
    for attn in (enc.attn, dec.attn, dec.cross_attn):  # Whisper: no key bias
        assert attn.k.bias is None and attn.q.bias is not None and attn.v.bias is not None


def test_k_bias_is_only_dropped_with_qkv_bias():
    m = build(_cfg(attention=dict(qkv_bias=True)), rngs=nnx.Rngs(0))
    assert m.decoder.cycles.layers[0].attn.k.bias is not None


def test_generate_through_the_caches_equals_the_forward(model):
    feats = _features(seed=2)
    prompt = np.array([[1, 7, 3], [1, 2, 9]])
    ours = np.asarray(generate(model, feats, prompt, max_new_tokens=6))
    full = np.asarray(_forward(model, np.concatenate([prompt, ours[:, :-1]], 1), feats))
    np.testing.assert_array_equal(full.argmax(-1)[:, 2:], ours)
    np.testing.assert_array_equal(
        np.asarray(generate(unrolled(model), feats, prompt, max_new_tokens=6)), ours)
    # after a row's first eos, padding
    eos = int(ours[0, 1])
    padded = np.asarray(generate(model, feats, prompt, max_new_tokens=6, eos_id=eos, pad_id=39))
    first = np.argmax(ours[0] == eos)
    assert (padded[0, first + 1:] == 39).all() and (padded[0, :first + 1] == ours[0, :first + 1]).all()


@pytest.mark.parametrize("features,match", [
    (np.zeros((2, MELS + 1, 10), np.float32), r"input_features: 7 mel bins, the model takes "
                                               r"model.audio.n_mels=6"),
    (np.zeros((2, MELS, 2 * SRC + 1), np.float32), r"input_features: 17 frames; .* 1 to 16 "
                                                   r"\(audio too long"),
    (np.zeros((2, MELS, 0), np.float32), r"input_features: 0 frames"),
    (np.zeros((MELS, 10), np.float32), r"input_features: expected rank 3"),
    (np.zeros((2, MELS, 10), np.int32), r"input_features: .* got dtype int32"),
    ([[0.0]], r"input_features: expected an array .* got list"),
])
def test_bad_features_are_one_line_before_compiling(model, features, match):
    with pytest.raises(ValueError, match=match) as e:
        model(np.array([[1, 2]]), input_features=features)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=match):  # under jit: raised while tracing
        jax.jit(lambda f: model.encode(f))(features) if hasattr(features, "dtype") else \
            check_features(model.config, features)


def test_missing_features_and_bad_generate_args(model):
    with pytest.raises(ValueError, match="input_features: a speech model needs"):
        model(np.array([[1, 2]]))
    with pytest.raises(ValueError, match=r"decoder_input_ids: expected \[batch=2"):
        generate(model, _features(), np.array([[1]]), max_new_tokens=2)
    with pytest.raises(ValueError, match="max_new_tokens: must be >= 1"):
        generate(model, _features(), np.ones((2, 1), int), max_new_tokens=0)
    with pytest.raises(ValueError, match="exceed model.max_len=24"):
        generate(model, _features(), np.ones((2, 4), int), max_new_tokens=21)


@pytest.mark.parametrize("override,match", [
    (dict(arch="decoder", num_encoder_layers=0), r"model.audio.n_mels: the audio front end "
                                                 r"feeds an encoder"),
    (dict(position="rope"), r"model.position: the audio encoder has fixed sinusoidal"),
    (dict(audio=dict(n_mels=MELS, num_heads=3)), r"model.audio.num_heads: d_model=20 is not "
                                                 r"divisible by 3"),
    (dict(audio=dict(n_mels=MELS, max_source_positions=0)),
     r"model.audio.max_source_positions: must be > 0"),
    (dict(audio=dict(n_mels=-1)), r"model.audio.n_mels: must be >= 0"),
    (dict(d_model=2, num_heads=1, audio=dict(n_mels=MELS)), r"model.d_model: .* even and >= 4"),
])
def test_config_errors_name_the_field(override, match):
    with pytest.raises(ValueError, match=match) as e:
        model_config(_cfg(**override))
    assert "\n" not in str(e.value)


def test_audio_off_is_the_token_encoder_decoder():
    c = model_config(_cfg(audio=dict(n_mels=0)))
    assert type(build(c, rngs=nnx.Rngs(0))).__name__ == "EncoderDecoderModel"


def test_raw_audio_through_log_mel_into_the_encoder(model):
    wave = np.sin(np.arange(2500) * 0.1).astype(np.float32)  # 15 frames of 10 ms
    feats = log_mel(wave, sampling_rate=16000, n_mels=MELS, seconds=None)[None]
    assert feats.shape == (1, MELS, 15)
    assert _encode(model, feats).shape == (1, 8, 20)
