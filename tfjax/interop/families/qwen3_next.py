"""Qwen3-Next (`Qwen3NextForCausalLM`): "gated_deltanet" / "global" layers from
`layer_types` (or `full_attention_interval`); gated attention (`attn.q` + `attn.gate`)
with QK-norm and partial rotary; `(1 + w)` RMSNorms; the Gated DeltaNet's fused,
per-key-head interleaved projections split into ours; a dropless softmax top-k MoE
with a gated shared expert where `decoder_sparse_step` and `mlp_only_layers` put it.
The `mtp.*` module loads into `model.mtp` when the checkpoint holds it. See
docs/interop.md."""

from __future__ import annotations

import numpy as np

from tfjax.config import ModelConfig
from tfjax.interop.config_mapping import (attention_bias, check_types, common_fields, need,
                                          read_rope, require_silu, rope_parameters,
                                          shortest_pattern, unsupported)
from tfjax.interop.families import Family
from tfjax.interop.tensor_mapping import (Weights, embedding_and_head, heads_in, heads_out,
                                          mtp_weights, norm_weights, qk_norm_weights,
                                          stacked_experts, swiglu_weights)

__all__ = ["FAMILY", "config", "mtp_depth", "to_hf", "weights"]

_KEY_TYPES: dict[str, tuple[type, ...]] = {  # beyond config_mapping.KEY_TYPES
    **dict.fromkeys((
        "full_attention_interval", "linear_num_key_heads", "linear_num_value_heads",
        "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim",
        "decoder_sparse_step", "num_experts", "moe_intermediate_size",
        "shared_expert_intermediate_size"), (int,)),
    "norm_topk_prob": (bool,),
    "mlp_only_layers": (list, type(None)),
}
_LAYERS = {"linear_attention": "gated_deltanet", "full_attention": "global"}


def _ffn_kinds(hf: dict, n: int) -> list[str]:
    """HF's rule: layer i is sparse (MoE) unless it is in mlp_only_layers, there are no
    experts, or (i + 1) % decoder_sparse_step != 0."""
    step, dense = hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers") or ()
    if not all(type(i) is int for i in dense):
        raise ValueError(f"config.json: mlp_only_layers={dense!r} must list layer indices")
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise ValueError(f"config.json: decoder_sparse_step={step!r} must be an integer >= 1")
    experts = hf.get("num_experts", 512)
    return ["moe" if experts > 0 and i not in dense and (i + 1) % step == 0 else "dense"
            for i in range(n)]


