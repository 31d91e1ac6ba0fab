"""Hugging Face `config.json` -> tfjax `ModelConfig` fields, one function per family.

Each `<family>_config(hf) -> dict` returns the fields of a `ModelConfig` (nested
sections as dicts: `rope`, `moe`, `ssm`, `t5`). Every HF option that changes the
computation is either mapped or refused with `NotImplementedError` naming it (e.g.
`rope_parameters.rope_type='longrope'`); options that do not change inference
(dropout, init ranges, cache flags) are ignored. Conventions that differ are
converted here: HF's `sliding_window=w` lets a query see w keys including itself,
ours counts the keys before it (w - 1); HF's dynamic NTK rope grows from
`max_position_embeddings`; every supported family uses the "half" (rotate_half)
RoPE layout in its HF form, so no permutation is needed. `tfjax.interop.hf.FAMILIES`
pairs these with the tensor mappings of `tfjax.interop.hf_weights`. Before any of
them runs, `check_types` checks the JSON type of every key they read (`KEY_TYPES`),
so a damaged config.json is a ValueError naming the key, not a TypeError deep inside.
"""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["KEY_TYPES", "ROPE_KEY_TYPES", "bert_config", "bloom_config", "check_types",
           "gemma2_config", "gpt2_config", "llama_config", "mamba_config", "mixtral_config",
           "neox_config", "qwen3_config", "require", "t5_config", "unsupported"]

_NULL = type(None)
_INT, _NUM, _BOOL, _STR = (int,), (int, float), (bool,), (str,)

# The JSON type of every config.json key the mappings (and `tfjax.generate --hf`) read,
# checked before any mapping runs (a key not listed is not checked). Sizes that build
# the model are never null; keys read with a fallback may be null where HF writes it.
KEY_TYPES: dict[str, tuple[type, ...]] = {
    **dict.fromkeys((
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
        "intermediate_size", "max_position_embeddings", "n_embd", "n_layer", "n_head",
        "n_positions", "d_model", "d_kv", "d_ff", "num_layers", "num_heads", "state_size",
        "conv_kernel", "num_local_experts", "num_experts_per_tok", "type_vocab_size",
        "relative_attention_num_buckets", "relative_attention_max_distance"), _INT),
    **dict.fromkeys(("num_key_value_heads", "head_dim", "n_inner", "sliding_window",
                     "num_decoder_layers", "bos_token_id"), _INT + (_NULL,)),
    "eos_token_id": (int, list, _NULL),
    "time_step_rank": (int, str),
    **dict.fromkeys(("rope_theta", "rotary_emb_base", "partial_rotary_factor", "rotary_pct",
                     "rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon",
                     "router_aux_loss_coef", "query_pre_attn_scalar"), _NUM),
    **dict.fromkeys(("attn_logit_softcapping", "final_logit_softcapping"), _NUM + (_NULL,)),
    **dict.fromkeys((
        "tie_word_embeddings", "attention_bias", "mlp_bias", "use_parallel_residual",
        "use_conv_bias", "use_bias", "scale_attn_weights", "scale_attn_by_inverse_layer_idx",
        "add_cross_attention", "is_decoder", "apply_residual_connection_post_layernorm",
        "scale_decoder_outputs"), _BOOL),
    **dict.fromkeys(("use_bidirectional_attention", "use_sliding_window"), _BOOL + (_NULL,)),
    **dict.fromkeys(("model_type", "activation_function", "feed_forward_proj"), _STR),
    **dict.fromkeys(("hidden_act", "hidden_activation", "dense_act_fn",
                     "position_embedding_type", "dtype", "torch_dtype"), _STR + (_NULL,)),
    **dict.fromkeys(("rope_scaling", "rope_parameters"), (dict, _NULL)),
    "layer_types": (list, _NULL),
}
# Inside `rope_scaling` / `rope_parameters`.
ROPE_KEY_TYPES: dict[str, tuple[type, ...]] = {
    **dict.fromkeys(("rope_type", "type"), _STR),
    **dict.fromkeys(("rope_theta", "factor", "partial_rotary_factor", "low_freq_factor",
                     "high_freq_factor", "beta_fast", "beta_slow", "attention_factor", "mscale",
                     "mscale_all_dim"), _NUM + (_NULL,)),
    "original_max_position_embeddings": _INT + (_NULL,),
    "truncate": _BOOL + (_NULL,),
}
_TYPE_NAMES = {int: "an integer", float: "a number", bool: "true / false", str: "a string",
               dict: "a JSON object", list: "a list", _NULL: "null"}


