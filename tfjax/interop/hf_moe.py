"""Hugging Face MoE families: gpt-oss, Llama 4 (text) and DeepSeek-V3.

For each `model_type` three functions, as `tfjax.interop.hf.Family` takes them:
`<family>_config(hf) -> ModelConfig fields` (every option that changes the
computation mapped, or refused with NotImplementedError naming it),
`<family>_weights(w, cfg, hf) -> {our parameter path: array}` and
`<family>_to_hf(cfg) -> config.json dict` (the inverse of the config mapping, for
export: what the family can say; `tfjax.interop.hf.export` checks that it says the
same model, `tfjax.interop.hf_export.config_diff`).
Every MoE loads dropless (`moe.capacity_factor=0`), as transformers routes.

- **gpt_oss**: `layer_types` alternate sliding (HF's window w: ours w - 1) and full
  attention; a learned sink logit per head (`model.attention.sinks`); q/k/v/o biases;
  YaRN with `truncate=False` (`rope.truncate`). The experts' `gate_up_proj` `[E, D,
  2F]` interleaves gate and up columns (gate = `[..., ::2]`, up = `[..., 1::2]`), so
  it is split into `wi_gate` / `wi_up` (and its bias likewise); softmax over the
  top-k router logits (+ `router.bias`) is our softmax-then-top-k renormalised, and
  `swiglu_alpha` / `swiglu_limit` are `moe.glu="clamped"`'s alpha and limit.
- **llama4_text**: a layer's kind is its `layer_types` entry and its `no_rope_layers`
  flag (1 = RoPE): chunked + RoPE -> "chunked" (`attention_chunk_size`), full +
  RoPE -> "global", full + NoPE -> "nope" (with `attn_temperature_tuning`: the query
  temperature of `floor_scale` / `attn_scale`); `moe_layers` (or every
  `interleave_moe_layer_step`-th layer) are "moe" (top-k sigmoid gates scaling the
  expert's input, `moe.gate_input`, plus a shared expert of `intermediate_size`), the
  others dense of `intermediate_size_mlp`. Llama 4 rotates complex pairs of its
  q/k features (`rope.layout="interleaved"`); `use_qk_norm` is the weightless L2 norm
  on the RoPE layers, which commutes with the rotation (our norm-then-rotate equals
  HF's rotate-then-norm). Its experts' `gate_up_proj` `[E, D, 2F]` is gate then up.
- **deepseek_v3**: every layer Multi-head Latent Attention (`model.mla`, low-rank
  query when `q_lora_rank` is set); HF's `rope_interleave` rotates (x[2i], x[2i+1])
  pairs and writes the result de-interleaved, the same for queries and keys, so the
  scores equal our "interleaved" layout's and no weight is permuted; YaRN's
  `mscale_all_dim` scales the softmax (`mla.mscale_all_dim`). The first
  `first_k_dense_replace` layers are dense, then MoE: sigmoid scores, group-limited
  top-k (`n_group` / `topk_group`), `e_score_correction_bias` for the choice only
  (`moe.score_bias`, fixed here: no balancing updates), `norm_topk_prob`,
  `routed_scaling_factor`, `n_shared_experts`. Multi-token-prediction layers past
  `num_hidden_layers` (DeepSeek's releases hold one; transformers' saves none) load
  into `model.mtp` (`model.mtp_depth`, `deepseek_v3_mtp_depth`), for the MTP loss and
  `tfjax.inference.speculative_generate`; such a model has no transformers
  equivalent to export to.
"""

from __future__ import annotations

import numpy as np

from tfjax.config import ModelConfig
from tfjax.interop.hf_config import _activation, _common, _layer_pattern, _rope, unsupported
from tfjax.interop.hf_export import _act, _decoder, _layer_types, _rope_parameters
from tfjax.interop.hf_weights import (Weights, _attention, _head, _heads_in, _heads_out, _norm,
                                      mtp_module_weights)

