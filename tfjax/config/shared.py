"""The `model.shared` section: transformer blocks shared across layers (Zamba2), and
its checks (called by `tfjax.config.model.validate_model`)."""

from __future__ import annotations

import dataclasses

from tfjax.config.checks import fail, non_negative

__all__ = ["SharedBlockConfig", "validate_shared"]


@dataclasses.dataclass(frozen=True)
class SharedBlockConfig:
    """Transformer blocks shared across layers (Zamba2; Glorioso et al. 2024,
    arXiv:2411.15242; `tfjax.nn.shared_block`): the layers of a kind that takes a
    shared block ("mamba2_shared") each run one use of block u % num_blocks (u: the
    use's index among those layers) on [hidden; token embeddings], through their own
    low-rank adapters, and add its output, through their own [D, D] projection, to
    their mixer's input. Which layers: model.layer_pattern. The block's attention
    has model.num_heads / num_kv_heads heads of model.head_dim (Zamba2: 2 D /
    num_heads) and model.attention.scale; its MLP model.activation and d_ff."""

    num_blocks: int = 0  # shared blocks, used in turn (Zamba2's num_mem_blocks); 0: none
    concat_embedding: bool = True  # the block reads [hidden; embeddings] (width 2D), else hidden
    adapter_rank: int = 0  # rank of each use's adapters; 0: no adapters
    attn_adapter: bool = True  # adapters on q, k, v (Zamba2's use_shared_attention_adapter)
    mlp_adapter: bool = True  # one adapter on the MLP's [gate; up] (Zamba2 always has it)
    d_ff: int = 0  # the shared MLP's width; 0 -> model.d_ff


def validate_shared(c, p: str) -> None:
    """The shared section's ranges and what shared blocks need of the model `c` (a
    `ModelConfig`; that layers of a kind taking one exist is
    `tfjax.models.check_names`'s)."""
    sh, q = c.shared, f"{p}.shared"
    for name in ("num_blocks", "adapter_rank", "d_ff"):
        non_negative(f"{q}.{name}", getattr(sh, name))
    if not sh.num_blocks:
        return
    if sh.adapter_rank and not (sh.attn_adapter or sh.mlp_adapter):
        fail(f"{q}.adapter_rank", f"{sh.adapter_rank} but shared.attn_adapter and "
             "shared.mlp_adapter are both off; turn one on or set adapter_rank=0")
    if c.arch != "decoder" or c.prefix_lm:
        fail(f"{q}.num_blocks", f"shared blocks are for causal decoders (arch='decoder', "
             f"prefix_lm=False); got arch={c.arch!r}, prefix_lm={c.prefix_lm}")
    if c.norm_placement != "pre" or c.block != "sequential":
        fail(f"{q}.num_blocks", "a shared block's output joins the mixer's input inside its "
             "pre-norm: needs model.norm_placement='pre' and model.block='sequential', got "
             f"{c.norm_placement!r}, {c.block!r}")
    if c.position not in ("rope", "none"):
        fail(f"{p}.position", f"a shared block's attention takes 'rope' (Zamba2's use_mem_rope) "
             f"or 'none', got {c.position!r}")
    if c.mtp_depth:
        fail(f"{p}.mtp_depth", "multi-token prediction is not built for models with shared "
             "blocks; set model.mtp_depth=0 (or model.shared.num_blocks=0)")