def check_types(hf: dict, source: str = "config.json",
                key_types: dict[str, tuple[type, ...]] | None = None) -> None:
    """Every key of `KEY_TYPES` (or of `key_types`: a family's own keys; and
    `ROPE_KEY_TYPES` inside the rope sections) that `hf` has holds a value of its JSON
    type, or a ValueError names `source`, the key, what it holds and what it should
    hold. (JSON `true` is not an integer here.)"""

    def check(key: str, value, types: tuple[type, ...]) -> None:
        bad = isinstance(value, bool) and bool not in types or not isinstance(value, types)
        if isinstance(value, list) and key == "eos_token_id":  # a list of ids
            bad = not all(type(i) is int for i in value)
        if bad:
            names = [_TYPE_NAMES[t] for t in types if not (t is int and float in types)]
            want = " or ".join(names).replace("a list", "a list of integers"
                                              if key == "eos_token_id" else "a list")
            got = _TYPE_NAMES.get(type(value), type(value).__name__)
            raise ValueError(f"{source}: {key} is {json.dumps(value)} ({got}), but it must be "
                             f"{want}; fix {key} in {source}")

    for key, types in (KEY_TYPES if key_types is None else key_types).items():
        if key in hf:
            check(key, hf[key], types)
    for section in ("rope_scaling", "rope_parameters"):
        for key, value in (hf.get(section) or {}).items():
            if key in ROPE_KEY_TYPES:
                check(f"{section}.{key}", value, ROPE_KEY_TYPES[key])


def unsupported(option: str, value: Any, hint: str = "") -> None:
    raise NotImplementedError(f"HF config {option}={value!r} is not supported by "
                              f"tfjax.interop.hf{': ' + hint if hint else ''}")


def require(hf: dict, key: str, allowed, hint: str = "") -> None:
    value = hf.get(key)
    if value is not None and value not in allowed:
        unsupported(key, value, hint or f"supported: {allowed}")


_GATED = {"silu": "swiglu", "swish": "swiglu", "gelu": "geglu", "gelu_new": "geglu_tanh",
          "gelu_pytorch_tanh": "geglu_tanh", "relu": "reglu"}
_PLAIN = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
          "relu": "relu", "silu": "silu", "swish": "silu"}


def _activation(hf: dict, key: str, gated: bool) -> str:
    name = hf.get(key) or ("silu" if gated else "gelu")
    table = _GATED if gated else _PLAIN
    if name not in table:
        unsupported(key, name, f"supported: {sorted(table)}")
    return table[name]


def _rope(hf: dict) -> dict:
    """HF `rope_parameters` (transformers >= 5) or `rope_theta` + `rope_scaling` (4.x)."""
    p = dict(hf.get("rope_scaling") or {})
    p.update(hf.get("rope_parameters") or {})
    theta = p.get("rope_theta", hf.get("rope_theta", hf.get("rotary_emb_base", 10000.0)))
    kind = p.get("rope_type", p.get("type", "default"))
    fraction = p.get("partial_rotary_factor",
                     hf.get("partial_rotary_factor", hf.get("rotary_pct", 1.0)))
    out: dict[str, Any] = dict(theta=float(theta), fraction=float(fraction), layout="half")
    max_pos = hf.get("max_position_embeddings", 2048)
    if kind == "default":
        return out
    factor = p.get("factor")
    if kind == "linear":
        out.update(scaling="linear", factor=float(factor))
    elif kind == "dynamic":
        # HF grows the base once the length exceeds max_position_embeddings.
        out.update(scaling="dynamic_ntk", factor=float(factor), original_max_len=int(max_pos))
    elif kind == "llama3":
        out.update(scaling="llama3", factor=float(factor),
                   low_freq_factor=float(p.get("low_freq_factor", 1.0)),
                   high_freq_factor=float(p.get("high_freq_factor", 4.0)),
                   original_max_len=int(p["original_max_position_embeddings"]))
    elif kind == "yarn":
        orig = int(p.get("original_max_position_embeddings") or max_pos)
        factor = float(factor if factor is not None else max_pos / orig)

        def get_mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        attn = p.get("attention_factor")
        if attn is None:
            m, m_all = p.get("mscale"), p.get("mscale_all_dim")
            attn = get_mscale(factor, m) / get_mscale(factor, m_all) if m and m_all else None
        mscale = 1.0
        if attn is not None:
            if factor <= 1.0:
                if abs(attn - 1.0) > 1e-12:
                    unsupported("rope_parameters.attention_factor", attn, "needs factor > 1")
            else:  # our temperature is 0.1 * mscale * ln(s) + 1
                mscale = (attn - 1.0) / (0.1 * math.log(factor))
        out.update(scaling="yarn", factor=factor, original_max_len=orig, mscale=mscale,
                   beta_fast=float(p.get("beta_fast") or 32.0),
                   beta_slow=float(p.get("beta_slow") or 1.0),
                   truncate=p.get("truncate", True) is not False)
    else:
        unsupported("rope_parameters.rope_type", kind,
                    "supported: default, linear, dynamic, yarn, llama3")
    return out


