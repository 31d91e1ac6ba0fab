"""Mamba-2 (Dao & Gu 2024, "Transformers are SSMs: Generalized Models and Efficient
Algorithms Through Structured State Space Duality"): a decoder whose every layer is
x + Mamba2(RMSNorm(x)) — no attention, no feed-forward, no position encoding. The SSD
mixer (`tfjax.nn.mamba2`) with d_state 128, head_dim 64 (so expand * d_model / 64
heads, each with a scalar decay), one group for B and C, conv width 4, expand 2, a
gated RMSNorm before the output projection; tied embeddings. Default: mamba2-130m
(128,989,632 parameters; vocab 50288 = GPT-NeoX's 50277 padded to a multiple of 16, as
the checkpoints are). Variants: "tiny" (CPU), "370m" (mamba2-370m).

    python -m tfjax.train --config configs/mamba2.py:tiny --workdir /tmp/mamba2

Training runs the chunked SSD form (`model.mamba2.chunk`); decoding is O(1) per token
with a `Mamba2Cache` (the conv window and the [heads, head_dim, d_state] state).
"""

from tfjax.config import apply_variant, default_config

BYTE_VOCAB = 259  # tfjax.data's byte tokenizer: 256 bytes + pad, bos, eos


def get_config(arg=None):
    cfg = default_config()
    cfg.model.update(dict(
        arch="decoder", vocab_size=50288, d_model=768, num_layers=24, num_heads=12,
        position="none", norm="rmsnorm", norm_eps=1e-5, tie_embeddings=True,
        layer_pattern=("mamba2",), ffn_pattern=("none",), max_len=2048,
        mamba2=dict(d_state=128, head_dim=64, expand=2, n_groups=1, d_conv=4, chunk=256,
                    conv_bias=True, proj_bias=False)))
    return apply_variant(cfg, arg, {
        "tiny": {"model": dict(vocab_size=BYTE_VOCAB, d_model=64, num_layers=2, num_heads=4,
                               mamba2=dict(d_state=16, head_dim=16, chunk=16))},
        "370m": {"model": dict(d_model=1024, num_layers=48, num_heads=16)},
    })
