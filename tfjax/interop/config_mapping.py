"""The config helpers the checkpoint families share, both ways: `config.json` ->
`ModelConfig` fields (the JSON types of the keys, refusals, activations, RoPE, layer
patterns and windows) and `ModelConfig` -> `config.json` (their inverses, and the check
of what a family cannot write). The conventions that differ are converted here: HF's
`sliding_window=w` counts the query itself (ours: w - 1), HF's dynamic NTK rope grows
from `max_position_embeddings`, and every family's HF form rotates halves ("half").
See docs/interop.md.
"""

from __future__ import annotations

import json
import math
from typing import Any

from tfjax.config import ModelConfig

__all__ = ["GATED", "KEY_TYPES", "PLAIN", "ROPE_KEY_TYPES", "attention_bias", "check_types",
           "common_fields", "decoder_to_hf", "hf_activation", "hf_window", "layer_types", "need",
           "per_layer", "read_activation", "read_layer_pattern", "read_rope", "refuse_quantized",
           "require", "require_silu", "rms_decoder_fields", "rms_decoder_to_hf",
           "rope_parameters", "shortest_pattern", "unsupported", "without"]

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


def require_silu(hf: dict, family: str) -> None:
    require(hf, "hidden_act", ("silu", "swish"),
            f"{family} uses hidden_act for its SiLU convolution gate and MLPs: silu only")


def refuse_quantized(hf: dict) -> None:
    q = hf.get("quantization_config")
    if q:
        method = q.get("quant_method") if isinstance(q, dict) else q
        unsupported("quantization_config.quant_method", method,
                    "load a dequantized checkpoint (transformers: from_pretrained with the "
                    "quantizer's dequantize=True, then save_pretrained)")


def without(hf: dict, *keys: str) -> dict:
    """`hf` less the keys its family's HF module ignores (so a shared mapping does not
    read them)."""
    return {k: v for k, v in hf.items() if k not in keys}


def per_layer(hf: dict, key: str, n: int) -> list:
    value = hf[key]
    if not isinstance(value, list) or len(value) != n:
        raise ValueError(f"config.json: {key} must be a list of num_hidden_layers={n} entries, "
                         f"got {value!r}")
    return value


GATED = {"silu": "swiglu", "swish": "swiglu", "gelu": "geglu", "gelu_new": "geglu_tanh",
          "gelu_pytorch_tanh": "geglu_tanh", "relu": "reglu"}
PLAIN = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
          "relu": "relu", "silu": "silu", "swish": "silu"}


def read_activation(hf: dict, key: str, gated: bool) -> str:
    name = hf.get(key) or ("silu" if gated else "gelu")
    table = GATED if gated else PLAIN
    if name not in table:
        unsupported(key, name, f"supported: {sorted(table)}")
    return table[name]


def hf_activation(cfg: ModelConfig, gated: bool) -> str:
    """The HF name of `cfg.activation` (the family's default where it has none: the
    round trip then names model.activation)."""
    table = GATED if gated else PLAIN
    names = [hf for hf, ours in table.items() if ours == cfg.activation]
    return names[0] if names else ("silu" if gated else "gelu")


def read_rope(hf: dict) -> dict:
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


def rope_parameters(cfg: ModelConfig, *, partial: bool = False, truncate: bool = False,
                    longrope: bool = False) -> dict:
    """`model.rope` as HF `rope_parameters` (the inverse of `read_rope`): the scalings every
    family shares; `partial` adds `partial_rotary_factor`, `truncate` YaRN's `truncate`
    (gpt-oss), `longrope` Phi-3's LongRoPE. Any other scaling comes out as "default",
    which the round trip of `tfjax.interop.computation.config_diff` then names."""
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


def shortest_pattern(kinds: list[str], *, whole_cycles: bool = False) -> tuple[str, ...]:
    """The shortest pattern that, cycled, gives `kinds` (layer i is pattern[i % len]);
    `whole_cycles`: of a length that divides the layers (so the stack scans whole
    cycles and has no leftover blocks)."""
    n = len(kinds)
    period = next(p for p in range(1, n + 1) if (n % p == 0 or not whole_cycles)
                  and all(kinds[i] == kinds[i % p] for i in range(n)))
    return tuple(kinds[:period])


