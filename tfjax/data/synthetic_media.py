"""Synthetic images and speech with their descriptions, for training and testing
multimodal models at tiny scale on a CPU (`shape_scenes`, `spoken_digits`).

Each scene is one coloured shape (square, circle, triangle, cross) on a dark, noisy
background, in one cell of a 3 x 3 grid, with a caption ("a red circle at the top
left") and a question with its one-word answer (shape, colour or place). Each
utterance is 1-4 spoken digits ("three one four"), each digit a voiced sound of its
own formants, with a speaker's pitch, tract length, speed and noise. Generators
are seeded numpy (`seed`: an int or a `np.random.Generator`): the same seed gives the
same scenes. See docs/multimodal.md ("Training").
"""

from __future__ import annotations

import numpy as np

__all__ = ["COLOURS", "DIGITS", "PLACES", "SHAPES", "shape_scenes", "digit_text",
           "spoken_digit", "spoken_digits"]

SHAPES = ("square", "circle", "triangle", "cross")
COLOURS = {"red": (220, 40, 40), "green": (40, 200, 60), "blue": (50, 90, 230),
           "yellow": (230, 210, 40), "white": (235, 235, 235)}
ROWS, COLS = ("top", "middle", "bottom"), ("left", "centre", "right")
PLACES = tuple(f"{r} {c}" if (r, c) != ("middle", "centre") else "centre"
               for r in ROWS for c in COLS)


def _rng(seed) -> np.random.Generator:
    return seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)


def _shape_mask(shape: str, size: int) -> np.ndarray:
    """[size, size] bool: the shape drawn to fill a square cell's inner part."""
    y, x = np.mgrid[0:size, 0:size] + 0.5
    c, r = size / 2, size * 0.4
    if shape == "square":
        return (np.abs(x - c) <= r) & (np.abs(y - c) <= r)
    if shape == "circle":
        return (x - c) ** 2 + (y - c) ** 2 <= r * r
    if shape == "triangle":  # apex up: its half-width grows linearly from the top
        top, bottom = c - r, c + r
        return (y >= top) & (y <= bottom) & (np.abs(x - c) <= (y - top) / 2)
    if shape == "cross":
        arm = max(size * 0.12, 0.75)
        inside = (np.abs(x - c) <= r) & (np.abs(y - c) <= r)
        return inside & ((np.abs(x - c) <= arm) | (np.abs(y - c) <= arm))
    raise ValueError(f"shape_scenes: unknown shape {shape!r}; shapes: {', '.join(SHAPES)}")


def shape_scenes(seed, count: int, *, image_size: int = 24, noise: float = 12.0) -> dict:
    """`count` scenes of `image_size` pixels a side (a multiple of 3, at least 9).

    Returns a dict of `images` uint8 `[count, image_size, image_size, 3]` (channels
    last) and lists of `count` strings: `captions`, `questions`, `answers`, and the
    scene's `shapes`, `colours` and `places`.
    """
    if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 1:
        raise ValueError(f"shape_scenes: count must be an integer >= 1, got {count!r}")
    if image_size % 3 or image_size < 9:
        raise ValueError(f"shape_scenes: image_size={image_size} must be a multiple of 3 "
                         f"and at least 9 (a 3 x 3 grid of cells)")
    rng = _rng(seed)
    cell = image_size // 3
    masks = {s: _shape_mask(s, cell) for s in SHAPES}
    colour_names = tuple(COLOURS)
    shape_of = rng.integers(len(SHAPES), size=count)
    colour_of = rng.integers(len(colour_names), size=count)
    place_of = rng.integers(len(PLACES), size=count)
    asked = rng.integers(3, size=count)  # 0: shape, 1: colour, 2: place
    background = rng.normal(30.0, noise, size=(count, image_size, image_size, 3))
    images = np.clip(background, 0, 255)
    out = dict(captions=[], questions=[], answers=[], shapes=[], colours=[], places=[])
    for i in range(count):
        shape, colour = SHAPES[shape_of[i]], colour_names[colour_of[i]]
        place = PLACES[place_of[i]]
        row, col = divmod(int(place_of[i]), 3)
        patch = images[i, row * cell:(row + 1) * cell, col * cell:(col + 1) * cell]
        patch[masks[shape]] = np.asarray(COLOURS[colour], np.float64)
        where = "in the centre" if place == "centre" else f"at the {place}"
        out["captions"].append(f"a {colour} {shape} {where}")
        if asked[i] == 0:
            q, a = f"what shape is {where}?", shape
        elif asked[i] == 1:
            q, a = f"what colour is the {shape}?", colour
        else:
            q, a = f"where is the {colour} {shape}?", place
        out["questions"].append(q)
        out["answers"].append(a)
        out["shapes"].append(shape)
        out["colours"].append(colour)
        out["places"].append(place)
    return dict(images=np.rint(images).astype(np.uint8), **out)


