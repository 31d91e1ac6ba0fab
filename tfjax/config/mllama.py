"""The vision tower of Llama-3.2-Vision (`MllamaVisionConfig`), resolved from a model
config's `model.vision` (its one home; 0 / "" fields take the model's): tiles of
`image_size` pixels cut into `patch_size` patches, a local encoder whose
`intermediate_layers` outputs are kept, a gated global encoder, and the projector to the
text model's width. See docs/multimodal.md ("Llama-3.2-Vision").
"""

from __future__ import annotations

import dataclasses

__all__ = ["MllamaVisionConfig", "aspect_ratios"]


def aspect_ratios(max_num_tiles: int) -> list[list[int]]:
    """Every (width, height) in tiles with width * height <= max_num_tiles, in the order
    of transformers' processor (HF's supported_aspect_ratios; id i + 1 is entry i)."""
    return [[w, h] for w in range(1, max_num_tiles + 1) for h in range(1, max_num_tiles + 1)
            if w * h <= max_num_tiles]


@dataclasses.dataclass(frozen=True)
class MllamaVisionConfig:
    d_model: int
    num_layers: int  # the local encoder
    num_global_layers: int  # the gated global encoder
    num_heads: int
    d_ff: int
    image_size: int  # a tile's side in pixels
    patch_size: int
    num_channels: int
    max_num_tiles: int
    max_aspect_ratio_id: int  # supported aspect ratios (id 0: no image)
    intermediate_layers: tuple[int, ...]  # local layers whose outputs are kept
    norm_eps: float  # the encoder blocks' layer norms
    activation: str
    text_dim: int  # the projector's output: the text model's d_model

    @classmethod
    def of(cls, cfg) -> "MllamaVisionConfig":
        """The tower of `cfg` (a validated ModelConfig) from `cfg.vision`."""
        v = cfg.vision
        tiles = v.max_num_tiles or 1
        return cls(d_model=v.d_model or cfg.d_model, num_layers=v.num_layers or cfg.num_layers,
                   num_global_layers=v.num_global_layers, num_heads=v.num_heads or cfg.num_heads,
                   d_ff=v.d_ff or cfg.d_ff, image_size=v.image_size, patch_size=v.patch_size,
                   num_channels=v.channels, max_num_tiles=tiles,
                   max_aspect_ratio_id=v.max_aspect_ratio_id or len(aspect_ratios(tiles)),
                   intermediate_layers=tuple(v.intermediate_layers),
                   norm_eps=v.norm_eps or cfg.norm_eps,
                   activation=v.activation or cfg.activation, text_dim=cfg.d_model)

    @property
    def patches(self) -> int:
        """Tokens per tile: the patches and the class token."""
        return (self.image_size // self.patch_size) ** 2 + 1

    @property
    def grid(self) -> int:
        """Patches along a tile's side."""
        return self.image_size // self.patch_size

    @property
    def output_dim(self) -> int:
        """The vision output's width: the global encoder's and the kept layers'."""
        return self.d_model * (len(self.intermediate_layers) + 1)
