"""Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3 attention (per-head QK-norm) and routed
experts (softmax, top-k, `norm_topk_prob` renormalises; dropless) on layers
`(i + 1) % decoder_sparse_step == 0` not in `mlp_only_layers`, dense SwiGLU on the
others (`model.ffn_pattern`); no shared experts. Experts load from the per-expert
tensors that `save_pretrained` writes or from the fused `gate_up_proj` / `down_proj` of
transformers 5's modules."""

from __future__ import annotations

import numpy as np

from tfjax.config import ModelConfig
from tfjax.interop.config_mapping import (attention_bias, check_types, hf_window, need,
                                          shortest_pattern, without)
from tfjax.interop.families import Family, llama, qwen3
from tfjax.interop.tensor_mapping import (Weights, attention_weights, embedding_and_head,
                                          norm_weights, qk_norm_weights, stacked_experts,
                                          swiglu_weights)

__all__ = ["FAMILY", "config", "to_hf", "weights"]

_KEY_TYPES: dict[str, tuple[type, ...]] = {  # beyond config_mapping.KEY_TYPES
    **dict.fromkeys(("decoder_sparse_step", "moe_intermediate_size", "num_experts",
                     "num_local_experts"), (int,)),
    "mlp_only_layers": (list, type(None)),
    "norm_topk_prob": (bool,),
}


def _sparse_layers(hf: dict, n: int) -> list[bool]:
    """Which layers route (Qwen3MoeDecoderLayer): not in mlp_only_layers, and
    (i + 1) % decoder_sparse_step == 0 when there are experts."""
    dense = hf.get("mlp_only_layers") or []
    step = hf.get("decoder_sparse_step", 1)
    if not all(type(i) is int for i in dense):
        raise ValueError(f"config.json: mlp_only_layers must be a list of layer indices, got "
                         f"{dense!r}")
    if step < 1:
        raise ValueError(f"config.json: decoder_sparse_step must be >= 1, got {step}")
    return [i not in dense and _num_experts(hf) > 0 and (i + 1) % step == 0 for i in range(n)]


def _num_experts(hf: dict) -> int:
    """`num_experts` (the hub's checkpoints) or `num_local_experts` (what transformers 5
    writes for it: its attribute_map)."""
    given = {k: hf[k] for k in ("num_experts", "num_local_experts") if k in hf}
    if len(set(map(repr, given.values()))) > 1:
        raise ValueError(f"config.json: num_experts and num_local_experts disagree ({given}); "
                         "keep one")
    return next(iter(given.values()), 128)


def config(hf: dict) -> dict:
    check_types(hf, key_types=_KEY_TYPES)
    n = hf["num_hidden_layers"]
    window = hf.get("sliding_window") if hf.get("use_sliding_window", False) else None
    # Qwen3MoeConfig has no layer_types / max_window_layers: a window covers every layer
    c = qwen3.config(dict(without(hf, "mlp_bias", "layer_types", "max_window_layers"),
                          sliding_window=window, use_sliding_window=window is not None))
    sparse = _sparse_layers(hf, n)
    if any(sparse):
        c.update(ffn_pattern=shortest_pattern(["moe" if s else "dense" for s in sparse]),
                 moe=dict(num_experts=_num_experts(hf), experts_per_token=hf["num_experts_per_tok"],
                          d_ff=hf["moe_intermediate_size"],
                          router_renormalize=bool(hf.get("norm_topk_prob", False)),
                          capacity_factor=0.0,
                          aux_loss_weight=float(hf.get("router_aux_loss_coef", 0.001))))
    return c


def _experts(w: Weights, p: str, L: tuple, cfg: ModelConfig) -> dict:
    """Router `gate.weight [E, D]` and the experts: per expert `experts.{e}.gate_proj`,
    `up_proj`, `down_proj` (as save_pretrained writes) or fused `experts.gate_up_proj
    [E, 2F, D]` (rows gate, up) and `experts.down_proj [E, D, F]`."""
    out = {L + ("router",): w[p + "gate.weight"].T}
    if p + "experts.gate_up_proj" in w:
        gate, up = np.split(w[p + "experts.gate_up_proj"], 2, axis=1)
        out.update({L + ("wi_gate",): np.swapaxes(gate, 1, 2),
                    L + ("wi_up",): np.swapaxes(up, 1, 2),
                    L + ("wo",): np.swapaxes(w[p + "experts.down_proj"], 1, 2)})
        return out
    out.update(stacked_experts(w, p, L, cfg.moe.num_experts))
    return out


def weights(w: Weights, cfg: ModelConfig, hf: dict) -> dict:
    out = embedding_and_head(w, cfg)
    for i in range(cfg.num_layers):
        p, L = f"model.layers.{i}.", ("layers", i)
        out.update(attention_weights(w, p + "self_attn.", L + ("attn",), cfg))
        out.update(qk_norm_weights(w, p + "self_attn.", L + ("attn",), cfg))
        out.update(norm_weights(w, p + "input_layernorm", L + ("attn_norm",), cfg))
        out.update(norm_weights(w, p + "post_attention_layernorm", L + ("ffn_norm",), cfg))
        if cfg.ffn_kind(i) == "moe":
            out.update(_experts(w, p + "mlp.", L + ("ffn",), cfg))
        else:
            out.update(swiglu_weights(w, p + "mlp", L + ("ffn",)))
    return out


def to_hf(cfg: ModelConfig) -> dict:
    m = cfg.moe
    kinds = [cfg.ffn_kind(i) for i in range(cfg.num_layers)]
    if not set(kinds) <= {"dense", "moe"}:
        raise ValueError(f"export: model.ffn_pattern={cfg.ffn_pattern!r} has no Qwen3-MoE form "
                         "(dense and moe layers)")
    hf = llama.checked_to_hf(cfg, "Qwen3-MoE", "qwen3_moe", "Qwen3MoeForCausalLM",
                             kinds=("global", "local"), uniform=True, ffn_pattern=cfg.ffn_pattern,
                             **{"attention.qk_norm": True, "attention.qk_norm_over": "head",
                                "attention.qk_norm_kind": ""})
    if "moe" in kinds:
        need(cfg, "Qwen3-MoE", **{
            "moe.shared_experts": 0, "moe.score": "softmax", "moe.n_group": 1,
            "moe.score_bias": False, "moe.routed_scaling_factor": 1.0, "moe.router_bias": False,
            "moe.glu": "standard", "moe.gate_input": False, "moe.capacity_factor": 0.0})
    window = hf_window(cfg)
    hf.update(attention_bias=attention_bias(cfg, "Qwen3-MoE"), use_sliding_window=window
              is not None, sliding_window=window, decoder_sparse_step=1,
              mlp_only_layers=[i for i, k in enumerate(kinds) if k == "dense"],
              num_experts=m.num_experts if "moe" in kinds else 0,
              num_experts_per_tok=m.experts_per_token, moe_intermediate_size=m.d_ff or cfg.d_ff,
              norm_topk_prob=m.router_renormalize, router_aux_loss_coef=m.aux_loss_weight)
    return hf


FAMILY = Family(model_types=("qwen3_moe",), config=config, weights=weights, to_hf=to_hf,
                prefix="model.")
