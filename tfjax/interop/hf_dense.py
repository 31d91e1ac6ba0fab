"""The 2024-25 dense-attention decoder families of Hugging Face, in and out of tfjax.

Per `model_type`, the three functions of a `tfjax.interop.hf.Family`:
`<family>_config(hf) -> ModelConfig fields`, `<family>_weights(w, cfg, hf) -> {our
path: array}` and `<family>_to_hf(cfg) -> config.json dict` (its inverse, for export).

- **qwen2** (Qwen2, Qwen2.5): Llama with q/k/v biases (never on o). A window only
  when `use_sliding_window`; then layers `i >= max_window_layers` slide (HF's
  `layer_types`, when written, win).
- **olmo2**: norms on the sublayers' outputs (`norm_placement="output"`), QK-norm
  over the whole q and k projections (`attention.qk_norm_over="projection"`), before RoPE.
- **smollm3**: Llama whose `no_rope_layers[i] == 0` layers have no RoPE ("nope"
  layers; by default every `no_rope_layer_interval`-th). Its sliding NoPE layers
  (`use_sliding_window`) are refused: tfjax has no windowed NoPE kind.
- **gemma3_text**: Gemma 2's sandwich norms, (1 + w) RMSNorm, scaled embeddings,
  `query_pre_attn_scalar` and final soft-cap (its `attn_logit_softcapping` is read
  by no transformers code path, so not here either), plus QK-norm per head and
  per-kind RoPE: sliding layers unscaled at their own base (`rope_local_base_freq`,
  or `rope_parameters.sliding_attention`: `model.attention.local_rope_theta`), global layers
  at theirs with its scaling (`model.rope`).
- **phi3** (Phi-3, Phi-3.5): fused `qkv_proj` (rows q, k, v) and `gate_up_proj`
  (rows gate, up); a `sliding_window` applies to every layer. LongRoPE (its
  `rope_type` "longrope", or the "su" / "yarn" that Phi3Config renames to it) is
  `model.rope.scaling="longrope"`: short factors while the longest position of a
  call is within `original_max_position_embeddings`, long ones beyond, as
  transformers' rotary embedding switches them. Generation that crosses that length
  differs from transformers': `Phi3ForCausalLM.prepare_inputs_for_generation` drops
  its cache there and re-encodes the whole sequence with the long factors, while a
  tfjax cache keeps the earlier keys as they were rotated (a prompt already past it,
  or a generation that stays within it, is the same).
- **qwen3_moe**: Qwen3 attention (per-head QK-norm) and routed experts (softmax,
  top-k, `norm_topk_prob` renormalises) on layers `(i + 1) % decoder_sparse_step ==
  0` not in `mlp_only_layers`, dense SwiGLU on the others (`model.ffn_pattern`); no
  shared experts. Experts load from the per-expert tensors that `save_pretrained`
  writes or from the fused `gate_up_proj` / `down_proj` of transformers 5's modules.

An HF option that changes the computation is mapped or refused (NotImplementedError
naming it); keys a family's HF module ignores (e.g. Phi-3's `attention_bias`) are
dropped before the shared Llama mapping (`tfjax.interop.hf_config.llama_config`) sees
them. The conventions (windows, RoPE layout, norms) are `hf_config`'s.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from tfjax.config import ModelConfig
from tfjax.interop.hf_config import (check_types, gemma2_config, llama_config, qwen3_config,
                                     unsupported)
from tfjax.interop.hf_export import _rope_parameters
from tfjax.interop.hf_weights import (Weights, _attention, _head, _heads_in, _heads_out, _linear,
                                      _norm)

__all__ = ["gemma3_text_config", "gemma3_text_to_hf", "olmo2_config", "olmo2_to_hf",
           "olmo2_weights", "phi3_config", "phi3_to_hf", "phi3_weights", "qwen2_config",
           "qwen2_to_hf", "qwen3_moe_config", "qwen3_moe_to_hf", "qwen3_moe_weights",
           "smollm3_config", "smollm3_to_hf"]

_FULL, _SLIDING = "full_attention", "sliding_attention"
_NULL = type(None)
# The JSON types of the keys these families read beyond `hf_config.KEY_TYPES`.
_KEY_TYPES: dict[str, tuple[type, ...]] = {
    **dict.fromkeys(("max_window_layers", "no_rope_layer_interval", "sliding_window_pattern",
                     "decoder_sparse_step", "moe_intermediate_size", "num_experts",
                     "num_local_experts"), (int,)),
    **dict.fromkeys(("no_rope_layers", "mlp_only_layers"), (list, _NULL)),
    "norm_topk_prob": (bool,),
    "rope_local_base_freq": (int, float),
}


def _without(hf: dict, *keys: str) -> dict:
    """`hf` less the keys its family's HF module ignores (so the shared mapping does not
    read them)."""
    return {k: v for k, v in hf.items() if k not in keys}


def _period(kinds: list[str]) -> tuple[str, ...]:
    """The shortest pattern that, cycled, gives `kinds` (layer i is pattern[i % len])."""
    return next(tuple(kinds[:p]) for p in range(1, len(kinds) + 1)
                if all(kinds[i] == kinds[i % p] for i in range(len(kinds))))


def _per_layer(hf: dict, key: str, n: int) -> list:
    value = hf[key]
    if not isinstance(value, list) or len(value) != n:
        raise ValueError(f"config.json: {key} must be a list of num_hidden_layers={n} entries, "
                         f"got {value!r}")
    return value


# --------------------------------------------------------------------------- #
# Config mappings.
# --------------------------------------------------------------------------- #


def qwen2_config(hf: dict) -> dict:
    check_types(hf, key_types=_KEY_TYPES)
    n = hf["num_hidden_layers"]
    window = hf.get("sliding_window") if hf.get("use_sliding_window", False) else None
    types = hf.get("layer_types")
    if types is None:  # Qwen2Config.__post_init__
        start = hf.get("max_window_layers", 28)
        types = [_SLIDING if window is not None and i >= start else _FULL for i in range(n)]
    elif _SLIDING in _per_layer(hf, "layer_types", n) and window is None:
        unsupported("layer_types", types, "sliding layers need use_sliding_window=true and a "
                    "sliding_window")
    c = llama_config(dict(_without(hf, "attention_bias", "mlp_bias", "use_sliding_window"),
                          layer_types=types, sliding_window=window))
    c["attention"].update(qkv_bias=True, out_bias=False)  # Qwen2Attention: q, k, v biased, o not
    return c


def olmo2_config(hf: dict) -> dict:
    check_types(hf, key_types=_KEY_TYPES)
    c = llama_config(_without(hf, "mlp_bias", "sliding_window", "layer_types"))
    c.update(norm_placement="output")
    c["attention"].update(qk_norm=True, qk_norm_over="projection")
    return c


def smollm3_config(hf: dict) -> dict:
    check_types(hf, key_types=_KEY_TYPES)
    n = hf["num_hidden_layers"]
    if hf.get("no_rope_layers") is None:  # SmolLM3Config.__post_init__
        every = hf.get("no_rope_layer_interval", 4)
        if every < 1:
            raise ValueError(f"config.json: no_rope_layer_interval must be >= 1, got {every}")
        rope = [int((i + 1) % every != 0) for i in range(n)]
    else:
        rope = _per_layer(hf, "no_rope_layers", n)
    sliding = bool(hf.get("use_sliding_window") and hf.get("sliding_window"))
    if sliding or _SLIDING in (hf.get("layer_types") or ()):
        unsupported("use_sliding_window", True, "SmolLM3's sliding layers are its NoPE layers; "
                    "tfjax has no windowed NoPE layer kind")
    c = llama_config(_without(hf, "sliding_window", "layer_types", "use_sliding_window"))
    c.update(layer_pattern=_period(["global" if r else "nope" for r in rope]))
    return c


def _gemma3_rope(hf: dict) -> tuple[dict, dict]:
    """(global, local) RoPE parameters: transformers 5's `rope_parameters` per layer
    type, or 4.x's `rope_theta` + `rope_scaling` (global) and `rope_local_base_freq`."""
    p = hf.get("rope_parameters") or {}
    if _FULL in p or _SLIDING in p:
        full = dict(p.get(_FULL) or {})
        local = dict(p.get(_SLIDING) or {})
    else:
        full = {**(hf.get("rope_scaling") or {}), **p}
        local = {"rope_type": "default", "rope_theta": hf.get("rope_local_base_freq", 10000.0)}
    full.setdefault("rope_theta", hf.get("rope_theta", 1_000_000.0))
    local.setdefault("rope_theta", 10000.0)
    kind = local.get("rope_type", local.get("type", "default"))
    if kind != "default":
        unsupported("rope_parameters.sliding_attention.rope_type", kind,
                    "tfjax's local layers rotate unscaled (model.attention.local_rope_theta)")
    for key in ("rope_theta", "partial_rotary_factor"):
        value = local.get(key, 1.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"config.json: rope_parameters.sliding_attention.{key} must be a "
                             f"positive number, got {value!r}")
    if local.get("partial_rotary_factor", 1.0) != full.get("partial_rotary_factor", 1.0):
        unsupported("rope_parameters.sliding_attention.partial_rotary_factor",
                    local["partial_rotary_factor"], "must equal the global layers'")
    return full, local