def config(hf: dict) -> dict:
    check_types(hf, key_types=_KEY_TYPES)
    require_silu(hf, "Qwen3-Next")
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None:
        interval = hf.get("full_attention_interval", 4)
        if interval < 1:
            raise ValueError(f"config.json: full_attention_interval={interval} must be >= 1")
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                 for i in range(n)]
    if len(types) != n:
        raise ValueError(f"config.json: layer_types has {len(types)} entries for "
                         f"num_hidden_layers={n}; give one per layer")
    for t in types:
        if t not in _LAYERS:
            unsupported("layer_types", t, f"supported: {sorted(_LAYERS)}")
    D, N = hf["hidden_size"], hf["num_attention_heads"]
    bias = bool(hf.get("attention_bias", False))
    rope = read_rope(hf)
    if "partial_rotary_factor" not in {**hf, **(hf.get("rope_parameters") or {}),
                                       **(hf.get("rope_scaling") or {})}:
        rope["fraction"] = 0.25  # Qwen3NextConfig's own default
    ffn = _ffn_kinds(hf, n)
    c = dict(common_fields(hf), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
             arch="decoder", d_model=D, num_layers=n, num_heads=N,  # defaults: Qwen3NextConfig's
             num_kv_heads=hf.get("num_key_value_heads", 2) or N,
             head_dim=hf.get("head_dim", 256) or D // N,
             d_ff=hf["intermediate_size"], max_len=hf.get("max_position_embeddings", 32768),
             activation="swiglu", ffn_bias=False,
             attention=dict(qkv_bias=bias, out_bias=bias, qk_norm=True, output_gate=True),
             position="rope", rope=rope, norm="rmsnorm_plus_one",
             norm_eps=hf.get("rms_norm_eps", 1e-6), norm_placement="pre",
             layer_pattern=shortest_pattern([_LAYERS[t] for t in types], whole_cycles=True),
             ffn_pattern=shortest_pattern(ffn, whole_cycles=True),
             gdn=dict(num_k_heads=hf.get("linear_num_key_heads", 16),
                      num_v_heads=hf.get("linear_num_value_heads", 32),
                      head_k_dim=hf.get("linear_key_head_dim", 128),
                      head_v_dim=hf.get("linear_value_head_dim", 128),
                      d_conv=hf.get("linear_conv_kernel_dim", 4)))
    if "moe" in ffn:
        shared = hf.get("shared_expert_intermediate_size", 512)
        if not shared:
            unsupported("shared_expert_intermediate_size", shared, "Qwen3-Next's sparse block "
                        "always has a shared expert (width >= 1)")
        c["moe"] = dict(num_experts=hf.get("num_experts", 512),
                        experts_per_token=hf.get("num_experts_per_tok", 10),
                        d_ff=hf.get("moe_intermediate_size", 512), shared_experts=1,
                        shared_d_ff=shared, shared_gate=True,
                        router_renormalize=bool(hf.get("norm_topk_prob", True)),
                        capacity_factor=0.0,  # dropless, as HF
                        aux_loss_weight=float(hf.get("router_aux_loss_coef", 0.001)))
    return c


def _gated_attention(w: Weights, p: str, L: tuple, cfg: ModelConfig) -> dict:
    """Qwen3-Next's attention: `q_proj` `[N * 2H, D]` holds, per head, the query's H rows
    then the output gate's H rows; k, v, o and the QK-norms as Qwen3's."""
    N, K, H = cfg.num_heads, cfg.kv_heads, cfg.head_size
    Wq = w[p + "q_proj.weight"].T
    Wq = Wq.reshape(Wq.shape[0], N, 2, H)
    out = {L + ("q", "kernel"): Wq[:, :, 0], L + ("gate", "kernel"): Wq[:, :, 1],
           L + ("k", "kernel"): heads_in(w[p + "k_proj.weight"], K, H),
           L + ("v", "kernel"): heads_in(w[p + "v_proj.weight"], K, H),
           L + ("o", "kernel"): heads_out(w[p + "o_proj.weight"], N, H)}
    if cfg.attention.qkv_bias:
        bq = w[p + "q_proj.bias"].reshape(N, 2, H)
        out[L + ("q", "bias")], out[L + ("gate", "bias")] = bq[:, 0], bq[:, 1]
        out[L + ("k", "bias")] = w[p + "k_proj.bias"].reshape(K, H)
        out[L + ("v", "bias")] = w[p + "v_proj.bias"].reshape(K, H)
    if cfg.attention.out_bias:
        out[L + ("o", "bias")] = w[p + "o_proj.bias"]
    out.update(qk_norm_weights(w, p, L, cfg))
    return out


