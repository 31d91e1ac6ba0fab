"""Mamba (Gu & Dao 2023, "Mamba: Linear-Time Sequence Modeling with Selective State
Spaces"): a decoder whose every layer is x + Mamba(RMSNorm(x)) — no attention, no
feed-forward, no position encoding. Selective SSM with d_state 16, conv width 4,
expand 2, dt rank ceil(D/16); tied embeddings. Default: mamba-130m (129,135,360
parameters; vocab 50280 = GPT-NeoX's padded to a multiple of 8). Variants: "tiny"
(CPU), "370m" (mamba-370m).

    python -m tfjax.train --config configs/mamba.py:tiny --workdir /tmp/mamba

Decoding is O(1) per token: `tfjax.nn.ssm.Mamba.step(x_t, state)` with
`init_state(batch)` (the conv window and the SSM state).
"""

from tfjax.config import apply_variant, default_config

BYTE_VOCAB = 259  # tfjax.data's byte tokenizer: 256 bytes + pad, bos, eos


def get_config(arg=None):
    cfg = default_config()
    cfg.model.update(dict(
        arch="decoder", vocab_size=50280, d_model=768, num_layers=24, num_heads=12,
        position="none", norm="rmsnorm", norm_eps=1e-5, tie_embeddings=True,
        layer_pattern=("mamba",), ffn_pattern=("none",), max_len=2048,
        ssm=dict(d_state=16, d_conv=4, expand=2, dt_rank=0, conv_bias=True, proj_bias=False,
                 chunk=256)))
    return apply_variant(cfg, arg, {
        "tiny": {"model": dict(vocab_size=BYTE_VOCAB, d_model=64, num_layers=2, num_heads=4,
                               ssm=dict(d_state=8, chunk=64))},
        "370m": {"model": dict(d_model=1024, num_layers=48, num_heads=16)},
    })