def _layer_pattern(hf: dict, num_layers: int) -> tuple[tuple[str, ...], int]:
    """HF `layer_types` / `sliding_window` -> our `layer_pattern` and
    `attention.sliding_window` (0 when no layer slides)."""
    window = hf.get("sliding_window")
    types = hf.get("layer_types")
    if types is None:
        local = bool(window) and hf.get("use_sliding_window", True)
        types = ["sliding_attention" if local else "full_attention"] * num_layers
    names = {"full_attention": "global", "sliding_attention": "local"}
    for t in types:
        if t not in names:
            unsupported("layer_types", t, f"supported: {sorted(names)}")
    kinds = [names[t] for t in types]
    period = next(p for p in range(1, len(kinds) + 1)
                  if all(kinds[i] == kinds[i % p] for i in range(len(kinds))))
    if "local" not in kinds:
        return tuple(kinds[:period]), 0
    if not window or window < 1:
        unsupported("sliding_window", window, "sliding layers need a window >= 1")
    return tuple(kinds[:period]), int(window) - 1  # HF's window includes the query itself


def _common(hf: dict) -> dict:
    return dict(vocab_size=hf["vocab_size"], tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
                dropout_rate=0.0, scan_layers=True)


def llama_config(hf: dict) -> dict:
    n = hf["num_hidden_layers"]
    D, N = hf["hidden_size"], hf["num_attention_heads"]
    bias = bool(hf.get("attention_bias", False))
    c = dict(_common(hf), arch="decoder", d_model=D, num_layers=n, num_heads=N,
             num_kv_heads=hf.get("num_key_value_heads") or N, head_dim=hf.get("head_dim") or D // N,
             d_ff=hf["intermediate_size"], max_len=hf.get("max_position_embeddings", 2048),
             activation=_activation(hf, "hidden_act", gated=True),
             ffn_bias=bool(hf.get("mlp_bias", False)),
             attention=dict(qkv_bias=bias, out_bias=bias), position="rope", rope=_rope(hf),
             norm="rmsnorm", norm_eps=hf.get("rms_norm_eps", 1e-6), norm_placement="pre")
    c["layer_pattern"], c["attention"]["sliding_window"] = _layer_pattern(hf, n)
    return c


def mixtral_config(hf: dict) -> dict:
    c = llama_config(hf)
    c.update(ffn_pattern=("moe",), moe=dict(
        num_experts=hf["num_local_experts"], experts_per_token=hf["num_experts_per_tok"],
        router_renormalize=True, capacity_factor=0.0,
        aux_loss_weight=float(hf.get("router_aux_loss_coef", 0.01))))
    return c


def qwen3_config(hf: dict) -> dict:
    c = llama_config(hf)
    c["attention"].update(qk_norm=True)  # RMSNorm of q and k over the head dim, before RoPE
    return c


def gemma2_config(hf: dict) -> dict:
    if hf.get("use_bidirectional_attention"):
        unsupported("use_bidirectional_attention", True, "causal Gemma 2 only")
    c = llama_config(hf)
    c.update(norm="rmsnorm_plus_one", norm_placement="sandwich", scale_embeddings=True,
             activation=_activation(hf, "hidden_activation", gated=True),
             final_softcap=float(hf.get("final_logit_softcapping") or 0.0))
    c["attention"].update(scale=float(hf.get("query_pre_attn_scalar", c["head_dim"])) ** -0.5,
                          softcap=float(hf.get("attn_logit_softcapping") or 0.0))
    return c


def gpt2_config(hf: dict) -> dict:
    for key in ("scale_attn_by_inverse_layer_idx", "add_cross_attention"):
        if hf.get(key):
            unsupported(key, hf[key])
    D = hf["n_embd"]
    return dict(_common(hf), arch="decoder", d_model=D, num_layers=hf["n_layer"],
                num_heads=hf["n_head"], d_ff=hf.get("n_inner") or 4 * D, max_len=hf["n_positions"],
                position="learned", norm="layernorm", norm_eps=hf.get("layer_norm_epsilon", 1e-5),
                activation=_activation(hf, "activation_function", gated=False), ffn_bias=True,
                attention=dict(qkv_bias=True, out_bias=True,
                               scale=0.0 if hf.get("scale_attn_weights", True) else 1.0))


