"""ModernBERT (Warner et al. 2024; `ModernBertForMaskedLM`): `tfjax.interop.hf.load`
gives an `HFEncoder` (`model(input_ids, attention_mask=...) -> MLM logits [B,T,V]`).

Pre-norm LayerNorms, HF's embedding norm as layer 0's `attn_norm`
(`model.first_norm_residual`), alternating local / global layers with one RoPE base
per kind, a GeGLU MLP, and the MLM head (its decoder tied to the token embedding as
`tie_word_embeddings` says). Only the MLM model loads: other heads and RoPE types
other than "default" are refused by name. See docs/interop.md.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tfjax.config import ModelConfig
from tfjax.interop.config_mapping import (check_types, common_fields, layer_types, need,
                                          read_activation, read_layer_pattern, require,
                                          unsupported)
from tfjax.interop.families import Family
from tfjax.interop.tensor_mapping import (Weights, head_weights, heads_out, linear_weights,
                                          norm_weights)

__all__ = ["FAMILY", "config", "to_hf", "weights"]

_INT, _NUM, _BOOL, _STR = (int,), (int, float), (bool,), (str,)
# ModernBERT's own config.json keys, type-checked before the mapping reads them.
_KEY_TYPES: dict[str, tuple[type, ...]] = {
    **dict.fromkeys(("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "intermediate_size", "max_position_embeddings", "local_attention",
                     "global_attn_every_n_layers"), _INT),
    "head_dim": _INT + (type(None),),
    **dict.fromkeys(("norm_eps", "global_rope_theta", "local_rope_theta"), _NUM),
    **dict.fromkeys(("norm_bias", "attention_bias", "mlp_bias", "decoder_bias",
                     "classifier_bias", "tie_word_embeddings"), _BOOL),
    **dict.fromkeys(("hidden_activation", "classifier_activation"), _STR),
    "layer_types": (list, type(None)),
    "architectures": (list, type(None)),
    **dict.fromkeys(("rope_parameters", "rope_scaling"), (dict, type(None))),
}
_ARCHITECTURES = ("ModernBertForMaskedLM",)
_DEFAULT_THETA = {"full_attention": 160_000.0, "sliding_attention": 10_000.0}  # HF's defaults
_OLD_THETA = {"full_attention": "global_rope_theta", "sliding_attention": "local_rope_theta"}
_ACTIVATIONS = {"geglu": "gelu", "geglu_tanh": "gelu_pytorch_tanh", "swiglu": "silu",
                "reglu": "relu"}  # ours -> HF hidden_activation (the inverse of read_activation)


def _rope_thetas(hf: dict) -> dict[str, float]:
    """The RoPE base of each HF layer type; any RoPE type but "default" is refused."""
    if hf.get("rope_scaling"):
        unsupported("rope_scaling", hf["rope_scaling"], "ModernBERT with default RoPE only")
    params = hf.get("rope_parameters") or {}
    extra = sorted(set(params) - set(_DEFAULT_THETA))
    if extra:
        unsupported(f"rope_parameters.{extra[0]}", params[extra[0]],
                    "ModernBERT's rope_parameters has full_attention and sliding_attention")
    thetas = {}
    for kind, default in _DEFAULT_THETA.items():
        p = params.get(kind) or {}
        if not isinstance(p, dict):
            raise ValueError(f"config.json: rope_parameters.{kind} must be a JSON object, "
                             f"got {p!r}")
        rope_type = p.get("rope_type", p.get("type", "default"))
        if rope_type != "default":
            unsupported(f"rope_parameters.{kind}.rope_type", rope_type, "supported: default")
        theta = p.get("rope_theta", hf.get(_OLD_THETA[kind], default))
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
            raise ValueError(f"config.json: rope_parameters.{kind}.rope_theta must be a positive "
                             f"number, got {theta!r}")
        thetas[kind] = float(theta)
    return thetas


def config(hf: dict) -> dict:
    check_types(hf, key_types=_KEY_TYPES)
    for arch in hf.get("architectures") or ():
        if arch not in _ARCHITECTURES:  # a bare ModernBertModel lacks the MLM head
            unsupported("architectures", hf["architectures"],
                        f"tfjax loads the MLM model: {', '.join(_ARCHITECTURES)}")
    require(hf, "classifier_activation", ("gelu",), "our MLM head uses exact GELU: 'gelu'")
    D, N, n = hf["hidden_size"], hf["num_attention_heads"], hf["num_hidden_layers"]
    if hf.get("head_dim") not in (None, D // N):
        unsupported("head_dim", hf["head_dim"], f"ModernBERT's head dim is hidden_size / "
                    f"num_attention_heads = {D // N}")
    types = hf.get("layer_types")
    if types is None:
        every = hf.get("global_attn_every_n_layers", 3)
        if every < 1:
            raise ValueError(f"config.json: global_attn_every_n_layers must be >= 1, got {every}")
        types = ["sliding_attention" if i % every else "full_attention" for i in range(n)]
    if len(types) != n:
        raise ValueError(f"config.json: layer_types has {len(types)} entries for "
                         f"num_hidden_layers={n}; give one per layer")
    half = hf.get("local_attention", 128) // 2  # |q - k| <= local_attention // 2
    if "sliding_attention" in types and half < 1:
        unsupported("local_attention", hf.get("local_attention"), "local layers need >= 2")
    # read_layer_pattern reads HF's causal convention (the window counts the query itself).
    pattern, window = read_layer_pattern(dict(layer_types=types, sliding_window=half + 1), n)
    thetas = _rope_thetas(hf)
    activation = read_activation(
        {"hidden_activation": hf.get("hidden_activation") or "gelu"}, "hidden_activation",
        gated=True)
    attn_bias = bool(hf.get("attention_bias", False))
    c: dict[str, Any] = dict(
        common_fields(hf), arch="encoder", d_model=D, num_layers=n, num_heads=N,
        d_ff=hf["intermediate_size"], max_len=hf.get("max_position_embeddings", 8192),
        position="rope", rope=dict(theta=thetas["full_attention"], fraction=1.0, layout="half"),
        norm="layernorm", norm_eps=float(hf.get("norm_eps", 1e-5)),
        norm_bias=bool(hf.get("norm_bias", False)), norm_placement="pre", final_norm=True,
        embed_norm=False, first_norm_residual=True, activation=activation,
        ffn_bias=bool(hf.get("mlp_bias", False)),
        attention=dict(qkv_bias=attn_bias, out_bias=attn_bias, sliding_window=window),
        type_vocab_size=0, num_classes=0, mlm_dense_bias=bool(hf.get("classifier_bias", False)),
        mlm_output_bias=bool(hf.get("decoder_bias", True)), layer_pattern=pattern)
    if "local" in pattern:
        c["attention"]["local_rope_theta"] = thetas["sliding_attention"]
    return c


def weights(w: Weights, cfg: ModelConfig, hf: dict) -> dict:
    N, H, D, F = cfg.num_heads, cfg.head_size, cfg.d_model, cfg.d_ff
    e = "model.embeddings."
    out = {("embed", "tokens", "embedding"): w[e + "tok_embeddings.weight"],
           **norm_weights(w, "model.final_norm", ("final_norm",), cfg)}
    for i in range(cfg.num_layers):
        p, L = f"model.layers.{i}.", ("layers", i)
        A = L + ("attn",)
        W = w[p + "attn.Wqkv.weight"].reshape(3, N, H, D)  # rows: q, k, v; each [N, H]
        for j, name in enumerate("qkv"):
            out[A + (name, "kernel")] = np.transpose(W[j], (2, 0, 1))  # [D, N, H]
        if cfg.attention.qkv_bias:
            b = w[p + "attn.Wqkv.bias"].reshape(3, N, H)
            out.update({A + (name, "bias"): b[j] for j, name in enumerate("qkv")})
        out[A + ("o", "kernel")] = heads_out(w[p + "attn.Wo.weight"], N, H)
        if cfg.attention.out_bias:
            out[A + ("o", "bias")] = w[p + "attn.Wo.bias"]
        # HF's layer 0 has no attn_norm: the embedding norm is ours (first_norm_residual)
        out.update(norm_weights(w, e + "norm" if i == 0 else p + "attn_norm",
                                L + ("attn_norm",), cfg))
        out.update(norm_weights(w, p + "mlp_norm", L + ("ffn_norm",), cfg))
        Wi = w[p + "mlp.Wi.weight"]  # [2F, D]: the activated half, then the gate
        out[L + ("ffn", "wi_gate", "kernel")], out[L + ("ffn", "wi_up", "kernel")] = (
            Wi[:F].T, Wi[F:].T)
        if cfg.ffn_bias:
            bi = w[p + "mlp.Wi.bias"]
            out[L + ("ffn", "wi_gate", "bias")], out[L + ("ffn", "wi_up", "bias")] = bi[:F], bi[F:]
        out.update(linear_weights(w, p + "mlp.Wo", L + ("ffn", "wo"), cfg.ffn_bias))
    out.update(linear_weights(w, "head.dense", ("mlm_dense",), cfg.mlm_dense_bias))
    out.update(norm_weights(w, "head.norm", ("mlm_norm",), cfg))
    if cfg.mlm_output_bias:
        out[("mlm_bias",)] = w["decoder.bias"]
    out.update(head_weights(w, "decoder.weight", cfg))  # tied: a saved copy is read and dropped
    return out


def _check_exportable(cfg: ModelConfig) -> None:
    need(cfg, "ModernBERT", **{
        "arch": "encoder", "norm": "layernorm", "norm_placement": "pre", "block": "sequential",
        "position": "rope", "embed_norm": False, "final_norm": True, "first_norm_residual": True,
        "attention.qk_norm": False, "attention.softcap": 0.0, "final_softcap": 0.0,
        "scale_embeddings": False, "logits_scale": 1.0, "ffn_pattern": ("dense",),
        "attention.sinks": False, "v_head_dim": 0, "type_vocab_size": 0, "num_classes": 0,
        "mup_base_width": 0, "attention.output_gate": False})
    if cfg.activation not in _ACTIVATIONS:
        raise ValueError(f"export: model.activation={cfg.activation!r}: ModernBERT's MLP is "
                         f"gated, one of {', '.join(_ACTIVATIONS)}")
    if cfg.attention.qkv_bias != cfg.attention.out_bias:
        raise ValueError("export: ModernBERT's attention_bias covers Wqkv and Wo together; "
                         f"got model.attention.qkv_bias={cfg.attention.qkv_bias}, "
                         f"model.attention.out_bias={cfg.attention.out_bias}")
    if cfg.kv_heads != cfg.num_heads or cfg.head_size * cfg.num_heads != cfg.d_model:
        raise ValueError("export: ModernBERT has num_heads * head_dim = d_model and no GQA; got "
                         f"{cfg.num_heads} heads, {cfg.kv_heads} kv heads, head_dim "
                         f"{cfg.head_size}, d_model {cfg.d_model}")
    r = cfg.rope
    if r.scaling != "none" or r.layout != "half" or r.fraction != 1.0:
        raise ValueError("export: ModernBERT uses rope.scaling='none', layout='half', "
                         f"fraction=1.0; got {r.scaling!r}, {r.layout!r}, {r.fraction}")
    kinds = set(cfg.layer_pattern)
    if not kinds <= {"global", "local"}:
        raise ValueError(f"export: model.layer_pattern={cfg.layer_pattern!r}: ModernBERT has "
                         "'global' and 'local' layers only")
    scale = cfg.attention.scale
    if scale and abs(scale - cfg.head_size ** -0.5) > 1e-12:
        raise ValueError(f"export: model.attention.scale={scale} is not 1/sqrt(head_dim)")


def to_hf(cfg: ModelConfig) -> dict:
    """The `config.json` of a ModernBERT-shaped tfjax encoder (`ModernBertForMaskedLM`);
    a config ModernBERT cannot express is a ValueError naming the field."""
    _check_exportable(cfg)
    types = layer_types(cfg)
    local_theta = cfg.attention.local_rope_theta or cfg.rope.theta
    return dict(
        architectures=list(_ARCHITECTURES), model_type="modernbert", vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model, intermediate_size=cfg.d_ff, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, hidden_activation=_ACTIVATIONS[cfg.activation],
        max_position_embeddings=cfg.max_len, norm_eps=cfg.norm_eps, norm_bias=cfg.norm_bias,
        attention_bias=cfg.attention.qkv_bias, mlp_bias=cfg.ffn_bias, layer_types=types,
        local_attention=2 * cfg.attention.sliding_window if "sliding_attention" in types else 128,
        rope_parameters=dict(
            full_attention=dict(rope_type="default", rope_theta=cfg.rope.theta),
            sliding_attention=dict(rope_type="default", rope_theta=local_theta)),
        classifier_bias=cfg.mlm_dense_bias, classifier_activation="gelu",
        decoder_bias=cfg.mlm_output_bias, tie_word_embeddings=cfg.tie_embeddings,
        dtype=cfg.param_dtype, attention_dropout=0.0, embedding_dropout=0.0, mlp_dropout=0.0,
        # token ids are the tokenizer's (export writes bos / eos / pad with one); HF's
        # defaults are ModernBERT's own vocabulary's
        pad_token_id=None, bos_token_id=None, eos_token_id=None, cls_token_id=None,
        sep_token_id=None)


FAMILY = Family(model_types=("modernbert",), config=config, weights=weights, to_hf=to_hf)
