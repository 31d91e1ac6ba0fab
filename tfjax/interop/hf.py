"""Hugging Face checkpoints in and out of tfjax, with logit parity.

    model, cfg = tfjax.interop.hf.load("path/to/checkpoint")       # config.json + *.safetensors
    logits = model(input_ids)                                       # causal LMs: [B, T, V]
    tfjax.interop.hf.export(model, "out/")                          # Llama family -> HF

`load` reads a local directory as `save_pretrained` writes it: `config.json` and
`model.safetensors` (or shards with `model.safetensors.index.json`), without torch
(`tfjax.interop.safetensors_io` memory-maps the files; bfloat16 comes out as an
`ml_dtypes` array). Each supported `model_type` (`FAMILIES`) has two functions:

- **config**: the HF config dict -> a `ModelConfig` dict. Every HF option that
  changes the computation is either mapped or refused with `NotImplementedError`
  naming it (e.g. `rope_parameters.rope_type='longrope'`); options that do not
  change inference (dropout, init ranges, cache flags) are ignored.
- **weights**: the checkpoint -> `{our parameter path: array}`, with per-layer
  paths `(stack, i, ...)`; HF `Linear` weights `[out, in]` become our `[in, ...]`
  kernels with explicit head axes (`q_proj [N*H, D] -> [D, N, H]`), fused QKV
  matrices are split by their per-family layout (NeoX / BLOOM `[N, 3, H]`,
  GPT-2 `[3, N, H]` Conv1D), Mixtral's experts are stacked over E. A checkpoint
  tensor left unread is an error (it means a feature we would silently drop).

The placement step then stacks layer `i` into the scanned cycles (`scan_layers`)
or the unrolled blocks, exactly as `LayerStack` lays them out, checks every
shape, casts to `dtype` and, with a `mesh`, puts each parameter on the mesh with
the sharding its logical axis names give (`tfjax.parallel.rules`).

Conventions that differ and are converted here (each is checked by a parity
test in tests/interop): HF's `sliding_window=w` lets a query see w keys including
itself, our `sliding_window` counts the keys before it (w - 1); HF's dynamic NTK
rope grows from `max_position_embeddings`; Gemma's `(1 + w)` RMSNorm weights load
as is into `rmsnorm_plus_one`; BLOOM's ALiBi `m * k` equals our `-m * |q - k|` up
to a per-query constant (softmax-invariant). RoPE: every supported family uses
the "half" (rotate_half) layout in its HF form, so no permutation is needed.
Loaded models are for inference: dropout is off.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tfjax.config import DEFAULT_RULES, ModelConfig, model_config
from tfjax.interop.safetensors_io import SafetensorsCheckpoint, save_file
from tfjax.models import EncoderModel, build
from tfjax.models.stack import cycle_length
from tfjax.registry import Registry

__all__ = ["FAMILIES", "HFEncoder", "config_from_hf", "export", "load", "load_state"]

_DTYPE_NAMES = ("float32", "bfloat16", "float16")


# --------------------------------------------------------------------------- #
# Config mapping.
# --------------------------------------------------------------------------- #


@dataclasses.dataclass(frozen=True)
class Family:
    config: Callable[[dict], dict]
    weights: Callable[["_Weights", ModelConfig, dict], dict]


FAMILIES: Registry[Family] = Registry("Hugging Face model_type")


def _unsupported(option: str, value: Any, hint: str = "") -> None:
    raise NotImplementedError(f"HF config {option}={value!r} is not supported by "
                              f"tfjax.interop.hf{': ' + hint if hint else ''}")


def _require(hf: dict, key: str, allowed, hint: str = "") -> None:
    value = hf.get(key)
    if value is not None and value not in allowed:
        _unsupported(key, value, hint or f"supported: {allowed}")


_GATED = {"silu": "swiglu", "swish": "swiglu", "gelu": "geglu", "gelu_new": "geglu_tanh",
          "gelu_pytorch_tanh": "geglu_tanh", "relu": "reglu"}
_PLAIN = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
          "relu": "relu", "silu": "silu", "swish": "silu"}


def _activation(hf: dict, key: str, gated: bool) -> str:
    name = hf.get(key) or ("silu" if gated else "gelu")
    table = _GATED if gated else _PLAIN
    if name not in table:
        _unsupported(key, name, f"supported: {sorted(table)}")
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
        if p.get("truncate", True) is False:
            _unsupported("rope_parameters.truncate", False, "yarn with truncate=True only")

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
                    _unsupported("rope_parameters.attention_factor", attn, "needs factor > 1")
            else:  # our temperature is 0.1 * mscale * ln(s) + 1
                mscale = (attn - 1.0) / (0.1 * math.log(factor))
        out.update(scaling="yarn", factor=factor, original_max_len=orig, mscale=mscale,
                   beta_fast=float(p.get("beta_fast") or 32.0),
                   beta_slow=float(p.get("beta_slow") or 1.0))
    else:
        _unsupported("rope_parameters.rope_type", kind,
                     "supported: default, linear, dynamic, yarn, llama3")
    return out


def _layer_pattern(hf: dict, num_layers: int) -> dict:
    """HF `layer_types` / `sliding_window` -> our layer_pattern and sliding_window."""
    window = hf.get("sliding_window")
    types = hf.get("layer_types")
    if types is None:
        local = bool(window) and hf.get("use_sliding_window", True)
        types = ["sliding_attention" if local else "full_attention"] * num_layers
    names = {"full_attention": "global", "sliding_attention": "local"}
    for t in types:
        if t not in names:
            _unsupported("layer_types", t, f"supported: {sorted(names)}")
    kinds = [names[t] for t in types]
    period = next(p for p in range(1, len(kinds) + 1)
                  if all(kinds[i] == kinds[i % p] for i in range(len(kinds))))
    out: dict[str, Any] = dict(layer_pattern=tuple(kinds[:period]))
    if "local" in kinds:
        if not window or window < 1:
            _unsupported("sliding_window", window, "sliding layers need a window >= 1")
        out["sliding_window"] = int(window) - 1  # HF's window includes the query itself
    return out


def _common(hf: dict) -> dict:
    return dict(vocab_size=hf["vocab_size"], tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
                dropout_rate=0.0, scan_layers=True)


def _llama_config(hf: dict) -> dict:
    n = hf["num_hidden_layers"]
    D, N = hf["hidden_size"], hf["num_attention_heads"]
    bias = bool(hf.get("attention_bias", False))
    c = dict(_common(hf), arch="decoder", d_model=D, num_layers=n, num_heads=N,
             num_kv_heads=hf.get("num_key_value_heads") or N, head_dim=hf.get("head_dim") or D // N,
             d_ff=hf["intermediate_size"], max_len=hf.get("max_position_embeddings", 2048),
             activation=_activation(hf, "hidden_act", gated=True),
             ffn_bias=bool(hf.get("mlp_bias", False)), qkv_bias=bias, out_bias=bias,
             position="rope", rope=_rope(hf), norm="rmsnorm", norm_eps=hf.get("rms_norm_eps", 1e-6),
             norm_placement="pre")
    c.update(_layer_pattern(hf, n))
    return c


def _mixtral_config(hf: dict) -> dict:
    c = _llama_config(hf)
    c.update(ffn_pattern=("moe",), num_experts=hf["num_local_experts"],
             experts_per_token=hf["num_experts_per_tok"], router_renormalize=True,
             capacity_factor=0.0, moe_aux_loss_weight=float(hf.get("router_aux_loss_coef", 0.01)))
    return c


def _qwen3_config(hf: dict) -> dict:
    c = _llama_config(hf)
    c.update(qk_norm=True)  # RMSNorm of q and k over the head dim, before RoPE
    return c


def _gemma2_config(hf: dict) -> dict:
    if hf.get("use_bidirectional_attention"):
        _unsupported("use_bidirectional_attention", True, "causal Gemma 2 only")
    c = _llama_config(hf)
    c.update(norm="rmsnorm_plus_one", norm_placement="sandwich", scale_embeddings=True,
             activation=_activation(hf, "hidden_activation", gated=True),
             attn_scale=float(hf.get("query_pre_attn_scalar", c["head_dim"])) ** -0.5,
             attn_softcap=float(hf.get("attn_logit_softcapping") or 0.0),
             final_softcap=float(hf.get("final_logit_softcapping") or 0.0))
    return c


def _gpt2_config(hf: dict) -> dict:
    for key in ("scale_attn_by_inverse_layer_idx", "add_cross_attention"):
        if hf.get(key):
            _unsupported(key, hf[key])
    D = hf["n_embd"]
    return dict(_common(hf), arch="decoder", d_model=D, num_layers=hf["n_layer"],
                num_heads=hf["n_head"], d_ff=hf.get("n_inner") or 4 * D, max_len=hf["n_positions"],
                position="learned", norm="layernorm", norm_eps=hf.get("layer_norm_epsilon", 1e-5),
                activation=_activation(hf, "activation_function", gated=False), ffn_bias=True,
                qkv_bias=True, out_bias=True, attn_scale=0.0 if hf.get("scale_attn_weights", True)
                else 1.0)


def _neox_config(hf: dict) -> dict:
    bias = bool(hf.get("attention_bias", True))
    D, N = hf["hidden_size"], hf["num_attention_heads"]
    parallel = bool(hf.get("use_parallel_residual", True))
    return dict(_common(hf), arch="decoder", d_model=D, num_layers=hf["num_hidden_layers"],
                num_heads=N, d_ff=hf["intermediate_size"],
                max_len=hf.get("max_position_embeddings", 2048), position="rope", rope=_rope(hf),
                norm="layernorm", norm_eps=hf.get("layer_norm_eps", 1e-5),
                block="parallel" if parallel else "sequential", parallel_shared_norm=False,
                activation=_activation(hf, "hidden_act", gated=False), ffn_bias=True,
                qkv_bias=bias, out_bias=bias)


def _bloom_config(hf: dict) -> dict:
    if hf.get("apply_residual_connection_post_layernorm"):
        _unsupported("apply_residual_connection_post_layernorm", True)
    D = hf["hidden_size"]
    return dict(_common(hf), arch="decoder", d_model=D, num_layers=hf["n_layer"],
                num_heads=hf["n_head"], d_ff=4 * D, max_len=2048, position="alibi",
                norm="layernorm", norm_eps=hf.get("layer_norm_epsilon", 1e-5), embed_norm=True,
                activation="gelu_tanh", ffn_bias=True, qkv_bias=True, out_bias=True)


def _bert_config(hf: dict) -> dict:
    _require(hf, "position_embedding_type", ("absolute",))
    if hf.get("is_decoder") or hf.get("add_cross_attention"):
        _unsupported("is_decoder", True, "BERT as an encoder only")
    if hf.get("hidden_act", "gelu") != "gelu":  # our MLM head uses exact GELU
        _unsupported("hidden_act", hf["hidden_act"], "supported: 'gelu'")
    return dict(_common(hf), arch="encoder", d_model=hf["hidden_size"],
                num_layers=hf["num_hidden_layers"], num_heads=hf["num_attention_heads"],
                d_ff=hf["intermediate_size"], max_len=hf["max_position_embeddings"],
                position="learned", type_vocab_size=hf.get("type_vocab_size", 2), num_classes=0,
                norm="layernorm", norm_eps=hf.get("layer_norm_eps", 1e-12), norm_placement="post",
                final_norm=False, embed_norm=True, activation="gelu", ffn_bias=True, qkv_bias=True,
                out_bias=True)


def _t5_config(hf: dict) -> dict:
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
                t5_num_buckets=hf.get("relative_attention_num_buckets", 32),
                t5_max_distance=hf.get("relative_attention_max_distance", 128),
                norm="rmsnorm", norm_eps=hf.get("layer_norm_epsilon", 1e-6), norm_placement="pre",
                activation=activation, ffn_bias=False, qkv_bias=False, out_bias=False,
                attn_scale=1.0, logits_scale=D ** -0.5 if scale_out else 1.0)


def _mamba_config(hf: dict) -> dict:
    _require(hf, "hidden_act", ("silu",))
    D, Di = hf["hidden_size"], hf["intermediate_size"]
    if Di % D:
        _unsupported("intermediate_size", Di, f"must be a multiple of hidden_size={D} (expand)")
    rank = hf.get("time_step_rank", "auto")
    return dict(_common(hf), arch="decoder", d_model=D, num_layers=hf["num_hidden_layers"],
                num_heads=1, d_ff=Di, position="none", norm="rmsnorm",
                norm_eps=hf.get("layer_norm_epsilon", 1e-5), layer_pattern=("mamba",),
                ffn_pattern=("none",), ssm_d_state=hf["state_size"], ssm_d_conv=hf["conv_kernel"],
                ssm_expand=Di // D, ssm_dt_rank=0 if rank == "auto" else int(rank),
                ssm_conv_bias=bool(hf.get("use_conv_bias", True)),
                ssm_proj_bias=bool(hf.get("use_bias", False)), ssm_chunk=0)


# --------------------------------------------------------------------------- #
# Weight mapping.
# --------------------------------------------------------------------------- #


class _Weights:
    """The checkpoint's tensors; remembers which were read so leftovers are an error."""

    def __init__(self, ckpt, prefix_aliases: tuple[str, ...] = ()):
        self.ckpt = ckpt
        self.used: set[str] = set()
        self.aliases = prefix_aliases

    def _key(self, name: str) -> str:
        if name in self.ckpt:
            return name
        for a in self.aliases:  # e.g. a bare `LlamaModel` checkpoint without "model."
            if name.startswith(a) and name[len(a):] in self.ckpt:
                return name[len(a):]
        raise ValueError(f"checkpoint has no tensor {name!r} (has e.g. "
                         f"{', '.join(sorted(self.ckpt)[:5])})")

    def __contains__(self, name: str) -> bool:
        try:
            self._key(name)
            return True
        except ValueError:
            return False

    def __getitem__(self, name: str) -> np.ndarray:
        key = self._key(name)
        self.used.add(key)
        return self.ckpt[key]

    def ignore(self, *names: str) -> None:
        for n in names:
            if n in self:
                self.used.add(self._key(n))

    def leftovers(self) -> list[str]:
        return sorted(set(self.ckpt) - self.used)


