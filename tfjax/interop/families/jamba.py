"""Jamba (`JambaForCausalLM`): attention (no positions) where `i % attn_layer_period ==
attn_layer_offset`, Mamba-1 layers with Jamba's inner RMSNorms on dt, B, C
(`ssm.inner_norm`; `mamba.mixer_weights`) elsewhere; a top-k MoE without
renormalisation (dropless, as HF) where `num_experts > 1` and `i % expert_layer_period
== expert_layer_offset`, a dense MLP elsewhere. Layer i's mixer sits at
`("layers", i, "attn")` whatever its kind."""

from __future__ import annotations

import math

from tfjax.config import ModelConfig
from tfjax.interop.config_mapping import (check_types, common_fields, need, require_silu,
                                          shortest_pattern)
from tfjax.interop.families import Family, mamba
from tfjax.interop.tensor_mapping import (Weights, attention_weights, embedding_and_head,
                                          norm_weights, stacked_experts, swiglu_weights)

__all__ = ["FAMILY", "config", "to_hf", "weights"]

_KEY_TYPES: dict[str, tuple[type, ...]] = {  # beyond config_mapping.KEY_TYPES
    **dict.fromkeys((
        "attn_layer_period", "attn_layer_offset", "expert_layer_period", "expert_layer_offset",
        "num_experts", "mamba_d_state", "mamba_d_conv", "mamba_expand"), (int,)),
    **dict.fromkeys(("mamba_conv_bias", "mamba_proj_bias"), (bool,)),
    "mamba_dt_rank": (int, str),
}


def _periodic(hf: dict, period_key: str, offset_key: str, defaults: tuple[int, int]) -> tuple:
    period, offset = hf.get(period_key, defaults[0]), hf.get(offset_key, defaults[1])
    for key, v in ((period_key, period), (offset_key, offset)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"config.json: {key}={v!r} must be an integer >= 0")
    if not 0 <= offset < period:
        raise ValueError(f"config.json: {offset_key}={offset} must be in [0, {period_key}="
                         f"{period}); fix {offset_key}")
    return period, offset


def config(hf: dict) -> dict:
    check_types(hf, key_types=_KEY_TYPES)
    require_silu(hf, "Jamba")
    n, D, N = hf["num_hidden_layers"], hf["hidden_size"], hf["num_attention_heads"]
    a_period, a_offset = _periodic(hf, "attn_layer_period", "attn_layer_offset", (8, 4))
    e_period, e_offset = _periodic(hf, "expert_layer_period", "expert_layer_offset", (2, 1))
    experts = hf.get("num_experts", hf.get("num_local_experts", 16))
    layers = ["global" if i % a_period == a_offset else "mamba" for i in range(n)]
    ffn = ["moe" if experts > 1 and i % e_period == e_offset else "dense" for i in range(n)]
    rank = hf.get("mamba_dt_rank", "auto")
    c = dict(common_fields(hf), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
             arch="decoder", d_model=D, num_layers=n, num_heads=N,  # defaults: JambaConfig's
             num_kv_heads=hf.get("num_key_value_heads", 8) or N,
             head_dim=hf.get("head_dim") or D // N,
             d_ff=hf["intermediate_size"], max_len=hf.get("max_position_embeddings", 262144),
             activation="swiglu", ffn_bias=False,
             attention=dict(qkv_bias=False, out_bias=False), position="none", norm="rmsnorm",
             norm_eps=hf.get("rms_norm_eps", 1e-6), norm_placement="pre",
             layer_pattern=shortest_pattern(layers, whole_cycles=True),
             ffn_pattern=shortest_pattern(ffn, whole_cycles=True),
             ssm=dict(d_state=hf.get("mamba_d_state", 16), d_conv=hf.get("mamba_d_conv", 4),
                      expand=hf.get("mamba_expand", 2),
                      dt_rank=0 if rank == "auto" else int(rank),
                      conv_bias=bool(hf.get("mamba_conv_bias", True)),
                      proj_bias=bool(hf.get("mamba_proj_bias", False)), inner_norm=True))
    if "moe" in ffn:
        c["moe"] = dict(num_experts=experts, experts_per_token=hf.get("num_experts_per_tok", 2),
                        router_renormalize=False, capacity_factor=0.0,  # dropless, as HF
                        aux_loss_weight=float(hf.get("router_aux_loss_coef", 0.001)))
    return c


def weights(w: Weights, cfg: ModelConfig, hf: dict) -> dict:
    out = embedding_and_head(w, cfg, final_norm="model.final_layernorm")
    for i in range(cfg.num_layers):
        p, L = f"model.layers.{i}.", ("layers", i)
        if cfg.layer_kind(i) == "mamba":
            out.update(mamba.mixer_weights(w, p + "mamba.", L + ("attn",), cfg))
        else:
            out.update(attention_weights(w, p + "self_attn.", L + ("attn",), cfg))
        out.update(norm_weights(w, p + "input_layernorm", L + ("attn_norm",), cfg))
        out.update(norm_weights(w, p + "pre_ff_layernorm", L + ("ffn_norm",), cfg))
        if cfg.ffn_kind(i) == "moe":
            f, F = p + "feed_forward.", L + ("ffn",)
            out[F + ("router",)] = w[f + "router.weight"].T  # [E, D] -> [D, E]
            out.update(stacked_experts(w, f, F, cfg.moe.num_experts))
        else:
            out.update(swiglu_weights(w, p + "feed_forward", L + ("ffn",)))
    return out


