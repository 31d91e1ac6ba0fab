"""Llama and Mistral (`LlamaForCausalLM`, `MistralForCausalLM`): pre-norm RMSNorm,
SwiGLU, RoPE in the "half" layout, `attention_bias` on q, k, v and o; Mistral is Llama
whose every layer slides a window. The layout most decoder families extend: qwen3,
mixtral, gemma2, qwen2, olmo2, smollm3, gemma3_text, phi3 and qwen3_moe read their
config through `config`, and most their tensors through `weights`, which also holds
Qwen3's QK-norms, Gemma 2's sandwich norms, OLMo 2's output norms and Mixtral's
experts.
"""

from __future__ import annotations

from typing import Any

from tfjax.config import ModelConfig
from tfjax.interop.config_mapping import (common_fields, decoder_to_hf, hf_activation,
                                          hf_window, need, read_activation,
                                          read_layer_pattern, read_rope, rope_parameters)
from tfjax.interop.families import Family
from tfjax.interop.tensor_mapping import (Weights, attention_weights, embedding_and_head,
                                          norm_weights, qk_norm_weights, stacked_experts,
                                          swiglu_weights)

__all__ = ["FAMILY", "checked_to_hf", "config", "to_hf", "to_hf_fields", "weights"]


def config(hf: dict) -> dict:
    n = hf["num_hidden_layers"]
    D, N = hf["hidden_size"], hf["num_attention_heads"]
    bias = bool(hf.get("attention_bias", False))
    c = dict(common_fields(hf), arch="decoder", d_model=D, num_layers=n, num_heads=N,
             num_kv_heads=hf.get("num_key_value_heads") or N, head_dim=hf.get("head_dim") or D // N,
             d_ff=hf["intermediate_size"], max_len=hf.get("max_position_embeddings", 2048),
             activation=read_activation(hf, "hidden_act", gated=True),
             ffn_bias=bool(hf.get("mlp_bias", False)),
             attention=dict(qkv_bias=bias, out_bias=bias), position="rope", rope=read_rope(hf),
             norm="rmsnorm", norm_eps=hf.get("rms_norm_eps", 1e-6), norm_placement="pre")
    c["layer_pattern"], c["attention"]["sliding_window"] = read_layer_pattern(hf, n)
    return c


# A layer's norms, HF's name -> ours, by model.norm_placement ("pre" for any other).
_NORMS = {
    "pre": (("input_layernorm", "attn_norm"), ("post_attention_layernorm", "ffn_norm")),
    "sandwich": (("input_layernorm", "attn_norm"), ("post_attention_layernorm", "post_attn_norm"),
                 ("pre_feedforward_layernorm", "ffn_norm"),
                 ("post_feedforward_layernorm", "post_ffn_norm")),  # Gemma 2
    "output": (("post_attention_layernorm", "attn_norm"),
               ("post_feedforward_layernorm", "ffn_norm")),  # OLMo 2: on the sublayers' outputs
}


def weights(w: Weights, cfg: ModelConfig, hf: dict) -> dict:
    out = embedding_and_head(w, cfg)
    norms = _NORMS.get(cfg.norm_placement, _NORMS["pre"])
    for i in range(cfg.num_layers):
        p, L = f"model.layers.{i}.", ("layers", i)
        out.update(attention_weights(w, p + "self_attn.", L + ("attn",), cfg))
        if cfg.attention.qk_norm:  # Qwen3, OLMo 2
            out.update(qk_norm_weights(w, p + "self_attn.", L + ("attn",), cfg))
        for theirs, ours in norms:
            out.update(norm_weights(w, p + theirs, L + (ours,), cfg))
        if cfg.ffn_kind(i) == "moe":  # Mixtral: router `gate`, experts w1 / w3 / w2
            m, F = p + "block_sparse_moe.", L + ("ffn",)
            out[F + ("router",)] = w[m + "gate.weight"].T  # [E, D] -> [D, E]
            out.update(stacked_experts(w, m, F, cfg.moe.num_experts, names=("w1", "w3", "w2")))
        else:
            out.update(swiglu_weights(w, p + "mlp", L + ("ffn",), cfg.ffn_bias))
    return out