def _heads_in(w: np.ndarray, heads: int, H: int) -> np.ndarray:
    """HF Linear `[heads*H, D]` -> our `[D, heads, H]`."""
    return w.T.reshape(w.shape[1], heads, H)


def _heads_out(w: np.ndarray, heads: int, H: int) -> np.ndarray:
    """HF Linear `[D, heads*H]` -> our `[heads, H, D]`."""
    return w.T.reshape(heads, H, w.shape[0])


def _attention(w, p: str, L: tuple, cfg: ModelConfig,
               names=("q_proj", "k_proj", "v_proj", "o_proj")) -> dict:
    """Separate q/k/v/o Linears `p + name` (a name starting with "/" is a full name)."""
    N, K, H = cfg.num_heads, cfg.kv_heads, cfg.head_size
    full = [n[1:] if n.startswith("/") else p + n for n in names]
    out = {}
    for ours, theirs, heads in zip("qkv", full[:3], (N, K, K)):
        out[L + (ours, "kernel")] = _heads_in(w[f"{theirs}.weight"], heads, H)
        if cfg.qkv_bias:
            out[L + (ours, "bias")] = w[f"{theirs}.bias"].reshape(heads, H)
    out[L + ("o", "kernel")] = _heads_out(w[f"{full[3]}.weight"], N, H)
    if cfg.out_bias:
        out[L + ("o", "bias")] = w[f"{full[3]}.bias"]
    return out


