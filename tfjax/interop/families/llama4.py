"""Llama 4, text (`Llama4ForCausalLM`, model_type "llama4_text"): a layer's kind is its
`layer_types` entry and its `no_rope_layers` flag (1 = RoPE): chunked + RoPE ->
"chunked" (`attention_chunk_size`), full + RoPE -> "global", full + NoPE -> "nope"
(with `attn_temperature_tuning`: the query temperature of `floor_scale` /
`attn_scale`); `moe_layers` (or every `interleave_moe_layer_step`-th layer) are "moe"
(top-k sigmoid gates scaling the expert's input, `moe.gate_input`, plus a shared
expert of `intermediate_size`; dropless), the others dense of `intermediate_size_mlp`.
Llama 4 rotates complex pairs of its q/k features (`rope.layout="interleaved"`);
`use_qk_norm` is the weightless L2 norm on the RoPE layers, which commutes with the
rotation (our norm-then-rotate equals HF's rotate-then-norm). Its experts'
`gate_up_proj` `[E, D, 2F]` is gate then up."""

from __future__ import annotations

from tfjax.config import ModelConfig
from tfjax.interop.config_mapping import (read_activation, read_rope, refuse_quantized,
                                          rms_decoder_fields, rms_decoder_to_hf,
                                          shortest_pattern, unsupported)
from tfjax.interop.families import Family
from tfjax.interop.tensor_mapping import (Weights, attention_weights, embedding_and_head,
                                          norm_weights, swiglu_weights)

__all__ = ["FAMILY", "config", "to_hf", "weights"]


def _layers(hf: dict, n: int) -> tuple[list[str], list[str]]:
    """(layer kind, ffn kind) of each of the n layers."""
    interval = hf.get("no_rope_layer_interval", 4)
    rope = hf.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n)]
    if len(rope) < n:
        unsupported("no_rope_layers", rope, f"needs an entry per layer ({n})")
    chunk = hf.get("attention_chunk_size")
    types = hf.get("layer_types") or [
        "chunked_attention" if r and chunk is not None else "full_attention" for r in rope[:n]]
    if len(types) < n:
        unsupported("layer_types", types, f"needs an entry per layer ({n})")
    kinds = []
    for i, (t, r) in enumerate(zip(types[:n], rope)):
        if t == "chunked_attention" and r:
            if not chunk or chunk < 1:
                unsupported("attention_chunk_size", chunk, "chunked layers need a chunk >= 1")
            kinds.append("chunked")
        elif t == "full_attention":
            kinds.append("global" if r else "nope")
        else:
            unsupported(f"layer_types[{i}]", t, "Llama 4 layers are chunked_attention (with "
                        "RoPE) or full_attention")
    step = hf.get("interleave_moe_layer_step", 1)
    moe = hf.get("moe_layers")
    moe = set(range(step - 1, n, step) if moe is None else moe)
    return kinds, ["moe" if i in moe else "dense" for i in range(n)]


def config(hf: dict) -> dict:
    refuse_quantized(hf)
    n = hf["num_hidden_layers"]
    kinds, ffns = _layers(hf, n)
    rope = dict(read_rope(hf), layout="interleaved")  # complex pairs (x[2i], x[2i+1])
    qk_norm = bool(hf.get("use_qk_norm", True))
    if qk_norm and rope.get("scaling") == "yarn":
        # the L2 norm commutes with a rotation, not with YaRN's cos/sin temperature
        unsupported("rope_parameters.rope_type", "yarn", "Llama 4 with use_qk_norm: default, "
                    "linear, llama3 or dynamic")
    bias = bool(hf.get("attention_bias", False))
    tuning = bool(hf.get("attn_temperature_tuning", True)) and "nope" in kinds
    chunk = int(hf.get("attention_chunk_size") or 0) if "chunked" in kinds else 0
    return dict(rms_decoder_fields(hf),
                d_ff=hf.get("intermediate_size_mlp") or hf["intermediate_size"],
                activation=read_activation(hf, "hidden_act", gated=True), ffn_bias=False,
                rope=rope, layer_pattern=shortest_pattern(kinds),
                ffn_pattern=shortest_pattern(ffns),
                attention=dict(qkv_bias=bias, out_bias=bias, qk_norm=qk_norm,
                               qk_norm_kind="rmsnorm_unit" if qk_norm else "",
                               qk_norm_layers="rope", chunk=chunk,
                               temperature_floor=int(hf.get("floor_scale", 8192)) if tuning else 0,
                               temperature_scale=float(hf.get("attn_scale", 0.1))),
                moe=dict(num_experts=hf["num_local_experts"],
                         experts_per_token=hf.get("num_experts_per_tok", 1),
                         d_ff=hf["intermediate_size"],
                         score="sigmoid", gate_input=True, shared_experts=1,
                         router_renormalize=False, capacity_factor=0.0,
                         aux_loss_weight=float(hf.get("router_aux_loss_coef", 0.001))))


def weights(w: Weights, cfg: ModelConfig, hf: dict) -> dict:
    out = embedding_and_head(w, cfg)
    F = cfg.moe.d_ff
    for i in range(cfg.num_layers):
        p, L = f"model.layers.{i}.", ("layers", i)
        out.update(attention_weights(w, p + "self_attn.", L + ("attn",), cfg))
        out.update(norm_weights(w, p + "input_layernorm", L + ("attn_norm",), cfg))
        out.update(norm_weights(w, p + "post_attention_layernorm", L + ("ffn_norm",), cfg))
        f = p + "feed_forward."
        if cfg.ffn_kind(i) != "moe":
            out.update(swiglu_weights(w, f[:-1], L + ("ffn",)))
            continue
        gate_up = w[f + "experts.gate_up_proj"]  # [E, D, 2F]: gate columns, then up
        out.update({L + ("ffn", "router"): w[f + "router.weight"].T,
                    L + ("ffn", "wi_gate"): gate_up[..., :F],
                    L + ("ffn", "wi_up"): gate_up[..., F:],
                    L + ("ffn", "wo"): w[f + "experts.down_proj"]})  # [E, F, D]
        out.update(swiglu_weights(w, f + "shared_expert", L + ("ffn", "shared")))
    return out


def to_hf(cfg: ModelConfig) -> dict:
    m, a = cfg.moe, cfg.attention
    n = cfg.num_layers
    kinds = [cfg.layer_kind(i) for i in range(n)]
    return rms_decoder_to_hf(
        cfg, "llama4_text", "Llama4ForCausalLM", intermediate_size=m.d_ff or cfg.d_ff,
        intermediate_size_mlp=cfg.d_ff, num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_size, num_local_experts=m.num_experts,
        num_experts_per_tok=m.experts_per_token,
        moe_layers=[i for i in range(n) if cfg.ffn_kind(i) == "moe"],
        layer_types=["chunked_attention" if k == "chunked" else "full_attention" for k in kinds],
        no_rope_layers=[int(k != "nope") for k in kinds],
        attention_chunk_size=a.chunk or None, use_qk_norm=a.qk_norm,
        attn_temperature_tuning=a.temperature_floor > 0,
        floor_scale=a.temperature_floor or 8192, attn_scale=a.temperature_scale,
        attention_bias=a.qkv_bias, router_aux_loss_coef=m.aux_loss_weight)


FAMILY = Family(model_types=("llama4_text",), config=config, weights=weights, to_hf=to_hf)