def _gated_deltanet(w: Weights, p: str, M: tuple, cfg: ModelConfig) -> dict:
    """HF's fused GDN projections -> our separate ones. `in_proj_qkvz` rows: per key head
    (Hk of them), q (dk), k (dk), then v and z (G * dv each, G = Hv / Hk value heads);
    `in_proj_ba`: per key head, G b's then G a's. Value head k * G + g reads key head k
    (HF's repeat_interleave, our h // G). The conv's channels are q, k, v flat."""
    Hk, Hv, dk, dv = cfg.gdn.dims(cfg.num_heads, cfg.head_size)
    G = Hv // Hk
    Wqkvz = w[p + "in_proj_qkvz.weight"].T  # [D, Hk * (2 dk + 2 G dv)]
    D = Wqkvz.shape[0]
    Wqkvz = Wqkvz.reshape(D, Hk, 2 * dk + 2 * G * dv)
    q, k, v, z = np.split(Wqkvz, [dk, 2 * dk, 2 * dk + G * dv], axis=-1)
    Wba = w[p + "in_proj_ba.weight"].T.reshape(D, Hk, 2 * G)
    conv = w[p + "conv1d.weight"][:, 0, :].T  # [Hk dk + Hk dk + Hv dv, 1, K] -> [K, C]
    cq, ck, cv = np.split(conv, [Hk * dk, 2 * Hk * dk], axis=-1)
    K = conv.shape[0]
    return {M + ("q_proj",): q, M + ("k_proj",): k,
            M + ("v_proj",): v.reshape(D, Hv, dv), M + ("z_proj",): z.reshape(D, Hv, dv),
            M + ("b_proj",): Wba[..., :G].reshape(D, Hv),
            M + ("a_proj",): Wba[..., G:].reshape(D, Hv),
            M + ("conv_q",): cq.reshape(K, Hk, dk), M + ("conv_k",): ck.reshape(K, Hk, dk),
            M + ("conv_v",): cv.reshape(K, Hv, dv),
            M + ("A_log",): w[p + "A_log"], M + ("dt_bias",): w[p + "dt_bias"],
            M + ("norm", "scale"): w[p + "norm.weight"],
            M + ("out_proj",): w[p + "out_proj.weight"].T.reshape(Hv, dv, D)}


def weights(w: Weights, cfg: ModelConfig, hf: dict) -> dict:
    out = embedding_and_head(w, cfg)
    n = cfg.num_layers
    for i in range(n):
        out.update(_layer(w, cfg, f"model.layers.{i}.", ("layers", i),
                                     cfg.layer_kind(i), cfg.ffn_kind(i)))
    if cfg.mtp_depth:  # `mtp.*`: one module (tfjax.models.mtp) of the last layer's kinds
        out.update(_layer(w, cfg, "mtp.layers.0.", ("mtp", 0, "layers", "blocks", 0),
                                     cfg.layer_kind(n - 1), cfg.ffn_kind(n - 1)))
        out.update(mtp_weights(w, cfg, 0, embed_norm="mtp.pre_fc_norm_embedding",
                                      hidden_norm="mtp.pre_fc_norm_hidden", norm="mtp.norm",
                                      proj="mtp.fc"))
    w.ignore(*(k for k in w.ckpt if k.startswith("mtp.")))  # a checkpoint without "mtp.fc"
    return out


def mtp_depth(hf: dict, names) -> int:
    """1 when the checkpoint holds Qwen3-Next's MTP module (`mtp.fc`, `mtp.layers.0`),
    else 0 (transformers' own saves drop it)."""
    names = set(names)
    if any(k.startswith("mtp.layers.1.") for k in names):
        raise NotImplementedError("mtp.layers.1: Qwen3-Next's deeper MTP shares mtp.fc and its "
                                  "norms across depths; tfjax's MTP modules have their own "
                                  "(model.mtp_depth=1 only)")
    return int("mtp.fc.weight" in names)


def _layer(w: Weights, cfg: ModelConfig, p: str, L: tuple, kind: str,
                      ffn_kind: str) -> dict:
    """Hub layer `p` (Gated DeltaNet or gated attention, then MoE or dense) -> under L."""
    out = {}
    if kind == "gated_deltanet":
        out.update(_gated_deltanet(w, p + "linear_attn.", L + ("attn",), cfg))
    else:
        out.update(_gated_attention(w, p + "self_attn.", L + ("attn",), cfg))
    out.update(norm_weights(w, p + "input_layernorm", L + ("attn_norm",), cfg))
    out.update(norm_weights(w, p + "post_attention_layernorm", L + ("ffn_norm",), cfg))
    F = L + ("ffn",)
    if ffn_kind == "moe":
        out[F + ("router",)] = w[p + "mlp.gate.weight"].T  # [E, D] -> [D, E]
        out.update(stacked_experts(w, p + "mlp.", F, cfg.moe.num_experts))
        out.update(swiglu_weights(w, p + "mlp.shared_expert", F + ("shared",)))
        out[F + ("shared_gate",)] = w[p + "mlp.shared_expert_gate.weight"].T  # [1, D] -> [D, 1]
    else:
        out.update(swiglu_weights(w, p + "mlp", F))
    return out