def _linear(w, name: str, L: tuple, bias: bool) -> dict:
    out = {L + ("kernel",): w[f"{name}.weight"].T}
    if bias:
        out[L + ("bias",)] = w[f"{name}.bias"]
    return out


def _norm(w, name: str, L: tuple, cfg: ModelConfig) -> dict:
    out = {L + ("scale",): w[f"{name}.weight"]}
    if cfg.norm == "layernorm" and cfg.norm_bias:
        out[L + ("bias",)] = w[f"{name}.bias"]
    return out


def _llama_weights(w: _Weights, cfg: ModelConfig, hf: dict) -> dict:
    out = {("embed", "tokens", "embedding"): w["model.embed_tokens.weight"],
           **_norm(w, "model.norm", ("final_norm",), cfg)}
    if cfg.tie_embeddings:
        w.ignore("lm_head.weight")
    else:
        out[("embed", "head", "kernel")] = w["lm_head.weight"].T
    sandwich = cfg.norm_placement == "sandwich"
    for i in range(cfg.num_layers):
        p, L = f"model.layers.{i}.", ("layers", i)
        out.update(_attention(w, p + "self_attn.", L + ("attn",), cfg))
        if cfg.qk_norm:
            out.update(_norm(w, p + "self_attn.q_norm", L + ("attn", "q_norm"), cfg))
            out.update(_norm(w, p + "self_attn.k_norm", L + ("attn", "k_norm"), cfg))
        out.update(_norm(w, p + "input_layernorm", L + ("attn_norm",), cfg))
        if sandwich:  # Gemma 2
            out.update(_norm(w, p + "post_attention_layernorm", L + ("post_attn_norm",), cfg))
            out.update(_norm(w, p + "pre_feedforward_layernorm", L + ("ffn_norm",), cfg))
            out.update(_norm(w, p + "post_feedforward_layernorm", L + ("post_ffn_norm",), cfg))
        else:
            out.update(_norm(w, p + "post_attention_layernorm", L + ("ffn_norm",), cfg))
        if cfg.ffn_kind(i) == "moe":
            out.update(_mixtral_experts(w, p + "block_sparse_moe.", L + ("ffn",), cfg))
        else:
            for ours, theirs in (("wi_gate", "gate_proj"), ("wi_up", "up_proj"), ("wo", "down_proj")):
                out.update(_linear(w, p + "mlp." + theirs, L + ("ffn", ours), cfg.ffn_bias))
    return out