__all__ = ["deepseek_v3_config", "deepseek_v3_mtp_depth", "deepseek_v3_to_hf",
           "deepseek_v3_weights", "gpt_oss_config", "gpt_oss_to_hf", "gpt_oss_weights",
           "llama4_config", "llama4_to_hf", "llama4_weights"]


# --------------------------------------------------------------------------- #
# Shared pieces.
# --------------------------------------------------------------------------- #


def _period(kinds: list[str]) -> tuple[str, ...]:
    """The shortest pattern that cycles to `kinds`."""
    p = next(p for p in range(1, len(kinds) + 1)
             if all(kinds[i] == kinds[i % p] for i in range(len(kinds))))
    return tuple(kinds[:p])


def _refuse_quantized(hf: dict) -> None:
    q = hf.get("quantization_config")
    if q:
        method = q.get("quant_method") if isinstance(q, dict) else q
        unsupported("quantization_config.quant_method", method,
                    "load a dequantized checkpoint (transformers: from_pretrained with the "
                    "quantizer's dequantize=True, then save_pretrained)")


def _base(hf: dict) -> dict:
    """The fields every family here shares: sizes, RMSNorm, untied head by default."""
    N = hf["num_attention_heads"]
    return dict(_common(hf), arch="decoder", d_model=hf["hidden_size"],
                num_layers=hf["num_hidden_layers"], num_heads=N,
                num_kv_heads=hf.get("num_key_value_heads") or N,
                head_dim=hf.get("head_dim") or hf["hidden_size"] // N,
                d_ff=hf["intermediate_size"], max_len=hf.get("max_position_embeddings", 2048),
                tie_embeddings=bool(hf.get("tie_word_embeddings", False)), position="rope",
                norm="rmsnorm", norm_eps=hf.get("rms_norm_eps", 1e-5), norm_placement="pre")


def _embed_and_head(w: Weights, cfg: ModelConfig) -> dict:
    return {("embed", "tokens", "embedding"): w["model.embed_tokens.weight"],
            **_norm(w, "model.norm", ("final_norm",), cfg), **_head(w, "lm_head.weight", cfg)}


def _mlp(w: Weights, p: str, L: tuple) -> dict:
    """A bias-free gate_proj / up_proj / down_proj SwiGLU `p` -> our FeedForward at `L`."""
    return {L + (ours, "kernel"): w[f"{p}.{theirs}.weight"].T
            for ours, theirs in (("wi_gate", "gate_proj"), ("wi_up", "up_proj"),
                                 ("wo", "down_proj"))}


def _rope_to_hf(cfg: ModelConfig) -> dict:
    """`rope_parameters` of `model.rope` (`hf_export`'s, with YaRN's `truncate`)."""
    return _rope_parameters(cfg, truncate=True)


def _to_hf(cfg: ModelConfig, model_type: str, architecture: str, **fields) -> dict:
    """The fields the three families share (`fields` override them); whether the model
    is the same is `hf_export.config_diff`'s question (export asks it), not this one's."""
    shared = dict(hidden_size=cfg.d_model, num_hidden_layers=cfg.num_layers,
                  num_attention_heads=cfg.num_heads, hidden_act=_act(cfg, gated=True),
                  max_position_embeddings=cfg.max_len, rms_norm_eps=cfg.norm_eps,
                  rope_parameters=_rope_to_hf(cfg), attention_dropout=0.0)
    return _decoder(cfg, model_type, architecture, **{**shared, **fields})


# --------------------------------------------------------------------------- #
# gpt-oss.
# --------------------------------------------------------------------------- #


def gpt_oss_config(hf: dict) -> dict:
    _refuse_quantized(hf)
    n = hf["num_hidden_layers"]
    hf = dict(hf)
    if hf.get("layer_types") is None:  # gpt-oss's default: sliding first, alternating
        hf["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention"
                             for i in range(n)]
    bias = bool(hf.get("attention_bias", True))
    c = dict(_base(hf), activation="swiglu", ffn_bias=True,
             attention=dict(qkv_bias=bias, out_bias=bias, sinks=True), rope=_rope(hf),
             ffn_pattern=("moe",),
             moe=dict(num_experts=hf["num_local_experts"],
                      experts_per_token=hf["num_experts_per_tok"], router_renormalize=True,
                      router_bias=True, glu="clamped",
                      glu_alpha=float(hf.get("swiglu_alpha", 1.702)),
                      glu_limit=float(hf.get("swiglu_limit", 7.0)), capacity_factor=0.0,
                      aux_loss_weight=float(hf.get("router_aux_loss_coef", 0.001))))
    c["layer_pattern"], c["attention"]["sliding_window"] = _layer_pattern(hf, n)
    return c


