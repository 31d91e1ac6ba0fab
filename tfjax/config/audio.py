"""The audio front end's config section (`model.audio`; Whisper): log-mel features
`[B, n_mels, frames]` through two 1-D convolutions (kernel 3, the second stride 2,
GELU) and fixed sinusoidal positions into the encoder of an encoder-decoder, which
may have its own heads and feed-forward width. See docs/multimodal.md.
"""

from __future__ import annotations

import dataclasses

from tfjax.config.checks import fail, non_negative, positive

__all__ = ["AudioConfig", "validate_audio"]


@dataclasses.dataclass(frozen=True)
class AudioConfig:
    """`n_mels` 0: no audio front end (the encoder reads tokens)."""

    n_mels: int = 0  # log-mel bins of the input features (Whisper: 80, large-v3: 128)
    max_source_positions: int = 1500  # encoder positions; frames <= 2 * this
    num_heads: int = 0  # the encoder's heads (head dim d_model / num_heads); 0 -> model's
    d_ff: int = 0  # the encoder's feed-forward width; 0 -> model.d_ff

    @property
    def max_frames(self) -> int:
        """The most input frames: the stride-2 convolution halves them into positions."""
        return 2 * self.max_source_positions


def validate_audio(c, p: str) -> None:
    """`c`: the ModelConfig; `p`: its path ("model")."""
    a, q = c.audio, f"{p}.audio"
    for name in ("n_mels", "num_heads", "d_ff"):
        non_negative(f"{q}.{name}", getattr(a, name))
    positive(f"{q}.max_source_positions", a.max_source_positions)
    if not a.n_mels:
        return
    if c.arch != "encoder_decoder":
        fail(f"{q}.n_mels", f"the audio front end feeds an encoder: needs arch="
             f"'encoder_decoder', got {c.arch!r} (or set n_mels=0)")
    if c.position in ("rope", "alibi", "t5"):
        fail(f"{p}.position", f"the audio encoder has fixed sinusoidal positions of its own; "
             f"use 'learned', 'sinusoidal' or 'none' for the decoder, got {c.position!r}")
    if a.num_heads and c.d_model % a.num_heads:
        fail(f"{q}.num_heads", f"d_model={c.d_model} is not divisible by {a.num_heads} "
             f"encoder heads; use a divisor of d_model")
    if c.d_model % 2 or c.d_model < 4:
        fail(f"{p}.d_model", f"the sinusoidal encoder positions pair sin and cos: d_model "
             f"must be even and >= 4 with model.audio, got {c.d_model}")
