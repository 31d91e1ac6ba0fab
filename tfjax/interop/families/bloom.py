"""BLOOM (`BloomForCausalLM`): ALiBi (BLOOM's `m * k` equals our `-m * |q - k|` up to a
per-query constant, which the softmax ignores), a LayerNorm on the embeddings,
GELU-tanh, and NeoX's layers (`gpt_neox.layer_weights`: fused `query_key_value`, per
head q, k, v)."""

from __future__ import annotations

from tfjax.config import ModelConfig
from tfjax.interop.config_mapping import common_fields, decoder_to_hf, unsupported
from tfjax.interop.families import Family, gpt_neox
from tfjax.interop.tensor_mapping import Weights, head_weights, norm_weights

__all__ = ["FAMILY", "config", "to_hf", "weights"]


def config(hf: dict) -> dict:
    if hf.get("apply_residual_connection_post_layernorm"):
        unsupported("apply_residual_connection_post_layernorm", True)
    D = hf["hidden_size"]
    return dict(common_fields(hf), arch="decoder", d_model=D, num_layers=hf["n_layer"],
                num_heads=hf["n_head"], d_ff=4 * D, max_len=2048, position="alibi",
                norm="layernorm", norm_eps=hf.get("layer_norm_epsilon", 1e-5), embed_norm=True,
                activation="gelu_tanh", ffn_bias=True,
                attention=dict(qkv_bias=True, out_bias=True))


def weights(w: Weights, cfg: ModelConfig, hf: dict) -> dict:
    out = {("embed", "tokens", "embedding"): w["transformer.word_embeddings.weight"],
           **norm_weights(w, "transformer.word_embeddings_layernorm", ("embed", "norm"), cfg),
           **norm_weights(w, "transformer.ln_f", ("final_norm",), cfg),
           **head_weights(w, "lm_head.weight", cfg)}
    for i in range(cfg.num_layers):
        p, L = f"transformer.h.{i}.", ("layers", i)
        out.update(gpt_neox.layer_weights(w, p, L, cfg, attention="self_attention."))
    return out


def to_hf(cfg: ModelConfig) -> dict:
    return decoder_to_hf(cfg, "bloom", "BloomForCausalLM", hidden_size=cfg.d_model,
                         n_layer=cfg.num_layers, n_head=cfg.num_heads,
                         layer_norm_epsilon=cfg.norm_eps)


FAMILY = Family(model_types=("bloom",), config=config, weights=weights, to_hf=to_hf,
                prefix="transformer.")
