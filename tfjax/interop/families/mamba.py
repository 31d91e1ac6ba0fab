"""Mamba (`MambaForCausalLM`): every layer `x + Mamba(RMSNorm(x))` ("mamba" layers,
`model.ssm`), under `backbone.`. Its mixer mapping (`mixer_weights`) also serves
Jamba's Mamba layers, its backbone (`backbone_weights`) Mamba-2's."""

from __future__ import annotations

from typing import Callable

from tfjax.config import ModelConfig
from tfjax.interop.config_mapping import common_fields, decoder_to_hf, require, unsupported
from tfjax.interop.families import Family
from tfjax.interop.tensor_mapping import Weights, embedding_and_head, norm_weights

__all__ = ["FAMILY", "backbone_weights", "config", "mixer_weights", "to_hf", "weights"]


def config(hf: dict) -> dict:
    require(hf, "hidden_act", ("silu",))
    D, Di = hf["hidden_size"], hf["intermediate_size"]
    if Di % D:
        unsupported("intermediate_size", Di, f"must be a multiple of hidden_size={D} (expand)")
    rank = hf.get("time_step_rank", "auto")
    return dict(common_fields(hf), arch="decoder", d_model=D, num_layers=hf["num_hidden_layers"],
                num_heads=1, d_ff=Di, position="none", norm="rmsnorm",
                norm_eps=hf.get("layer_norm_epsilon", 1e-5), layer_pattern=("mamba",),
                ffn_pattern=("none",),
                ssm=dict(d_state=hf["state_size"], d_conv=hf["conv_kernel"], expand=Di // D,
                         dt_rank=0 if rank == "auto" else int(rank),
                         conv_bias=bool(hf.get("use_conv_bias", True)),
                         proj_bias=bool(hf.get("use_bias", False)), chunk=0))


def mixer_weights(w: Weights, m: str, M: tuple, cfg: ModelConfig) -> dict:
    """One Mamba mixer `m` (HF `MambaMixer` / `JambaMambaMixer`) -> our `Mamba` at `M`;
    with `model.ssm.inner_norm`, Jamba's dt / B / C RMSNorms too."""
    D, Di = cfg.d_model, cfg.ssm.expand * cfg.d_model
    out = {M + ("in_proj",): w[m + "in_proj.weight"].T.reshape(D, 2, Di)}  # rows: x then z
    if cfg.ssm.proj_bias:
        out[M + ("in_bias",)] = w[m + "in_proj.bias"].reshape(2, Di)
        out[M + ("out_bias",)] = w[m + "out_proj.bias"]
    out[M + ("conv_w",)] = w[m + "conv1d.weight"][:, 0, :].T  # [Di, 1, K] -> [K, Di]
    if cfg.ssm.conv_bias:
        out[M + ("conv_b",)] = w[m + "conv1d.bias"]
    out[M + ("x_proj",)] = w[m + "x_proj.weight"].T  # [R + 2N, Di] -> [Di, R + 2N]
    out[M + ("dt_proj",)] = w[m + "dt_proj.weight"].T  # [Di, R] -> [R, Di]
    out[M + ("dt_bias",)] = w[m + "dt_proj.bias"]
    out[M + ("A_log",)] = w[m + "A_log"]
    out[M + ("D",)] = w[m + "D"]
    out[M + ("out_proj",)] = w[m + "out_proj.weight"].T
    if cfg.ssm.inner_norm:
        for ours, theirs in (("dt_norm", "dt_layernorm"), ("b_norm", "b_layernorm"),
                             ("c_norm", "c_layernorm")):
            out[M + (ours, "scale")] = w[f"{m}{theirs}.weight"]
    return out


def backbone_weights(w: Weights, cfg: ModelConfig, mixer: Callable[..., dict]) -> dict:
    """A `backbone.` checkpoint of `x + mixer(RMSNorm(x))` layers, each mixer `mixer(w,
    name, path, cfg)` (ours sits where attention does)."""
    out = embedding_and_head(w, cfg, embedding="backbone.embeddings.weight",
                             final_norm="backbone.norm_f")
    for i in range(cfg.num_layers):
        p, L = f"backbone.layers.{i}.", ("layers", i)
        out.update(norm_weights(w, p + "norm", L + ("attn_norm",), cfg))
        out.update(mixer(w, p + "mixer.", L + ("attn",), cfg))
    return out


def weights(w: Weights, cfg: ModelConfig, hf: dict) -> dict:
    return backbone_weights(w, cfg, mixer_weights)


def to_hf(cfg: ModelConfig) -> dict:
    s = cfg.ssm
    return decoder_to_hf(cfg, "mamba", "MambaForCausalLM", hidden_size=cfg.d_model,
                         intermediate_size=s.expand * cfg.d_model, expand=s.expand,
                         num_hidden_layers=cfg.num_layers, state_size=s.d_state,
                         conv_kernel=s.d_conv, time_step_rank=s.dt_rank or "auto",
                         use_conv_bias=s.conv_bias, use_bias=s.proj_bias,
                         layer_norm_epsilon=cfg.norm_eps, hidden_act="silu")


FAMILY = Family(model_types=("mamba",), config=config, weights=weights, to_hf=to_hf,
                prefix="backbone.")
