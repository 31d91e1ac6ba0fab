"""The model's vision section (`model.vision`): the image a vision encoder takes and
how it pools, and, for a model that carries an image tower beside its own stack
(a vision-language decoder), the tower's width, depth, heads and ffn (0 / "": the
model's own). `arch="vision"` is the encoder alone. See docs/multimodal.md.
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


def validate_vision(arch: str, position: str, v: VisionConfig, p: str) -> None:
    q = f"{p}.vision"
    for name in ("image_size", "image_width", "d_model", "num_layers", "num_heads", "d_ff",
                 "norm_eps"):
        non_negative(f"{q}.{name}", getattr(v, name))
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
