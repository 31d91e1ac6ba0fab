"""tfjax.data.synthetic_media: scenes are reproducible and what the caption, question and
answer say is what the image shows."""

import numpy as np
import pytest

from tfjax.data.synthetic_media import COLOURS, PLACES, SHAPES, shape_scenes


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
