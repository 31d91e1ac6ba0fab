"""Mamba-2 (`Mamba2ForCausalLM`): every layer `x + Mamba2(RMSNorm(x))` ("mamba2"
layers, `model.mamba2`), Mamba's backbone (`mamba.backbone_weights`). HF's one
`in_proj` (z, x, B, C, dt), conv over (x, B, C), gated RMSNorm over `n_groups` groups
after the gate (mamba_ssm's `norm_before_gate=False`; a config asking for True is
refused), D skip, dt bias, `time_step_limit` -> `mamba2.dt_min_limit` / `dt_max_limit`
(HF's torch path clips dt in its chunked form only, not in its one-token decode step;
ours clips in both, so with a limit that binds, decoding follows the training-time
form and can differ from HF `generate`), `time_step_min/max` -> the dt_bias init
range, `chunk_size` -> `mamba2.chunk`. `residual_in_fp32` only matters below float32
(our residual stream is the compute dtype). Its mixer mapping (`mixer_weights`) also
serves Zamba2's."""

from __future__ import annotations

import math
from typing import Any

from tfjax.config import ModelConfig
from tfjax.interop.config_mapping import (check_types, common_fields, need, require_silu,
                                          unsupported)
from tfjax.interop.families import Family, mamba
from tfjax.interop.tensor_mapping import Weights

__all__ = ["FAMILY", "config", "mixer_weights", "to_hf", "weights"]

_KEY_TYPES: dict[str, tuple[type, ...]] = {  # beyond config_mapping.KEY_TYPES
    **dict.fromkeys(("expand", "n_groups", "chunk_size"), (int,)),
    **dict.fromkeys(("time_step_min", "time_step_max"), (int, float)),
    "norm_before_gate": (bool,),
    "time_step_limit": (list,),
}


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


def config(hf: dict) -> dict:
    check_types(hf, key_types=_KEY_TYPES)
    require_silu(hf, "Mamba-2")
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
    return dict(common_fields(hf), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
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


def mixer_weights(w: Weights, m: str, M: tuple, cfg: ModelConfig) -> dict:
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


def weights(w: Weights, cfg: ModelConfig, hf: dict) -> dict:
    return mamba.backbone_weights(w, cfg, mixer_weights)


def to_hf(cfg: ModelConfig) -> dict:
    s = cfg.mamba2
    need(cfg, "Mamba-2", arch="decoder", layer_pattern=("mamba2",), ffn_pattern=("none",),
         norm="rmsnorm", norm_placement="pre", position="none", final_norm=True,
         embed_norm=False, scale_embeddings=False, logits_scale=1.0, final_softcap=0.0,
         block="sequential")
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


FAMILY = Family(model_types=("mamba2",), config=config, weights=weights, to_hf=to_hf,
                prefix="backbone.")
