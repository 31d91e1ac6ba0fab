"""Zamba2 (Glorioso et al. 2024, "The Zamba2 Suite", arXiv:2411.15242): a Mamba-2
backbone in which some layers also run a transformer block (attention + MLP) whose
weights are shared across those layers, on [hidden; token embeddings] (width 2D),
each use with its own low-rank adapters and [D, D] output projection, its output
added to the Mamba-2 layer's input inside its pre-norm (`tfjax.nn.shared_block`).

Default: the configuration transformers' `Zamba2Config()` describes (its docstring: a
Zamba2-2.7B-style configuration; 54 layers of width 2560, 9 of them hybrid, one shared
block of 32 heads of 160, MLP 10240 GELU-gated, Mamba-2 with 8 heads of 640 and
d_state 64, rank-128 MLP adapters, no attention adapters, no RoPE): 2,481,848,336
parameters, what transformers' `Zamba2ForCausalLM` of that config counts on the meta
device (tests/test_presets.py). The hub checkpoints' own config.json files were not
read, so no published checkpoint's count is claimed.
Variant "tiny" (CPU: 6 layers of width 64, every third hybrid, 2 shared blocks with
RoPE and rank-8 adapters on q, k, v and the MLP).

    python -m tfjax.train --config configs/zamba2.py:tiny --workdir /tmp/zamba2

In tfjax terms: layer_pattern lists "mamba2" and "mamba2_shared" layers (the whole
54-layer stack is one cycle: its hybrid layers do not repeat); ffn_pattern = ("none",)
(the MLP is the shared block's); model.shared holds the blocks.
"""

from tfjax.config import apply_variant, default_config

BYTE_VOCAB = 259  # tfjax.data's byte tokenizer: 256 bytes + pad, bos, eos

# transformers' default layers_block_type: 54 layers, "hybrid" at 6, 12, ..., 42, 47, 51
PATTERN = (("mamba2",) + (("mamba2",) * 5 + ("mamba2_shared",)) * 7 + ("mamba2",) * 4
           + ("mamba2_shared",) + ("mamba2",) * 3 + ("mamba2_shared",) + ("mamba2",) * 2)


def get_config(arg=None):
    cfg = default_config()
    D, N = 2560, 32
    head = 2 * D // N  # the shared attention reads [hidden; embeddings]: 2D wide
    cfg.model.update(dict(
        arch="decoder", vocab_size=32000, d_model=D, num_layers=54, num_heads=N,
        num_kv_heads=N, head_dim=head, d_ff=4 * D,
        max_len=4096, position="none", norm="rmsnorm", norm_eps=1e-5, activation="geglu",
        ffn_bias=False, tie_embeddings=True, layer_pattern=PATTERN, ffn_pattern=("none",),
        mamba2=dict(d_state=64, head_dim=2 * D // 8, expand=2, n_groups=1, d_conv=4,
                    chunk=256, conv_bias=True, proj_bias=False, dt_min_limit=0.001),
        shared=dict(num_blocks=1, concat_embedding=True, adapter_rank=128,
                    attn_adapter=False, mlp_adapter=True),
                    attention=dict(scale=(head / 2) ** -0.5)))
    return apply_variant(cfg, arg, {
        "tiny": {"model": dict(vocab_size=BYTE_VOCAB, d_model=64, num_layers=6, num_heads=4,
                               num_kv_heads=4, head_dim=32, d_ff=128,
                               max_len=2048, position="rope",
                               layer_pattern=("mamba2", "mamba2", "mamba2_shared"),
                               mamba2=dict(d_state=16, head_dim=16, chunk=64),
                               shared=dict(num_blocks=2, adapter_rank=8,
                                           attn_adapter=True), attention=dict(scale=16 ** -0.5))},
    })
