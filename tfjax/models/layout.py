"""Where each layer of a layer stack lives: the one description of the stack's shape.

    layout = StackLayout.of(cfg, num_layers)
    layout.where(i) -> ("cycles", j, c)   position j of the cycle, cycle c (stacked axis)
                    | ("blocks", j)       the j-th unrolled block

Layers are grouped into cycles of lcm(len(layer_pattern), len(ffn_pattern)); with
`scan_layers` the whole cycles are stacked and scanned, the rest are unrolled blocks.
The stack, the inference caches and the checkpoint mapping follow it.
See docs/models.md.
"""

from __future__ import annotations

import dataclasses
import math

from tfjax.config import ModelConfig

__all__ = ["StackLayout"]


@dataclasses.dataclass(frozen=True)
class StackLayout:
    """pattern / ffn_pattern: the layer and ffn kinds of one cycle; num_cycles: the
    scanned cycles (0: none); the remaining layers are unrolled blocks."""

    pattern: tuple[str, ...]
    ffn_pattern: tuple[str, ...]
    num_layers: int
    num_cycles: int

    @classmethod
    def of(cls, cfg: ModelConfig, num_layers: int | None = None) -> "StackLayout":
        """The layout of a stack of `num_layers` layers (default `cfg.num_layers`)."""
        n = cfg.num_layers if num_layers is None else num_layers
        period = math.lcm(len(cfg.layer_pattern), len(cfg.ffn_pattern))
        return cls(pattern=tuple(cfg.layer_kind(i) for i in range(period)),
                   ffn_pattern=tuple(cfg.ffn_kind(i) for i in range(period)),
                   num_layers=n, num_cycles=n // period if cfg.scan_layers else 0)

    @property
    def cycle_length(self) -> int:
        return len(self.pattern)

    @property
    def num_blocks(self) -> int:
        return self.num_layers - self.num_cycles * self.cycle_length

    def where(self, i: int) -> tuple:
        """Layer i -> ("cycles", position in the cycle, cycle index) or ("blocks", j)."""
        if not 0 <= i < self.num_layers:
            raise IndexError(f"layer {i} of a stack of {self.num_layers} layers")
        scanned = self.num_cycles * self.cycle_length
        if i < scanned:
            return ("cycles", i % self.cycle_length, i // self.cycle_length)
        return ("blocks", i - scanned)

    def block_layer(self, j: int) -> int:
        """The layer index of unrolled block j."""
        return self.num_cycles * self.cycle_length + j

    def kind(self, i: int) -> str:
        """Layer i's layer kind."""
        return self.pattern[i % self.cycle_length]

    def ffn_kind(self, i: int) -> str:
        return self.ffn_pattern[i % self.cycle_length]
