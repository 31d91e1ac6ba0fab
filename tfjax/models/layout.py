"""Where each layer of a layer stack lives: the one description of the stack's shape.

A stack of `num_layers` layers is grouped into cycles of `lcm(len(layer_pattern),
len(ffn_pattern))` layers (layer i has mixer kind `layer_pattern[i % len]` and ffn
kind `ffn_pattern[i % len]`, so every cycle is the same). With `scan_layers` the
parameters of position j of the cycle are stacked over the `num_cycles` whole
cycles (a leading "layers" axis) and applied with `nnx.scan`; the layers left over
when the depth is not a multiple of the cycle run unrolled after the scan, as
`blocks`. Without `scan_layers` (or with less than one whole cycle) every layer is
an unrolled block.

    layout = StackLayout.of(cfg, num_layers)
    layout.where(i) -> ("cycles", j, c)   position j of the cycle, cycle c (stacked axis)
                    | ("blocks", j)       the j-th unrolled block

`LayerStack` builds its module tree from it (`stack.cycles.layers[j]`,
`stack.blocks[j]`), the inference caches are the same tree of per-layer states
(`tfjax.models.caching`), and the checkpoint mapping places layer i of a
checkpoint by it (`tfjax.interop.hf`).
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