def gpt_oss_weights(w: Weights, cfg: ModelConfig, hf: dict) -> dict:
    out = _embed_and_head(w, cfg)
    for i in range(cfg.num_layers):
        p, L = f"model.layers.{i}.", ("layers", i)
        out.update(_attention(w, p + "self_attn.", L + ("attn",), cfg))
        out[L + ("attn", "sinks")] = w[p + "self_attn.sinks"]
        out.update(_norm(w, p + "input_layernorm", L + ("attn_norm",), cfg))
        out.update(_norm(w, p + "post_attention_layernorm", L + ("ffn_norm",), cfg))
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


def gpt_oss_to_hf(cfg: ModelConfig) -> dict:
    m = cfg.moe
    return _to_hf(cfg, "gpt_oss", "GptOssForCausalLM", intermediate_size=m.d_ff or cfg.d_ff,
                  num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_size,
                  num_local_experts=m.num_experts, num_experts_per_tok=m.experts_per_token,
                  layer_types=_layer_types(cfg), sliding_window=cfg.attention.sliding_window + 1,
                  attention_bias=cfg.attention.qkv_bias, swiglu_alpha=m.glu_alpha,
                  swiglu_limit=m.glu_limit, router_aux_loss_coef=m.aux_loss_weight)


# --------------------------------------------------------------------------- #
# Llama 4 (text).
# --------------------------------------------------------------------------- #


def _llama4_layers(hf: dict, n: int) -> tuple[list[str], list[str]]:
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


