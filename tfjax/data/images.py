"""Images of examples as a vision model takes them: decoded (PNG, JPEG, ... by Pillow,
the `vision` extra) from a path, bytes, a `datasets` Image record or an array; checked
against `model.vision.channels`; resized to the model's size as Hugging Face's SigLIP /
PaliGemma processors do (bicubic); scaled to the float `[C, H, W]` input in [-1, 1].
Errors are one line naming the file and line / row. See docs/data.md ("Images").
"""

from __future__ import annotations

import base64
import io
import os

import numpy as np
from etils import epath

from tfjax.config.vision import VisionConfig

__all__ = ["check_image", "check_image_value", "load_image", "pixel_values", "resolve_image"]

_DATA_URI = "data:"
# Pillow modes read as they are (their bands are the channels); "P" (a palette) reads
# as RGB, or RGBA when it has a transparent colour; "1" (bilevel) as L
_PLAIN = ("L", "LA", "RGB", "RGBA", "CMYK")


def _pil():
    try:
        from PIL import Image
    except ImportError:
        raise ValueError("images need the `Pillow` package: pip install 'tfjax[vision]'"
                         ) from None
    return Image


def check_image_value(where: str, name: str, value) -> None:
    """A one-line ValueError unless `value` can name an image: a non-empty string (a
    path, or a base64 `data:` URI), bytes, a `datasets` Image record ({"bytes",
    "path"}), a Pillow image or a uint8 array."""
    ok = ((isinstance(value, str) and value.strip()) or isinstance(value, (bytes, bytearray))
          or (isinstance(value, dict) and (value.get("bytes") or value.get("path")))
          or hasattr(value, "getbands")
          or (isinstance(value, np.ndarray) and value.dtype == np.uint8))
    if not ok:
        raise ValueError(f"{where}: field {name!r} must name an image (a path relative to the "
                         f"file, a base64 data: URI, or bytes), got {_short(value)}")


def resolve_image(value, base: str):
    """`value` with a relative path made relative to the directory `base` (the file
    that names it); other values as they are."""
    if isinstance(value, dict) and not value.get("bytes") and value.get("path"):
        value = value["path"]
    if (isinstance(value, str) and not value.startswith(_DATA_URI) and "://" not in value
            and not os.path.isabs(value)):
        return os.path.join(base, value)
    return value


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _open(value, where: str, name: str, load: bool):
    """(Pillow image, what it is for errors); `load=False` reads the header only."""
    Image = _pil()
    if hasattr(value, "getbands"):
        return value, "the image"
    if isinstance(value, dict):
        value = value.get("bytes") or value.get("path")
    if isinstance(value, str) and value.startswith(_DATA_URI):
        what = "the data: URI"
        try:
            data = base64.b64decode(value.partition(",")[2], validate=True)
        except ValueError as e:
            raise ValueError(f"{where}: field {name!r}: {what} is not base64 ({e})") from None
    elif isinstance(value, str):
        what = value
        try:
            data = epath.Path(value).read_bytes()
        except FileNotFoundError:
            raise ValueError(f"{where}: field {name!r}: no image file {value} (a relative path "
                             f"is read from the directory of the file that names it)") from None
        except OSError as e:
            raise ValueError(f"{where}: field {name!r}: cannot read {value} ({e})") from None
    else:
        what, data = f"its {len(value)} bytes", bytes(value)
    try:
        img = Image.open(io.BytesIO(data))
        if load:
            img.load()
    except Exception as e:  # Pillow raises UnidentifiedImageError, OSError, SyntaxError...
        raise ValueError(f"{where}: field {name!r}: {what} is not an image Pillow can decode "
                         f"({type(e).__name__}: {e}); give a PNG or JPEG") from None
    return img, what


def _checked(value, where: str, vision: VisionConfig, name: str, load: bool):
    """(Pillow image in a plain mode, or the uint8 `[H, W, C]` array) after the channel
    check."""
    C = vision.channels
    if isinstance(value, np.ndarray):
        if value.ndim not in (2, 3) or value.dtype != np.uint8:
            raise ValueError(f"{where}: field {name!r}: an image array must be uint8 [H, W, C], "
                             f"got {value.dtype} {value.shape}")
        img = value if value.ndim == 3 else value[..., None]
        what, channels, mode = "the image array", img.shape[-1], None
    else:
        img, what = _open(value, where, name, load)
        mode = img.mode
        if mode not in _PLAIN + ("P", "1"):
            raise ValueError(f"{where}: field {name!r}: {what} has Pillow mode {mode!r} "
                             f"(16-bit or float pixels); give 8-bit images (L, RGB)")
        channels = (4 if "transparency" in img.info else 3) if mode == "P" else len(img.getbands())
    if channels != C:
        kind = f" (mode {mode})" if mode else ""
        raise ValueError(f"{where}: field {name!r}: {what} has {channels} channel(s){kind}, the "
                         f"model takes {C} (model.vision.channels); convert the image (e.g. "
                         f"Pillow's .convert({'RGB' if C == 3 else 'L'!r})) or set "
                         f"model.vision.channels")
    return img


def check_image(value, where: str, vision: VisionConfig, name: str = "image") -> None:
    """`load_image`'s checks from the image's header alone (not decoded): it opens, is
    8-bit and has `vision.channels` channels; else a one-line ValueError."""
    _checked(value, where, vision, name, load=False)


def load_image(value, where: str, vision: VisionConfig, name: str = "image") -> np.ndarray:
    """The image `value` names (`check_image_value`; a path already resolved) as uint8
    `[H, W, C]` at the model's size (`vision.image_size`, `vision.width`): resized with
    bicubic resampling when it is another size (Hugging Face's SiglipImageProcessor /
    PaliGemmaProcessor do the same). An image of another channel count than
    `vision.channels` is a one-line ValueError naming `where` and the field."""
    Image = _pil()
    H, W = vision.image_size, vision.width
    img = _checked(value, where, vision, name, load=True)
    if isinstance(img, np.ndarray):
        if img.shape[:2] == (H, W):
            return img
        img = Image.fromarray(img if img.shape[-1] > 1 else img[..., 0])
    elif img.mode == "P":
        img = img.convert("RGBA" if "transparency" in img.info else "RGB")
    elif img.mode == "1":
        img = img.convert("L")
    if img.size != (W, H):
        img = img.resize((W, H), Image.Resampling.BICUBIC)
    out = np.asarray(img, np.uint8)
    return out if out.ndim == 3 else out[..., None]


def pixel_values(images: np.ndarray) -> np.ndarray:
    """uint8 images `[..., H, W, C]` -> float32 `[..., C, H, W]` in [-1, 1] (SigLIP and
    PaliGemma's normalisation: x / 255, then mean 0.5 and std 0.5 per channel)."""
    x = np.asarray(images, np.float32) * (2.0 / 255.0) - 1.0
    return np.moveaxis(x, -1, -3)