def gemma3_text_config(hf: dict) -> dict:
    check_types(hf, key_types=_KEY_TYPES)
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None:  # Gemma3TextConfig.__post_init__
        every = hf.get("sliding_window_pattern", 6)
        types = [_SLIDING if (i + 1) % every else _FULL for i in range(n)]
    full, local = _gemma3_rope(hf)
    # transformers' Gemma3Attention stores attn_logit_softcapping but never applies it
    c = gemma2_config(dict(_without(hf, "rope_scaling", "rope_theta", "mlp_bias",
                                    "attn_logit_softcapping"),
                           layer_types=types, rope_parameters=full))
    c["attention"].update(qk_norm=True, local_rope_theta=float(local["rope_theta"]))
    return c


_LONGROPE = ("longrope", "su", "yarn")  # Phi3Config renames "su" and "yarn" to "longrope"


def _longrope(hf: dict, p: dict) -> dict:
    """Phi-3's LongRoPE (`_compute_longrope_parameters` of transformers) as `model.rope`:
    factors per rotated pair, s = factor or max_position_embeddings / original, and the
    default attention factor sqrt(1 + ln s / ln original) (another is refused)."""
    orig = p.get("original_max_position_embeddings", hf.get("original_max_position_embeddings"))
    if type(orig) is not int or orig < 1:
        raise ValueError(f"config.json: LongRoPE needs original_max_position_embeddings, an "
                         f"integer >= 1; got {orig!r}")
    factors = {}
    for key in ("short_factor", "long_factor"):
        value = p.get(key)
        if not isinstance(value, list) or not all(
                isinstance(f, (int, float)) and not isinstance(f, bool) for f in value):
            raise ValueError(f"config.json: rope_parameters.{key} must be a list of numbers "
                             f"(one per rotated pair), got {value!r}")
        factors[key] = tuple(float(f) for f in value)
    factor = float(p.get("factor") or hf.get("max_position_embeddings", 4096) / orig)
    default = math.sqrt(1 + math.log(factor) / math.log(orig)) if factor > 1 else 1.0
    given = p.get("attention_factor")
    if given is not None and abs(given - default) > 1e-9 * default:
        unsupported("rope_parameters.attention_factor", given, f"LongRoPE with its default "
                    f"sqrt(1 + ln(factor) / ln(original_max_position_embeddings)) = {default}")
    return dict(scaling="longrope", factor=max(factor, 1.0), original_max_len=orig, **factors)