# ------------------------------------------------------------------- speech
DIGITS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
# Per digit: formants (F1, F2, F3 in Hz) at its start and end (a glide between two
# vowels), the pitch's relative rise over the digit, and a fricative onset (its noise
# band in Hz, or None): ten sounds a small model tells apart.
_VOICES = (
    ((300, 2300, 3000), (450, 800, 2300), 0.00, (5000, 7800)),   # zero: "z" + i -> u
    ((450, 800, 2400), (600, 1500, 2500), 0.10, None),          # one: u -> a
    ((700, 1200, 2500), (300, 800, 2300), -0.10, (2500, 5000)),  # two: "t" + u
    ((500, 1700, 2600), (300, 2300, 3000), 0.05, (1500, 4000)),  # three: "th" + i
    ((650, 1100, 2400), (500, 900, 2300), -0.15, (1500, 6000)),  # four: "f" + o
    ((750, 1250, 2500), (350, 2200, 2900), 0.15, (1500, 6000)),  # five: "f" + a -> i
    ((350, 2300, 3000), (550, 1900, 2600), -0.05, (4000, 7500)),  # six: "s" + i
    ((550, 1800, 2500), (500, 1100, 2400), 0.00, (4000, 7500)),  # seven: "s" + e -> o
    ((550, 1900, 2600), (350, 2300, 2900), 0.20, None),          # eight: e -> i
    ((300, 1000, 2300), (700, 1300, 2400), -0.20, None),         # nine: n -> a
)


def _formant_gain(freq, formants, bandwidth):
    """Sum of resonance peaks (one per formant, each broadcast against `freq`)."""
    return sum(1.0 / (1.0 + ((freq - f) / bandwidth) ** 2) for f in formants)


def _voiced(digit: int, n: int, sample_rate: int, pitch: float, tract: float) -> np.ndarray:
    """`[n]` samples of one digit's vowel glide: harmonics of a pitch contour, each
    weighted by the formant peaks at its frequency, under a raised-cosine envelope."""
    start, end, rise, _ = _VOICES[digit]
    u = np.linspace(0.0, 1.0, n)
    f0 = pitch * (1.0 + rise * u - 0.05 * u * u)  # [n]
    phase = 2 * np.pi * np.cumsum(f0) / sample_rate
    formants = [tract * (a + (b - a) * u) for a, b in zip(start, end)]  # each [n]
    k = np.arange(1, int(min(4000.0, sample_rate / 2 - 200) / f0.max()) + 1)[:, None]  # [K, 1]
    harmonics = (k * f0).astype(np.float32)  # [K, n]; float32: the bulk of the work
    gain = _formant_gain(harmonics, [f[None].astype(np.float32) for f in formants], 90.0)
    wave = (gain / k ** 0.5 * np.sin(k * phase.astype(np.float32))).sum(0, dtype=np.float64)
    ramp = max(1, int(0.02 * sample_rate))
    env = np.ones(n)
    env[:ramp] = 0.5 - 0.5 * np.cos(np.pi * np.arange(ramp) / ramp)
    env[-2 * ramp:] = np.minimum(env[-2 * ramp:], 0.5 + 0.5 * np.cos(
        np.pi * np.arange(min(2 * ramp, n)) / (2 * ramp)))
    return wave * env / max(np.abs(wave).max(), 1e-9)


