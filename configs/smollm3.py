"""SmolLM3 (Hugging Face 2025): a Llama-style decoder (GQA 16/4, RMSNorm, SwiGLU,
no biases, tied output) whose every fourth layer has no positional encoding (NoPE,
3:1 with RoPE, base 5M). Default: SmolLM3-3B. Variant: "tiny" (CPU).

    python -m tfjax.train --config configs/smollm3.py:tiny --workdir /tmp/smollm3
"""

from tfjax.config import apply_variant, default_config

BYTE_VOCAB = 259  # tfjax.data's byte tokenizer: 256 bytes + pad, bos, eos


def get_config(arg=None):
    cfg = default_config()
    cfg.model.update(dict(
        arch="decoder", vocab_size=128256, d_model=2048, num_layers=36, num_heads=16,
        num_kv_heads=4, d_ff=11008, max_len=65536, position="rope", norm="rmsnorm",
        norm_eps=1e-6, norm_placement="pre", activation="swiglu", ffn_bias=False,
        tie_embeddings=True,
        layer_pattern=("global", "global", "global", "nope"),
        attention=dict(qkv_bias=False, out_bias=False)))
    cfg.model.rope.update(dict(theta=5_000_000.0))
    return apply_variant(cfg, arg, {
        "tiny": {"model": dict(vocab_size=BYTE_VOCAB, d_model=64, num_layers=4, num_heads=4,
                               num_kv_heads=2, d_ff=192, max_len=2048,
                               rope=dict(theta=10000.0))},
    })
