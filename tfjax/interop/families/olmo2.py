"""OLMo 2 (`Olmo2ForCausalLM`): Llama with its norms on the sublayers' outputs
(`norm_placement="output"`) and QK-norm over the whole q and k projections
(`attention.qk_norm_over="projection"`), before RoPE."""

from __future__ import annotations

from tfjax.config import ModelConfig
from tfjax.interop.config_mapping import attention_bias, without
from tfjax.interop.families import Family, llama
from tfjax.interop.tensor_mapping import (Weights, attention_weights, embedding_and_head,
                                          norm_weights, qk_norm_weights, swiglu_weights)

__all__ = ["FAMILY", "config", "to_hf", "weights"]


def config(hf: dict) -> dict:
    c = llama.config(without(hf, "mlp_bias", "sliding_window", "layer_types"))
    c.update(norm_placement="output")
    c["attention"].update(qk_norm=True, qk_norm_over="projection")
    return c


def weights(w: Weights, cfg: ModelConfig, hf: dict) -> dict:
    out = embedding_and_head(w, cfg)
    for i in range(cfg.num_layers):
        p, L = f"model.layers.{i}.", ("layers", i)
        out.update(attention_weights(w, p + "self_attn.", L + ("attn",), cfg))
        out.update(qk_norm_weights(w, p + "self_attn.", L + ("attn",), cfg))  # [N*H], [K*H]
        out.update(norm_weights(w, p + "post_attention_layernorm", L + ("attn_norm",), cfg))
        out.update(norm_weights(w, p + "post_feedforward_layernorm", L + ("ffn_norm",), cfg))
        out.update(swiglu_weights(w, p + "mlp", L + ("ffn",)))
    return out


def to_hf(cfg: ModelConfig) -> dict:
    hf = llama.checked_to_hf(cfg, "OLMo 2", "olmo2", "Olmo2ForCausalLM", norm_placement="output",
                             **{"attention.qk_norm": True, "attention.qk_norm_over": "projection",
                                "attention.qk_norm_kind": ""})
    hf.update(attention_bias=attention_bias(cfg, "OLMo 2"))
    return hf


FAMILY = Family(model_types=("olmo2",), config=config, weights=weights, to_hf=to_hf,
                prefix="model.")