def phi3_config(hf: dict) -> dict:
    check_types(hf, key_types=_KEY_TYPES)
    p = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    kind = p.get("rope_type", p.get("type", "default"))
    if kind not in _LONGROPE + ("default",):
        unsupported("rope_parameters.rope_type", kind, "Phi-3 has default or longrope only")
    # Phi3Attention has no biases; its sliding_window (if any) covers every layer
    plain = {k: v for k, v in p.items() if k in ("rope_theta", "partial_rotary_factor")}
    c = llama_config(dict(_without(hf, "attention_bias", "mlp_bias", "layer_types",
                                   "use_sliding_window", "rope_scaling"),
                          rope_parameters=dict(plain, rope_type="default")))
    if kind in _LONGROPE:
        c["rope"].update(_longrope(hf, p))
    return c


def _sparse_layers(hf: dict, n: int) -> list[bool]:
    """Which layers route (Qwen3MoeDecoderLayer): not in mlp_only_layers, and
    (i + 1) % decoder_sparse_step == 0 when there are experts."""
    dense = hf.get("mlp_only_layers") or []
    step = hf.get("decoder_sparse_step", 1)
    if not all(type(i) is int for i in dense):
        raise ValueError(f"config.json: mlp_only_layers must be a list of layer indices, got "
                         f"{dense!r}")
    if step < 1:
        raise ValueError(f"config.json: decoder_sparse_step must be >= 1, got {step}")
    return [i not in dense and _num_experts(hf) > 0 and (i + 1) % step == 0 for i in range(n)]


