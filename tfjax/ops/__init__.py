"""Attention ops below the layers: one entry point, lazy masks, many implementations.

`dot_product_attention` is the entry point; `tfjax.ops.attention` holds the table of
implementations and the whole choice among them (`IMPLEMENTATIONS`, `AUTO_ORDER`,
`select_implementation`, and ring attention's `select_ring_block`)."""

from tfjax.ops import cudnn, masks, pallas, target
from tfjax.ops.attention import (
    AUTO_ORDER,
    IMPLEMENTATIONS,
    dot_product_attention,
    select_implementation,
    select_ring_block,
)
from tfjax.ops.blockwise import blockwise_attention
from tfjax.ops.implementation import AttentionRequest, Implementation
from tfjax.ops.reference import Alibi, RelativeBias, attention_reference, make_alibi

__all__ = [
    "AUTO_ORDER",
    "Alibi",
    "AttentionRequest",
    "IMPLEMENTATIONS",
    "Implementation",
    "RelativeBias",
    "attention_reference",
    "blockwise_attention",
    "cudnn",
    "dot_product_attention",
    "make_alibi",
    "masks",
    "pallas",
    "select_implementation",
    "select_ring_block",
    "target",
]
