"""image_lm's host side (tfjax.data.image_text, tfjax.data.images): the row layout against
a hand-made example, images read from paths, bytes, parquet and data: URIs, the files
`python -m tfjax.data.synthetic_media` writes giving the built-in source's batches, and
the one-line errors of bad images and examples."""

import base64
import io
import json

import numpy as np
import pytest
from PIL import Image

from tfjax.config import DataConfig, VisionConfig
from tfjax.data import synthetic_media
from tfjax.data.image_text import image_text_batches, image_text_examples, image_text_row
from tfjax.data.images import load_image, pixel_values
from tfjax.data.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
VISION = VisionConfig(image_size=8, patch_size=4, image_token_id=259)  # 4 image tokens


def _png(array, mode=None):
    buf = io.BytesIO()
    Image.fromarray(array, mode).save(buf, format="PNG")
    return buf.getvalue()


def test_a_row_is_image_prompt_target_with_the_loss_on_the_target():
    image = np.arange(8 * 8 * 3, dtype=np.uint8).reshape(8, 8, 3)
    ex = dict(image=image, prefix=np.array([257, *b"cap\n"]), target=np.array([*b"ab", 258]))
    row = image_text_row([ex], 16, TOK, VISION)
    I, B, E, pad = 259, 257, 258, 256
    c, a, p, nl, b = b"cap\nb"
    np.testing.assert_array_equal(row["inputs"], [I, I, I, I, B, c, a, p, nl, a, b] + [pad] * 5)
    np.testing.assert_array_equal(row["targets"], [I, I, I, B, c, a, p, nl, a, b, E] + [pad] * 5)
    # scored: the newline's target (the first target byte), the second byte, the EOS
    np.testing.assert_array_equal(row["mask"], [0] * 8 + [1, 1, 1] + [0] * 5)
    np.testing.assert_array_equal(row["target_bytes"], [0] * 8 + [1, 1, 0] + [0] * 5)
    # the image, BOS, prompt and newline are the prefix (type 0); target and padding type 1
    np.testing.assert_array_equal(row["token_type_ids"], [0] * 9 + [1] * 7)
    np.testing.assert_array_equal(row["segment_ids"], [1] * 11 + [0] * 5)
    np.testing.assert_array_equal(row["positions"], np.arange(16))
    assert row["pixel_values"].shape == (3, 8, 8) and row["pixel_values"].dtype == np.float32
    np.testing.assert_allclose(row["pixel_values"][:, 0, 1], np.array([3, 4, 5]) / 127.5 - 1)
    empty = image_text_row([], 16, TOK, VISION)
    assert not empty["mask"].any() and not empty["segment_ids"].any()


def test_the_rows_type_ids_make_the_models_prefix():
    """Through ImagePrefixLM: a prompt token sees a later prompt token (bidirectional
    prefix) but not the target (causal suffix)."""
    import jax.numpy as jnp
    from flax import nnx

    from tfjax.models import build

    model = build(dict(vocab_size=260, d_model=32, num_layers=2, num_heads=4, d_ff=48,
                       prefix_lm=True, vision=dict(image_size=8, patch_size=4, d_model=16,
                                                   num_layers=1, num_heads=2, d_ff=16,
                                                   image_token_id=259)), rngs=nnx.Rngs(0))
    image = np.random.default_rng(0).integers(0, 256, (8, 8, 3), dtype=np.uint8)

    def logits(prompt, target):
        ex = dict(image=image, prefix=np.array([257, *prompt]), target=np.array([*target, 258]))
        r = image_text_row([ex], 16, TOK, VISION)
        return np.asarray(model(jnp.asarray(r["inputs"][None]),
                                pixel_values=jnp.asarray(r["pixel_values"][None]),
                                token_type_ids=jnp.asarray(r["token_type_ids"][None]),
                                segment_ids=jnp.asarray(r["segment_ids"][None])))[0]

    base = logits(b"cap\n", b"ab")
    assert np.abs(logits(b"cop\n", b"ab")[5] - base[5]).max() > 1e-4  # 'c' sees the 'o'
    np.testing.assert_allclose(logits(b"cap\n", b"xb")[:9], base[:9], atol=1e-6)  # prefix


@pytest.fixture(scope="module")
def scenes(tmp_path_factory):
    """The built-in scenes (4 train, 2 validation) and the files the writer makes."""
    mp = pytest.MonkeyPatch()
    mp.setattr(synthetic_media, "SPLITS", {"train": (0, 4), "validation": (1, 2)})
    out = tmp_path_factory.mktemp("scenes")
    written = synthetic_media.write_scenes(str(out))
    yield out, written
    mp.undo()


def _batches(data, split, vision=VISION, seq_len=64):
    examples = image_text_examples(data, split, vision)
    it = image_text_batches(examples, TOK, vision, seq_len=seq_len, global_batch=4, seed=3,
                            shuffle=split == "train", repeat=split == "train")
    return [next(it) for _ in range(3)] if split == "train" else list(it)


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "json"])
def test_the_written_files_give_the_built_in_batches(scenes, kind):
    out, written = scenes
    if kind == "json":  # a .json list with the images inline, as base64 data: URIs
        for split in ("train", "validation"):
            rows = [json.loads(line) for line in open(out / f"{split}.jsonl")]
            for r in rows:
                r["image"] = ("data:image/png;base64," + base64.b64encode(
                    (out / r["image"]).read_bytes()).decode())
            (out / f"{split}.json").write_text(json.dumps(rows))
        paths = [str(out / "train.json"), str(out / "validation.json")]
    else:
        paths = written[kind]
    files = DataConfig(source="jsonl", paths=(paths[0],), val_paths=(paths[1],))
    for split in ("train", "validation"):
        want = _batches(DataConfig(source="synthetic"), split)
        got = _batches(files, split)
        assert len(got) == len(want) > 0
        for w, g in zip(want, got):
            assert sorted(w) == sorted(g)
            for k in w:
                np.testing.assert_array_equal(g[k], w[k], err_msg=k)
    # 4 scenes a caption and a question each; the image resized from 24 to 8 pixels
    assert want[0]["pixel_values"].shape == (4, 3, 8, 8)


