"""Architectures, built from a `ModelConfig`: `build(cfg.model, rngs=nnx.Rngs(0))`.
See docs/models.md.

    architectures.py     ARCHITECTURES, check_names (registry-owned names), build, unrolled,
                         cache_bytes
    decoder.py encoder.py encoder_decoder.py vision.py vision_language.py speech.py
    layer_kinds.py       one record per layer kind and ffn kind (LAYER_KINDS, FFN_KINDS)
    layout.py            StackLayout: where layer i of a stack lives
    stack.py             LayerStack, the block of each layer, embedder and head
    attention_inputs.py  each layer kind's mask and position bias (whole sequence, cached step)
    caching.py           the model side of inference caches (empty cache, step inputs)
"""

from tfjax.models.architectures import (ARCHITECTURES, build, cache_bytes, check_names,
                                        kv_bytes_per_token, model_class, unrolled)
from tfjax.models.decoder import DecoderLM
from tfjax.models.encoder import EncoderModel
from tfjax.models.encoder_decoder import EncoderDecoderModel
from tfjax.models.layer_kinds import FFN_KINDS, LAYER_KINDS, FfnKind, LayerKind
from tfjax.models.layout import StackLayout
from tfjax.models.speech import SpeechEncoderDecoderModel
from tfjax.models.vision import VisionEncoder
from tfjax.models.vision_language import ImagePrefixLM

__all__ = ["ARCHITECTURES", "DecoderLM", "EncoderDecoderModel", "EncoderModel", "FFN_KINDS",
           "FfnKind", "ImagePrefixLM", "LAYER_KINDS", "LayerKind", "SpeechEncoderDecoderModel",
           "StackLayout", "VisionEncoder", "build", "cache_bytes", "check_names",
           "kv_bytes_per_token", "model_class", "unrolled"]
