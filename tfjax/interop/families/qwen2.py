"""Qwen2 and Qwen2.5 (`Qwen2ForCausalLM`): Llama with q/k/v biases (never on o). A
window only when `use_sliding_window`; then layers `i >= max_window_layers` slide
(HF's `layer_types`, when written, win). Its tensors are Llama's (`llama.weights`)."""

from __future__ import annotations

from tfjax.config import ModelConfig
from tfjax.interop.config_mapping import (check_types, hf_window, layer_types, need, per_layer,
                                          unsupported, without)
from tfjax.interop.families import Family, llama

__all__ = ["FAMILY", "config", "to_hf"]

_KEY_TYPES = {"max_window_layers": (int,)}  # beyond config_mapping.KEY_TYPES


def config(hf: dict) -> dict:
    check_types(hf, key_types=_KEY_TYPES)
    n = hf["num_hidden_layers"]
    window = hf.get("sliding_window") if hf.get("use_sliding_window", False) else None
    types = hf.get("layer_types")
    if types is None:  # Qwen2Config.__post_init__
        start = hf.get("max_window_layers", 28)
        types = ["sliding_attention" if window is not None and i >= start else "full_attention"
                 for i in range(n)]
    elif "sliding_attention" in per_layer(hf, "layer_types", n) and window is None:
        unsupported("layer_types", types, "sliding layers need use_sliding_window=true and a "
                    "sliding_window")
    c = llama.config(dict(without(hf, "attention_bias", "mlp_bias", "use_sliding_window"),
                          layer_types=types, sliding_window=window))
    c["attention"].update(qkv_bias=True, out_bias=False)  # Qwen2Attention: o has no bias
    return c


def to_hf(cfg: ModelConfig) -> dict:
    need(cfg, "Qwen2", **{"attention.qkv_bias": True, "attention.out_bias": False})
    hf = llama.checked_to_hf(cfg, "Qwen2", "qwen2", "Qwen2ForCausalLM", kinds=("global", "local"))
    window = hf_window(cfg)
    hf.update(use_sliding_window=window is not None, sliding_window=window,
              layer_types=layer_types(cfg), max_window_layers=cfg.num_layers)
    return hf


FAMILY = Family(model_types=("qwen2",), config=config, weights=llama.weights, to_hf=to_hf,
                prefix="model.")
