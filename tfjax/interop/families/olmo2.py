"""OLMo 2 (`Olmo2ForCausalLM`): Llama with its norms on the sublayers' outputs
(`norm_placement="output"`) and QK-norm over the whole q and k projections
(`attention.qk_norm_over="projection"`), before RoPE. Its tensors are Llama's
(`llama.weights`)."""

from __future__ import annotations

from tfjax.config import ModelConfig
from tfjax.interop.config_mapping import attention_bias, without
from tfjax.interop.families import Family, llama

__all__ = ["FAMILY", "config", "to_hf"]


def config(hf: dict) -> dict:
    c = llama.config(without(hf, "mlp_bias", "sliding_window", "layer_types"))
    c.update(norm_placement="output")
    c["attention"].update(qk_norm=True, qk_norm_over="projection")
    return c


def to_hf(cfg: ModelConfig) -> dict:
    hf = llama.checked_to_hf(cfg, "OLMo 2", "olmo2", "Olmo2ForCausalLM", norm_placement="output",
                             **{"attention.qk_norm": True, "attention.qk_norm_over": "projection",
                                "attention.qk_norm_kind": ""})
    hf.update(attention_bias=attention_bias(cfg, "OLMo 2"))
    return hf


FAMILY = Family(model_types=("olmo2",), config=config, weights=llama.weights, to_hf=to_hf,
                prefix="model.")
