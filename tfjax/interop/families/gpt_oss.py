"""gpt-oss (`GptOssForCausalLM`): `layer_types` alternate sliding (HF's window w: ours
w - 1) and full attention; a learned sink logit per head (`model.attention.sinks`);
q/k/v/o biases; YaRN with `truncate=False` (`rope.truncate`). The experts'
`gate_up_proj` `[E, D, 2F]` interleaves gate and up columns (gate = `[..., ::2]`, up =
`[..., 1::2]`), so it is split into `wi_gate` / `wi_up` (and its bias likewise);
softmax over the top-k router logits (+ `router.bias`) is our softmax-then-top-k
renormalised (dropless, as transformers routes), and `swiglu_alpha` / `swiglu_limit`
are `moe.glu="clamped"`'s alpha and limit."""

from __future__ import annotations

from tfjax.config import ModelConfig
from tfjax.interop.config_mapping import (layer_types, read_layer_pattern, read_rope,
                                          refuse_quantized, rms_decoder_fields,
                                          rms_decoder_to_hf)
from tfjax.interop.families import Family
from tfjax.interop.tensor_mapping import (Weights, attention_weights, embedding_and_head,
                                          norm_weights)

__all__ = ["FAMILY", "config", "to_hf", "weights"]


def config(hf: dict) -> dict:
    refuse_quantized(hf)
    n = hf["num_hidden_layers"]
    hf = dict(hf)
    if hf.get("layer_types") is None:  # gpt-oss's default: sliding first, alternating
        hf["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention"
                             for i in range(n)]
    bias = bool(hf.get("attention_bias", True))
    c = dict(rms_decoder_fields(hf), activation="swiglu", ffn_bias=True,
             attention=dict(qkv_bias=bias, out_bias=bias, sinks=True), rope=read_rope(hf),
             ffn_pattern=("moe",),
             moe=dict(num_experts=hf["num_local_experts"],
                      experts_per_token=hf["num_experts_per_tok"], router_renormalize=True,
                      router_bias=True, glu="clamped",
                      glu_alpha=float(hf.get("swiglu_alpha", 1.702)),
                      glu_limit=float(hf.get("swiglu_limit", 7.0)), capacity_factor=0.0,
                      aux_loss_weight=float(hf.get("router_aux_loss_coef", 0.001))))
    c["layer_pattern"], c["attention"]["sliding_window"] = read_layer_pattern(hf, n)
    return c


def weights(w: Weights, cfg: ModelConfig, hf: dict) -> dict:
    out = embedding_and_head(w, cfg)
    for i in range(cfg.num_layers):
        p, L = f"model.layers.{i}.", ("layers", i)
        out.update(attention_weights(w, p + "self_attn.", L + ("attn",), cfg))
        out[L + ("attn", "sinks")] = w[p + "self_attn.sinks"]
        out.update(norm_weights(w, p + "input_layernorm", L + ("attn_norm",), cfg))
        out.update(norm_weights(w, p + "post_attention_layernorm", L + ("ffn_norm",), cfg))
        e, F = p + "mlp.", L + ("ffn",)
        out[F + ("router",)] = w[e + "router.weight"].T  # [E, D] -> [D, E]
        out[F + ("router_bias",)] = w[e + "router.bias"]
        gate_up = w[e + "experts.gate_up_proj"]  # [E, D, 2F], columns gate, up, gate, up, ...
        bias = w[e + "experts.gate_up_proj_bias"]  # [E, 2F]
        out.update({F + ("wi_gate",): gate_up[..., 0::2], F + ("wi_up",): gate_up[..., 1::2],
                    F + ("bi_gate",): bias[..., 0::2], F + ("bi_up",): bias[..., 1::2],
                    F + ("wo",): w[e + "experts.down_proj"],  # [E, F, D]
                    F + ("bo",): w[e + "experts.down_proj_bias"]})
    return out


def to_hf(cfg: ModelConfig) -> dict:
    m = cfg.moe
    return rms_decoder_to_hf(cfg, "gpt_oss", "GptOssForCausalLM",
                             intermediate_size=m.d_ff or cfg.d_ff,
                             num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_size,
                             num_local_experts=m.num_experts,
                             num_experts_per_tok=m.experts_per_token,
                             layer_types=layer_types(cfg),
                             sliding_window=cfg.attention.sliding_window + 1,
                             attention_bias=cfg.attention.qkv_bias, swiglu_alpha=m.glu_alpha,
                             swiglu_limit=m.glu_limit, router_aux_loss_coef=m.aux_loss_weight)


FAMILY = Family(model_types=("gpt_oss",), config=config, weights=weights, to_hf=to_hf)
