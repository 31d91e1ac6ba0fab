"""The model's vision section (`model.vision`): the image a vision encoder takes and
how it pools, and, for a model that carries an image tower beside its own stack
(a vision-language decoder), the tower's width, depth, heads and ffn (0 / "": the
model's own). `arch="vision"` is the encoder alone; a decoder with images is an
image-prefix model, or with "cross" layers Llama-3.2-Vision (its tiled tower's fields
below). See docs/multimodal.md.
"""

from __future__ import annotations

import dataclasses

from tfjax.config.checks import fail, non_negative, one_of, positive

__all__ = ["IMAGE_ATTENTION", "POOLINGS", "PROJECTORS", "VisionConfig", "validate_vision"]

# none: the patch features only (PaliGemma's tower); cls: a learned class token in
# front, pooled as its final feature (ViT); map: multihead attention pooling by a
# learned probe, then a norm and an MLP (SigLIP's head)
POOLINGS = ("none", "cls", "map")
# a decoder's image features -> its image tokens: linear (PaliGemma: one token per
# patch, a linear layer with a bias); pooled (Gemma 3: the patch grid average-pooled to
# tokens_per_image, an RMSNorm (1 + w), a linear map without a bias)
PROJECTORS = ("linear", "pooled")
# what a decoder's image tokens see: prefix (PaliGemma: the type-0 tokens, image and
# prompt, are one bidirectional prefix, model.prefix_lm); blocks (Gemma 3: each run of
# image tokens sees itself both ways, everything else is causal)
IMAGE_ATTENTION = ("prefix", "blocks")


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    image_size: int = 0  # image height in pixels; 0: no vision input
    image_width: int = 0  # 0 -> image_size (square)
    patch_size: int = 16  # square patches; must divide the image's height and width
    channels: int = 3
    pooling: str = "none"  # none | cls | map
    # a decoder's image placeholder token: its positions take the image's patch
    # features, in order (PaliGemma's <image>); -1: none
    image_token_id: int = -1
    projector: str = "linear"  # linear | pooled (PROJECTORS)
    tokens_per_image: int = 0  # "pooled": image tokens per image, a square number
    image_attention: str = "prefix"  # prefix | blocks (IMAGE_ATTENTION)
    # the image tower of a model whose own stack is not it (0 / "": the model's field)
    d_model: int = 0
    num_layers: int = 0
    num_heads: int = 0
    d_ff: int = 0
    activation: str = ""
    norm_eps: float = 0.0
    # Llama-3.2-Vision's tiled tower (a decoder whose layer_pattern has "cross" layers;
    # tfjax.config.mllama): num_layers local layers, then num_global_layers gated ones
    num_global_layers: int = 0
    max_num_tiles: int = 0  # tiles of image_size pixels an image is cut into; 0 -> 1
    # aspect-ratio ids (id 0: none); 0 -> every (w, h) tiles with w h <= max_num_tiles
    max_aspect_ratio_id: int = 0
    intermediate_layers: tuple[int, ...] = ()  # local layers whose outputs join the features
    # embedding rows past the head's, input-only (Mllama's 8: <|image|> and reserved
    # ids); the logits are the first vocab_size - image_token_rows
    image_token_rows: int = 0

    @property
    def width(self) -> int:
        return self.image_width or self.image_size

    @property
    def grid(self) -> tuple[int, int]:
        """(patch rows, patch columns)."""
        return self.image_size // self.patch_size, self.width // self.patch_size

    @property
    def num_patches(self) -> int:
        rows, cols = self.grid
        return rows * cols

    @property
    def image_tokens(self) -> int:
        """A decoder's image tokens per image: one per patch, or the pooled grid's."""
        return self.tokens_per_image if self.projector == "pooled" else self.num_patches


# the fields only Llama-3.2-Vision's tiled tower reads
_TILED = ("num_global_layers", "max_num_tiles", "max_aspect_ratio_id", "intermediate_layers",
          "image_token_rows")