def _mixtral_experts(w: _Weights, p: str, L: tuple, cfg: ModelConfig) -> dict:
    E = cfg.num_experts
    out = {L + ("router",): w[p + "gate.weight"].T}  # [E, D] -> [D, E]
    # The per-expert layout save_pretrained writes: w1 gate, w3 up, w2 down, each [out, in].
    for ours, theirs in (("wi_gate", "w1"), ("wi_up", "w3"), ("wo", "w2")):
        out[L + (ours,)] = np.stack([w[f"{p}experts.{e}.{theirs}.weight"].T for e in range(E)])
    return out


def _fused_qkv(w, p: str, L: tuple, cfg: ModelConfig) -> dict:
    """NeoX / BLOOM `query_key_value` `[N*3*H, D]`: per head, q then k then v."""
    N, H = cfg.num_heads, cfg.head_size
    W = w[p + "query_key_value.weight"]
    W = W.reshape(N, 3, H, W.shape[-1])
    out = {L + (n, "kernel"): np.transpose(W[:, j], (2, 0, 1)) for j, n in enumerate("qkv")}
    if cfg.qkv_bias:
        b = w[p + "query_key_value.bias"].reshape(N, 3, H)
        out.update({L + (n, "bias"): b[:, j] for j, n in enumerate("qkv")})
    out[L + ("o", "kernel")] = _heads_out(w[p + "dense.weight"], N, H)
    if cfg.out_bias:
        out[L + ("o", "bias")] = w[p + "dense.bias"]
    return out


def _neox_weights(w: _Weights, cfg: ModelConfig, hf: dict) -> dict:
    out = {("embed", "tokens", "embedding"): w["gpt_neox.embed_in.weight"],
           **_norm(w, "gpt_neox.final_layer_norm", ("final_norm",), cfg)}
    if cfg.tie_embeddings:
        w.ignore("embed_out.weight")
    else:
        out[("embed", "head", "kernel")] = w["embed_out.weight"].T
    for i in range(cfg.num_layers):
        p, L = f"gpt_neox.layers.{i}.", ("layers", i)
        out.update(_fused_qkv(w, p + "attention.", L + ("attn",), cfg))
        out.update(_norm(w, p + "input_layernorm", L + ("attn_norm",), cfg))
        out.update(_norm(w, p + "post_attention_layernorm", L + ("ffn_norm",), cfg))
        out.update(_linear(w, p + "mlp.dense_h_to_4h", L + ("ffn", "wi"), True))
        out.update(_linear(w, p + "mlp.dense_4h_to_h", L + ("ffn", "wo"), True))
        w.ignore(p + "attention.bias", p + "attention.masked_bias", p + "attention.rotary_emb.inv_freq")
    return out


def _bloom_weights(w: _Weights, cfg: ModelConfig, hf: dict) -> dict:
    out = {("embed", "tokens", "embedding"): w["transformer.word_embeddings.weight"],
           **_norm(w, "transformer.word_embeddings_layernorm", ("embed", "norm"), cfg),
           **_norm(w, "transformer.ln_f", ("final_norm",), cfg)}
    if cfg.tie_embeddings:
        w.ignore("lm_head.weight")
    else:
        out[("embed", "head", "kernel")] = w["lm_head.weight"].T
    for i in range(cfg.num_layers):
        p, L = f"transformer.h.{i}.", ("layers", i)
        out.update(_fused_qkv(w, p + "self_attention.", L + ("attn",), cfg))
        out.update(_norm(w, p + "input_layernorm", L + ("attn_norm",), cfg))
        out.update(_norm(w, p + "post_attention_layernorm", L + ("ffn_norm",), cfg))
        out.update(_linear(w, p + "mlp.dense_h_to_4h", L + ("ffn", "wi"), True))
        out.update(_linear(w, p + "mlp.dense_4h_to_h", L + ("ffn", "wo"), True))
    return out