def _phase(kinds: list[str], kind: str, family: str, field: str) -> tuple[int, int]:
    """(period, offset) of the layers of `kind` in `kinds`: exactly those i with
    i % period == offset (Jamba's rule), or a ValueError naming the pattern."""
    at = [i for i, k in enumerate(kinds) if k == kind]
    n = len(kinds)
    if not at:
        return n + 1, n  # none: a period past the stack (offset < period)
    period = at[1] - at[0] if len(at) > 1 else n
    if all((k == kind) == (i % period == at[0] % period) for i, k in enumerate(kinds)):
        return period, at[0] % period
    raise ValueError(f"export: model.{field} does not place its {kind!r} layers every k "
                     f"layers from an offset, as {family} does")


def to_hf(cfg: ModelConfig) -> dict:
    need(cfg, "Jamba", **{
        "arch": "decoder", "norm": "rmsnorm", "norm_placement": "pre", "block": "sequential",
        "position": "none", "activation": "swiglu", "ffn_bias": False,
        "attention.qkv_bias": False, "attention.out_bias": False, "attention.qk_norm": False,
        "attention.output_gate": False, "attention.softcap": 0.0, "final_softcap": 0.0,
        "scale_embeddings": False, "embed_norm": False, "logits_scale": 1.0,
        "attention.sinks": False, "v_head_dim": 0, "attention.differential": False,
        "attention.value_residual": "none", "attention.scale": 0.0, "final_norm": True,
        "ssm.inner_norm": True})
    n = cfg.num_layers
    kinds = [cfg.layer_kind(i) for i in range(n)]
    ffn = [cfg.ffn_kind(i) for i in range(n)]
    if any(k not in ("mamba", "global") for k in kinds):
        raise ValueError(f"export: model.layer_pattern={cfg.layer_pattern!r}: Jamba has mamba "
                         "and global layers only")
    if any(f not in ("dense", "moe") for f in ffn):
        raise ValueError(f"export: model.ffn_pattern={cfg.ffn_pattern!r}: Jamba has dense and "
                         "moe feed-forwards only")
    a_period, a_offset = _phase(kinds, "global", "Jamba", "layer_pattern")
    e_period, e_offset = _phase(ffn, "moe", "Jamba", "ffn_pattern")
    s, m = cfg.ssm, cfg.moe
    out = dict(architectures=["JambaForCausalLM"], model_type="jamba", vocab_size=cfg.vocab_size,
               hidden_size=cfg.d_model, intermediate_size=cfg.d_ff, num_hidden_layers=n,
               num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.kv_heads,
               hidden_act="silu", max_position_embeddings=cfg.max_len, rms_norm_eps=cfg.norm_eps,
               tie_word_embeddings=cfg.tie_embeddings, attention_dropout=0.0,
               attn_layer_period=a_period, attn_layer_offset=a_offset,
               expert_layer_period=e_period, expert_layer_offset=e_offset,
               mamba_d_state=s.d_state, mamba_d_conv=s.d_conv, mamba_expand=s.expand,
               mamba_dt_rank=s.dt_rank or math.ceil(cfg.d_model / 16),
               mamba_conv_bias=s.conv_bias, mamba_proj_bias=s.proj_bias, num_experts=1,
               num_experts_per_tok=1, dtype=cfg.param_dtype)
    if cfg.head_size != cfg.d_model // cfg.num_heads:
        raise ValueError(f"export: model.head_dim={cfg.head_size}: Jamba's heads are "
                         f"hidden_size / num_attention_heads = {cfg.d_model // cfg.num_heads}")
    if "moe" in ffn:
        need(cfg, "Jamba", **{
            "moe.shared_experts": 0, "moe.score": "softmax", "moe.n_group": 1,
            "moe.score_bias": False, "moe.routed_scaling_factor": 1.0, "moe.router_bias": False,
            "moe.glu": "standard", "moe.gate_input": False, "moe.router_renormalize": False,
            "moe.capacity_factor": 0.0})
        if m.d_ff not in (0, cfg.d_ff):
            raise ValueError(f"export: model.moe.d_ff={m.d_ff}: Jamba's experts are "
                             f"intermediate_size={cfg.d_ff} wide")
        if m.num_experts < 2:
            raise ValueError("export: Jamba has no one-expert MoE (num_experts=1 is its dense "
                             "MLP); use ffn_pattern 'dense' or moe.num_experts >= 2")
        out.update(num_experts=m.num_experts, num_experts_per_tok=m.experts_per_token,
                   router_aux_loss_coef=m.aux_loss_weight)
    return out


FAMILY = Family(model_types=("jamba",), config=config, weights=weights, to_hf=to_hf,
                prefix="model.")
