"""Log-mel features of raw audio (tfjax.data.audio) against transformers'
WhisperFeatureExtractor: 30 s padded and as long as the audio, 80 and 128 mel bins,
odd lengths; the sample rate and the waveform's shape refused in one line."""

from __future__ import annotations

import numpy as np
import pytest

from tfjax.data.audio import SAMPLE_RATE, log_mel, mel_filters


def _wave(n, seed=0):
    rng = np.random.default_rng(seed)
    t = np.arange(n) / SAMPLE_RATE
    return (0.3 * np.sin(2 * np.pi * 440 * t) + 0.05 * rng.normal(size=n)).astype(np.float32)


@pytest.mark.parametrize("n_mels,samples", [(80, 3 * SAMPLE_RATE + 37), (128, 5000), (80, 401)])
def test_equals_whispers_feature_extractor(n_mels, samples):
    transformers = pytest.importorskip("transformers")
    fe = transformers.WhisperFeatureExtractor(feature_size=n_mels)
    wav = _wave(samples)
    padded = fe(wav, sampling_rate=SAMPLE_RATE, return_tensors="np").input_features[0]
    ours = log_mel(wav, sampling_rate=SAMPLE_RATE, n_mels=n_mels)
    assert ours.shape == padded.shape == (n_mels, 3000) and ours.dtype == np.float32
    np.testing.assert_allclose(ours, padded, atol=1e-4)
    longest = fe(wav, sampling_rate=SAMPLE_RATE, return_tensors="np",
                 padding="longest").input_features[0]
    ours = log_mel(wav, sampling_rate=SAMPLE_RATE, n_mels=n_mels, seconds=None)
    assert ours.shape == longest.shape == (n_mels, samples // 160)
    np.testing.assert_allclose(ours, longest, atol=1e-4)


def test_long_audio_is_cut_to_the_window_and_silence_is_finite():
    out = log_mel(_wave(31 * SAMPLE_RATE), sampling_rate=SAMPLE_RATE)
    assert out.shape == (80, 3000)
    np.testing.assert_array_equal(out, log_mel(_wave(31 * SAMPLE_RATE)[:30 * SAMPLE_RATE],
                                               sampling_rate=SAMPLE_RATE))
    silent = log_mel(np.zeros(100), sampling_rate=SAMPLE_RATE, seconds=None)
    assert np.isfinite(silent).all()


def test_filters_are_triangles_covering_the_band():
    bank = mel_filters(40)
    assert bank.shape == (201, 40) and (bank >= 0).all()
    assert (bank.sum(0) > 0).all()  # no empty filter
    assert bank[0].sum() == 0  # 0 Hz is every triangle's edge


@pytest.mark.parametrize("wave,rate,match", [
    (np.zeros(1000), 8000, r"sampling_rate: the audio is sampled at 8000 Hz, Whisper's "
                           r"features need 16000 Hz; resample it"),
    (np.zeros(1000), 44100, r"sampled at 44100 Hz"),
    (np.zeros((2, 1000)), SAMPLE_RATE, r"waveform: expected a non-empty mono \[samples\] "
                                       r"array .* shape \(2, 1000\)"),
    (np.zeros(0), SAMPLE_RATE, r"waveform: expected a non-empty mono"),
    (np.array(["a", "b"]), SAMPLE_RATE, r"waveform: .* dtype <U1"),
])
def test_bad_audio_is_one_line(wave, rate, match):
    with pytest.raises(ValueError, match=match) as e:
        log_mel(wave, sampling_rate=rate)
    assert "\n" not in str(e.value)
