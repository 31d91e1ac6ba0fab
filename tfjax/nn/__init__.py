"""Flax NNX layers of the Transformer family. See docs/layers.md."""

from tfjax.nn.attention import MultiHeadAttention
from tfjax.nn.blocks import BLOCKS, TransformerBlock
from tfjax.nn.ffn import ACTIVATIONS, FeedForward
from tfjax.nn.gated_deltanet import GatedDeltaNet, GatedDeltaNetState
from tfjax.nn.latent_attention import MultiHeadLatentAttention
from tfjax.nn.linear_attention import FEATURE_MAPS, LinearAttention, LinearAttentionState
from tfjax.nn.mamba2 import Mamba2, Mamba2State
from tfjax.nn.moe import MoE, MoEAux, moe_aux
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
from tfjax.nn.shared_block import SharedBlock, SharedBlockUse
from tfjax.nn.ssm import Mamba, MambaState

__all__ = [
    "MultiHeadAttention", "MultiHeadLatentAttention", "TransformerBlock", "FeedForward",
    "make_norm", "RMSNormPlusOne",
    "LearnedPositions", "RotaryEmbedding", "T5RelativeBias", "alibi_bias", "alibi_slopes",
    "relative_position_bucket", "sinusoidal_embedding",
    "ACTIVATIONS", "BLOCKS", "NORMS", "POSITIONS", "ROPE_SCALINGS",
    "MoE", "MoEAux", "moe_aux", "Mamba", "MambaState", "Mamba2", "Mamba2State",
    "LinearAttention", "LinearAttentionState",
    "FEATURE_MAPS", "GatedDeltaNet", "GatedDeltaNetState", "SharedBlock", "SharedBlockUse",
]
