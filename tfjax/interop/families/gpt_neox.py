"""GPT-NeoX and Pythia (`GPTNeoXForCausalLM`): LayerNorms, a biased GELU MLP
(`dense_h_to_4h` / `dense_4h_to_h`), partial rotary (`rotary_pct`), a parallel
residual with two norms (`use_parallel_residual`; else sequential), and a fused
`query_key_value` `[N*3*H, D]` (per head q, k, v). BLOOM's layers are these
(`layer_weights`)."""

from __future__ import annotations

from tfjax.config import ModelConfig
from tfjax.interop.config_mapping import (common_fields, decoder_to_hf, hf_activation,
                                          read_activation, read_rope, rope_parameters)
from tfjax.interop.families import Family
from tfjax.interop.tensor_mapping import (Weights, embedding_and_head, fused_qkv_weights,
                                          linear_weights, norm_weights)

__all__ = ["FAMILY", "config", "layer_weights", "to_hf", "weights"]


def config(hf: dict) -> dict:
    bias = bool(hf.get("attention_bias", True))
    D, N = hf["hidden_size"], hf["num_attention_heads"]
    parallel = bool(hf.get("use_parallel_residual", True))
    return dict(common_fields(hf), arch="decoder", d_model=D, num_layers=hf["num_hidden_layers"],
                num_heads=N, d_ff=hf["intermediate_size"],
                max_len=hf.get("max_position_embeddings", 2048), position="rope",
                rope=read_rope(hf), norm="layernorm", norm_eps=hf.get("layer_norm_eps", 1e-5),
                block="parallel" if parallel else "sequential", parallel_shared_norm=False,
                activation=read_activation(hf, "hidden_act", gated=False), ffn_bias=True,
                attention=dict(qkv_bias=bias, out_bias=bias))


def layer_weights(w: Weights, p: str, L: tuple, cfg: ModelConfig, *, attention: str) -> dict:
    """A NeoX / BLOOM layer: fused QKV under `p + attention`, two LayerNorms, a
    dense_h_to_4h / dense_4h_to_h MLP with biases."""
    return {**fused_qkv_weights(w, p + attention, L + ("attn",), cfg),
            **norm_weights(w, p + "input_layernorm", L + ("attn_norm",), cfg),
            **norm_weights(w, p + "post_attention_layernorm", L + ("ffn_norm",), cfg),
            **linear_weights(w, p + "mlp.dense_h_to_4h", L + ("ffn", "wi"), True),
            **linear_weights(w, p + "mlp.dense_4h_to_h", L + ("ffn", "wo"), True)}


def weights(w: Weights, cfg: ModelConfig, hf: dict) -> dict:
    out = embedding_and_head(w, cfg, embedding="gpt_neox.embed_in.weight",
                             final_norm="gpt_neox.final_layer_norm", head="embed_out.weight")
    for i in range(cfg.num_layers):
        p, L = f"gpt_neox.layers.{i}.", ("layers", i)
        out.update(layer_weights(w, p, L, cfg, attention="attention."))
        w.ignore(p + "attention.bias", p + "attention.masked_bias",
                 p + "attention.rotary_emb.inv_freq")
    return out


def to_hf(cfg: ModelConfig) -> dict:
    return decoder_to_hf(cfg, "gpt_neox", "GPTNeoXForCausalLM", hidden_size=cfg.d_model,
                         intermediate_size=cfg.d_ff, num_hidden_layers=cfg.num_layers,
                         num_attention_heads=cfg.num_heads, max_position_embeddings=cfg.max_len,
                         rope_parameters=rope_parameters(cfg, partial=True),
                         layer_norm_eps=cfg.norm_eps,
                         use_parallel_residual=cfg.block == "parallel",
                         attention_bias=cfg.attention.qkv_bias,
                         hidden_act=hf_activation(cfg, gated=False))


FAMILY = Family(model_types=("gpt_neox",), config=config, weights=weights, to_hf=to_hf,
                prefix="gpt_neox.")