def _num_experts(hf: dict) -> int:
    """`num_experts` (the hub's checkpoints) or `num_local_experts` (what transformers 5
    writes for it: its attribute_map)."""
    given = {k: hf[k] for k in ("num_experts", "num_local_experts") if k in hf}
    if len(set(map(repr, given.values()))) > 1:
        raise ValueError(f"config.json: num_experts and num_local_experts disagree ({given}); "
                         "keep one")
    return next(iter(given.values()), 128)


def qwen3_moe_config(hf: dict) -> dict:
    check_types(hf, key_types=_KEY_TYPES)
    n = hf["num_hidden_layers"]
    window = hf.get("sliding_window") if hf.get("use_sliding_window", False) else None
    # Qwen3MoeConfig has no layer_types / max_window_layers: a window covers every layer
    c = qwen3_config(dict(_without(hf, "mlp_bias", "layer_types", "max_window_layers"),
                          sliding_window=window, use_sliding_window=window is not None))
    sparse = _sparse_layers(hf, n)
    if any(sparse):
        c.update(ffn_pattern=_period(["moe" if s else "dense" for s in sparse]), moe=dict(
            num_experts=_num_experts(hf), experts_per_token=hf["num_experts_per_tok"],
            d_ff=hf["moe_intermediate_size"],
            router_renormalize=bool(hf.get("norm_topk_prob", False)), capacity_factor=0.0,
            aux_loss_weight=float(hf.get("router_aux_loss_coef", 0.001))))
    return c


# --------------------------------------------------------------------------- #
# Weight mappings (qwen2, smollm3, gemma3_text: `hf_weights.llama_weights`).
# --------------------------------------------------------------------------- #


def _outer(w: Weights, cfg: ModelConfig) -> dict:
    """The embedding, final norm and (untied) output head of a `model.` checkpoint."""
    return {("embed", "tokens", "embedding"): w["model.embed_tokens.weight"],
            **_norm(w, "model.norm", ("final_norm",), cfg), **_head(w, "lm_head.weight", cfg)}


def _qk_norms(w: Weights, p: str, A: tuple, cfg: ModelConfig) -> dict:
    return {**_norm(w, p + "q_norm", A + ("q_norm",), cfg),
            **_norm(w, p + "k_norm", A + ("k_norm",), cfg)}


def _swiglu(w: Weights, p: str, L: tuple) -> dict:
    out = {}
    for ours, theirs in (("wi_gate", "gate_proj"), ("wi_up", "up_proj"), ("wo", "down_proj")):
        out.update(_linear(w, p + theirs, L + (ours,), False))
    return out


def olmo2_weights(w: Weights, cfg: ModelConfig, hf: dict) -> dict:
    out = _outer(w, cfg)
    for i in range(cfg.num_layers):
        p, L = f"model.layers.{i}.", ("layers", i)
        out.update(_attention(w, p + "self_attn.", L + ("attn",), cfg))
        out.update(_qk_norms(w, p + "self_attn.", L + ("attn",), cfg))  # [N*H], [K*H]
        out.update(_norm(w, p + "post_attention_layernorm", L + ("attn_norm",), cfg))
        out.update(_norm(w, p + "post_feedforward_layernorm", L + ("ffn_norm",), cfg))
        out.update(_swiglu(w, p + "mlp.", L + ("ffn",)))
    return out


def phi3_weights(w: Weights, cfg: ModelConfig, hf: dict) -> dict:
    N, K, H = cfg.num_heads, cfg.kv_heads, cfg.head_size
    out = _outer(w, cfg)
    for i in range(cfg.num_layers):
        p, L = f"model.layers.{i}.", ("layers", i)
        A = L + ("attn",)
        q, k, v = np.split(w[p + "self_attn.qkv_proj.weight"], [N * H, (N + K) * H])
        out.update({A + ("q", "kernel"): _heads_in(q, N, H),
                    A + ("k", "kernel"): _heads_in(k, K, H),
                    A + ("v", "kernel"): _heads_in(v, K, H),
                    A + ("o", "kernel"): _heads_out(w[p + "self_attn.o_proj.weight"], N, H)})
        gate, up = np.split(w[p + "mlp.gate_up_proj.weight"], 2)  # rows: gate, then up
        out.update({L + ("ffn", "wi_gate", "kernel"): gate.T, L + ("ffn", "wi_up", "kernel"): up.T,
                    **_linear(w, p + "mlp.down_proj", L + ("ffn", "wo"), False),
                    **_norm(w, p + "input_layernorm", L + ("attn_norm",), cfg),
                    **_norm(w, p + "post_attention_layernorm", L + ("ffn_norm",), cfg)})
    return out