def test_batches_resume_exactly(scenes):
    examples = image_text_examples(DataConfig(source="synthetic"), "train", VISION)
    it = image_text_batches(examples, TOK, VISION, seq_len=64, global_batch=3, seed=1)
    next(it), next(it)
    state = json.loads(json.dumps(it.get_state()))
    want = [next(it) for _ in range(3)]
    again = image_text_batches(examples, TOK, VISION, seq_len=64, global_batch=3, seed=1)
    again.set_state(state)
    for w in want:
        g = next(again)
        for k in w:
            np.testing.assert_array_equal(g[k], w[k], err_msg=k)


def test_images_are_resized_and_scaled_as_the_siglip_processor_does():
    transformers = pytest.importorskip("transformers")
    image = np.random.default_rng(0).integers(0, 256, (13, 10, 3), dtype=np.uint8)
    vision = VisionConfig(image_size=8, image_width=12, patch_size=4)
    got = pixel_values(load_image(_png(image), "x", vision))
    proc = transformers.SiglipImageProcessor(size={"height": 8, "width": 12})
    want = proc(Image.fromarray(image), return_tensors="np")["pixel_values"][0]
    assert got.shape == want.shape == (3, 8, 12)
    np.testing.assert_allclose(got, want, atol=1e-6)


def _write(tmp_path, rows, name="data.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return DataConfig(source="jsonl", paths=(str(path),), val_paths=(str(path),))


RGB = np.zeros((8, 8, 3), np.uint8)


@pytest.mark.parametrize("image,match", [
    (np.zeros((8, 8), np.uint8), r"data.jsonl:2: field 'image': .*gray.png has 1 channel\(s\) "
     r"\(mode L\), the model takes 3 \(model.vision.channels\); convert"),
    (np.zeros((8, 8, 4), np.uint8), r"data.jsonl:2: .*has 4 channel\(s\) \(mode RGBA\)"),
    (b"not a png", r"data.jsonl:2: field 'image': .*bad.png is not an image Pillow can decode"),
    (None, r"data.jsonl:2: field 'image': no image file .*missing.png \(a relative path"),
    (7, r"data.jsonl:2: field 'image' must name an image .*got 7"),
])
def test_bad_images_are_one_line_naming_file_and_line(tmp_path, image, match):
    (tmp_path / "ok.png").write_bytes(_png(RGB))
    if isinstance(image, np.ndarray):
        name = "gray.png" if image.ndim == 2 else "rgba.png"
        (tmp_path / name).write_bytes(_png(image))
    elif isinstance(image, bytes):
        name = "bad.png"
        (tmp_path / name).write_bytes(image)
    else:
        name = "missing.png" if image is None else image
    rows = [dict(image="ok.png", prompt="caption en", target="a"),
            dict(image=name, prompt="caption en", target="b")]
    with pytest.raises(ValueError, match=match) as e:
        image_text_examples(_write(tmp_path, rows), "train", VISION)
    assert "\n" not in str(e.value)


def test_a_bad_parquet_image_names_the_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"image": [_png(RGB), _png(np.zeros((8, 8), np.uint8))],
                             "prompt": ["p", "p"], "target": ["a", "b"]}), path)
    data = DataConfig(source="jsonl", paths=(str(path),), val_paths=(str(path),))
    with pytest.raises(ValueError, match=r"d.parquet: row 1 \(0-based\): field 'image': its "
                                         r"\d+ bytes has 1 channel"):
        image_text_examples(data, "train", VISION)


def test_an_example_longer_than_the_row_names_seq_len(tmp_path):
    (tmp_path / "ok.png").write_bytes(_png(RGB))
    data = _write(tmp_path, [dict(image="ok.png", prompt="caption en", target="x" * 40)])
    examples = image_text_examples(data, "train", VISION)
    with pytest.raises(ValueError, match=r"data.jsonl:1: the example needs 56 tokens a row \(4 "
                                         r"image tokens, 12 of BOS \+ prompt \+ newline, 41 .*"
                                         r"train.seq_len=48"):
        image_text_batches(examples, TOK, VISION, seq_len=48, global_batch=1)


def test_a_datasets_directory_with_an_image_feature(scenes, tmp_path):
    datasets = pytest.importorskip("datasets")
    out, _ = scenes
    for split in ("train", "validation"):
        rows = [json.loads(line) for line in open(out / f"{split}.jsonl")]
        ds = datasets.Dataset.from_dict({
            "image": [str(out / r["image"]) for r in rows],
            "prompt": [r["prompt"] for r in rows], "target": [r["target"] for r in rows],
        }).cast_column("image", datasets.Image())
        ds.save_to_disk(str(tmp_path / split))
    data = DataConfig(source="jsonl", paths=(str(tmp_path / "train"),),
                      val_paths=(str(tmp_path / "validation"),))
    for split in ("train", "validation"):
        want = _batches(DataConfig(source="synthetic"), split)
        for w, g in zip(want, _batches(data, split)):
            for k in w:
                np.testing.assert_array_equal(g[k], w[k], err_msg=k)
