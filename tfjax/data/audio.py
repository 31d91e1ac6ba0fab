"""Log-mel features of raw audio, as Whisper's feature extractor computes them
(transformers' `WhisperFeatureExtractor`, numpy path): a 16 kHz mono waveform ->
`[n_mels, frames]` float32, 100 frames a second, padded or cut to `seconds` (Whisper:
30 s -> 3000 frames). Audio at another sample rate is refused. See docs/multimodal.md.
"""

from __future__ import annotations

import numpy as np

__all__ = ["SAMPLE_RATE", "log_mel", "mel_filters"]

SAMPLE_RATE, N_FFT, HOP = 16000, 400, 160  # Whisper's: 25 ms windows every 10 ms


def _hz_to_mel(f):  # Slaney's scale: linear below 1 kHz, logarithmic above
    f = np.asarray(f, np.float64)
    log = 15.0 + np.log(np.maximum(f, 1e-10) / 1000.0) * 27.0 / np.log(6.4)
    return np.where(f >= 1000.0, log, 3.0 * f / 200.0)


def _mel_to_hz(m):
    m = np.asarray(m, np.float64)
    return np.where(m >= 15.0, 1000.0 * np.exp(np.log(6.4) / 27.0 * (m - 15.0)), 200.0 * m / 3.0)


def mel_filters(n_mels: int, n_fft: int = N_FFT, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """`[n_fft // 2 + 1, n_mels]` triangular filters from 0 Hz to the Nyquist frequency,
    Slaney's mel scale and area normalisation (librosa's and transformers' defaults)."""
    edges = _mel_to_hz(np.linspace(_hz_to_mel(0.0), _hz_to_mel(sample_rate / 2), n_mels + 2))
    fft = np.linspace(0, sample_rate // 2, n_fft // 2 + 1)
    width = np.diff(edges)
    slopes = edges[None, :] - fft[:, None]
    down, up = -slopes[:, :-2] / width[:-1], slopes[:, 2:] / width[1:]
    bank = np.maximum(0.0, np.minimum(down, up))
    return bank * (2.0 / (edges[2:] - edges[:-2]))[None]


def log_mel(waveform, *, sampling_rate: int, n_mels: int = 80, seconds: float | None = 30.0
            ) -> np.ndarray:
    """`[n_mels, frames]` of a mono `waveform` `[samples]` sampled at `sampling_rate`
    (must be 16000): zero-padded or cut to `seconds` (None: as long as it is; frames =
    samples // 160), a centred (reflect-padded) periodic-Hann STFT, power through the
    mel filters, log10 floored at 1e-10, clipped to 8 below the maximum, (x + 4) / 4."""
    if sampling_rate != SAMPLE_RATE:
        raise ValueError(f"sampling_rate: the audio is sampled at {sampling_rate} Hz, Whisper's "
                         f"features need {SAMPLE_RATE} Hz; resample it first (e.g. "
                         f"librosa.resample or torchaudio.functional.resample)")
    x = np.asarray(waveform)
    if x.ndim != 1 or not np.issubdtype(x.dtype, np.number) or not x.size:
        raise ValueError(f"waveform: expected a non-empty mono [samples] array of numbers, got "
                         f"shape {x.shape}, dtype {x.dtype} (average the channels of stereo)")
    x = x.astype(np.float64)
    if seconds is not None:
        n = int(round(seconds * SAMPLE_RATE))
        x = np.pad(x[:n], (0, max(0, n - x.size)))
    if x.size <= N_FFT // 2:  # the centring's reflection needs more than half a window
        x = np.pad(x, (0, N_FFT // 2 + 1 - x.size))
    padded = np.pad(x, N_FFT // 2, mode="reflect")
    frames = 1 + (padded.size - N_FFT) // HOP
    idx = np.arange(N_FFT)[None] + HOP * np.arange(frames)[:, None]
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(N_FFT) / N_FFT)  # periodic Hann
    power = np.abs(np.fft.rfft(padded[idx] * window, axis=1)) ** 2  # [frames, bins]
    mel = np.log10(np.maximum(power @ mel_filters(n_mels), 1e-10)).T[:, :-1]
    mel = np.maximum(mel, mel.max() - 8.0)
    return ((mel + 4.0) / 4.0).astype(np.float32)