def _qwen_experts(w: Weights, p: str, L: tuple, cfg: ModelConfig) -> dict:
    """Router `gate.weight [E, D]` and the experts: per expert `experts.{e}.gate_proj`,
    `up_proj`, `down_proj` (as save_pretrained writes) or fused `experts.gate_up_proj
    [E, 2F, D]` (rows gate, up) and `experts.down_proj [E, D, F]`."""
    E = cfg.moe.num_experts
    out = {L + ("router",): w[p + "gate.weight"].T}
    if p + "experts.gate_up_proj" in w:
        gate, up = np.split(w[p + "experts.gate_up_proj"], 2, axis=1)
        out.update({L + ("wi_gate",): np.swapaxes(gate, 1, 2),
                    L + ("wi_up",): np.swapaxes(up, 1, 2),
                    L + ("wo",): np.swapaxes(w[p + "experts.down_proj"], 1, 2)})
        return out
    for ours, theirs in (("wi_gate", "gate_proj"), ("wi_up", "up_proj"), ("wo", "down_proj")):
        out[L + (ours,)] = np.stack([w[f"{p}experts.{e}.{theirs}.weight"].T for e in range(E)])
    return out


def qwen3_moe_weights(w: Weights, cfg: ModelConfig, hf: dict) -> dict:
    out = _outer(w, cfg)
    for i in range(cfg.num_layers):
        p, L = f"model.layers.{i}.", ("layers", i)
        out.update(_attention(w, p + "self_attn.", L + ("attn",), cfg))
        out.update(_qk_norms(w, p + "self_attn.", L + ("attn",), cfg))
        out.update(_norm(w, p + "input_layernorm", L + ("attn_norm",), cfg))
        out.update(_norm(w, p + "post_attention_layernorm", L + ("ffn_norm",), cfg))
        if cfg.ffn_kind(i) == "moe":
            out.update(_qwen_experts(w, p + "mlp.", L + ("ffn",), cfg))
        else:
            out.update(_swiglu(w, p + "mlp.", L + ("ffn",)))
    return out


# --------------------------------------------------------------------------- #
# Inverses: a tfjax config -> its family's config.json (what export writes).
# --------------------------------------------------------------------------- #


def _need(section, family: str, prefix: str = "model", **want: Any) -> None:
    """Each field of `section` (a config or one of its sections, named `prefix`; dotted
    names reach into sections) has the value `want` gives, or a ValueError names it and
    what the family needs."""
    for field, value in want.items():
        got = section
        for part in field.split("."):
            got = getattr(got, part)
        if got != value:
            raise ValueError(f"export: {prefix}.{field}={got!r} has no {family} equivalent "
                             f"(needs {value!r})")


def _rope_to_hf(cfg: ModelConfig, family: str) -> dict:
    """`model.rope` as HF `rope_parameters` (`hf_export`'s, LongRoPE for Phi-3), or a
    ValueError for what these families cannot hold."""
    r = cfg.rope
    if r.layout != "half":
        raise ValueError(f"export: {family} rotates halves: needs model.rope.layout='half', got "
                         f"{r.layout!r}")
    if r.scaling not in ("none", "linear", "llama3", "yarn") and not (
            (r.scaling == "dynamic_ntk" and r.original_max_len == cfg.max_len)
            or (r.scaling == "longrope" and family == "Phi-3")):
        raise ValueError(f"export: model.rope.scaling={r.scaling!r} has no {family} form "
                         "(none, linear, llama3, yarn, dynamic_ntk from max_len are; "
                         "longrope for Phi-3)")
    return _rope_parameters(cfg, partial=r.fraction != 1.0, longrope=family == "Phi-3")


def _hf_window(cfg: ModelConfig) -> int | None:
    # HF counts the query
    return cfg.attention.sliding_window + 1 if "local" in cfg.layer_pattern else None


