"""SmolLM3 (`SmolLM3ForCausalLM`): Llama whose `no_rope_layers[i] == 0` layers have no
RoPE ("nope" layers; by default every `no_rope_layer_interval`-th). Its sliding NoPE
layers (`use_sliding_window`) are refused: tfjax has no windowed NoPE kind. Its tensors
are Llama's (`llama.weights`)."""

from __future__ import annotations

from tfjax.config import ModelConfig
from tfjax.interop.config_mapping import (attention_bias, check_types, per_layer,
                                          shortest_pattern, unsupported, without)
from tfjax.interop.families import Family, llama

__all__ = ["FAMILY", "config", "to_hf"]

_KEY_TYPES = {"no_rope_layer_interval": (int,),  # beyond config_mapping.KEY_TYPES
              "no_rope_layers": (list, type(None))}


def config(hf: dict) -> dict:
    check_types(hf, key_types=_KEY_TYPES)
    n = hf["num_hidden_layers"]
    if hf.get("no_rope_layers") is None:  # SmolLM3Config.__post_init__
        every = hf.get("no_rope_layer_interval", 4)
        if every < 1:
            raise ValueError(f"config.json: no_rope_layer_interval must be >= 1, got {every}")
        rope = [int((i + 1) % every != 0) for i in range(n)]
    else:
        rope = per_layer(hf, "no_rope_layers", n)
    sliding = bool(hf.get("use_sliding_window") and hf.get("sliding_window"))
    if sliding or "sliding_attention" in (hf.get("layer_types") or ()):
        unsupported("use_sliding_window", True, "SmolLM3's sliding layers are its NoPE layers; "
                    "tfjax has no windowed NoPE layer kind")
    c = llama.config(without(hf, "sliding_window", "layer_types", "use_sliding_window"))
    c.update(layer_pattern=shortest_pattern(["global" if r else "nope" for r in rope]))
    return c


def to_hf(cfg: ModelConfig) -> dict:
    hf = llama.checked_to_hf(cfg, "SmolLM3", "smollm3", "SmolLM3ForCausalLM",
                             kinds=("global", "nope"))
    hf.update(attention_bias=attention_bias(cfg, "SmolLM3"), mlp_bias=False,
              use_sliding_window=False, sliding_window=None,
              no_rope_layers=[int(cfg.layer_kind(i) != "nope") for i in range(cfg.num_layers)])
    return hf


FAMILY = Family(model_types=("smollm3",), config=config, weights=llama.weights, to_hf=to_hf,
                prefix="model.")
