"""Gemma 2 (`Gemma2ForCausalLM`, causal only): Llama with sandwich norms (before and
after each sublayer), `(1 + w)` RMSNorm weights (`rmsnorm_plus_one`, loaded as they
are), scaled embeddings, GeGLU (`hidden_activation`), the softmax scale
`query_pre_attn_scalar ** -0.5`, attention and final logit soft-caps, and alternating
windows by `layer_types`. Its tensors are Llama's (`llama.weights`)."""

from __future__ import annotations

import math

from tfjax.config import ModelConfig
from tfjax.interop.config_mapping import (hf_activation, hf_window, layer_types,
                                          read_activation, unsupported)
from tfjax.interop.families import Family, llama

__all__ = ["FAMILY", "config", "to_hf"]


def config(hf: dict) -> dict:
    if hf.get("use_bidirectional_attention"):
        unsupported("use_bidirectional_attention", True, "causal Gemma 2 only")
    c = llama.config(hf)
    c.update(norm="rmsnorm_plus_one", norm_placement="sandwich", scale_embeddings=True,
             activation=read_activation(hf, "hidden_activation", gated=True),
             final_softcap=float(hf.get("final_logit_softcapping") or 0.0))
    c["attention"].update(scale=float(hf.get("query_pre_attn_scalar", c["head_dim"])) ** -0.5,
                          softcap=float(hf.get("attn_logit_softcapping") or 0.0))
    return c


def _number(x: float) -> int | float:
    """An integer where `x` is one (up to rounding): HF's int fields refuse floats."""
    return round(x) if math.isclose(x, round(x), rel_tol=1e-12) else x


def to_hf(cfg: ModelConfig) -> dict:
    window = hf_window(cfg)
    c = llama.to_hf_fields(cfg, "gemma2", "Gemma2ForCausalLM",
                           attention_bias=cfg.attention.qkv_bias,
                           hidden_activation=hf_activation(cfg, gated=True),
                           layer_types=layer_types(cfg),
                           query_pre_attn_scalar=_number(cfg.attention_scale ** -2),
                           attn_logit_softcapping=cfg.attention.softcap or None,
                           final_logit_softcapping=cfg.final_softcap or None,
                           **({} if window is None else {"sliding_window": window}))
    del c["hidden_act"]
    return c


FAMILY = Family(model_types=("gemma2",), config=config, weights=llama.weights, to_hf=to_hf,
                prefix="model.")