def _hf_layer_types(cfg: ModelConfig) -> list[str]:
    return [_SLIDING if cfg.layer_kind(i) == "local" else _FULL for i in range(cfg.num_layers)]


def _base_to_hf(cfg: ModelConfig, family: str, model_type: str, architecture: str, *,
                kinds: tuple[str, ...] = ("global",), uniform: bool = False,
                **want: Any) -> dict:
    """The fields every Llama-like family writes, after checking what it cannot carry:
    fields other than `want`'s values, layer kinds other than `kinds` (`uniform`: one
    kind for every layer)."""
    base = {"arch": "decoder", "norm": "rmsnorm", "norm_placement": "pre",
            "block": "sequential", "position": "rope", "activation": "swiglu",
            "ffn_bias": False, "attention.qk_norm": False, "attention.softcap": 0.0,
            "final_softcap": 0.0, "scale_embeddings": False, "embed_norm": False,
            "logits_scale": 1.0, "ffn_pattern": ("dense",), "prefix_lm": False,
            "attention.sinks": False, "v_head_dim": 0, "final_norm": True,
            "attention.differential": False, "attention.value_residual": "none",
            "attention.output_gate": False, "mup_base_width": 0,
            "attention.local_rope_theta": 0.0,
            "attention.scale": 0.0 if not cfg.attention.scale else cfg.head_size ** -0.5}
    base.update(want)
    _need(cfg, family, **base)
    if not set(cfg.layer_pattern) <= set(kinds) or uniform and len(set(cfg.layer_pattern)) > 1:
        one = ", one for all layers" if uniform else ""
        raise ValueError(f"export: model.layer_pattern={cfg.layer_pattern!r} has no {family} "
                         f"form (layer kinds {', '.join(kinds)}{one})")
    N, D = cfg.num_heads, cfg.d_model
    return dict(architectures=[architecture], model_type=model_type, vocab_size=cfg.vocab_size,
                hidden_size=D, intermediate_size=cfg.d_ff, num_hidden_layers=cfg.num_layers,
                num_attention_heads=N, num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_size,
                hidden_act="silu", max_position_embeddings=cfg.max_len,
                rms_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings,
                rope_parameters=_rope_to_hf(cfg, family), dtype=cfg.param_dtype,
                attention_dropout=0.0,
                # no token ids of the family's own vocabulary (export writes the tokenizer's)
                pad_token_id=None, bos_token_id=None, eos_token_id=None)


def _biases(cfg: ModelConfig, family: str) -> bool:
    if cfg.attention.qkv_bias != cfg.attention.out_bias:
        raise ValueError(f"export: {family}'s attention_bias covers q, k, v and o together; got "
                         f"model.attention.qkv_bias={cfg.attention.qkv_bias}, "
                         f"model.attention.out_bias={cfg.attention.out_bias}")
    return cfg.attention.qkv_bias


def qwen2_to_hf(cfg: ModelConfig) -> dict:
    _need(cfg, "Qwen2", **{"attention.qkv_bias": True, "attention.out_bias": False})
    hf = _base_to_hf(cfg, "Qwen2", "qwen2", "Qwen2ForCausalLM", kinds=("global", "local"))
    window = _hf_window(cfg)
    hf.update(use_sliding_window=window is not None, sliding_window=window,
              layer_types=_hf_layer_types(cfg), max_window_layers=cfg.num_layers)
    return hf


def olmo2_to_hf(cfg: ModelConfig) -> dict:
    hf = _base_to_hf(cfg, "OLMo 2", "olmo2", "Olmo2ForCausalLM", norm_placement="output",
                     **{"attention.qk_norm": True, "attention.qk_norm_over": "projection",
                        "attention.qk_norm_kind": ""})
    hf.update(attention_bias=_biases(cfg, "OLMo 2"))
    return hf


def smollm3_to_hf(cfg: ModelConfig) -> dict:
    hf = _base_to_hf(cfg, "SmolLM3", "smollm3", "SmolLM3ForCausalLM", kinds=("global", "nope"))
    hf.update(attention_bias=_biases(cfg, "SmolLM3"), mlp_bias=False, use_sliding_window=False,
              sliding_window=None,
              no_rope_layers=[int(cfg.layer_kind(i) != "nope") for i in range(cfg.num_layers)])
    return hf


