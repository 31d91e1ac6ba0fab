"""Synthetic images with their descriptions, for training and testing multimodal models
at tiny scale on a CPU (`shape_scenes`).

Each scene is one coloured shape (square, circle, triangle, cross) on a dark, noisy
background, in one cell of a 3 x 3 grid, with a caption ("a red circle at the top
left") and a question with its one-word answer (shape, colour or place). Generators
are seeded numpy (`seed`: an int or a `np.random.Generator`): the same seed gives the
same scenes. See docs/multimodal.md ("Training").
"""

from __future__ import annotations

import numpy as np

__all__ = ["COLOURS", "PLACES", "SHAPES", "shape_scenes"]

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
