"""Gemma 3, text only (`Gemma3ForCausalLM`, model_type "gemma3_text"): Gemma 2's
sandwich norms, `(1 + w)` RMSNorm, scaled embeddings, `query_pre_attn_scalar` and final
soft-cap (its `attn_logit_softcapping` is read by no transformers code path, so not
here either), plus QK-norm per head and per-kind RoPE: sliding layers unscaled at their
own base (`rope_local_base_freq`, or `rope_parameters.sliding_attention`:
`model.attention.local_rope_theta`), global layers at theirs with its scaling
(`model.rope`). Its tensors are Llama's (`llama.weights`)."""

from __future__ import annotations

from tfjax.config import ModelConfig
from tfjax.interop.config_mapping import (attention_bias, check_types, hf_window, layer_types,
                                          unsupported, without)
from tfjax.interop.families import Family, gemma2, llama

__all__ = ["FAMILY", "config", "to_hf"]

_FULL, _SLIDING = "full_attention", "sliding_attention"
_KEY_TYPES = {"sliding_window_pattern": (int,),  # beyond config_mapping.KEY_TYPES
              "rope_local_base_freq": (int, float)}


def _rope(hf: dict) -> tuple[dict, dict]:
    """(global, local) RoPE parameters: transformers 5's `rope_parameters` per layer
    type, or 4.x's `rope_theta` + `rope_scaling` (global) and `rope_local_base_freq`."""
    p = hf.get("rope_parameters") or {}
    if _FULL in p or _SLIDING in p:
        full = dict(p.get(_FULL) or {})
        local = dict(p.get(_SLIDING) or {})
    else:
        full = {**(hf.get("rope_scaling") or {}), **p}
        local = {"rope_type": "default", "rope_theta": hf.get("rope_local_base_freq", 10000.0)}
    full.setdefault("rope_theta", hf.get("rope_theta", 1_000_000.0))
    local.setdefault("rope_theta", 10000.0)
    kind = local.get("rope_type", local.get("type", "default"))
    if kind != "default":
        unsupported("rope_parameters.sliding_attention.rope_type", kind,
                    "tfjax's local layers rotate unscaled (model.attention.local_rope_theta)")
    for key in ("rope_theta", "partial_rotary_factor"):
        value = local.get(key, 1.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"config.json: rope_parameters.sliding_attention.{key} must be a "
                             f"positive number, got {value!r}")
    if local.get("partial_rotary_factor", 1.0) != full.get("partial_rotary_factor", 1.0):
        unsupported("rope_parameters.sliding_attention.partial_rotary_factor",
                    local["partial_rotary_factor"], "must equal the global layers'")
    return full, local


def config(hf: dict) -> dict:
    check_types(hf, key_types=_KEY_TYPES)
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None:  # Gemma3TextConfig.__post_init__
        every = hf.get("sliding_window_pattern", 6)
        types = [_SLIDING if (i + 1) % every else _FULL for i in range(n)]
    full, local = _rope(hf)
    # transformers' Gemma3Attention stores attn_logit_softcapping but never applies it
    c = gemma2.config(dict(without(hf, "rope_scaling", "rope_theta", "mlp_bias",
                                   "attn_logit_softcapping"),
                           layer_types=types, rope_parameters=full))
    c["attention"].update(qk_norm=True, local_rope_theta=float(local["rope_theta"]))
    return c


def to_hf(cfg: ModelConfig) -> dict:
    a = cfg.attention
    scale = a.scale or cfg.head_size ** -0.5
    hf = llama.checked_to_hf(cfg, "Gemma 3", "gemma3_text", "Gemma3ForCausalLM",
                             kinds=("global", "local"), norm="rmsnorm_plus_one",
                             norm_placement="sandwich", activation="geglu_tanh",
                             scale_embeddings=True, final_softcap=cfg.final_softcap,
                             **{"attention.qk_norm": True, "attention.qk_norm_over": "head",
                                "attention.qk_norm_kind": "", "attention.scale": a.scale,
                                "attention.local_rope_theta": a.local_rope_theta})
    if "local" in cfg.layer_pattern and not a.local_rope_theta:
        raise ValueError("export: Gemma 3's sliding layers rotate at their own base: set "
                         "model.attention.local_rope_theta")
    full = hf.pop("rope_parameters")
    local = {"rope_type": "default", "rope_theta": a.local_rope_theta or full["rope_theta"]}
    if "partial_rotary_factor" in full:
        local["partial_rotary_factor"] = full["partial_rotary_factor"]
    scalar = round(scale ** -2)  # an integer in Gemma3TextConfig
    if abs(scalar ** -0.5 - scale) > 1e-9 * scale:
        raise ValueError(f"export: Gemma 3's query_pre_attn_scalar is an integer n with "
                         f"scale = n ** -0.5; model.attention.scale={a.scale} is not")
    window = hf_window(cfg)
    del hf["hidden_act"]
    hf.update(hidden_activation="gelu_pytorch_tanh",
              query_pre_attn_scalar=scalar, attention_bias=attention_bias(cfg, "Gemma 3"),
              sliding_window=window or cfg.max_len, layer_types=layer_types(cfg),
              final_logit_softcapping=cfg.final_softcap or None,
              rope_parameters={_FULL: full, _SLIDING: local})
    return hf


FAMILY = Family(model_types=("gemma3_text",), config=config, weights=llama.weights,
                to_hf=to_hf, prefix="model.")
