"""OLMo 2 (Team OLMo 2024): a decoder whose norms sit on each sublayer's output
(x + norm(f(x)), "reordered norm"), QK-norm over the whole q and k projections,
MHA, RoPE (base 500k), RMSNorm, SwiGLU, no biases, untied output. Default:
OLMo-2-1124-7B. Variant: "tiny" (CPU).

    python -m tfjax.train --config configs/olmo2.py:tiny --workdir /tmp/olmo2
"""

from tfjax.config import apply_variant, default_config

BYTE_VOCAB = 259  # tfjax.data's byte tokenizer: 256 bytes + pad, bos, eos


def get_config(arg=None):
    cfg = default_config()
    cfg.model.update(dict(
        arch="decoder", vocab_size=100352, d_model=4096, num_layers=32, num_heads=32,
        d_ff=11008, max_len=4096, position="rope", norm="rmsnorm", norm_eps=1e-6,
        norm_placement="output", activation="swiglu", ffn_bias=False, tie_embeddings=False,
        attention=dict(qk_norm=True, qk_norm_over="projection", qkv_bias=False, out_bias=False)))
    cfg.model.rope.update(dict(theta=500000.0))
    return apply_variant(cfg, arg, {
        "tiny": {"model": dict(vocab_size=BYTE_VOCAB, d_model=64, num_layers=2, num_heads=4,
                               d_ff=192, max_len=2048, rope=dict(theta=10000.0))},
    })
