"""The host side of `train.objective="image_lm"`: examples of an image, a prompt and a
target text laid out as PaliGemma trains them.

A row is `[image tokens x P][bos] prompt "\\n" | target [eos]`, padded: the image tokens
(`model.vision.image_token_id`), BOS, prompt and newline are the bidirectional prefix
(`token_type_ids` 0), target and EOS the causal, scored suffix (type 1, padding too);
`pixel_values` the image at the model's size in [-1, 1] (`tfjax.data.images`). Examples:
`data.source="synthetic"` (`synthetic_media.scene_examples`) or jsonl / json / parquet /
datasets inputs with fields image, prompt, target (`read_examples`); image headers and
lengths are checked before the first batch. See docs/multimodal.md ("Training").
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tfjax.config import DataConfig, RunConfig, VisionConfig
from tfjax.data.images import check_image, load_image, pixel_values
from tfjax.data.objectives import ExampleBatches, read_examples, token_bytes_of
from tfjax.data.pipeline import BATCH_KEYS
from tfjax.data.synthetic_media import scene_examples

__all__ = ["IMAGE_TEXT_FIELDS", "IMAGE_TEXT_KEYS", "check_image_lm", "image_text_batches",
           "image_text_examples",
           "image_text_row"]

IMAGE_TEXT_FIELDS = {"image": "image", "prompt": "text", "target": "text"}
IMAGE_TEXT_KEYS = BATCH_KEYS + ("token_type_ids", "pixel_values")


def image_text_examples(cfg: DataConfig, split: str, vision: VisionConfig) -> list[dict]:
    """The examples of `split` (dicts of image, prompt, target and "where", for errors):
    `data.source="synthetic"`'s built-in scenes, or `read_examples` of the inputs, each
    image's header checked against `vision` (`check_image`)."""
    if cfg.source == "synthetic":
        return [dict(ex, where=f"data.source='synthetic' {split} example {i}")
                for i, ex in enumerate(scene_examples(split))]
    examples = read_examples(cfg, split, IMAGE_TEXT_FIELDS, where=True)
    for ex in examples:
        check_image(ex["image"], ex["where"], vision)
    return examples


def _encode_text(examples: Sequence[dict], tokenizer, vision: VisionConfig,
                 seq_len: int) -> list[dict]:
    """Each example's prefix ids (`[bos] + prompt + "\\n"`) and target ids (`target +
    [eos]`), checked: no image token in the text, and the row fits `seq_len`."""
    P, image_id = vision.image_tokens, vision.image_token_id
    out = []
    for ex in examples:
        prefix = np.concatenate([[tokenizer.bos_id], tokenizer.encode(ex["prompt"] + "\n")])
        target = np.concatenate([tokenizer.encode(ex["target"]), [tokenizer.eos_id]])
        for name, ids in (("prompt", prefix), ("target", target)):
            if (ids == image_id).any():
                raise ValueError(f"{ex['where']}: field {name!r} encodes to the image token "
                                 f"(id {image_id}, model.vision.image_token_id); the image "
                                 f"tokens are placed by the objective: drop it from the text")
        need = P + len(prefix) + len(target) - 1  # the inputs: all but the last target
        if need > seq_len:
            raise ValueError(f"{ex['where']}: the example needs {need} tokens a row ({P} image "
                             f"tokens, {len(prefix)} of BOS + prompt + newline, {len(target)} "
                             f"of target + EOS, less one), more than train.seq_len={seq_len}; "
                             f"raise train.seq_len or shorten the text")
        out.append(dict(image=ex["image"], where=ex["where"], prefix=prefix.astype(np.int32),
                        target=target.astype(np.int32)))
    return out