def validate_vision(c, p: str) -> None:
    """`c`: the ModelConfig whose `vision` section this is."""
    arch, position, v, q = c.arch, c.position, c.vision, f"{p}.vision"
    for name in ("image_size", "image_width", "d_model", "num_layers", "num_heads", "d_ff",
                 "norm_eps", "num_global_layers", "max_num_tiles", "max_aspect_ratio_id",
                 "image_token_rows"):
        non_negative(f"{q}.{name}", getattr(v, name))
    tiled = arch == "decoder" and bool(v.image_size) and "cross" in c.layer_pattern
    if not tiled:
        for name in _TILED:
            if getattr(v, name):
                fail(f"{q}.{name}", "is for Llama-3.2-Vision's tiled tower, which a decoder "
                     "with images (vision.image_size) and 'cross' layers in layer_pattern has; "
                     "set it to 0 / ()")
    positive(f"{q}.patch_size", v.patch_size)
    positive(f"{q}.channels", v.channels)
    one_of(f"{q}.pooling", v.pooling, POOLINGS)
    one_of(f"{q}.projector", v.projector, PROJECTORS)
    one_of(f"{q}.image_attention", v.image_attention, IMAGE_ATTENTION)
    non_negative(f"{q}.tokens_per_image", v.tokens_per_image)
    if arch == "vision" and not v.image_size:
        fail(f"{q}.image_size", "arch='vision' needs the image's size in pixels, e.g. 224")
    if arch == "vision" and position != "learned":
        fail(f"{p}.position", f"arch='vision' adds a learned table of patch positions: set "
             f"'learned', got {position!r}")
    if not v.image_size:
        if v.image_token_id >= 0:
            fail(f"{q}.image_token_id", "an image token needs images: set vision.image_size "
                 "(and the tower), or image_token_id=-1")
        return
    if tiled:
        _validate_tiled(c, p)
        return
    if arch == "decoder" and v.image_token_id < 0:
        fail(f"{q}.image_token_id", "a decoder with images places their features at an image "
             "token: set its id (PaliGemma's <image>)")
    if arch not in ("decoder", "vision"):
        fail(f"{q}.image_size", f"images go into arch='vision' or a 'decoder' (its prefix), "
             f"not arch={arch!r}; set image_size=0")
    for name, size in (("image_size", v.image_size), ("image_width", v.width)):
        if size % v.patch_size:
            fail(f"{q}.{name}", f"{size} pixels is not a whole number of patches of "
                 f"patch_size={v.patch_size}; use a multiple of it")
    if v.projector == "pooled":
        side, (rows, cols) = round(v.tokens_per_image ** 0.5), v.grid
        if not v.tokens_per_image or side * side != v.tokens_per_image or rows != cols \
                or rows % side:
            fail(f"{q}.tokens_per_image", f"the pooled projector averages the {rows} x {cols} "
                 f"patch grid in square windows: set a square number whose side divides "
                 f"{rows} (square images), got {v.tokens_per_image}")
    if arch == "vision" and any((v.d_model, v.num_layers, v.num_heads, v.d_ff)):
        fail(f"{q}.d_model", "arch='vision' is the tower itself: set model.d_model, "
             "num_layers, num_heads, d_ff and leave vision.d_model / num_layers / num_heads / "
             "d_ff at 0")


def _validate_tiled(c, p: str) -> None:
    """Llama-3.2-Vision's tower (`tfjax.config.mllama.MllamaVisionConfig.of`)."""
    v, q = c.vision, f"{p}.vision"
    if v.image_width and v.image_width != v.image_size:
        fail(f"{q}.image_width", f"Llama-3.2-Vision's tiles are square: set 0 or image_size="
             f"{v.image_size}, got {v.image_width}")
    if v.image_size % v.patch_size:
        fail(f"{q}.image_size", f"{v.image_size} pixels is not a whole number of patches of "
             f"patch_size={v.patch_size}; use a multiple of it")
    if v.pooling != "none":
        fail(f"{q}.pooling", f"the cross layers read every patch feature: set 'none', got "
             f"{v.pooling!r}")
    for name, default in (("projector", "linear"), ("image_attention", "prefix"),
                          ("tokens_per_image", 0)):
        if getattr(v, name) != default:
            fail(f"{q}.{name}", f"is for image-prefix decoders; Llama-3.2-Vision's images "
                 f"enter through the 'cross' layers: leave it at {default!r}")
    if c.prefix_lm:
        fail(f"{p}.prefix_lm", "the images enter through the 'cross' layers, not as a "
             "prefix: set False (or drop the cross layers for an image-prefix decoder)")
    d, heads = v.d_model or c.d_model, v.num_heads or c.num_heads
    if d % heads:
        fail(f"{q}.num_heads", f"the tower's width {d} is not divisible by its {heads} heads; "
             "set vision.d_model / vision.num_heads")
    layers = v.num_layers or c.num_layers
    bad = [i for i in v.intermediate_layers if not 0 <= i < layers]
    if bad:
        fail(f"{q}.intermediate_layers", f"{bad} are not layers of the {layers}-layer local "
             "encoder (vision.num_layers)")
    if v.image_token_rows >= c.vocab_size:
        fail(f"{q}.image_token_rows", f"{v.image_token_rows} input-only rows leave no logits "
             f"of vocab_size={c.vocab_size}")
