"""Architectures, built from a `ModelConfig`: `build(cfg.model, rngs=nnx.Rngs(0))`."""

from __future__ import annotations

from flax import nnx

from tfjax.models.decoder import DecoderLM
from tfjax.models.encoder import EncoderModel
from tfjax.models.encoder_decoder import EncoderDecoderModel
from tfjax.registry import Registry

__all__ = ["ARCHITECTURES", "build", "DecoderLM", "EncoderModel", "EncoderDecoderModel"]

ARCHITECTURES: Registry[type] = Registry("architecture")
ARCHITECTURES.register("decoder", DecoderLM)
ARCHITECTURES.register("encoder", EncoderModel)
ARCHITECTURES.register("encoder_decoder", EncoderDecoderModel)


def build(model_cfg, *, rngs: nnx.Rngs | None = None) -> nnx.Module:
    """A model from `cfg.model` (ConfigDict, dict or ModelConfig), validated first."""
    from tfjax.config import model_config

    cfg = model_config(model_cfg)
    return ARCHITECTURES.get(cfg.arch, field="model.arch")(cfg, rngs=rngs or nnx.Rngs(0))
