"""Flax NNX layers of the Transformer family."""

from tfjax.nn.attention import MultiHeadAttention
from tfjax.nn.blocks import BLOCKS, LAYER_KINDS, TransformerBlock
from tfjax.nn.ffn import ACTIVATIONS, FeedForward
from tfjax.nn.norms import NORMS, RMSNormPlusOne, make_norm
from tfjax.nn.positions import (
    POSITIONS,
    ROPE_SCALINGS,
    LearnedPositions,
    RotaryEmbedding,
    T5RelativeBias,
    alibi_bias,
    alibi_slopes,
    relative_position_bucket,
    sinusoidal_embedding,
)

__all__ = [
    "MultiHeadAttention", "TransformerBlock", "FeedForward", "make_norm", "RMSNormPlusOne",
    "LearnedPositions", "RotaryEmbedding", "T5RelativeBias", "alibi_bias", "alibi_slopes",
    "relative_position_bucket", "sinusoidal_embedding",
    "ACTIVATIONS", "BLOCKS", "LAYER_KINDS", "NORMS", "POSITIONS", "ROPE_SCALINGS",
]
