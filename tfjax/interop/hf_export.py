"""tfjax `ModelConfig` -> Hugging Face `config.json`, one function per family, and the
check that the HF config is the same model.

Each `<family>_to_hf(cfg) -> dict` is the inverse of `tfjax.interop.hf_config`'s
`<family>_config`: the config.json dict (model_type, architectures and every field
the family reads) of a tfjax config. It writes what the family can say and no more:
whether that is the same model is not its business but `config_diff`'s, which maps
the dict back through the family's own config mapping and compares the two configs
field by field (`computation`: only what changes the computation, with derived
values resolved, so `head_dim=0` equals `head_dim=8` where d_model / num_heads is 8,
and a section no layer uses is left out). `tfjax.interop.hf.export` refuses a model
for which that comparison is not empty, naming each differing field.
"""

from __future__ import annotations

import math
from typing import Any

from tfjax.config import ModelConfig, flat_fields
from tfjax.interop.hf_config import _GATED, _PLAIN

__all__ = ["bert_to_hf", "bloom_to_hf", "computation", "config_diff", "gemma2_to_hf",
           "gpt2_to_hf", "llama_to_hf", "mamba_to_hf", "mixtral_to_hf", "neox_to_hf",
           "qwen3_to_hf", "t5_to_hf"]

# Fields that do not change what the model computes at inference (numerics, layout,
# training-only knobs); export writes the dtype it is asked for.
NOT_COMPUTATION = frozenset((
    "dtype", "param_dtype", "init_std", "dropout_rate", "scan_layers", "remat", "attention.impl",
    "attention.context_parallel", "attention.zigzag", "moe.impl", "moe.aux_loss_weight", "moe.z_loss_weight",
    "moe.bias_update_rate", "ssm.chunk", "mamba2.chunk", "mamba2.dt_min", "mamba2.dt_max",
    "linear.chunk", "gdn.chunk"))
# A section's fields count only where a layer of its kind is.
_SECTION_KIND = {"ssm": "mamba", "mamba2": "mamba2", "linear": "linear", "gdn": "gated_deltanet",
                 "mla": "mla"}
_RECURRENT = frozenset(("mamba", "mamba2"))  # mixers with no attention heads of model.num_heads