def _gpt2_weights(w: _Weights, cfg: ModelConfig, hf: dict) -> dict:
    N, H, D = cfg.num_heads, cfg.head_size, cfg.d_model
    out = {("embed", "tokens", "embedding"): w["transformer.wte.weight"],
           ("embed", "positions", "embedding"): w["transformer.wpe.weight"],
           **_norm(w, "transformer.ln_f", ("final_norm",), cfg)}
    if cfg.tie_embeddings:
        w.ignore("lm_head.weight")
    else:
        out[("embed", "head", "kernel")] = w["lm_head.weight"].T
    for i in range(cfg.num_layers):
        p, L = f"transformer.h.{i}.", ("layers", i)
        A = L + ("attn",)
        W = w[p + "attn.c_attn.weight"].reshape(D, 3, N, H)  # Conv1D: [in, out], out = [3, N, H]
        b = w[p + "attn.c_attn.bias"].reshape(3, N, H)
        for j, n in enumerate("qkv"):
            out[A + (n, "kernel")], out[A + (n, "bias")] = W[:, j], b[j]
        out[A + ("o", "kernel")] = w[p + "attn.c_proj.weight"].reshape(N, H, D)
        out[A + ("o", "bias")] = w[p + "attn.c_proj.bias"]
        out.update(_norm(w, p + "ln_1", L + ("attn_norm",), cfg))
        out.update(_norm(w, p + "ln_2", L + ("ffn_norm",), cfg))
        for ours, theirs in (("wi", "c_fc"), ("wo", "c_proj")):  # Conv1D: no transpose
            out[L + ("ffn", ours, "kernel")] = w[f"{p}mlp.{theirs}.weight"]
            out[L + ("ffn", ours, "bias")] = w[f"{p}mlp.{theirs}.bias"]
        w.ignore(p + "attn.bias", p + "attn.masked_bias")
    return out


def _bert_weights(w: _Weights, cfg: ModelConfig, hf: dict) -> dict:
    e = "bert.embeddings."
    out = {("embed", "tokens", "embedding"): w[e + "word_embeddings.weight"],
           ("embed", "positions", "embedding"): w[e + "position_embeddings.weight"],
           ("embed", "token_types", "embedding"): w[e + "token_type_embeddings.weight"],
           **_norm(w, e + "LayerNorm", ("embed", "norm"), cfg)}
    w.ignore(e + "position_ids", e + "token_type_ids")
    for i in range(cfg.num_layers):
        p, L = f"bert.encoder.layer.{i}.", ("layers", i)
        out.update(_attention(w, p + "attention.self.", L + ("attn",), cfg,
                              names=("query", "key", "value", f"/{p}attention.output.dense")))
        out.update(_norm(w, p + "attention.output.LayerNorm", L + ("attn_norm",), cfg))
        out.update(_linear(w, p + "intermediate.dense", L + ("ffn", "wi"), True))
        out.update(_linear(w, p + "output.dense", L + ("ffn", "wo"), True))
        out.update(_norm(w, p + "output.LayerNorm", L + ("ffn_norm",), cfg))
    c = "cls.predictions."
    out.update(_linear(w, c + "transform.dense", ("mlm_dense",), True))
    out.update(_norm(w, c + "transform.LayerNorm", ("mlm_norm",), cfg))
    out[("mlm_bias",)] = w[c + "bias"]
    if cfg.tie_embeddings:
        w.ignore(c + "decoder.weight", c + "decoder.bias")
    else:
        out[("embed", "head", "kernel")] = w[c + "decoder.weight"].T
        w.ignore(c + "decoder.bias")
    if "bert.pooler.dense.weight" in w:
        out.update(_linear(w, "bert.pooler.dense", ("pooler",), True))
    w.ignore("cls.seq_relationship.weight", "cls.seq_relationship.bias")  # NSP head
    return out


