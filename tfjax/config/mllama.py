"""The vision tower of Llama-3.2-Vision (`MllamaVisionConfig`): tiles of
`image_size` pixels cut into `patch_size` patches, a local encoder whose
`intermediate_layers` outputs are kept, a gated global encoder, and the projector to the
text model's width. The text side is a `ModelConfig` whose `layer_pattern` holds
"cross" layers. See docs/multimodal.md ("Llama-3.2-Vision").
"""

from __future__ import annotations

import dataclasses

__all__ = ["MllamaVisionConfig"]


@dataclasses.dataclass(frozen=True)
class MllamaVisionConfig:
    d_model: int = 32
    num_layers: int = 4  # the local encoder
    num_global_layers: int = 2  # the gated global encoder
    num_heads: int = 4
    d_ff: int = 64
    image_size: int = 28  # a tile's side in pixels
    patch_size: int = 14
    num_channels: int = 3
    max_num_tiles: int = 4
    max_aspect_ratio_id: int = 8  # supported aspect ratios (id 0: no image)
    intermediate_layers: tuple[int, ...] = (1, 3)  # local layers whose outputs are kept
    norm_eps: float = 1e-5  # the encoders' layer norms (layernorm_pre / _post: 1e-5)
    activation: str = "gelu"
    text_dim: int = 64  # the projector's output: the text model's d_model

    @property
    def patches(self) -> int:
        """Tokens per tile: the patches and the class token."""
        return (self.image_size // self.patch_size) ** 2 + 1

    @property
    def output_dim(self) -> int:
        """The vision output's width: the global encoder's and the kept layers'."""
        return self.d_model * (len(self.intermediate_layers) + 1)

    def validate(self) -> "MllamaVisionConfig":
        if self.image_size % self.patch_size:
            raise ValueError(f"vision.image_size={self.image_size} must be a multiple of "
                             f"vision.patch_size={self.patch_size}")
        if self.d_model % self.num_heads:
            raise ValueError(f"vision.d_model={self.d_model} must be divisible by "
                             f"vision.num_heads={self.num_heads}")
        bad = [i for i in self.intermediate_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"vision.intermediate_layers: {bad} are not layers of the "
                             f"{self.num_layers}-layer local encoder")
        return self