def to_hf_fields(cfg: ModelConfig, model_type: str, architecture: str, **fields) -> dict:
    """The config.json of a Llama-shaped model (`fields` added); whether it says the
    same model is `tfjax.interop.computation.config_diff`'s question, which export asks."""
    return decoder_to_hf(cfg, model_type, architecture, hidden_size=cfg.d_model,
                         intermediate_size=cfg.d_ff, num_hidden_layers=cfg.num_layers,
                         num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.kv_heads,
                         head_dim=cfg.head_size, hidden_act=hf_activation(cfg, gated=True),
                         max_position_embeddings=cfg.max_len, rms_norm_eps=cfg.norm_eps,
                         rope_parameters=rope_parameters(cfg), attention_dropout=0.0, **fields)


def to_hf(cfg: ModelConfig) -> dict:
    """Llama, or Mistral where every layer slides a window (Llama has none)."""
    if set(cfg.layer_pattern) == {"local"}:
        return to_hf_fields(cfg, "mistral", "MistralForCausalLM", sliding_window=hf_window(cfg))
    return to_hf_fields(cfg, "llama", "LlamaForCausalLM", attention_bias=cfg.attention.qkv_bias,
                        mlp_bias=cfg.ffn_bias)


def _rope_to_hf(cfg: ModelConfig, family: str) -> dict:
    """`model.rope` as HF `rope_parameters` (LongRoPE for Phi-3), or a ValueError for
    what these families cannot hold."""
    r = cfg.rope
    if r.layout != "half":
        raise ValueError(f"export: {family} rotates halves: needs model.rope.layout='half', got "
                         f"{r.layout!r}")
    if r.scaling not in ("none", "linear", "llama3", "yarn") and not (
            (r.scaling == "dynamic_ntk" and r.original_max_len == cfg.max_len)
            or (r.scaling == "longrope" and family == "Phi-3")):
        raise ValueError(f"export: model.rope.scaling={r.scaling!r} has no {family} form "
                         "(none, linear, llama3, yarn, dynamic_ntk from max_len are; "
                         "longrope for Phi-3)")
    return rope_parameters(cfg, partial=r.fraction != 1.0, longrope=family == "Phi-3")


def checked_to_hf(cfg: ModelConfig, family: str, model_type: str, architecture: str, *,
                  kinds: tuple[str, ...] = ("global",), uniform: bool = False,
                  **want: Any) -> dict:
    """The fields every Llama-like family of 2024-25 (qwen2, olmo2, smollm3, gemma3_text,
    phi3, qwen3_moe) writes, after checking what it cannot carry: fields other than
    `want`'s values (dotted names reach into sections), layer kinds other than `kinds`
    (`uniform`: one kind for every layer)."""
    base = {"arch": "decoder", "norm": "rmsnorm", "norm_placement": "pre",
            "block": "sequential", "position": "rope", "activation": "swiglu",
            "ffn_bias": False, "attention.qk_norm": False, "attention.softcap": 0.0,
            "final_softcap": 0.0, "scale_embeddings": False, "embed_norm": False,
            "logits_scale": 1.0, "ffn_pattern": ("dense",), "prefix_lm": False,
            "attention.sinks": False, "v_head_dim": 0, "final_norm": True,
            "attention.differential": False, "attention.value_residual": "none",
            "attention.output_gate": False, "mup_base_width": 0,
            "attention.local_rope_theta": 0.0,
            "attention.scale": 0.0 if not cfg.attention.scale else cfg.head_size ** -0.5}
    base.update(want)
    need(cfg, family, **base)
    if not set(cfg.layer_pattern) <= set(kinds) or uniform and len(set(cfg.layer_pattern)) > 1:
        one = ", one for all layers" if uniform else ""
        raise ValueError(f"export: model.layer_pattern={cfg.layer_pattern!r} has no {family} "
                         f"form (layer kinds {', '.join(kinds)}{one})")
    N, D = cfg.num_heads, cfg.d_model
    return dict(architectures=[architecture], model_type=model_type, vocab_size=cfg.vocab_size,
                hidden_size=D, intermediate_size=cfg.d_ff, num_hidden_layers=cfg.num_layers,
                num_attention_heads=N, num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_size,
                hidden_act="silu", max_position_embeddings=cfg.max_len,
                rms_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings,
                rope_parameters=_rope_to_hf(cfg, family), dtype=cfg.param_dtype,
                attention_dropout=0.0,
                # no token ids of the family's own vocabulary (export writes the tokenizer's)
                pad_token_id=None, bos_token_id=None, eos_token_id=None)


FAMILY = Family(model_types=("llama", "mistral"), config=config, weights=weights, to_hf=to_hf,
                prefix="model.")