def llama4_config(hf: dict) -> dict:
    _refuse_quantized(hf)
    n = hf["num_hidden_layers"]
    kinds, ffns = _llama4_layers(hf, n)
    rope = dict(_rope(hf), layout="interleaved")  # complex pairs (x[2i], x[2i+1])
    qk_norm = bool(hf.get("use_qk_norm", True))
    if qk_norm and rope.get("scaling") == "yarn":
        # the L2 norm commutes with a rotation, not with YaRN's cos/sin temperature
        unsupported("rope_parameters.rope_type", "yarn", "Llama 4 with use_qk_norm: default, "
                    "linear, llama3 or dynamic")
    bias = bool(hf.get("attention_bias", False))
    tuning = bool(hf.get("attn_temperature_tuning", True)) and "nope" in kinds
    chunk = int(hf.get("attention_chunk_size") or 0) if "chunked" in kinds else 0
    return dict(_base(hf), d_ff=hf.get("intermediate_size_mlp") or hf["intermediate_size"],
                activation=_activation(hf, "hidden_act", gated=True), ffn_bias=False,
                rope=rope, layer_pattern=_period(kinds), ffn_pattern=_period(ffns),
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


def llama4_weights(w: Weights, cfg: ModelConfig, hf: dict) -> dict:
    out = _embed_and_head(w, cfg)
    F = cfg.moe.d_ff
    for i in range(cfg.num_layers):
        p, L = f"model.layers.{i}.", ("layers", i)
        out.update(_attention(w, p + "self_attn.", L + ("attn",), cfg))
        out.update(_norm(w, p + "input_layernorm", L + ("attn_norm",), cfg))
        out.update(_norm(w, p + "post_attention_layernorm", L + ("ffn_norm",), cfg))
        f = p + "feed_forward."
        if cfg.ffn_kind(i) != "moe":
            out.update(_mlp(w, f[:-1], L + ("ffn",)))
            continue
        gate_up = w[f + "experts.gate_up_proj"]  # [E, D, 2F]: gate columns, then up
        out.update({L + ("ffn", "router"): w[f + "router.weight"].T,
                    L + ("ffn", "wi_gate"): gate_up[..., :F],
                    L + ("ffn", "wi_up"): gate_up[..., F:],
                    L + ("ffn", "wo"): w[f + "experts.down_proj"]})  # [E, F, D]
        out.update(_mlp(w, f + "shared_expert", L + ("ffn", "shared")))
    return out


def llama4_to_hf(cfg: ModelConfig) -> dict:
    m, a = cfg.moe, cfg.attention
    kinds = [cfg.layer_kind(i) for i in range(cfg.num_layers)]
    return _to_hf(cfg, "llama4_text", "Llama4ForCausalLM", intermediate_size=m.d_ff or cfg.d_ff,
                  intermediate_size_mlp=cfg.d_ff, num_key_value_heads=cfg.kv_heads,
                  head_dim=cfg.head_size, num_local_experts=m.num_experts,
                  num_experts_per_tok=m.experts_per_token,
                  moe_layers=[i for i in range(cfg.num_layers) if cfg.ffn_kind(i) == "moe"],
                  layer_types=["chunked_attention" if k == "chunked" else "full_attention"
                               for k in kinds],
                  no_rope_layers=[int(k != "nope") for k in kinds],
                  attention_chunk_size=a.chunk or None, use_qk_norm=a.qk_norm,
                  attn_temperature_tuning=a.temperature_floor > 0,
                  floor_scale=a.temperature_floor or 8192,
                  attn_scale=a.temperature_scale, attention_bias=a.qkv_bias,
                  router_aux_loss_coef=m.aux_loss_weight)


# --------------------------------------------------------------------------- #
# DeepSeek-V3.
# --------------------------------------------------------------------------- #


def deepseek_v3_config(hf: dict) -> dict:
    _refuse_quantized(hf)
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
    rope = dict(_rope(hf), layout="interleaved" if hf.get("rope_interleave", True) else "half")
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
        _base(hf), num_kv_heads=N, head_dim=head_dim,
        activation=_activation(hf, "hidden_act", True),
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


def deepseek_v3_weights(w: Weights, cfg: ModelConfig, hf: dict) -> dict:
    out = _embed_and_head(w, cfg)
    n = cfg.num_layers
    for i in range(n):
        out.update(_deepseek_layer(w, cfg, f"model.layers.{i}.", ("layers", i), cfg.ffn_kind(i)))
    # Multi-token prediction (tfjax.models.mtp): hub layer n + k is module k, its block
    # of the last layer's kinds. Its embed_tokens and shared_head.head are copies of
    # the model's own (shared in tfjax) and are not read twice.
    for k in range(cfg.mtp_depth):
        p, M = f"model.layers.{n + k}.", ("mtp", k)
        out.update(_deepseek_layer(w, cfg, p, M + ("layers", "blocks", 0), cfg.ffn_kind(n - 1)))
        out.update(mtp_module_weights(w, cfg, k, embed_norm=p + "enorm", hidden_norm=p + "hnorm",
                                      norm=p + "shared_head.norm", proj=p + "eh_proj"))
        w.ignore(p + "embed_tokens.weight", p + "shared_head.head.weight")
    # MTP layers the model does not hold (deepseek_v3_mtp_depth found none complete)
    w.ignore(*[k for k in w.ckpt if _layer_index(k) is not None
               and _layer_index(k) >= n + cfg.mtp_depth])
    return out


def deepseek_v3_mtp_depth(hf: dict, names) -> int:
    """How many multi-token-prediction modules the checkpoint holds: hub layers
    num_hidden_layers + k (k < num_nextn_predict_layers) that have an `eh_proj`
    (transformers' own saves have none: 0, and the model loads without MTP)."""
    n, names = hf["num_hidden_layers"], set(names)
    want = hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers")) or 0
    depth = 0
    while depth < want and f"model.layers.{n + depth}.eh_proj.weight" in names:
        depth += 1
    return depth


def _deepseek_layer(w: Weights, cfg: ModelConfig, p: str, L: tuple, ffn_kind: str) -> dict:
    """Hub decoder layer `p` (MLA, then a dense or MoE feed-forward) -> our paths under L."""
    out = {}
    m, a = cfg.mla, cfg.moe
    N, dn, dr, dv = cfg.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
    s, A = p + "self_attn.", L + ("attn",)
    if m.q_lora_rank:
        out[A + ("q_a", "kernel")] = w[s + "q_a_proj.weight"].T  # [D, rq]
        out.update(_norm(w, s + "q_a_layernorm", A + ("q_norm",), cfg))
        out[A + ("q_b", "kernel")] = _heads_in(w[s + "q_b_proj.weight"], N, dn + dr)
    else:
        out[A + ("q", "kernel")] = _heads_in(w[s + "q_proj.weight"], N, dn + dr)
    out[A + ("kv_a", "kernel")] = w[s + "kv_a_proj_with_mqa.weight"].T  # [D, r + dr]
    out.update(_norm(w, s + "kv_a_layernorm", A + ("kv_norm",), cfg))
    out[A + ("kv_b", "kernel")] = _heads_in(w[s + "kv_b_proj.weight"], N, dn + dv)
    out[A + ("o", "kernel")] = _heads_out(w[s + "o_proj.weight"], N, dv)
    out.update(_norm(w, p + "input_layernorm", L + ("attn_norm",), cfg))
    out.update(_norm(w, p + "post_attention_layernorm", L + ("ffn_norm",), cfg))
    f, F = p + "mlp.", L + ("ffn",)
    if ffn_kind != "moe":
        out.update(_mlp(w, f[:-1], F))
        return out
    out[F + ("router",)] = w[f + "gate.weight"].T  # [E, D] -> [D, E]
    out[F + ("score_bias",)] = w[f + "gate.e_score_correction_bias"]
    for ours, theirs in (("wi_gate", "gate_proj"), ("wi_up", "up_proj"), ("wo", "down_proj")):
        out[F + (ours,)] = np.stack([w[f"{f}experts.{e}.{theirs}.weight"].T
                                   for e in range(a.num_experts)])
    if a.shared_experts:
        out.update(_mlp(w, f + "shared_experts", F + ("shared",)))
    return out


def _layer_index(name: str) -> int | None:
    parts = name.split(".")
    for j, part in enumerate(parts[:-1]):
        if part == "layers" and parts[j + 1].isdigit():
            return int(parts[j + 1])
    return None


def deepseek_v3_to_hf(cfg: ModelConfig) -> dict:
    m, a = cfg.mla, cfg.moe
    ffns = [cfg.ffn_kind(i) for i in range(cfg.num_layers)]
    rope = _rope_to_hf(cfg)
    if cfg.rope.scaling == "yarn" and m.mscale_all_dim:  # the softmax's YaRN factor
        rope["mscale_all_dim"] = m.mscale_all_dim
    return _to_hf(cfg, "deepseek_v3", "DeepseekV3ForCausalLM", intermediate_size=cfg.d_ff,
                  moe_intermediate_size=a.d_ff or cfg.d_ff, num_key_value_heads=cfg.num_heads,
                  n_routed_experts=a.num_experts, n_shared_experts=a.shared_experts,
                  num_experts_per_tok=a.experts_per_token, n_group=a.n_group,
                  topk_group=a.topk_group, routed_scaling_factor=a.routed_scaling_factor,
                  norm_topk_prob=a.router_renormalize,
                  first_k_dense_replace=next((i for i, k in enumerate(ffns) if k == "moe"),
                                             len(ffns)),
                  q_lora_rank=m.q_lora_rank or None, kv_lora_rank=m.kv_lora_rank,
                  qk_nope_head_dim=m.qk_nope_head_dim, qk_rope_head_dim=m.qk_rope_head_dim,
                  v_head_dim=m.v_head_dim, rope_interleave=cfg.rope.layout == "interleaved",
                  attention_bias=False, rope_parameters=rope)
