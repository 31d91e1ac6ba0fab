"""Mixtral (`MixtralForCausalLM`): Llama whose feed-forwards are a routed MoE
(`block_sparse_moe`: router `gate`, experts w1 / w3 / w2; top-k renormalised,
dropless as transformers routes), with a window on every layer when `sliding_window`
is set. Its tensors are Llama's (`llama.weights`)."""

from __future__ import annotations

from tfjax.config import ModelConfig
from tfjax.interop.config_mapping import hf_window
from tfjax.interop.families import Family, llama

__all__ = ["FAMILY", "config", "to_hf"]


def config(hf: dict) -> dict:
    c = llama.config(hf)
    c.update(ffn_pattern=("moe",), moe=dict(
        num_experts=hf["num_local_experts"], experts_per_token=hf["num_experts_per_tok"],
        router_renormalize=True, capacity_factor=0.0,
        aux_loss_weight=float(hf.get("router_aux_loss_coef", 0.01))))
    return c


def to_hf(cfg: ModelConfig) -> dict:
    local = set(cfg.layer_pattern) == {"local"}
    return llama.to_hf_fields(cfg, "mixtral", "MixtralForCausalLM",
                              num_local_experts=cfg.moe.num_experts,
                              num_experts_per_tok=cfg.moe.experts_per_token,
                              router_aux_loss_coef=cfg.moe.aux_loss_weight,
                              **({"sliding_window": hf_window(cfg)} if local else {}))


FAMILY = Family(model_types=("mixtral",), config=config, weights=llama.weights, to_hf=to_hf,
                prefix="model.")
