"""DeepSeek-V3 (`DeepseekV3ForCausalLM`): Multi-head Latent Attention in every layer
(`model.mla`; a low-rank query when `q_lora_rank` is set) with interleaved RoPE and
YaRN's `mscale_all_dim`; `first_k_dense_replace` dense layers, then a dropless MoE
(sigmoid scores, group-limited top-k, `e_score_correction_bias`, `routed_scaling_factor`,
shared experts). Multi-token-prediction layers past `num_hidden_layers` load into
`model.mtp`; such a model is not exportable. See docs/interop.md."""

from __future__ import annotations

from tfjax.config import ModelConfig
from tfjax.interop.config_mapping import (read_activation, read_rope, refuse_quantized,
                                          rms_decoder_fields, rms_decoder_to_hf,
                                          rope_parameters, unsupported)
from tfjax.interop.families import Family
from tfjax.interop.tensor_mapping import (Weights, embedding_and_head, heads_in, heads_out,
                                          mtp_weights, norm_weights, stacked_experts,
                                          swiglu_weights)

__all__ = ["FAMILY", "config", "mtp_depth", "to_hf", "weights"]


def config(hf: dict) -> dict:
    refuse_quantized(hf)
    if hf.get("attention_bias"):
        unsupported("attention_bias", True, "tfjax's MLA has no biases")
    for key, ok in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if hf.get(key) not in (None, ok):
            unsupported(key, hf[key], f"DeepSeek-V3 routes with {ok!r}")
    if hf.get("moe_layer_freq", 1) != 1:
        unsupported("moe_layer_freq", hf["moe_layer_freq"], "every layer after "
                    "first_k_dense_replace is MoE (1)")
    if hf.get("rms_norm_eps", 1e-6) != 1e-6:  # transformers' latent norms keep 1e-6
        unsupported("rms_norm_eps", hf["rms_norm_eps"], "DeepSeek-V3's q / kv latent norms use "
                    "1e-6 whatever it says, tfjax's MLA the model's eps: 1e-6 only")
    n, N = hf["num_hidden_layers"], hf["num_attention_heads"]
    if (hf.get("num_key_value_heads") or N) != N:
        unsupported("num_key_value_heads", hf["num_key_value_heads"],
                    f"MLA expands a key and value per head: num_attention_heads={N}")
    rope = dict(read_rope(hf), layout="interleaved" if hf.get("rope_interleave", True) else "half")
    params = dict(hf.get("rope_scaling") or {}, **(hf.get("rope_parameters") or {}))
    mscale_all_dim = float(params.get("mscale_all_dim") or 0.0)
    if mscale_all_dim and rope.get("scaling") != "yarn":
        unsupported("rope_parameters.mscale_all_dim", mscale_all_dim, "with rope_type 'yarn' "
                    "only")
    dense = min(int(hf.get("first_k_dense_replace") or 0), n)
    ffns = ["dense"] * dense + ["moe"] * (n - dense)
    dr, D = hf["qk_rope_head_dim"], hf["hidden_size"]
    # MLA layers use neither model.head_dim nor its scale; left to derive (as the preset
    # does) unless d_model / num_heads is no valid RoPE head size
    head_dim = 0 if D % N == 0 and D // N % 2 == 0 else dr
    return dict(
        rms_decoder_fields(hf), num_kv_heads=N, head_dim=head_dim,
        activation=read_activation(hf, "hidden_act", True),
        ffn_bias=False, rope=rope, layer_pattern=("mla",),
        ffn_pattern=tuple(ffns) if dense else ("moe",), norm_eps=hf.get("rms_norm_eps", 1e-6),
        mla=dict(q_lora_rank=hf.get("q_lora_rank") or 0, kv_lora_rank=hf["kv_lora_rank"],
                 qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=dr,
                 v_head_dim=hf["v_head_dim"], mscale_all_dim=mscale_all_dim),
        moe=dict(num_experts=hf["n_routed_experts"], experts_per_token=hf["num_experts_per_tok"],
                 d_ff=hf["moe_intermediate_size"], shared_experts=hf.get("n_shared_experts") or 0,
                 score="sigmoid", n_group=hf.get("n_group") or 1,
                 topk_group=hf.get("topk_group") or 1, score_bias=True, bias_update_rate=0.0,
                 routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                 router_renormalize=bool(hf.get("norm_topk_prob", True)), capacity_factor=0.0,
                 aux_loss_weight=0.0))


def weights(w: Weights, cfg: ModelConfig, hf: dict) -> dict:
    out = embedding_and_head(w, cfg)
    n = cfg.num_layers
    for i in range(n):
        out.update(_layer(w, cfg, f"model.layers.{i}.", ("layers", i), cfg.ffn_kind(i)))
    # Multi-token prediction (tfjax.models.mtp): hub layer n + k is module k, its block
    # of the last layer's kinds. Its embed_tokens and shared_head.head are copies of
    # the model's own (shared in tfjax) and are not read twice.
    for k in range(cfg.mtp_depth):
        p, M = f"model.layers.{n + k}.", ("mtp", k)
        out.update(_layer(w, cfg, p, M + ("layers", "blocks", 0), cfg.ffn_kind(n - 1)))
        out.update(mtp_weights(w, cfg, k, embed_norm=p + "enorm", hidden_norm=p + "hnorm",
                               norm=p + "shared_head.norm", proj=p + "eh_proj"))
        w.ignore(p + "embed_tokens.weight", p + "shared_head.head.weight")
    # MTP layers the model does not hold (mtp_depth found none complete)
    w.ignore(*[k for k in w.ckpt if _layer_index(k) is not None
               and _layer_index(k) >= n + cfg.mtp_depth])
    return out


