"""tfjax.data.synthetic_media: scenes and spoken digits are reproducible; what the
caption, question and answer say is what the image shows; an utterance holds one
voiced run per digit its label names."""

import numpy as np
import pytest

from tfjax.data.synthetic_media import COLOURS, DIGITS, PLACES, SHAPES, shape_scenes, spoken_digits


def test_same_seed_same_scenes_and_different_seeds_differ():
    a, b, c = shape_scenes(3, 16), shape_scenes(3, 16), shape_scenes(4, 16)
    np.testing.assert_array_equal(a["images"], b["images"])
    assert a["captions"] == b["captions"]
    assert not np.array_equal(a["images"], c["images"])


@pytest.mark.parametrize("image_size", [9, 24, 33])
def test_the_shape_is_drawn_in_its_colour_in_its_cell_only(image_size):
    scenes = shape_scenes(0, 40, image_size=image_size, noise=0.0)
    cell = image_size // 3
    assert scenes["images"].shape == (40, image_size, image_size, 3)
    assert set(scenes["shapes"]) == set(SHAPES) and set(scenes["places"]) <= set(PLACES)
    for i in range(40):
        image = scenes["images"][i]
        colour = np.asarray(COLOURS[scenes["colours"][i]])
        painted = np.all(image == colour, axis=-1)
        row, col = divmod(PLACES.index(scenes["places"][i]), 3)
        inside = np.zeros_like(painted)
        inside[row * cell:(row + 1) * cell, col * cell:(col + 1) * cell] = True
        assert painted[inside].sum() >= 3 and not painted[~inside].any()
        caption = scenes["captions"][i]
        assert scenes["shapes"][i] in caption and scenes["colours"][i] in caption
        assert scenes["answers"][i] in (scenes["shapes"][i], scenes["colours"][i],
                                        scenes["places"][i])


def test_shapes_differ_from_each_other():
    scenes = shape_scenes(1, 200, image_size=30, noise=0.0)
    drawn = {}
    for image, shape in zip(scenes["images"], scenes["shapes"]):
        drawn.setdefault(shape, set()).add(int((image.max(-1) > 100).sum()))
    sizes = [min(v) for v in drawn.values()]
    assert len(set(sizes)) == len(SHAPES)  # each shape paints its own pixel count


@pytest.mark.parametrize("kwargs, message", [
    (dict(count=0), "count must be an integer >= 1"),
    (dict(count=2, image_size=10), "image_size=10 must be a multiple of 3"),
])
def test_bad_arguments_are_one_line_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        shape_scenes(0, **kwargs)


# ------------------------------------------------------------------- speech
def voiced_runs(waveform):
    """Runs of 10 ms frames whose energy below 1 kHz (the voice's harmonics; fricatives
    and most of the noise are above) is within 12 dB of the loudest, apart by pauses: one per digit."""
    frames = waveform[: waveform.size // 160 * 160].reshape(-1, 160).astype(np.float64)
    low = (np.abs(np.fft.rfft(frames, axis=1))[:, :11] ** 2).sum(1)  # 100 Hz bins
    loud = np.flatnonzero(low > low.max() * 10 ** -1.2)
    return 1 + int(np.sum(np.diff(loud) > 3))  # a pause: 30 ms or more below it


def test_spoken_digits_are_reproducible_labelled_and_bounded():
    a, b = spoken_digits(5, 40), spoken_digits(5, 40)
    assert a["texts"] == b["texts"] and a["sample_rate"] == 16000
    for x, y in zip(a["audio"], b["audio"]):
        np.testing.assert_array_equal(x, y)
    assert spoken_digits(6, 5)["texts"] != a["texts"][:5]
    tail = spoken_digits(5, 10, start=30)  # utterance i is the same wherever it is drawn
    np.testing.assert_array_equal(tail["audio"][0], a["audio"][30])
    counts = set()
    for wave_, digits, text in zip(a["audio"], a["digits"], a["texts"]):
        assert text == " ".join(DIGITS[d] for d in digits) and 1 <= len(digits) <= 4
        counts.add(len(digits))
        assert wave_.dtype == np.float32 and 0.2 < wave_.size / 16000 <= 1.98
        assert np.abs(wave_).max() < 1.0
        np.testing.assert_array_equal(wave_ * 32768, np.rint(wave_ * 32768))  # 16-bit grid
        assert voiced_runs(wave_) == len(digits), (text, voiced_runs(wave_))
    assert counts == {1, 2, 3, 4}


def test_each_digit_sounds_different():
    """The ten digits' average spectra (one speaker: the same pitch and tract) differ:
    every pair is further apart than the same digit drawn twice."""
    from tfjax.data.synthetic_media import _voiced

    def spectrum(d, pitch):
        x = _voiced(d, 4000, 16000, pitch, 1.0)
        s = np.abs(np.fft.rfft(x)) ** 2
        return np.log(s[:2000].reshape(-1, 50).sum(1) + 1e-9)  # 40 bands of 250 Hz

    same = max(np.abs(spectrum(d, 120) - spectrum(d, 125)).mean() for d in range(10))
    apart = min(np.abs(spectrum(a, 120) - spectrum(b, 120)).mean()
                for a in range(10) for b in range(a + 1, 10))
    assert apart > same, (apart, same)


def test_spoken_digits_bad_arguments():
    with pytest.raises(ValueError, match="spoken_digits: count must be an integer >= 1"):
        spoken_digits(0, 0)
    with pytest.raises(ValueError, match="sample_rate=8000 cannot hold the fricatives"):
        spoken_digits(0, 1, sample_rate=8000)