def image_text_row(examples: list[dict], seq_len: int, tokenizer, vision: VisionConfig) -> dict:
    """One example (`image`: uint8 `[H, W, C]` at the model's size, `prefix`, `target`
    ids) -> the `IMAGE_TEXT_KEYS` arrays of one row; no example: a row of padding
    (nothing scored, zero pixels)."""
    T, P = seq_len, vision.image_tokens
    t = np.arange(T)
    if not examples:
        z = np.zeros(T, np.int32)
        pad = np.full(T, tokenizer.pad_id, np.int32)
        shape = (vision.channels, vision.image_size, vision.width)
        return dict(inputs=pad, targets=pad, positions=z, segment_ids=z, mask=z,
                    target_bytes=z, token_type_ids=np.ones(T, np.int32),
                    pixel_values=np.zeros(shape, np.float32))
    (ex,) = examples
    full = np.concatenate([np.full(P, vision.image_token_id), ex["prefix"], ex["target"]])
    n, prefix = len(full) - 1, P + len(ex["prefix"])
    inputs = np.full(T, tokenizer.pad_id, np.int32)
    targets = inputs.copy()
    inputs[:n], targets[:n] = full[:-1], full[1:]
    # scored: the targets of the prompt's newline (the target's first token) .. the EOS
    mask = ((t >= prefix - 1) & (t < n)).astype(np.int32)
    return dict(inputs=inputs, targets=targets, positions=t.astype(np.int32),
                segment_ids=(t < n).astype(np.int32), mask=mask,
                target_bytes=token_bytes_of(tokenizer, targets) * mask,
                token_type_ids=(t >= prefix).astype(np.int32),
                pixel_values=pixel_values(ex["image"]))


def image_text_batches(examples: Sequence[dict], tokenizer, vision: VisionConfig, *,
                       seq_len: int, global_batch: int, local_rows: Sequence[int] | None = None,
                       seed: int = 0, shuffle: bool = True, repeat: bool = True) -> ExampleBatches:
    """Checkpointable batches of `image_text_row`s, one example a row (`ExampleBatches`;
    the images decoded and resized as each row is made, `load_image`)."""
    encoded = _encode_text(examples, tokenizer, vision, seq_len)

    def encode(ex):
        return dict(ex, image=load_image(ex["image"], ex["where"], vision))

    return ExampleBatches(encoded, encode,
                          lambda exs: image_text_row(exs, seq_len, tokenizer, vision),
                          global_batch=global_batch, local_rows=local_rows, seed=seed,
                          shuffle=shuffle, repeat=repeat)


def check_image_lm(cfg: RunConfig, tokenizer) -> None:
    """image_lm's one-line config errors: no image tower, a source without images, an
    image token the text can produce, rows too short for the image tokens."""
    m, v, t = cfg.model, cfg.model.vision, cfg.train
    if not v.image_size:
        raise ValueError("train.objective: 'image_lm' trains a decoder with an image tower; set "
                         "model.vision (image_size, patch_size, the tower's sizes, "
                         "image_token_id), as configs/paligemma.py does")
    if cfg.data.source not in ("synthetic", "jsonl"):
        raise ValueError(f"data.source: 'image_lm' reads examples of image, prompt and target "
                         f"(data.source='jsonl': jsonl, json, parquet or datasets inputs) or the "
                         f"shipped scenes ('synthetic'), not {cfg.data.source!r}")
    i = v.image_token_id
    if i >= m.vocab_size or i in (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id) or (
            i < len(tokenizer.token_bytes) and tokenizer.token_bytes[i] > 0):
        raise ValueError(f"model.vision.image_token_id: {i} must be an id of the model "
                         f"(< model.vocab_size={m.vocab_size}) that the text never uses; set it "
                         f"to {tokenizer.vocab_size} (above the tokenizer's vocabulary) and "
                         f"model.vocab_size to {tokenizer.vocab_size + 1} or more")
    if t.seq_len < v.image_tokens + 4:
        raise ValueError(f"train.seq_len: {t.seq_len} cannot hold a row's {v.image_tokens} image "
                         f"tokens, BOS, a prompt and a target; set it well above "
                         f"{v.image_tokens + 3}")
