"""Hugging Face recurrent and hybrid families: Mamba-2, Qwen3-Next and Jamba.

Each family has the three functions of a `tfjax.interop.hf.Family`: `<family>_config(hf)
-> ModelConfig fields`, `<family>_weights(w, cfg, hf) -> {our path: array}` and
`<family>_to_hf(cfg) -> config.json dict` (its inverse, for export). Options that change
the computation are mapped or refused with NotImplementedError naming them; options
that only change initialisation, training kernels or the cache are ignored.

- **mamba2** (`Mamba2ForCausalLM`): every layer `x + Mamba2(RMSNorm(x))` ("mamba2"
  layers, `model.mamba2`). HF's one `in_proj` (z, x, B, C, dt), conv over (x, B, C),
  gated RMSNorm over `n_groups` groups after the gate (mamba_ssm's
  `norm_before_gate=False`; a config asking for True is refused), D skip, dt bias,
  `time_step_limit` -> `mamba2.dt_min_limit` / `dt_max_limit` (HF's torch path clips dt
  in its chunked form only, not in its one-token decode step; ours clips in both, so
  with a limit that binds, decoding follows the training-time form and can differ
  from HF `generate`),
  `time_step_min/max` -> the dt_bias init range, `chunk_size` -> `mamba2.chunk`.
  `residual_in_fp32` only matters below float32 (our residual stream is the compute
  dtype).
- **qwen3_next** (`Qwen3NextForCausalLM`): `layer_types` (or `full_attention_interval`)
  -> "gated_deltanet" / "global" layers; the attention's fused `q_proj` (per head: query
  then output gate) -> `attn.q` + `attn.gate` (`model.attention.output_gate`), QK-norm, partial
  rotary (HF's default `partial_rotary_factor` here is 0.25); zero-centred `(1 + w)`
  RMSNorms (`rmsnorm_plus_one`; the Gated DeltaNet's own gated norm is a plain `w`
  RMSNorm); the GDN's fused, per-key-head interleaved `in_proj_qkvz` (q, k, then the
  G = num_v / num_k value heads' v and z) and `in_proj_ba` (G b's then G a's) and its
  conv over (q, k, v) split into our separate projections; the MoE (softmax top-k,
  `norm_topk_prob`, a shared expert behind its sigmoid gate) on layers i with
  `(i + 1) % decoder_sparse_step == 0` not in `mlp_only_layers`, dense MLPs elsewhere
  (`model.ffn_pattern`). Dropless dispatch (`moe.capacity_factor=0`): no token is
  ever dropped, as in HF. The multi-token-prediction module (`mtp.*`: fc, its norms,
  one full-attention MoE layer), which transformers' causal LM skips, loads into
  `model.mtp` when the checkpoint holds it (`qwen3_next_mtp_depth`).
- **jamba** (`JambaForCausalLM`): attention (no positions) where `i % attn_layer_period
  == attn_layer_offset`, Mamba-1 layers with Jamba's inner RMSNorms on dt, B, C
  (`ssm.inner_norm`) elsewhere; a top-k MoE without renormalisation (dropless) where
  `num_experts > 1` and `i % expert_layer_period == expert_layer_offset`, a dense MLP
  elsewhere. Layer i's mixer sits at `("layers", i, "attn")` whatever its kind.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from tfjax.config import ModelConfig
from tfjax.interop.hf_config import _common, _rope, check_types, require, unsupported
from tfjax.interop.hf_export import _rope_parameters
from tfjax.interop.hf_weights import (Weights, _attention, _head, _heads_in, _heads_out,
                                      _linear, _mixtral_experts, _norm, mamba_mixer_weights,
                                      mtp_module_weights)

__all__ = ["jamba_config", "jamba_to_hf", "jamba_weights", "mamba2_config",
           "mamba2_mixer_weights", "mamba2_to_hf", "mamba2_weights", "qwen3_next_config", "qwen3_next_mtp_depth", "qwen3_next_to_hf",
           "qwen3_next_weights"]


# --------------------------------------------------------------------------- #
# Shared pieces.
# --------------------------------------------------------------------------- #

_INT, _NUM, _BOOL = (int,), (int, float), (bool,)
# The JSON types of the keys these families read beyond `hf_config.KEY_TYPES`.
_KEY_TYPES: dict[str, tuple[type, ...]] = {
    **dict.fromkeys((
        "expand", "n_groups", "chunk_size", "full_attention_interval", "linear_num_key_heads",
        "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
        "linear_conv_kernel_dim", "decoder_sparse_step", "num_experts", "moe_intermediate_size",
        "shared_expert_intermediate_size", "attn_layer_period", "attn_layer_offset",
        "expert_layer_period", "expert_layer_offset", "mamba_d_state", "mamba_d_conv",
        "mamba_expand"), _INT),
    **dict.fromkeys(("time_step_min", "time_step_max"), _NUM),
    **dict.fromkeys(("norm_before_gate", "norm_topk_prob", "mamba_conv_bias", "mamba_proj_bias"),
                    _BOOL),
    "mamba_dt_rank": (int, str),
    "time_step_limit": (list,),
    "mlp_only_layers": (list, type(None)),
}


def _cycle(kinds: list[str]) -> tuple[str, ...]:
    """The shortest prefix of `kinds` whose repetition is `kinds` (a tfjax pattern), of
    a length that divides the layers (so the stack scans whole cycles)."""
    n = len(kinds)
    period = next(p for p in range(1, n + 1)
                  if n % p == 0 and all(kinds[i] == kinds[i % p] for i in range(n)))
    return tuple(kinds[:period])


def _expand(pattern: tuple[str, ...], n: int) -> list[str]:
    return [pattern[i % len(pattern)] for i in range(n)]


def _number(value: Any, key: str) -> float:
    """A JSON number, or transformers' `{"__float__": "Infinity"}` encoding of one."""
    if isinstance(value, dict) and set(value) == {"__float__"}:
        value = value["__float__"]
    try:
        if isinstance(value, bool):
            raise ValueError
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"config.json: {key} holds {value!r}, not a number; fix {key}") from None