def neox_config(hf: dict) -> dict:
    bias = bool(hf.get("attention_bias", True))
    D, N = hf["hidden_size"], hf["num_attention_heads"]
    parallel = bool(hf.get("use_parallel_residual", True))
    return dict(_common(hf), arch="decoder", d_model=D, num_layers=hf["num_hidden_layers"],
                num_heads=N, d_ff=hf["intermediate_size"],
                max_len=hf.get("max_position_embeddings", 2048), position="rope", rope=_rope(hf),
                norm="layernorm", norm_eps=hf.get("layer_norm_eps", 1e-5),
                block="parallel" if parallel else "sequential", parallel_shared_norm=False,
                activation=_activation(hf, "hidden_act", gated=False), ffn_bias=True,
                attention=dict(qkv_bias=bias, out_bias=bias))


def bloom_config(hf: dict) -> dict:
    if hf.get("apply_residual_connection_post_layernorm"):
        unsupported("apply_residual_connection_post_layernorm", True)
    D = hf["hidden_size"]
    return dict(_common(hf), arch="decoder", d_model=D, num_layers=hf["n_layer"],
                num_heads=hf["n_head"], d_ff=4 * D, max_len=2048, position="alibi",
                norm="layernorm", norm_eps=hf.get("layer_norm_epsilon", 1e-5), embed_norm=True,
                activation="gelu_tanh", ffn_bias=True,
                attention=dict(qkv_bias=True, out_bias=True))


def bert_config(hf: dict) -> dict:
    require(hf, "position_embedding_type", ("absolute",))
    if hf.get("is_decoder") or hf.get("add_cross_attention"):
        unsupported("is_decoder", True, "BERT as an encoder only")
    if hf.get("hidden_act", "gelu") != "gelu":  # our MLM head uses exact GELU
        unsupported("hidden_act", hf["hidden_act"], "supported: 'gelu'")
    return dict(_common(hf), arch="encoder", d_model=hf["hidden_size"],
                num_layers=hf["num_hidden_layers"], num_heads=hf["num_attention_heads"],
                d_ff=hf["intermediate_size"], max_len=hf["max_position_embeddings"],
                position="learned", type_vocab_size=hf.get("type_vocab_size", 2), num_classes=0,
                norm="layernorm", norm_eps=hf.get("layer_norm_eps", 1e-12), norm_placement="post",
                final_norm=False, embed_norm=True, activation="gelu", ffn_bias=True,
                attention=dict(qkv_bias=True, out_bias=True))


def t5_config(hf: dict) -> dict:
    proj = hf.get("feed_forward_proj", "relu")
    gated = proj.startswith("gated-")
    act = hf.get("dense_act_fn") or proj.split("-")[-1]
    activation = _activation({"act": act}, "act", gated=gated)
    D = hf["d_model"]
    scale_out = hf.get("scale_decoder_outputs", hf.get("tie_word_embeddings", True))
    return dict(_common(hf), arch="encoder_decoder", d_model=D,
                num_layers=hf.get("num_decoder_layers") or hf["num_layers"],
                num_encoder_layers=hf["num_layers"], num_heads=hf["num_heads"],
                head_dim=hf["d_kv"], d_ff=hf["d_ff"], max_len=512, position="t5",
                t5=dict(num_buckets=hf.get("relative_attention_num_buckets", 32),
                        max_distance=hf.get("relative_attention_max_distance", 128)),
                norm="rmsnorm", norm_eps=hf.get("layer_norm_epsilon", 1e-6), norm_placement="pre",
                activation=activation, ffn_bias=False,
                attention=dict(qkv_bias=False, out_bias=False, scale=1.0),
                logits_scale=D ** -0.5 if scale_out else 1.0)


def mamba_config(hf: dict) -> dict:
    require(hf, "hidden_act", ("silu",))
    D, Di = hf["hidden_size"], hf["intermediate_size"]
    if Di % D:
        unsupported("intermediate_size", Di, f"must be a multiple of hidden_size={D} (expand)")
    rank = hf.get("time_step_rank", "auto")
    return dict(_common(hf), arch="decoder", d_model=D, num_layers=hf["num_hidden_layers"],
                num_heads=1, d_ff=Di, position="none", norm="rmsnorm",
                norm_eps=hf.get("layer_norm_epsilon", 1e-5), layer_pattern=("mamba",),
                ffn_pattern=("none",),
                ssm=dict(d_state=hf["state_size"], d_conv=hf["conv_kernel"], expand=Di // D,
                         dt_rank=0 if rank == "auto" else int(rank),
                         conv_bias=bool(hf.get("use_conv_bias", True)),
                         proj_bias=bool(hf.get("use_bias", False)), chunk=0))