def _t5_weights(w: _Weights, cfg: ModelConfig, hf: dict) -> dict:
    out = {("embed", "tokens", "embedding"): w["shared.weight"]}
    w.ignore("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
    if cfg.tie_embeddings:
        w.ignore("lm_head.weight")
    else:
        out[("embed", "head", "kernel")] = w["lm_head.weight"].T
    qkvo = ("q", "k", "v", "o")

    def ffn(p, L):
        if cfg.activation in ("relu", "gelu", "gelu_tanh", "silu"):
            pairs = (("wi", "wi"), ("wo", "wo"))
        else:
            pairs = (("wi_gate", "wi_0"), ("wi_up", "wi_1"), ("wo", "wo"))
        return {k: v for ours, theirs in pairs
                for k, v in _linear(w, f"{p}.DenseReluDense.{theirs}", L + ("ffn", ours), False).items()}

    for stack, n in (("encoder", cfg.encoder_layers), ("decoder", cfg.num_layers)):
        out[(f"{stack}_rel_bias", "embedding")] = w[
            f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"]
        out.update(_norm(w, f"{stack}.final_layer_norm", (f"{stack}_norm",), cfg))
        for i in range(n):
            p, L = f"{stack}.block.{i}.layer.", (stack, i)
            out.update(_attention(w, p + "0.SelfAttention.", L + ("attn",), cfg, names=qkvo))
            out.update(_norm(w, p + "0.layer_norm", L + ("attn_norm",), cfg))
            f = 1
            if stack == "decoder":
                out.update(_attention(w, p + "1.EncDecAttention.", L + ("cross_attn",), cfg,
                                      names=qkvo))
                out.update(_norm(w, p + "1.layer_norm", L + ("cross_norm",), cfg))
                f = 2
            out.update(ffn(f"{p}{f}", L))
            out.update(_norm(w, f"{p}{f}.layer_norm", L + ("ffn_norm",), cfg))
    return out


def _mamba_weights(w: _Weights, cfg: ModelConfig, hf: dict) -> dict:
    D, Di = cfg.d_model, cfg.ssm_expand * cfg.d_model
    out = {("embed", "tokens", "embedding"): w["backbone.embeddings.weight"],
           **_norm(w, "backbone.norm_f", ("final_norm",), cfg)}
    if cfg.tie_embeddings:
        w.ignore("lm_head.weight")
    else:
        out[("embed", "head", "kernel")] = w["lm_head.weight"].T
    for i in range(cfg.num_layers):
        p, L = f"backbone.layers.{i}.", ("layers", i)
        M = L + ("attn",)  # the mixer sits where attention does
        out.update(_norm(w, p + "norm", L + ("attn_norm",), cfg))
        m = p + "mixer."
        out[M + ("in_proj",)] = w[m + "in_proj.weight"].T.reshape(D, 2, Di)  # rows: x then z
        if cfg.ssm_proj_bias:
            out[M + ("in_bias",)] = w[m + "in_proj.bias"].reshape(2, Di)
            out[M + ("out_bias",)] = w[m + "out_proj.bias"]
        out[M + ("conv_w",)] = w[m + "conv1d.weight"][:, 0, :].T  # [Di, 1, K] -> [K, Di]
        if cfg.ssm_conv_bias:
            out[M + ("conv_b",)] = w[m + "conv1d.bias"]
        out[M + ("x_proj",)] = w[m + "x_proj.weight"].T  # [R + 2N, Di] -> [Di, R + 2N]
        out[M + ("dt_proj",)] = w[m + "dt_proj.weight"].T  # [Di, R] -> [R, Di]
        out[M + ("dt_bias",)] = w[m + "dt_proj.bias"]
        out[M + ("A_log",)] = w[m + "A_log"]
        out[M + ("D",)] = w[m + "D"]
        out[M + ("out_proj",)] = w[m + "out_proj.weight"].T
    return out


for _names, _fam in (
        (("llama", "mistral"), Family(_llama_config, _llama_weights)),
        (("qwen3",), Family(_qwen3_config, _llama_weights)),
        (("mixtral",), Family(_mixtral_config, _llama_weights)),
        (("gemma2",), Family(_gemma2_config, _llama_weights)),
        (("gpt2",), Family(_gpt2_config, _gpt2_weights)),
        (("gpt_neox",), Family(_neox_config, _neox_weights)),
        (("bloom",), Family(_bloom_config, _bloom_weights)),
        (("bert",), Family(_bert_config, _bert_weights)),
        (("t5",), Family(_t5_config, _t5_weights)),
        (("mamba",), Family(_mamba_config, _mamba_weights))):
    for _n in _names:
        FAMILIES.register(_n, _fam)

_PREFIXES = {"llama": "model.", "mistral": "model.", "qwen3": "model.", "mixtral": "model.",
             "gemma2": "model.", "gpt2": "transformer.", "gpt_neox": "gpt_neox.",
             "bloom": "transformer.", "bert": "bert.", "mamba": "backbone."}


# --------------------------------------------------------------------------- #
# Placement: per-layer arrays -> the (scanned) parameter tree.
# --------------------------------------------------------------------------- #


def _stacks(cfg: ModelConfig) -> dict[str, int]:
    if cfg.arch == "encoder_decoder":
        return {"encoder": cfg.encoder_layers, "decoder": cfg.num_layers}
    return {"layers": cfg.num_layers}


def _target(cfg: ModelConfig, key: tuple) -> tuple[tuple, int | None]:
    """Our per-layer key `(stack, i, ...)` -> (state path, index in the scanned stack)."""
    stacks = _stacks(cfg)
    if key[0] not in stacks or not isinstance(key[1], int):
        return key, None
    stack, i, *rest = key
    P = cycle_length(cfg)
    n_cycles = stacks[stack] // P if cfg.scan_layers else 0
    if i < n_cycles * P:
        return (stack, "cycles", "layers", i % P, *rest), i // P
    return (stack, "blocks", i - n_cycles * P, *rest), None


def _abstract(cfg: ModelConfig):
    with nnx.use_eager_sharding(False):
        return nnx.eval_shape(lambda: build(cfg, rngs=nnx.Rngs(0)))


def load_state(arrays: dict, cfg: ModelConfig, *, mesh=None, rules=DEFAULT_RULES,
               allow_missing: tuple[tuple, ...] = ()) -> nnx.Module:
    """Build the model of `cfg` with its parameters from `arrays` (`{our key: array}`,
    per-layer keys `(stack, i, ...)`), cast to `cfg.param_dtype`, on `mesh` if given.
    Every parameter must be given (except paths in `allow_missing`, left at init)."""
    from tfjax.parallel.rules import logical_rules, spec_for, variable_axes

    abstract = _abstract(cfg)
    graphdef, state = nnx.split(abstract)
    flat = dict(nnx.to_flat_state(state))
    values: dict[tuple, Any] = {}
    for key, arr in arrays.items():
        path, idx = _target(cfg, key)
        if path not in flat:
            raise ValueError(f"{key}: no such parameter {path} in the tfjax model")
        shape = flat[path].get_value().shape
        if idx is None:
            values[path] = arr
            want = shape
        else:
            values.setdefault(path, [None] * shape[0])[idx] = arr
            want = shape[1:]
        if tuple(arr.shape) != tuple(want):
            raise ValueError(f"{key}: checkpoint shape {tuple(arr.shape)} != tfjax {tuple(want)}")
    lrules = logical_rules(rules) if mesh is not None else None
    out = []
    for path, var in flat.items():
        aval = var.get_value()
        if path in values:
            v = values[path]
            if isinstance(v, list):
                if any(a is None for a in v):
                    raise ValueError(f"{path}: layers missing from the checkpoint")
                v = np.stack([np.asarray(a) for a in v])
            v = np.asarray(v).astype(aval.dtype)
        elif isinstance(var, nnx.Param) and not any(path[:len(m)] == m for m in allow_missing):
            raise ValueError(f"parameter {'.'.join(map(str, path))} not found in the checkpoint")
        elif isinstance(var, nnx.Param):
            v = np.asarray(jax.random.normal(jax.random.key(0), aval.shape, jnp.float32) * 0.02,
                           aval.dtype)
        else:  # bookkeeping state (MoE statistics): zeros
            v = np.zeros(aval.shape, aval.dtype)
        if mesh is None:
            v = jnp.asarray(v)
        else:
            names = variable_axes(var)
            spec = (spec_for(".".join(map(str, path)), names, v.shape, mesh, lrules)
                    if names and len(names) == v.ndim else jax.sharding.PartitionSpec())
            v = jax.device_put(v, jax.sharding.NamedSharding(mesh, spec))
        out.append((path, var.replace(v)))
    model = nnx.merge(graphdef, nnx.from_flat_state(out))
    model.eval()
    return model


# --------------------------------------------------------------------------- #
# Public entry points.
# --------------------------------------------------------------------------- #


class HFEncoder(nnx.Module):
    """A BERT checkpoint called as transformers calls it:
    `model(input_ids, token_type_ids=None, attention_mask=None) -> MLM logits [B,T,V]`,
    `model.pooled_output(...) -> [B, D]` (when the checkpoint has the pooler)."""

    def __init__(self, model: EncoderModel, has_pooler: bool):
        self.model = model
        self.config = model.config
        self.has_pooler = has_pooler

    def __call__(self, input_ids, token_type_ids=None, attention_mask=None):
        return self.model(input_ids, token_type_ids, attention_mask)

    def encode(self, input_ids, token_type_ids=None, attention_mask=None):
        return self.model.encode(input_ids, token_type_ids, attention_mask)

    def pooled_output(self, input_ids, token_type_ids=None, attention_mask=None):
        if not self.has_pooler:
            raise ValueError("this checkpoint has no pooler (bert.pooler.dense); save it from "
                             "BertModel / BertForPreTraining to get pooled outputs")
        return self.model.pool(self.encode(input_ids, token_type_ids, attention_mask))


def _read_config(path: str) -> dict:
    file = os.path.join(path, "config.json")
    if not os.path.isdir(path) or not os.path.exists(file):
        raise ValueError(f"path: {path!r} is not a checkpoint directory with config.json "
                         "(as transformers' save_pretrained writes)")
    with open(file) as f:
        return json.load(f)


def config_from_hf(hf: dict, *, dtype: str | None = None) -> ModelConfig:
    """The tfjax `ModelConfig` of an HF config dict (unsupported options raise)."""
    model_type = hf.get("model_type")
    family = FAMILIES.get(model_type, field="config.json model_type")
    c = family.config(hf)
    name = dtype or hf.get("dtype") or hf.get("torch_dtype") or "float32"
    try:
        name = str(jnp.dtype(name))
    except TypeError:
        pass
    if name not in _DTYPE_NAMES:
        raise ValueError(f"dtype: {name!r} is not a model dtype; use float32, bfloat16 or float16")
    c.update(dtype=name, param_dtype=name)
    return model_config(c)


def load(path: str, *, dtype: str | None = None, mesh=None, rules=DEFAULT_RULES):
    """`(model, config)` from a local HF checkpoint directory.

    dtype: compute and parameter dtype (default: the checkpoint's `dtype`).
    mesh: a `jax.sharding.Mesh`; each parameter is placed with the sharding its
      logical axes give under `rules` (default `tfjax.config.DEFAULT_RULES`).
    Causal LMs come back as `DecoderLM` (`model(input_ids) -> logits [B,T,V]`, usable
    with `tfjax.inference.generate`); BERT as `HFEncoder`; T5 as `EncoderDecoderModel`
    (`model(input_ids, decoder_input_ids) -> logits`).
    """
    hf = _read_config(path)
    cfg = config_from_hf(hf, dtype=dtype)
    family = FAMILIES.get(hf["model_type"], field="config.json model_type")
    prefix = _PREFIXES.get(hf["model_type"])
    w = _Weights(SafetensorsCheckpoint(path), (prefix,) if prefix else ())
    arrays = family.weights(w, cfg, hf)
    left = w.leftovers()
    if left:
        raise NotImplementedError(
            f"{path}: checkpoint tensors not used by the {hf['model_type']} mapping (a feature "
            f"tfjax.interop.hf does not support?): {', '.join(left[:8])}"
            f"{' ...' if len(left) > 8 else ''}")
    if hf["model_type"] == "bert":
        has_pooler = ("pooler", "kernel") in arrays
        model = load_state(arrays, cfg, mesh=mesh, rules=rules,
                           allow_missing=() if has_pooler else (("pooler",),))
        return HFEncoder(model, has_pooler), cfg
    return load_state(arrays, cfg, mesh=mesh, rules=rules), cfg


# --------------------------------------------------------------------------- #
# Export (Llama family).
# --------------------------------------------------------------------------- #


def _check_llama_exportable(cfg: ModelConfig) -> None:
    want = dict(arch="decoder", norm="rmsnorm", norm_placement="pre", block="sequential",
                position="rope", activation="swiglu", qk_norm=False, attn_softcap=0.0,
                final_softcap=0.0, scale_embeddings=False, embed_norm=False, logits_scale=1.0,
                layer_pattern=("global",), ffn_pattern=("dense",), prefix_lm=False)
    for field, value in want.items():
        if getattr(cfg, field) != value:
            raise ValueError(f"export: model.{field}={getattr(cfg, field)!r} has no Llama "
                             f"equivalent (needs {value!r})")
    if cfg.qkv_bias != cfg.out_bias:
        raise ValueError("export: Llama's attention_bias covers q, k, v and o together; "
                         f"got qkv_bias={cfg.qkv_bias}, out_bias={cfg.out_bias}")
    if cfg.rope.layout != "half" or cfg.rope.fraction != 1.0:
        raise ValueError("export: Llama uses rope.layout='half' and rope.fraction=1.0")
    if cfg.attn_scale and abs(cfg.attn_scale - cfg.head_size ** -0.5) > 1e-12:
        raise ValueError(f"export: attn_scale={cfg.attn_scale} is not 1/sqrt(head_dim)")


def _rope_parameters(r) -> dict:
    out: dict[str, Any] = {"rope_theta": r.theta, "rope_type": "default"}
    if r.scaling == "linear":
        out.update(rope_type="linear", factor=r.factor)
    elif r.scaling == "llama3":
        out.update(rope_type="llama3", factor=r.factor, low_freq_factor=r.low_freq_factor,
                   high_freq_factor=r.high_freq_factor,
                   original_max_position_embeddings=r.original_max_len)
    elif r.scaling == "yarn":
        out.update(rope_type="yarn", factor=r.factor, beta_fast=r.beta_fast, beta_slow=r.beta_slow,
                   original_max_position_embeddings=r.original_max_len,
                   attention_factor=0.1 * r.mscale * math.log(r.factor) + 1.0)
    elif r.scaling != "none":
        raise ValueError(f"export: rope.scaling={r.scaling!r} is not exported (none, linear, "
                         "llama3, yarn are)")
    return out


def export(model: nnx.Module, path: str, *, dtype: str | None = None) -> None:
    """Write a Llama-family tfjax decoder as an HF checkpoint (`config.json` +
    `model.safetensors`) that `transformers.LlamaForCausalLM.from_pretrained` loads."""
    cfg: ModelConfig = model.config
    _check_llama_exportable(cfg)
    flat = {p: v.get_value() for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    out_dtype = np.dtype(jnp.dtype(dtype or cfg.param_dtype))

    def get(key):
        p, idx = _target(cfg, key)
        a = np.asarray(jax.device_get(flat[p]))
        return a if idx is None else a[idx]

    N, K, H, D = cfg.num_heads, cfg.kv_heads, cfg.head_size, cfg.d_model
    t: dict[str, np.ndarray] = {"model.embed_tokens.weight": get(("embed", "tokens", "embedding")),
                                "model.norm.weight": get(("final_norm", "scale"))}
    if not cfg.tie_embeddings:
        t["lm_head.weight"] = get(("embed", "head", "kernel")).T
    for i in range(cfg.num_layers):
        p, L = f"model.layers.{i}.", ("layers", i)
        for ours, theirs, heads in (("q", "q_proj", N), ("k", "k_proj", K), ("v", "v_proj", K)):
            t[f"{p}self_attn.{theirs}.weight"] = get(L + ("attn", ours, "kernel")).reshape(D, heads * H).T
            if cfg.qkv_bias:
                t[f"{p}self_attn.{theirs}.bias"] = get(L + ("attn", ours, "bias")).reshape(-1)
        t[f"{p}self_attn.o_proj.weight"] = get(L + ("attn", "o", "kernel")).reshape(N * H, D).T
        if cfg.out_bias:
            t[f"{p}self_attn.o_proj.bias"] = get(L + ("attn", "o", "bias"))
        t[f"{p}input_layernorm.weight"] = get(L + ("attn_norm", "scale"))
        t[f"{p}post_attention_layernorm.weight"] = get(L + ("ffn_norm", "scale"))
        for ours, theirs in (("wi_gate", "gate_proj"), ("wi_up", "up_proj"), ("wo", "down_proj")):
            t[f"{p}mlp.{theirs}.weight"] = get(L + ("ffn", ours, "kernel")).T
            if cfg.ffn_bias:
                t[f"{p}mlp.{theirs}.bias"] = get(L + ("ffn", ours, "bias"))
    os.makedirs(path, exist_ok=True)
    save_file({k: np.ascontiguousarray(v.astype(out_dtype)) for k, v in t.items()},
              os.path.join(path, "model.safetensors"))
    hf = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=cfg.vocab_size,
              hidden_size=D, intermediate_size=cfg.d_ff, num_hidden_layers=cfg.num_layers,
              num_attention_heads=N, num_key_value_heads=K, head_dim=H, hidden_act="silu",
              max_position_embeddings=cfg.max_len, rms_norm_eps=cfg.norm_eps,
              tie_word_embeddings=cfg.tie_embeddings, attention_bias=cfg.qkv_bias,
              mlp_bias=cfg.ffn_bias, rope_parameters=_rope_parameters(cfg.rope),
              dtype=str(out_dtype), attention_dropout=0.0)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