def computation(cfg: ModelConfig) -> dict[str, Any]:
    """The fields of `cfg` that change what it computes, by dotted name, with derived
    values resolved (`head_dim` is the head size, `attention.scale` the scale in effect) and
    the fields of what the model does not use (a section no layer has, RoPE settings of
    a model without RoPE, an FFN's width where no layer has one) left out."""
    c = {k: v for k, v in flat_fields(cfg).items() if k not in NOT_COMPUTATION}
    n = max(cfg.num_layers, cfg.encoder_layers)
    kinds = tuple(cfg.layer_kind(i) for i in range(n))
    ffns = tuple(cfg.ffn_kind(i) for i in range(n))
    c.update(layer_pattern=kinds, ffn_pattern=ffns, num_kv_heads=cfg.kv_heads,
             head_dim=cfg.head_size, v_head_dim=cfg.value_head_size,
             logits_scale=cfg.logits_multiplier,
             num_encoder_layers=cfg.encoder_layers if cfg.arch == "encoder_decoder" else 0)
    c["attention.scale"] = cfg.attention_scale
    c["attention.qk_norm_kind"] = cfg.attention.qk_norm_kind or cfg.norm
    for k in ("mup_base_width", "mup_base_head_dim"):  # in effect: attention.scale, logits_scale
        c.pop(k)
    drop = set()
    m = cfg.moe
    c["moe.d_ff"] = m.d_ff or cfg.d_ff
    c["moe.shared_d_ff"] = m.shared_d_ff or c["moe.d_ff"]
    c["ssm.dt_rank"] = cfg.ssm.dt_rank or math.ceil(cfg.d_model / 16)
    c["mamba2.norm_groups"] = cfg.mamba2.norm_groups or cfg.mamba2.n_groups
    for k, v in zip(("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim"),
                    cfg.gdn.dims(cfg.num_heads, cfg.head_size)):
        c[f"gdn.{k}"] = v
    sections = {s for s, kind in _SECTION_KIND.items() if kind not in kinds}
    if "moe" not in ffns:
        sections.add("moe")
    else:
        if not m.shared_experts:
            drop |= {"moe.shared_d_ff", "moe.shared_gate"}
        if m.glu != "clamped":
            drop |= {"moe.glu_alpha", "moe.glu_limit"}
    if cfg.position != "rope":
        sections.add("rope")
    else:
        r = cfg.rope
        if r.scaling == "none":
            drop.add("rope.factor")
        if r.scaling not in ("dynamic_ntk", "yarn", "llama3"):
            drop.add("rope.original_max_len")
        if r.scaling != "yarn":
            drop |= {"rope.beta_fast", "rope.beta_slow", "rope.mscale", "rope.truncate"}
        if r.scaling != "llama3":
            drop |= {"rope.low_freq_factor", "rope.high_freq_factor"}
    if cfg.position != "t5":
        sections.add("t5")
    if cfg.position in ("alibi", "t5", "none"):  # max_len sizes no table and no RoPE
        drop.add("max_len")
    if "local" not in kinds:
        drop |= {"attention.sliding_window", "attention.local_rope_theta"}
    if "chunked" not in kinds:
        drop.add("attention.chunk")
    if "nope" not in kinds or not cfg.attention.temperature_floor:
        drop |= {"attention.temperature_floor", "attention.temperature_scale"}
    if not cfg.attention.qk_norm:
        drop |= {"attention.qk_norm_over", "attention.qk_norm_kind", "attention.qk_norm_layers"}
    if "dense" not in ffns:
        drop.add("d_ff")
    if "dense" not in ffns and "moe" not in ffns:
        drop |= {"activation", "ffn_bias"}
    if set(kinds) <= _RECURRENT:  # no attention layer: the attention section counts nowhere
        sections.add("attention")
        drop |= {"num_heads", "num_kv_heads", "head_dim", "v_head_dim", "position", "max_len",
                 "prefix_lm"}
    if cfg.block != "parallel":
        drop.add("parallel_shared_norm")
    if cfg.norm != "layernorm":
        drop.add("norm_bias")
    return {k: v for k, v in c.items() if k not in drop and k.split(".")[0] not in sections}