def read_layer_pattern(hf: dict, num_layers: int) -> tuple[tuple[str, ...], int]:
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
    if "local" not in kinds:
        return shortest_pattern(kinds), 0
    if not window or window < 1:
        unsupported("sliding_window", window, "sliding layers need a window >= 1")
    return shortest_pattern(kinds), int(window) - 1  # HF's window includes the query itself


def layer_types(cfg: ModelConfig) -> list[str]:
    """HF `layer_types` of the model's layers (the inverse of `read_layer_pattern`)."""
    names = {"global": "full_attention", "local": "sliding_attention"}
    return [names.get(cfg.layer_kind(i), cfg.layer_kind(i)) for i in range(cfg.num_layers)]


def hf_window(cfg: ModelConfig) -> int | None:
    """HF's `sliding_window` (it counts the query itself) where a layer is local."""
    return cfg.attention.sliding_window + 1 if "local" in cfg.layer_pattern else None


def common_fields(hf: dict) -> dict:
    """The fields every family reads alike: vocabulary, tied head (HF's default: tied)."""
    return dict(vocab_size=hf["vocab_size"],
                tie_embeddings=bool(hf.get("tie_word_embeddings", True)), dropout_rate=0.0,
                scan_layers=True)


def rms_decoder_fields(hf: dict) -> dict:
    """The fields of a pre-norm RMSNorm decoder with RoPE, its sizes read as Llama's are,
    with the defaults of the 2025 MoE releases (gpt-oss, Llama 4, DeepSeek-V3): an
    untied head, eps 1e-5."""
    N = hf["num_attention_heads"]
    return dict(common_fields(hf), arch="decoder", d_model=hf["hidden_size"],
                num_layers=hf["num_hidden_layers"], num_heads=N,
                num_kv_heads=hf.get("num_key_value_heads") or N,
                head_dim=hf.get("head_dim") or hf["hidden_size"] // N,
                d_ff=hf["intermediate_size"], max_len=hf.get("max_position_embeddings", 2048),
                tie_embeddings=bool(hf.get("tie_word_embeddings", False)), position="rope",
                norm="rmsnorm", norm_eps=hf.get("rms_norm_eps", 1e-5), norm_placement="pre")


def decoder_to_hf(cfg: ModelConfig, model_type: str, architecture: str, **fields) -> dict:
    return dict(model_type=model_type, architectures=[architecture], vocab_size=cfg.vocab_size,
                tie_word_embeddings=cfg.tie_embeddings, **fields)


def rms_decoder_to_hf(cfg: ModelConfig, model_type: str, architecture: str, **fields) -> dict:
    """The fields `rms_decoder_fields` reads, as config.json (`fields` override them; RoPE with
    YaRN's `truncate`); whether the model is the same is `config_diff`'s question."""
    shared = dict(hidden_size=cfg.d_model, num_hidden_layers=cfg.num_layers,
                  num_attention_heads=cfg.num_heads, hidden_act=hf_activation(cfg, gated=True),
                  max_position_embeddings=cfg.max_len, rms_norm_eps=cfg.norm_eps,
                  rope_parameters=rope_parameters(cfg, truncate=True), attention_dropout=0.0)
    return decoder_to_hf(cfg, model_type, architecture, **{**shared, **fields})


def need(cfg: ModelConfig, family: str, **want: Any) -> None:
    """Each field of `cfg` named in `want` (dotted names reach into sections:
    `**{"attention.qk_norm": True}`) has the value `want` gives, or a ValueError names
    `model.<field>` and what the family needs."""
    for field, value in want.items():
        got = cfg
        for part in field.split("."):
            got = getattr(got, part)
        if got != value:
            raise ValueError(f"export: model.{field}={got!r} has no {family} equivalent "
                             f"(needs {value!r})")


def attention_bias(cfg: ModelConfig, family: str) -> bool:
    """HF's one `attention_bias` (q, k, v and o together), or a ValueError where the
    model's biases differ."""
    a = cfg.attention
    if a.qkv_bias != a.out_bias:
        raise ValueError(f"export: {family}'s attention_bias covers q, k, v and o together; got "
                         f"model.attention.qkv_bias={a.qkv_bias}, "
                         f"model.attention.out_bias={a.out_bias}")
    return a.qkv_bias
