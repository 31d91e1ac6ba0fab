"""Qwen3 (`Qwen3ForCausalLM`): Llama with QK-norm (RMSNorm of q and k over the head
dim, before RoPE) and, with `use_sliding_window`, windowed layers by `layer_types`.
Its tensors are Llama's (`llama.weights`)."""

from __future__ import annotations

from tfjax.config import ModelConfig
from tfjax.interop.config_mapping import hf_window, layer_types
from tfjax.interop.families import Family, llama

__all__ = ["FAMILY", "config", "to_hf"]


def config(hf: dict) -> dict:
    c = llama.config(hf)
    c["attention"].update(qk_norm=True)
    return c


def to_hf(cfg: ModelConfig) -> dict:
    window = hf_window(cfg)
    return llama.to_hf_fields(cfg, "qwen3", "Qwen3ForCausalLM",
                              attention_bias=cfg.attention.qkv_bias,
                              layer_types=layer_types(cfg), use_sliding_window=window is not None,
                              **({} if window is None else {"sliding_window": window}))


FAMILY = Family(model_types=("qwen3",), config=config, weights=llama.weights, to_hf=to_hf,
                prefix="model.")
