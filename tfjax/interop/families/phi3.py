"""Phi-3 and Phi-3.5 (`Phi3ForCausalLM`): Llama with a fused `qkv_proj` (rows q, k, v)
and `gate_up_proj` (rows gate, up), no biases; a `sliding_window` applies to every
layer. LongRoPE (its `rope_type` "longrope", or the "su" / "yarn" that Phi3Config
renames to it) is `model.rope.scaling="longrope"`: short factors while the longest
position of a call is within `original_max_position_embeddings`, long ones beyond, as
transformers' rotary embedding switches them. Generation that crosses that length
differs from transformers': `Phi3ForCausalLM.prepare_inputs_for_generation` drops its
cache there and re-encodes the whole sequence with the long factors, while a tfjax
cache keeps the earlier keys as they were rotated (a prompt already past it, or a
generation that stays within it, is the same)."""

from __future__ import annotations

import math

import numpy as np

from tfjax.config import ModelConfig
from tfjax.interop.config_mapping import hf_window, need, unsupported, without
from tfjax.interop.families import Family, llama
from tfjax.interop.tensor_mapping import (Weights, embedding_and_head, heads_in, heads_out,
                                          linear_weights, norm_weights)

__all__ = ["FAMILY", "config", "to_hf", "weights"]

_LONGROPE = ("longrope", "su", "yarn")  # Phi3Config renames "su" and "yarn" to "longrope"


def _longrope(hf: dict, p: dict) -> dict:
    """Phi-3's LongRoPE (`_compute_longrope_parameters` of transformers) as `model.rope`:
    factors per rotated pair, s = factor or max_position_embeddings / original, and the
    default attention factor sqrt(1 + ln s / ln original) (another is refused)."""
    orig = p.get("original_max_position_embeddings", hf.get("original_max_position_embeddings"))
    if type(orig) is not int or orig < 1:
        raise ValueError(f"config.json: LongRoPE needs original_max_position_embeddings, an "
                         f"integer >= 1; got {orig!r}")
    factors = {}
    for key in ("short_factor", "long_factor"):
        value = p.get(key)
        if not isinstance(value, list) or not all(
                isinstance(f, (int, float)) and not isinstance(f, bool) for f in value):
            raise ValueError(f"config.json: rope_parameters.{key} must be a list of numbers "
                             f"(one per rotated pair), got {value!r}")
        factors[key] = tuple(float(f) for f in value)
    factor = float(p.get("factor") or hf.get("max_position_embeddings", 4096) / orig)
    default = math.sqrt(1 + math.log(factor) / math.log(orig)) if factor > 1 else 1.0
    given = p.get("attention_factor")
    if given is not None and abs(given - default) > 1e-9 * default:
        unsupported("rope_parameters.attention_factor", given, f"LongRoPE with its default "
                    f"sqrt(1 + ln(factor) / ln(original_max_position_embeddings)) = {default}")
    return dict(scaling="longrope", factor=max(factor, 1.0), original_max_len=orig, **factors)


def config(hf: dict) -> dict:
    p = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    kind = p.get("rope_type", p.get("type", "default"))
    if kind not in _LONGROPE + ("default",):
        unsupported("rope_parameters.rope_type", kind, "Phi-3 has default or longrope only")
    # Phi3Attention has no biases (its module ignores attention_bias); its sliding_window
    # (if any) covers every layer
    plain = {k: v for k, v in p.items() if k in ("rope_theta", "partial_rotary_factor")}
    c = llama.config(dict(without(hf, "attention_bias", "mlp_bias", "layer_types",
                                  "use_sliding_window", "rope_scaling"),
                          rope_parameters=dict(plain, rope_type="default")))
    if kind in _LONGROPE:
        c["rope"].update(_longrope(hf, p))
    return c


def weights(w: Weights, cfg: ModelConfig, hf: dict) -> dict:
    N, K, H = cfg.num_heads, cfg.kv_heads, cfg.head_size
    out = embedding_and_head(w, cfg)
    for i in range(cfg.num_layers):
        p, L = f"model.layers.{i}.", ("layers", i)
        A = L + ("attn",)
        q, k, v = np.split(w[p + "self_attn.qkv_proj.weight"], [N * H, (N + K) * H])
        out.update({A + ("q", "kernel"): heads_in(q, N, H),
                    A + ("k", "kernel"): heads_in(k, K, H),
                    A + ("v", "kernel"): heads_in(v, K, H),
                    A + ("o", "kernel"): heads_out(w[p + "self_attn.o_proj.weight"], N, H)})
        gate, up = np.split(w[p + "mlp.gate_up_proj.weight"], 2)  # rows: gate, then up
        out.update({L + ("ffn", "wi_gate", "kernel"): gate.T, L + ("ffn", "wi_up", "kernel"): up.T,
                    **linear_weights(w, p + "mlp.down_proj", L + ("ffn", "wo"), False),
                    **norm_weights(w, p + "input_layernorm", L + ("attn_norm",), cfg),
                    **norm_weights(w, p + "post_attention_layernorm", L + ("ffn_norm",), cfg)})
    return out


def to_hf(cfg: ModelConfig) -> dict:
    need(cfg, "Phi-3", **{"attention.qkv_bias": False, "attention.out_bias": False})
    hf = llama.checked_to_hf(cfg, "Phi-3", "phi3", "Phi3ForCausalLM", kinds=("global", "local"),
                             uniform=True)
    if hf["rope_parameters"]["rope_type"] not in ("default", "longrope"):
        raise ValueError(f"export: Phi-3 has no {hf['rope_parameters']['rope_type']!r} RoPE "
                         "(model.rope.scaling must be 'none' or 'longrope')")
    hf.update(sliding_window=hf_window(cfg), original_max_position_embeddings=(
        cfg.rope.original_max_len if cfg.rope.scaling == "longrope" else cfg.max_len))
    return hf


FAMILY = Family(model_types=("phi3",), config=config, weights=weights, to_hf=to_hf,
                prefix="model.")