def gemma3_text_to_hf(cfg: ModelConfig) -> dict:
    a = cfg.attention
    scale = a.scale or cfg.head_size ** -0.5
    hf = _base_to_hf(cfg, "Gemma 3", "gemma3_text", "Gemma3ForCausalLM",
                     kinds=("global", "local"), norm="rmsnorm_plus_one",
                     norm_placement="sandwich", activation="geglu_tanh", scale_embeddings=True,
                     final_softcap=cfg.final_softcap,
                     **{"attention.qk_norm": True, "attention.qk_norm_over": "head",
                        "attention.qk_norm_kind": "", "attention.scale": a.scale,
                        "attention.local_rope_theta": a.local_rope_theta})
    if "local" in cfg.layer_pattern and not a.local_rope_theta:
        raise ValueError("export: Gemma 3's sliding layers rotate at their own base: set "
                         "model.attention.local_rope_theta")
    full = hf.pop("rope_parameters")
    local = {"rope_type": "default", "rope_theta": a.local_rope_theta or full["rope_theta"]}
    if "partial_rotary_factor" in full:
        local["partial_rotary_factor"] = full["partial_rotary_factor"]
    scalar = round(scale ** -2)  # an integer in Gemma3TextConfig
    if abs(scalar ** -0.5 - scale) > 1e-9 * scale:
        raise ValueError(f"export: Gemma 3's query_pre_attn_scalar is an integer n with "
                         f"scale = n ** -0.5; model.attention.scale={a.scale} is not")
    window = _hf_window(cfg)
    del hf["hidden_act"]
    hf.update(hidden_activation="gelu_pytorch_tanh",
              query_pre_attn_scalar=scalar, attention_bias=_biases(cfg, "Gemma 3"),
              sliding_window=window or cfg.max_len, layer_types=_hf_layer_types(cfg),
              final_logit_softcapping=cfg.final_softcap or None,
              rope_parameters={_FULL: full, _SLIDING: local})
    return hf


def phi3_to_hf(cfg: ModelConfig) -> dict:
    _need(cfg, "Phi-3", **{"attention.qkv_bias": False, "attention.out_bias": False})
    hf = _base_to_hf(cfg, "Phi-3", "phi3", "Phi3ForCausalLM", kinds=("global", "local"),
                     uniform=True)
    if hf["rope_parameters"]["rope_type"] not in ("default", "longrope"):
        raise ValueError(f"export: Phi-3 has no {hf['rope_parameters']['rope_type']!r} RoPE "
                         "(model.rope.scaling must be 'none' or 'longrope')")
    hf.update(sliding_window=_hf_window(cfg), original_max_position_embeddings=(
        cfg.rope.original_max_len if cfg.rope.scaling == "longrope" else cfg.max_len))
    return hf


def qwen3_moe_to_hf(cfg: ModelConfig) -> dict:
    m = cfg.moe
    kinds = [cfg.ffn_kind(i) for i in range(cfg.num_layers)]
    if not set(kinds) <= {"dense", "moe"}:
        raise ValueError(f"export: model.ffn_pattern={cfg.ffn_pattern!r} has no Qwen3-MoE form "
                         "(dense and moe layers)")
    hf = _base_to_hf(cfg, "Qwen3-MoE", "qwen3_moe", "Qwen3MoeForCausalLM",
                     kinds=("global", "local"), uniform=True, ffn_pattern=cfg.ffn_pattern,
                     **{"attention.qk_norm": True, "attention.qk_norm_over": "head",
                        "attention.qk_norm_kind": ""})
    if "moe" in kinds:
        _need(cfg.moe, "Qwen3-MoE", "model.moe", shared_experts=0, score="softmax", n_group=1,
              score_bias=False, routed_scaling_factor=1.0, router_bias=False, glu="standard",
              gate_input=False, capacity_factor=0.0)
    hf.update(attention_bias=_biases(cfg, "Qwen3-MoE"), use_sliding_window=_hf_window(cfg)
              is not None, sliding_window=_hf_window(cfg), decoder_sparse_step=1,
              mlp_only_layers=[i for i, k in enumerate(kinds) if k == "dense"],
              num_experts=m.num_experts if "moe" in kinds else 0,
              num_experts_per_tok=m.experts_per_token, moe_intermediate_size=m.d_ff or cfg.d_ff,
              norm_topk_prob=m.router_renormalize, router_aux_loss_coef=m.aux_loss_weight)
    return hf