def _check_export(cfg: ModelConfig, family: str, **want) -> None:
    """Every `model.<field>` in `want` has the value the HF family can express."""
    for field, value in want.items():
        got = cfg
        for part in field.split("."):
            got = getattr(got, part)
        if got != value:
            raise ValueError(f"export: model.{field}={got!r} has no {family} equivalent "
                             f"(needs {value!r})")


def _silu(hf: dict, family: str) -> None:
    require(hf, "hidden_act", ("silu", "swish"),
            f"{family} uses hidden_act for its SiLU convolution gate and MLPs: silu only")


def _swiglu_mlp(w: Weights, p: str, L: tuple, cfg: ModelConfig) -> dict:
    """A dense SwiGLU MLP `p` (gate_proj, up_proj, down_proj, no biases) at `L`."""
    out = {}
    for ours, theirs in (("wi_gate", "gate_proj"), ("wi_up", "up_proj"), ("wo", "down_proj")):
        out.update(_linear(w, p + theirs, L + (ours,), False))
    return out


# --------------------------------------------------------------------------- #
# Mamba-2.
# --------------------------------------------------------------------------- #


def mamba2_config(hf: dict) -> dict:
    check_types(hf, key_types=_KEY_TYPES)
    _silu(hf, "Mamba-2")
    if hf.get("norm_before_gate"):
        unsupported("norm_before_gate", True, "Mamba-2 with the gate before the norm "
                    "(norm_before_gate=False, as HF computes it) only")
    # Missing keys take Mamba2Config's defaults (save_pretrained writes them all).
    D, expand, P = hf["hidden_size"], hf.get("expand", 2), hf.get("head_dim") or 64
    if not isinstance(expand, int) or isinstance(expand, bool):
        unsupported("expand", expand, "an integer expansion factor")
    heads = hf.get("num_heads", expand * D // P)
    if heads * P != expand * D:
        raise ValueError(f"config.json: num_heads={heads} * head_dim={P} must equal expand * "
                         f"hidden_size = {expand * D}; fix num_heads")
    limit = hf.get("time_step_limit", (0.0, math.inf))
    if len(limit) != 2:
        raise ValueError(f"config.json: time_step_limit={limit!r} must be [min, max]")
    lo, hi = (_number(v, "time_step_limit") for v in limit)
    return dict(_common(hf), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
                arch="decoder", d_model=D, num_layers=hf["num_hidden_layers"], num_heads=1,
                d_ff=expand * D, position="none", norm="rmsnorm",
                norm_eps=hf.get("layer_norm_epsilon", 1e-5), layer_pattern=("mamba2",),
                ffn_pattern=("none",),
                mamba2=dict(d_state=hf.get("state_size", 128), head_dim=P, expand=expand,
                            n_groups=hf.get("n_groups", 8), d_conv=hf.get("conv_kernel", 4),
                            chunk=hf.get("chunk_size", 256),
                            conv_bias=bool(hf.get("use_conv_bias", True)),
                            proj_bias=bool(hf.get("use_bias", False)),
                            dt_min=float(hf.get("time_step_min", 0.001)),
                            dt_max=float(hf.get("time_step_max", 0.1)),
                            dt_min_limit=lo, dt_max_limit=0.0 if math.isinf(hi) else hi))


def mamba2_weights(w: Weights, cfg: ModelConfig, hf: dict) -> dict:
    out = {("embed", "tokens", "embedding"): w["backbone.embeddings.weight"],
           **_norm(w, "backbone.norm_f", ("final_norm",), cfg)}
    out.update(_head(w, "lm_head.weight", cfg))
    for i in range(cfg.num_layers):
        p, L = f"backbone.layers.{i}.", ("layers", i)
        out.update(_norm(w, p + "norm", L + ("attn_norm",), cfg))
        out.update(mamba2_mixer_weights(w, p + "mixer.", L + ("attn",), cfg))
    return out


def mamba2_mixer_weights(w: Weights, m: str, M: tuple, cfg: ModelConfig) -> dict:
    """HF's Mamba-2 mixer `m` (`Mamba2Mixer`, Zamba2's `Zamba2MambaMixer`) -> our
    `Mamba2` at `M`."""
    out = {M + ("in_proj",): w[m + "in_proj.weight"].T,  # [W, D] -> [D, W]: z, x, B, C, dt
           M + ("conv_w",): w[m + "conv1d.weight"][:, 0, :].T}  # [C, 1, K] -> [K, C]
    if cfg.mamba2.conv_bias:
        out[M + ("conv_b",)] = w[m + "conv1d.bias"]
    if cfg.mamba2.proj_bias:
        out[M + ("in_bias",)] = w[m + "in_proj.bias"]
        out[M + ("out_bias",)] = w[m + "out_proj.bias"]
    for name in ("dt_bias", "A_log", "D"):
        out[M + (name,)] = w[m + name]
    out[M + ("norm_w",)] = w[m + "norm.weight"]
    out[M + ("out_proj",)] = w[m + "out_proj.weight"].T
    return out


def mamba2_to_hf(cfg: ModelConfig) -> dict:
    s = cfg.mamba2
    _check_export(cfg, "Mamba-2", arch="decoder", layer_pattern=("mamba2",),
                  ffn_pattern=("none",), norm="rmsnorm", norm_placement="pre",
                  position="none", final_norm=True, embed_norm=False, scale_embeddings=False,
                  logits_scale=1.0, final_softcap=0.0, block="sequential")
    if s.norm_groups not in (0, s.n_groups):
        raise ValueError(f"export: model.mamba2.norm_groups={s.norm_groups} has no Mamba-2 "
                         f"equivalent (HF normalises n_groups={s.n_groups} groups)")
    D = cfg.d_model
    return dict(architectures=["Mamba2ForCausalLM"], model_type="mamba2",
                vocab_size=cfg.vocab_size, hidden_size=D, num_hidden_layers=cfg.num_layers,
                num_heads=s.expand * D // s.head_dim, head_dim=s.head_dim, expand=s.expand,
                state_size=s.d_state, n_groups=s.n_groups, conv_kernel=s.d_conv,
                chunk_size=s.chunk, use_bias=s.proj_bias, use_conv_bias=s.conv_bias,
                hidden_act="silu", layer_norm_epsilon=cfg.norm_eps, residual_in_fp32=True,
                time_step_min=s.dt_min, time_step_max=s.dt_max,
                time_step_limit=[s.dt_min_limit, s.dt_max_limit or math.inf],
                tie_word_embeddings=cfg.tie_embeddings, dtype=cfg.param_dtype)


# --------------------------------------------------------------------------- #
# Qwen3-Next.
# --------------------------------------------------------------------------- #

_QWEN3_NEXT_LAYERS = {"linear_attention": "gated_deltanet", "full_attention": "global"}


def _qwen3_next_ffn_kinds(hf: dict, n: int) -> list[str]:
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


def qwen3_next_config(hf: dict) -> dict:
    check_types(hf, key_types=_KEY_TYPES)
    _silu(hf, "Qwen3-Next")
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
        if t not in _QWEN3_NEXT_LAYERS:
            unsupported("layer_types", t, f"supported: {sorted(_QWEN3_NEXT_LAYERS)}")
    D, N = hf["hidden_size"], hf["num_attention_heads"]
    bias = bool(hf.get("attention_bias", False))
    rope = _rope(hf)
    if "partial_rotary_factor" not in {**hf, **(hf.get("rope_parameters") or {}),
                                       **(hf.get("rope_scaling") or {})}:
        rope["fraction"] = 0.25  # Qwen3NextConfig's own default
    ffn = _qwen3_next_ffn_kinds(hf, n)
    c = dict(_common(hf), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
             arch="decoder", d_model=D, num_layers=n, num_heads=N,  # defaults: Qwen3NextConfig's
             num_kv_heads=hf.get("num_key_value_heads", 2) or N,
             head_dim=hf.get("head_dim", 256) or D // N,
             d_ff=hf["intermediate_size"], max_len=hf.get("max_position_embeddings", 32768),
             activation="swiglu", ffn_bias=False,
             attention=dict(qkv_bias=bias, out_bias=bias, qk_norm=True, output_gate=True),
             position="rope", rope=rope, norm="rmsnorm_plus_one",
             norm_eps=hf.get("rms_norm_eps", 1e-6), norm_placement="pre",
             layer_pattern=_cycle([_QWEN3_NEXT_LAYERS[t] for t in types]),
             ffn_pattern=_cycle(ffn),
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
           L + ("k", "kernel"): _heads_in(w[p + "k_proj.weight"], K, H),
           L + ("v", "kernel"): _heads_in(w[p + "v_proj.weight"], K, H),
           L + ("o", "kernel"): _heads_out(w[p + "o_proj.weight"], N, H)}
    if cfg.attention.qkv_bias:
        bq = w[p + "q_proj.bias"].reshape(N, 2, H)
        out[L + ("q", "bias")], out[L + ("gate", "bias")] = bq[:, 0], bq[:, 1]
        out[L + ("k", "bias")] = w[p + "k_proj.bias"].reshape(K, H)
        out[L + ("v", "bias")] = w[p + "v_proj.bias"].reshape(K, H)
    if cfg.attention.out_bias:
        out[L + ("o", "bias")] = w[p + "o_proj.bias"]
    out.update(_norm(w, p + "q_norm", L + ("q_norm",), cfg))
    out.update(_norm(w, p + "k_norm", L + ("k_norm",), cfg))
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


def qwen3_next_weights(w: Weights, cfg: ModelConfig, hf: dict) -> dict:
    out = {("embed", "tokens", "embedding"): w["model.embed_tokens.weight"],
           **_norm(w, "model.norm", ("final_norm",), cfg)}
    out.update(_head(w, "lm_head.weight", cfg))
    n = cfg.num_layers
    for i in range(n):
        out.update(_qwen3_next_layer(w, cfg, f"model.layers.{i}.", ("layers", i),
                                     cfg.layer_kind(i), cfg.ffn_kind(i)))
    if cfg.mtp_depth:  # `mtp.*`: one module (tfjax.models.mtp) of the last layer's kinds
        out.update(_qwen3_next_layer(w, cfg, "mtp.layers.0.", ("mtp", 0, "layers", "blocks", 0),
                                     cfg.layer_kind(n - 1), cfg.ffn_kind(n - 1)))
        out.update(mtp_module_weights(w, cfg, 0, embed_norm="mtp.pre_fc_norm_embedding",
                                      hidden_norm="mtp.pre_fc_norm_hidden", norm="mtp.norm",
                                      proj="mtp.fc"))
    w.ignore(*(k for k in w.ckpt if k.startswith("mtp.")))  # a checkpoint without "mtp.fc"
    return out


def qwen3_next_mtp_depth(hf: dict, names) -> int:
    """1 when the checkpoint holds Qwen3-Next's MTP module (`mtp.fc`, `mtp.layers.0`),
    else 0 (transformers' own saves drop it)."""
    names = set(names)
    if any(k.startswith("mtp.layers.1.") for k in names):
        raise NotImplementedError("mtp.layers.1: Qwen3-Next's deeper MTP shares mtp.fc and its "
                                  "norms across depths; tfjax's MTP modules have their own "
                                  "(model.mtp_depth=1 only)")
    return int("mtp.fc.weight" in names)


def _qwen3_next_layer(w: Weights, cfg: ModelConfig, p: str, L: tuple, kind: str,
                      ffn_kind: str) -> dict:
    """Hub layer `p` (Gated DeltaNet or gated attention, then MoE or dense) -> under L."""
    out = {}
    if kind == "gated_deltanet":
        out.update(_gated_deltanet(w, p + "linear_attn.", L + ("attn",), cfg))
    else:
        out.update(_gated_attention(w, p + "self_attn.", L + ("attn",), cfg))
    out.update(_norm(w, p + "input_layernorm", L + ("attn_norm",), cfg))
    out.update(_norm(w, p + "post_attention_layernorm", L + ("ffn_norm",), cfg))
    F = L + ("ffn",)
    if ffn_kind == "moe":
        out.update(_mixtral_experts(w, p + "mlp.", F, cfg,
                                    names=("gate_proj", "up_proj", "down_proj")))
        out.update(_swiglu_mlp(w, p + "mlp.shared_expert.", F + ("shared",), cfg))
        out[F + ("shared_gate",)] = w[p + "mlp.shared_expert_gate.weight"].T  # [1, D] -> [D, 1]
    else:
        out.update(_swiglu_mlp(w, p + "mlp.", F, cfg))
    return out


def qwen3_next_to_hf(cfg: ModelConfig) -> dict:
    _check_export(cfg, "Qwen3-Next", arch="decoder", norm="rmsnorm_plus_one",
                  norm_placement="pre", block="sequential", position="rope",
                  activation="swiglu", ffn_bias=False,
                  **{"attention.qk_norm": True, "attention.qk_norm_kind": "",
                     "attention.qk_norm_over": "head", "attention.qk_norm_layers": "all",
                     "attention.output_gate": True, "attention.softcap": 0.0},
                  final_softcap=0.0, scale_embeddings=False, embed_norm=False, logits_scale=1.0,
                  **{"attention.sinks": False}, v_head_dim=0,
                  **{"attention.differential": False, "attention.value_residual": "none",
                     "attention.scale": 0.0},
                  final_norm=True, **{"rope.layout": "half"})
    if cfg.attention.qkv_bias != cfg.attention.out_bias:
        raise ValueError("export: Qwen3-Next's attention_bias covers q, k, v and o together; "
                         f"got model.attention.qkv_bias={cfg.attention.qkv_bias}, "
                         f"model.attention.out_bias={cfg.attention.out_bias}")
    n = cfg.num_layers
    names = {v: k for k, v in _QWEN3_NEXT_LAYERS.items()}
    kinds = _expand(cfg.layer_pattern, n)
    if any(k not in names for k in kinds):
        raise ValueError(f"export: model.layer_pattern={cfg.layer_pattern!r}: Qwen3-Next has "
                         "gated_deltanet and global layers only")
    ffn = _expand(cfg.ffn_pattern, n)
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
               tie_word_embeddings=cfg.tie_embeddings, attention_bias=cfg.attention.qkv_bias,
               attention_dropout=0.0,
               rope_parameters=_rope_parameters(cfg, partial=True),
               layer_types=[names[k] for k in kinds], linear_conv_kernel_dim=cfg.gdn.d_conv,
               linear_num_key_heads=hk, linear_num_value_heads=hv, linear_key_head_dim=dk,
               linear_value_head_dim=dv, decoder_sparse_step=1,
               mlp_only_layers=[i for i, f in enumerate(ffn) if f == "dense"],
               dtype=cfg.param_dtype)
    if "moe" in ffn:
        _check_export(cfg, "Qwen3-Next", **{
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


# --------------------------------------------------------------------------- #
# Jamba.
# --------------------------------------------------------------------------- #


def _periodic(hf: dict, period_key: str, offset_key: str, defaults: tuple[int, int]) -> tuple:
    period, offset = hf.get(period_key, defaults[0]), hf.get(offset_key, defaults[1])
    for key, v in ((period_key, period), (offset_key, offset)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"config.json: {key}={v!r} must be an integer >= 0")
    if not 0 <= offset < period:
        raise ValueError(f"config.json: {offset_key}={offset} must be in [0, {period_key}="
                         f"{period}); fix {offset_key}")
    return period, offset


def jamba_config(hf: dict) -> dict:
    check_types(hf, key_types=_KEY_TYPES)
    _silu(hf, "Jamba")
    n, D, N = hf["num_hidden_layers"], hf["hidden_size"], hf["num_attention_heads"]
    a_period, a_offset = _periodic(hf, "attn_layer_period", "attn_layer_offset", (8, 4))
    e_period, e_offset = _periodic(hf, "expert_layer_period", "expert_layer_offset", (2, 1))
    experts = hf.get("num_experts", hf.get("num_local_experts", 16))
    layers = ["global" if i % a_period == a_offset else "mamba" for i in range(n)]
    ffn = ["moe" if experts > 1 and i % e_period == e_offset else "dense" for i in range(n)]
    rank = hf.get("mamba_dt_rank", "auto")
    c = dict(_common(hf), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
             arch="decoder", d_model=D, num_layers=n, num_heads=N,  # defaults: JambaConfig's
             num_kv_heads=hf.get("num_key_value_heads", 8) or N,
             head_dim=hf.get("head_dim") or D // N,
             d_ff=hf["intermediate_size"], max_len=hf.get("max_position_embeddings", 262144),
             activation="swiglu", ffn_bias=False,
             attention=dict(qkv_bias=False, out_bias=False), position="none", norm="rmsnorm", norm_eps=hf.get("rms_norm_eps", 1e-6),
             norm_placement="pre", layer_pattern=_cycle(layers), ffn_pattern=_cycle(ffn),
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


def jamba_weights(w: Weights, cfg: ModelConfig, hf: dict) -> dict:
    out = {("embed", "tokens", "embedding"): w["model.embed_tokens.weight"],
           **_norm(w, "model.final_layernorm", ("final_norm",), cfg)}
    out.update(_head(w, "lm_head.weight", cfg))
    for i in range(cfg.num_layers):
        p, L = f"model.layers.{i}.", ("layers", i)
        if cfg.layer_kind(i) == "mamba":
            out.update(mamba_mixer_weights(w, p + "mamba.", L + ("attn",), cfg))
        else:
            out.update(_attention(w, p + "self_attn.", L + ("attn",), cfg))
        out.update(_norm(w, p + "input_layernorm", L + ("attn_norm",), cfg))
        out.update(_norm(w, p + "pre_ff_layernorm", L + ("ffn_norm",), cfg))
        if cfg.ffn_kind(i) == "moe":
            out.update(_mixtral_experts(w, p + "feed_forward.", L + ("ffn",), cfg, router="router",
                                        names=("gate_proj", "up_proj", "down_proj")))
        else:
            out.update(_swiglu_mlp(w, p + "feed_forward.", L + ("ffn",), cfg))
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


def jamba_to_hf(cfg: ModelConfig) -> dict:
    _check_export(cfg, "Jamba", arch="decoder", norm="rmsnorm", norm_placement="pre",
                  block="sequential", position="none", activation="swiglu", ffn_bias=False,
                  **{"attention.qkv_bias": False, "attention.out_bias": False,
                     "attention.qk_norm": False, "attention.output_gate": False,
                     "attention.softcap": 0.0},
                  final_softcap=0.0, scale_embeddings=False, embed_norm=False, logits_scale=1.0,
                  **{"attention.sinks": False}, v_head_dim=0,
                  **{"attention.differential": False, "attention.value_residual": "none",
                     "attention.scale": 0.0},
                  final_norm=True, **{"ssm.inner_norm": True})
    n = cfg.num_layers
    kinds, ffn = _expand(cfg.layer_pattern, n), _expand(cfg.ffn_pattern, n)
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
        _check_export(cfg, "Jamba", **{
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