def mtp_depth(hf: dict, names) -> int:
    """How many multi-token-prediction modules the checkpoint holds: hub layers
    num_hidden_layers + k (k < num_nextn_predict_layers) that have an `eh_proj`
    (transformers' own saves have none: 0, and the model loads without MTP)."""
    n, names = hf["num_hidden_layers"], set(names)
    want = hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers")) or 0
    depth = 0
    while depth < want and f"model.layers.{n + depth}.eh_proj.weight" in names:
        depth += 1
    return depth


def _layer(w: Weights, cfg: ModelConfig, p: str, L: tuple, ffn_kind: str) -> dict:
    """Hub decoder layer `p` (MLA, then a dense or MoE feed-forward) -> our paths under L."""
    out = {}
    m, a = cfg.mla, cfg.moe
    N, dn, dr, dv = cfg.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
    s, A = p + "self_attn.", L + ("attn",)
    if m.q_lora_rank:
        out[A + ("q_a", "kernel")] = w[s + "q_a_proj.weight"].T  # [D, rq]
        out.update(norm_weights(w, s + "q_a_layernorm", A + ("q_norm",), cfg))
        out[A + ("q_b", "kernel")] = heads_in(w[s + "q_b_proj.weight"], N, dn + dr)
    else:
        out[A + ("q", "kernel")] = heads_in(w[s + "q_proj.weight"], N, dn + dr)
    out[A + ("kv_a", "kernel")] = w[s + "kv_a_proj_with_mqa.weight"].T  # [D, r + dr]
    out.update(norm_weights(w, s + "kv_a_layernorm", A + ("kv_norm",), cfg))
    out[A + ("kv_b", "kernel")] = heads_in(w[s + "kv_b_proj.weight"], N, dn + dv)
    out[A + ("o", "kernel")] = heads_out(w[s + "o_proj.weight"], N, dv)
    out.update(norm_weights(w, p + "input_layernorm", L + ("attn_norm",), cfg))
    out.update(norm_weights(w, p + "post_attention_layernorm", L + ("ffn_norm",), cfg))
    f, F = p + "mlp.", L + ("ffn",)
    if ffn_kind != "moe":
        out.update(swiglu_weights(w, f[:-1], F))
        return out
    out[F + ("router",)] = w[f + "gate.weight"].T  # [E, D] -> [D, E]
    out[F + ("score_bias",)] = w[f + "gate.e_score_correction_bias"]
    out.update(stacked_experts(w, f, F, a.num_experts))
    if a.shared_experts:
        out.update(swiglu_weights(w, f + "shared_experts", F + ("shared",)))
    return out


def _layer_index(name: str) -> int | None:
    parts = name.split(".")
    for j, part in enumerate(parts[:-1]):
        if part == "layers" and parts[j + 1].isdigit():
            return int(parts[j + 1])
    return None


def to_hf(cfg: ModelConfig) -> dict:
    m, a = cfg.mla, cfg.moe
    ffns = [cfg.ffn_kind(i) for i in range(cfg.num_layers)]
    rope = rope_parameters(cfg, truncate=True)
    if cfg.rope.scaling == "yarn" and m.mscale_all_dim:  # the softmax's YaRN factor
        rope["mscale_all_dim"] = m.mscale_all_dim
    return rms_decoder_to_hf(
        cfg, "deepseek_v3", "DeepseekV3ForCausalLM", intermediate_size=cfg.d_ff,
        moe_intermediate_size=a.d_ff or cfg.d_ff, num_key_value_heads=cfg.num_heads,
        n_routed_experts=a.num_experts, n_shared_experts=a.shared_experts,
        num_experts_per_tok=a.experts_per_token, n_group=a.n_group, topk_group=a.topk_group,
        routed_scaling_factor=a.routed_scaling_factor, norm_topk_prob=a.router_renormalize,
        first_k_dense_replace=next((i for i, k in enumerate(ffns) if k == "moe"), len(ffns)),
        q_lora_rank=m.q_lora_rank or None, kv_lora_rank=m.kv_lora_rank,
        qk_nope_head_dim=m.qk_nope_head_dim, qk_rope_head_dim=m.qk_rope_head_dim,
        v_head_dim=m.v_head_dim, rope_interleave=cfg.rope.layout == "interleaved",
        attention_bias=False, rope_parameters=rope)


FAMILY = Family(model_types=("deepseek_v3",), config=config, weights=weights, to_hf=to_hf,
                mtp_depth=mtp_depth)