def _same(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isclose(
            a, b, rel_tol=1e-9, abs_tol=1e-12)
    return a == b


def config_diff(ours: ModelConfig, theirs: ModelConfig, label: str = "theirs") -> list[str]:
    """`model.field=ours (label: theirs)` for each field of `computation` where the two
    configs differ ("not used": the field does not count in that config)."""
    a, b = computation(ours), computation(theirs)

    def show(c, k):
        return repr(c[k]) if k in c else "not used"

    return [f"model.{k}={show(a, k)} ({label}: {show(b, k)})"
            for k in sorted(a.keys() | b.keys()) if not _same(a.get(k), b.get(k))]


# --------------------------------------------------------------------------- #
# Per family.
# --------------------------------------------------------------------------- #


def _act(cfg: ModelConfig, gated: bool) -> str:
    """The HF name of `cfg.activation` (the family's default where it has none: the
    round trip then names model.activation)."""
    table = _GATED if gated else _PLAIN
    names = [hf for hf, ours in table.items() if ours == cfg.activation]
    return names[0] if names else ("silu" if gated else "gelu")


def _rope_parameters(cfg: ModelConfig, *, partial: bool = False, truncate: bool = False,
                     longrope: bool = False) -> dict:
    """`model.rope` as HF `rope_parameters` (the inverse of `hf_config._rope`): the
    scalings every family shares; `partial` adds `partial_rotary_factor`, `truncate`
    YaRN's `truncate` (gpt-oss), `longrope` Phi-3's LongRoPE. Any other scaling comes
    out as "default", which the round trip of `config_diff` then names."""
    r = cfg.rope
    out: dict[str, Any] = {"rope_theta": r.theta, "rope_type": "default"}
    if partial:
        out["partial_rotary_factor"] = r.fraction
    if r.scaling == "linear":
        out.update(rope_type="linear", factor=r.factor)
    elif r.scaling == "dynamic_ntk":
        out.update(rope_type="dynamic", factor=r.factor)
    elif r.scaling == "llama3":
        out.update(rope_type="llama3", factor=r.factor, low_freq_factor=r.low_freq_factor,
                   high_freq_factor=r.high_freq_factor,
                   original_max_position_embeddings=r.original_max_len)
    elif r.scaling == "yarn":
        out.update(rope_type="yarn", factor=r.factor, beta_fast=r.beta_fast, beta_slow=r.beta_slow,
                   original_max_position_embeddings=r.original_max_len,
                   attention_factor=0.1 * r.mscale * math.log(r.factor) + 1.0)
        if truncate:
            out["truncate"] = r.truncate
    elif r.scaling == "longrope" and longrope:
        out.update(rope_type="longrope", factor=r.factor, short_factor=list(r.short_factor),
                   long_factor=list(r.long_factor),
                   original_max_position_embeddings=r.original_max_len)
    return out


def _number(x: float) -> int | float:
    """An integer where `x` is one (up to rounding): HF's int fields refuse floats."""
    return round(x) if math.isclose(x, round(x), rel_tol=1e-12) else x


def _layer_types(cfg: ModelConfig) -> list[str]:
    names = {"global": "full_attention", "local": "sliding_attention"}
    return [names.get(cfg.layer_kind(i), cfg.layer_kind(i)) for i in range(cfg.num_layers)]


def _window(cfg: ModelConfig) -> dict:
    """HF's sliding_window (it counts the query itself) where a layer is local."""
    return ({"sliding_window": cfg.attention.sliding_window + 1} if "local" in cfg.layer_pattern
            else {})


def _decoder(cfg: ModelConfig, model_type: str, architecture: str, **fields) -> dict:
    return dict(model_type=model_type, architectures=[architecture], vocab_size=cfg.vocab_size,
                tie_word_embeddings=cfg.tie_embeddings, **fields)


def _llama_like(cfg: ModelConfig, model_type: str, architecture: str, **fields) -> dict:
    return _decoder(cfg, model_type, architecture, hidden_size=cfg.d_model,
                    intermediate_size=cfg.d_ff, num_hidden_layers=cfg.num_layers,
                    num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.kv_heads,
                    head_dim=cfg.head_size, hidden_act=_act(cfg, gated=True),
                    max_position_embeddings=cfg.max_len, rms_norm_eps=cfg.norm_eps,
                    rope_parameters=_rope_parameters(cfg), attention_dropout=0.0, **fields)


def llama_to_hf(cfg: ModelConfig) -> dict:
    """Llama, or Mistral where every layer slides a window (Llama has none)."""
    if set(cfg.layer_pattern) == {"local"}:
        return _llama_like(cfg, "mistral", "MistralForCausalLM", **_window(cfg))
    return _llama_like(cfg, "llama", "LlamaForCausalLM", attention_bias=cfg.attention.qkv_bias,
                       mlp_bias=cfg.ffn_bias)


def mixtral_to_hf(cfg: ModelConfig) -> dict:
    local = set(cfg.layer_pattern) == {"local"}
    return _llama_like(cfg, "mixtral", "MixtralForCausalLM", num_local_experts=cfg.moe.num_experts,
                       num_experts_per_tok=cfg.moe.experts_per_token,
                       router_aux_loss_coef=cfg.moe.aux_loss_weight,
                       **(_window(cfg) if local else {}))


def qwen3_to_hf(cfg: ModelConfig) -> dict:
    local = "local" in cfg.layer_pattern
    return _llama_like(cfg, "qwen3", "Qwen3ForCausalLM", attention_bias=cfg.attention.qkv_bias,
                       layer_types=_layer_types(cfg), use_sliding_window=local,
                       **_window(cfg))


def gemma2_to_hf(cfg: ModelConfig) -> dict:
    c = _llama_like(cfg, "gemma2", "Gemma2ForCausalLM", attention_bias=cfg.attention.qkv_bias,
                    hidden_activation=_act(cfg, gated=True), layer_types=_layer_types(cfg),
                    query_pre_attn_scalar=_number(cfg.attention_scale ** -2),
                    attn_logit_softcapping=cfg.attention.softcap or None,
                    final_logit_softcapping=cfg.final_softcap or None, **_window(cfg))
    del c["hidden_act"]
    return c


def gpt2_to_hf(cfg: ModelConfig) -> dict:
    return _decoder(cfg, "gpt2", "GPT2LMHeadModel", n_embd=cfg.d_model, n_layer=cfg.num_layers,
                    n_head=cfg.num_heads, n_inner=cfg.d_ff, n_positions=cfg.max_len,
                    layer_norm_epsilon=cfg.norm_eps, activation_function=_act(cfg, gated=False),
                    scale_attn_weights=not math.isclose(cfg.attention_scale, 1.0))


def neox_to_hf(cfg: ModelConfig) -> dict:
    return _decoder(cfg, "gpt_neox", "GPTNeoXForCausalLM", hidden_size=cfg.d_model,
                    intermediate_size=cfg.d_ff, num_hidden_layers=cfg.num_layers,
                    num_attention_heads=cfg.num_heads, max_position_embeddings=cfg.max_len,
                    rope_parameters=_rope_parameters(cfg, partial=True),
                    layer_norm_eps=cfg.norm_eps, use_parallel_residual=cfg.block == "parallel",
                    attention_bias=cfg.attention.qkv_bias, hidden_act=_act(cfg, gated=False))


def bloom_to_hf(cfg: ModelConfig) -> dict:
    return _decoder(cfg, "bloom", "BloomForCausalLM", hidden_size=cfg.d_model,
                    n_layer=cfg.num_layers, n_head=cfg.num_heads, layer_norm_epsilon=cfg.norm_eps)


def bert_to_hf(cfg: ModelConfig) -> dict:
    """BERT with its MLM head (`tfjax.interop.hf.export` names BertForPreTraining
    instead for a loaded checkpoint that has the pooler)."""
    return dict(model_type="bert", architectures=["BertForMaskedLM"], vocab_size=cfg.vocab_size,
                hidden_size=cfg.d_model, num_hidden_layers=cfg.num_layers,
                num_attention_heads=cfg.num_heads, intermediate_size=cfg.d_ff,
                max_position_embeddings=cfg.max_len, type_vocab_size=cfg.type_vocab_size,
                layer_norm_eps=cfg.norm_eps, hidden_act="gelu", position_embedding_type="absolute",
                tie_word_embeddings=cfg.tie_embeddings)


def t5_to_hf(cfg: ModelConfig) -> dict:
    gated = cfg.activation not in _PLAIN.values()
    act = _act(cfg, gated)
    # HF's feed_forward_proj names gelu "gelu" and takes the exact form from dense_act_fn
    proj = ("gated-" if gated else "") + {"gelu_new": "gelu", "gelu_pytorch_tanh": "gelu",
                                          "swish": "silu"}.get(act, act)
    return dict(model_type="t5", architectures=["T5ForConditionalGeneration"],
                vocab_size=cfg.vocab_size, d_model=cfg.d_model, d_kv=cfg.head_size, d_ff=cfg.d_ff,
                num_layers=cfg.encoder_layers, num_decoder_layers=cfg.num_layers,
                num_heads=cfg.num_heads, relative_attention_num_buckets=cfg.t5.num_buckets,
                relative_attention_max_distance=cfg.t5.max_distance,
                layer_norm_epsilon=cfg.norm_eps, feed_forward_proj=proj, dense_act_fn=act,
                tie_word_embeddings=cfg.tie_embeddings,
                scale_decoder_outputs=not math.isclose(cfg.logits_multiplier, 1.0),
                is_encoder_decoder=True)


def mamba_to_hf(cfg: ModelConfig) -> dict:
    s = cfg.ssm
    return _decoder(cfg, "mamba", "MambaForCausalLM", hidden_size=cfg.d_model,
                    intermediate_size=s.expand * cfg.d_model, expand=s.expand,
                    num_hidden_layers=cfg.num_layers, state_size=s.d_state, conv_kernel=s.d_conv,
                    time_step_rank=s.dt_rank or "auto", use_conv_bias=s.conv_bias,
                    use_bias=s.proj_bias, layer_norm_epsilon=cfg.norm_eps, hidden_act="silu")
