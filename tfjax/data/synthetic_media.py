"""Synthetic images with their descriptions, for training and testing multimodal models
at tiny scale on a CPU (`shape_scenes`).

Each scene is one coloured shape (square, circle, triangle, cross) on a dark, noisy
background, in one cell of a 3 x 3 grid, with a caption ("a red circle at the top
left") and a question with its one-word answer (shape, colour or place). Generators
are seeded numpy (`seed`: an int or a `np.random.Generator`): the same seed gives the
same scenes. `scene_examples` are the examples of `data.source="shapes"` (captioning
and VQA, PaliGemma's prompts); `python -m tfjax.data.synthetic_media --out DIR` writes
the same examples as jsonl + PNG files and as parquet with the PNG bytes. See
docs/multimodal.md ("Training").
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys

import numpy as np

__all__ = ["CAPTION_PROMPT", "COLOURS", "PLACES", "SCENE_SIZE", "SHAPES", "SPLITS",
           "scene_examples", "shape_scenes", "write_scenes"]

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


# data.source="shapes": scenes of SCENE_SIZE pixels, (seed, scenes) per split
SCENE_SIZE = 24
SPLITS = {"train": (0, 2000), "validation": (1, 100)}
CAPTION_PROMPT = "caption en"  # PaliGemma's; its VQA prompt is "answer en <question>"


def scene_examples(split: str, count: int | None = None) -> list[dict]:
    """The examples of `split` ("train" | "validation": `SPLITS`' seed and scene count,
    or the first `count` scenes): two per scene, in order, a caption (`prompt` "caption
    en") and a question ("answer en " + question), each a dict of `image` (uint8 `[24,
    24, 3]`), `prompt` and `target`."""
    if split not in SPLITS:
        raise ValueError(f"scene_examples: split {split!r}; splits: {', '.join(SPLITS)}")
    seed, n = SPLITS[split]
    n = n if count is None else count
    s = shape_scenes(seed, n, image_size=SCENE_SIZE)
    out = []
    for i in range(n):
        image = s["images"][i]
        out.append(dict(image=image, prompt=CAPTION_PROMPT, target=s["captions"][i]))
        out.append(dict(image=image, prompt=f"answer en {s['questions'][i]}",
                        target=s["answers"][i]))
    return out


def _png(image: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG")
    return buf.getvalue()


def write_scenes(out: str, counts: dict[str, int] | None = None) -> dict[str, list[str]]:
    """Write `scene_examples` of each split as `OUT/<split>.jsonl` (fields image: a PNG
    under `OUT/images/`, relative to the file; prompt; target) and `OUT/<split>.parquet`
    (image: the PNG's bytes); `counts`: scenes per split (default `SPLITS`'). Returns
    the files written per kind ("jsonl", "parquet")."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(os.path.join(out, "images"), exist_ok=True)
    written: dict[str, list[str]] = {"jsonl": [], "parquet": []}
    for split in SPLITS:
        examples = scene_examples(split, (counts or {}).get(split))
        names, pngs = [], []
        for i in range(0, len(examples), 2):  # a scene's two examples share its image
            name = f"images/{split}_{i // 2:05d}.png"
            png = _png(examples[i]["image"])
            with open(os.path.join(out, name), "wb") as f:
                f.write(png)
            names += [name, name]
            pngs += [png, png]
        path = os.path.join(out, f"{split}.jsonl")
        with open(path, "w") as f:
            for name, ex in zip(names, examples):
                f.write(json.dumps(dict(image=name, prompt=ex["prompt"],
                                        target=ex["target"])) + "\n")
        written["jsonl"].append(path)
        path = os.path.join(out, f"{split}.parquet")
        pq.write_table(pa.table({"image": pa.array(pngs, pa.binary()),
                                 "prompt": [ex["prompt"] for ex in examples],
                                 "target": [ex["target"] for ex in examples]}), path)
        written["parquet"].append(path)
    return written


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m tfjax.data.synthetic_media",
                                description="Write the shape scenes of data.source='shapes' "
                                "as jsonl + PNG files and as parquet with image bytes.")
    p.add_argument("--out", required=True, help="directory to write into")
    args = p.parse_args(argv)
    written = write_scenes(args.out)
    for kind, paths in written.items():
        print(f"{kind}: {', '.join(paths)}")
    print(f"train on them: --config.data.source=jsonl --config.data.paths=\"('"
          f"{written['jsonl'][0]}',)\" --config.data.val_paths=\"('{written['jsonl'][1]}',)\"")


if __name__ == "__main__":
    main(sys.argv[1:])
