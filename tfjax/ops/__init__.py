"""Attention ops below the layers: one entry point, lazy masks, many implementations."""

from tfjax.ops import (
    cudnn,  # registers "cudnn" (before pallas in the GPU auto order)
    masks,
    pallas,  # registers "pallas"
)
from tfjax.ops.attention import (
    AUTO_ORDER,
    IMPLEMENTATIONS,
    AttentionRequest,
    dot_product_attention,
    register_implementation,
    select_implementation,
)
from tfjax.ops.blockwise import blockwise_attention  # registers "blockwise"
from tfjax.ops.reference import Alibi, RelativeBias, attention_reference, make_alibi

__all__ = [
    "AUTO_ORDER",
    "Alibi",
    "IMPLEMENTATIONS",
    "RelativeBias",
    "AttentionRequest",
    "attention_reference",
    "blockwise_attention",
    "cudnn",
    "dot_product_attention",
    "make_alibi",
    "masks",
    "pallas",
    "register_implementation",
    "select_implementation",
]
