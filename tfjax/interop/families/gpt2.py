"""GPT-2 (`GPT2LMHeadModel`): learned positions, pre-norm LayerNorms, a biased MLP
(`activation_function`), and Conv1D weights (`[in, out]`, no transpose), the attention's
fused `c_attn` `[D, 3 * N * H]` holding q, k, v in that order; `scale_attn_weights=False`
is an unscaled softmax (`model.attention.scale=1`)."""

from __future__ import annotations

import math

from tfjax.config import ModelConfig
from tfjax.interop.config_mapping import (common_fields, decoder_to_hf, hf_activation,
                                          read_activation, unsupported)
from tfjax.interop.families import Family
from tfjax.interop.tensor_mapping import Weights, head_weights, norm_weights

__all__ = ["FAMILY", "config", "to_hf", "weights"]


def config(hf: dict) -> dict:
    for key in ("scale_attn_by_inverse_layer_idx", "add_cross_attention"):
        if hf.get(key):
            unsupported(key, hf[key])
    D = hf["n_embd"]
    return dict(common_fields(hf), arch="decoder", d_model=D, num_layers=hf["n_layer"],
                num_heads=hf["n_head"], d_ff=hf.get("n_inner") or 4 * D, max_len=hf["n_positions"],
                position="learned", norm="layernorm", norm_eps=hf.get("layer_norm_epsilon", 1e-5),
                activation=read_activation(hf, "activation_function", gated=False), ffn_bias=True,
                attention=dict(qkv_bias=True, out_bias=True,
                               scale=0.0 if hf.get("scale_attn_weights", True) else 1.0))


def weights(w: Weights, cfg: ModelConfig, hf: dict) -> dict:
    N, H, D = cfg.num_heads, cfg.head_size, cfg.d_model
    out = {("embed", "tokens", "embedding"): w["transformer.wte.weight"],
           ("embed", "positions", "embedding"): w["transformer.wpe.weight"],
           **norm_weights(w, "transformer.ln_f", ("final_norm",), cfg),
           **head_weights(w, "lm_head.weight", cfg)}
    for i in range(cfg.num_layers):
        p, L = f"transformer.h.{i}.", ("layers", i)
        A = L + ("attn",)
        W = w[p + "attn.c_attn.weight"].reshape(D, 3, N, H)  # Conv1D: [in, out], out = [3, N, H]
        b = w[p + "attn.c_attn.bias"].reshape(3, N, H)
        for j, n in enumerate("qkv"):
            out[A + (n, "kernel")], out[A + (n, "bias")] = W[:, j], b[j]
        out[A + ("o", "kernel")] = w[p + "attn.c_proj.weight"].reshape(N, H, D)
        out[A + ("o", "bias")] = w[p + "attn.c_proj.bias"]
        out.update(norm_weights(w, p + "ln_1", L + ("attn_norm",), cfg))
        out.update(norm_weights(w, p + "ln_2", L + ("ffn_norm",), cfg))
        for ours, theirs in (("wi", "c_fc"), ("wo", "c_proj")):  # Conv1D: no transpose
            out[L + ("ffn", ours, "kernel")] = w[f"{p}mlp.{theirs}.weight"]
            out[L + ("ffn", ours, "bias")] = w[f"{p}mlp.{theirs}.bias"]
        w.ignore(p + "attn.bias", p + "attn.masked_bias")
    return out


def to_hf(cfg: ModelConfig) -> dict:
    return decoder_to_hf(cfg, "gpt2", "GPT2LMHeadModel", n_embd=cfg.d_model,
                         n_layer=cfg.num_layers, n_head=cfg.num_heads, n_inner=cfg.d_ff,
                         n_positions=cfg.max_len, layer_norm_epsilon=cfg.norm_eps,
                         activation_function=hf_activation(cfg, gated=False),
                         scale_attn_weights=not math.isclose(cfg.attention_scale, 1.0))


FAMILY = Family(model_types=("gpt2",), config=config, weights=weights, to_hf=to_hf,
                prefix="transformer.")
