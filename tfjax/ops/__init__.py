"""Attention ops below the layers: one entry point, lazy masks, many implementations."""

from tfjax.ops import masks
from tfjax.ops.attention import (
    AUTO_ORDER,
    IMPLEMENTATIONS,
    AttentionRequest,
    dot_product_attention,
    register_implementation,
    select_implementation,
)
from tfjax.ops.reference import attention_reference
from tfjax.ops.blockwise import blockwise_attention  # registers "blockwise"
from tfjax.ops import pallas  # registers "pallas"

__all__ = [
    "masks", "pallas", "dot_product_attention", "attention_reference", "blockwise_attention", "IMPLEMENTATIONS", "AUTO_ORDER",
    "AttentionRequest", "register_implementation", "select_implementation",
]