def to_hf(cfg: ModelConfig) -> dict:
    need(cfg, "Qwen3-Next", **{
        "arch": "decoder", "norm": "rmsnorm_plus_one", "norm_placement": "pre",
        "block": "sequential", "position": "rope", "activation": "swiglu", "ffn_bias": False,
        "attention.qk_norm": True, "attention.qk_norm_kind": "", "attention.qk_norm_over": "head",
        "attention.qk_norm_layers": "all", "attention.output_gate": True,
        "attention.softcap": 0.0, "final_softcap": 0.0, "scale_embeddings": False,
        "embed_norm": False, "logits_scale": 1.0, "attention.sinks": False, "v_head_dim": 0,
        "attention.differential": False, "attention.value_residual": "none",
        "attention.scale": 0.0, "final_norm": True, "rope.layout": "half"})
    bias = attention_bias(cfg, "Qwen3-Next")
    n = cfg.num_layers
    names = {v: k for k, v in _LAYERS.items()}
    kinds = [cfg.layer_kind(i) for i in range(n)]
    if any(k not in names for k in kinds):
        raise ValueError(f"export: model.layer_pattern={cfg.layer_pattern!r}: Qwen3-Next has "
                         "gated_deltanet and global layers only")
    ffn = [cfg.ffn_kind(i) for i in range(n)]
    if any(f not in ("dense", "moe") for f in ffn):
        raise ValueError(f"export: model.ffn_pattern={cfg.ffn_pattern!r}: Qwen3-Next has "
                         "dense and moe feed-forwards only")
    m = cfg.moe
    hk, hv, dk, dv = cfg.gdn.dims(cfg.num_heads, cfg.head_size)
    out = dict(architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next",
               vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
               num_hidden_layers=n, num_attention_heads=cfg.num_heads,
               num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_size, hidden_act="silu",
               max_position_embeddings=cfg.max_len, rms_norm_eps=cfg.norm_eps,
               tie_word_embeddings=cfg.tie_embeddings, attention_bias=bias,
               attention_dropout=0.0,
               rope_parameters=rope_parameters(cfg, partial=True),
               layer_types=[names[k] for k in kinds], linear_conv_kernel_dim=cfg.gdn.d_conv,
               linear_num_key_heads=hk, linear_num_value_heads=hv, linear_key_head_dim=dk,
               linear_value_head_dim=dv, decoder_sparse_step=1,
               mlp_only_layers=[i for i, f in enumerate(ffn) if f == "dense"],
               dtype=cfg.param_dtype)
    if "moe" in ffn:
        need(cfg, "Qwen3-Next", **{
            "moe.shared_experts": 1, "moe.shared_gate": True, "moe.score": "softmax",
            "moe.n_group": 1, "moe.score_bias": False, "moe.routed_scaling_factor": 1.0,
            "moe.router_bias": False, "moe.glu": "standard", "moe.gate_input": False,
            "moe.capacity_factor": 0.0})
        out.update(num_experts=m.num_experts, num_experts_per_tok=m.experts_per_token,
                   moe_intermediate_size=m.d_ff or cfg.d_ff,
                   shared_expert_intermediate_size=m.shared_d_ff or m.d_ff or cfg.d_ff,
                   norm_topk_prob=m.router_renormalize, router_aux_loss_coef=m.aux_loss_weight)
    else:
        out.update(num_experts=0)
    return out


FAMILY = Family(model_types=("qwen3_next",), config=config, weights=weights, to_hf=to_hf,
                prefix="model.", mtp_depth=mtp_depth)