def _fricative(band, n: int, sample_rate: int, rng) -> np.ndarray:
    """`[n]` samples of noise in `band` (Hz), shaped by a rise and fall."""
    spec = np.fft.rfft(rng.normal(size=n))
    f = np.fft.rfftfreq(n, 1.0 / sample_rate)
    spec[(f < band[0]) | (f > min(band[1], sample_rate / 2))] = 0
    noise = np.fft.irfft(spec, n)
    return noise / max(np.abs(noise).max(), 1e-9) * np.sin(np.pi * np.linspace(0, 1, n)) ** 2


def spoken_digit(seed, index: int, *, sample_rate: int = 16000, min_digits: int = 1,
                 max_digits: int = 4) -> tuple[np.ndarray, tuple[int, ...]]:
    """Utterance `index` of the stream `seed` (an int; a pure function of both):
    (waveform float32 `[samples]` in [-1, 1), on the 16-bit grid (k / 32768, as a
    16-bit WAV holds it), the digits spoken). One speaker per utterance: pitch 85-230
    Hz, tract length (formants x 0.88-1.12), speed 0.8-1.25, noise 25-45 dB below
    the voice; digits of 0.18-0.30 s (before speed) with pauses of 0.03-0.15 s and
    0.02-0.12 s of silence at each end: at most 1.98 s for 4 digits."""
    rng = np.random.default_rng([int(seed), int(index)])
    digits = tuple(int(d) for d in rng.integers(0, 10, rng.integers(min_digits, max_digits + 1)))
    pitch, tract = rng.uniform(85.0, 230.0), rng.uniform(0.88, 1.12)
    speed = rng.uniform(0.8, 1.25)
    sec = lambda lo, hi: int(rng.uniform(lo, hi) * sample_rate)  # noqa: E731
    pieces = [np.zeros(sec(0.02, 0.12))]
    for i, d in enumerate(digits):
        if i:
            pieces.append(np.zeros(sec(0.03, 0.15)))
        n = max(int(rng.uniform(0.18, 0.30) / speed * sample_rate), 64)
        band = _VOICES[d][3]
        if band is not None:  # a fricative onset, then the voice
            m = n // 4
            pieces.append(0.5 * _fricative(band, m, sample_rate, rng))
            n -= m
        pieces.append(_voiced(d, n, sample_rate, pitch * rng.uniform(0.95, 1.05), tract))
    pieces.append(np.zeros(sec(0.02, 0.12)))
    wave = 0.6 * np.concatenate(pieces)
    wave += rng.normal(size=wave.size) * 0.6 * 10 ** (-rng.uniform(25.0, 45.0) / 20)
    pcm = np.clip(np.rint(wave * 32768), -32768, 32767)
    return (pcm / 32768).astype(np.float32), digits


def spoken_digits(seed, count: int, *, start: int = 0, sample_rate: int = 16000,
                  min_digits: int = 1, max_digits: int = 4) -> dict:
    """Utterances `start` .. `start + count - 1` of the stream `seed`
    (`spoken_digit`): a dict of `audio` (a list of float32 waveforms), `digits`
    (tuples of ints), `texts` ("three one four") and `sample_rate`."""
    if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 1:
        raise ValueError(f"spoken_digits: count must be an integer >= 1, got {count!r}")
    if not 1 <= min_digits <= max_digits:
        raise ValueError(f"spoken_digits: need 1 <= min_digits <= max_digits, got "
                         f"{min_digits}, {max_digits}")
    if sample_rate < 16000:
        raise ValueError(f"spoken_digits: sample_rate={sample_rate} cannot hold the fricatives "
                         f"(up to 7.5 kHz); use 16000 or more")
    out = [spoken_digit(seed, i, sample_rate=sample_rate, min_digits=min_digits,
                        max_digits=max_digits) for i in range(start, start + count)]
    return dict(audio=[a for a, _ in out], digits=[d for _, d in out],
                texts=[digit_text(d) for _, d in out], sample_rate=sample_rate)


def digit_text(digits) -> str:
    """The label of `digits`: their names joined by spaces ("three one four")."""
    return " ".join(DIGITS[d] for d in digits)
