"""Zamba2 (`Zamba2ForCausalLM`): its config and its tensors (load only; no `to_hf` yet).

A Mamba-2 stack whose hybrid layers (`layers_block_type`) also run one of
`num_mem_blocks` shared transformer blocks in turn, on [hidden; embeddings]: "mamba2"
and "mamba2_shared" layers and the `model.shared` section. The blocks load stacked
into `layers.shared`, each use's adapters and `linear` into its layer's `mixer_input`.
Refused by name: a saved copy of a tied block that differs from it, `rms_norm_eps`
other than 1e-5 and `use_long_context`. See docs/interop.md.
"""

from __future__ import annotations

import numpy as np

from tfjax.config import ModelConfig
from tfjax.interop.config_mapping import (check_types, common_fields, read_activation,
                                          read_rope, shortest_pattern, unsupported)
from tfjax.interop.families import Family, mamba2
from tfjax.interop.tensor_mapping import (Weights, embedding_and_head, heads_in, heads_out,
                                          norm_weights)

__all__ = ["FAMILY", "config", "weights"]

_INT, _NUM, _BOOL = (int,), (int, float), (bool,)
_KEY_TYPES: dict[str, tuple[type, ...]] = {
    **dict.fromkeys(("mamba_d_state", "mamba_d_conv", "mamba_expand", "mamba_ngroups",
                     "n_mamba_heads", "chunk_size", "num_mem_blocks", "adapter_rank"), _INT),
    **dict.fromkeys(("time_step_min", "time_step_max"), _NUM),
    **dict.fromkeys(("use_conv_bias", "add_bias_linear", "use_shared_attention_adapter",
                     "use_mem_rope", "use_long_context"), _BOOL),
    "layers_block_type": (list,),
}
_LAYERS = {"linear_attention": "mamba2", "mamba": "mamba2", "hybrid": "mamba2_shared"}


def _kinds(hf: dict) -> list[str]:
    types = hf["layers_block_type"]
    if len(types) != hf["num_hidden_layers"]:
        raise ValueError(f"config.json: layers_block_type has {len(types)} entries for "
                         f"num_hidden_layers={hf['num_hidden_layers']}; give one per layer")
    for t in types:
        if t not in _LAYERS:
            unsupported("layers_block_type", t, f"supported: {sorted(_LAYERS)}")
    return [_LAYERS[t] for t in types]


def config(hf: dict) -> dict:
    check_types(hf, key_types=_KEY_TYPES)
    if hf.get("use_long_context"):
        unsupported("use_long_context", True, "Zamba2's rescaled long-context RoPE")
    eps = hf.get("rms_norm_eps", 1e-5)
    if eps != 1e-5:
        unsupported("rms_norm_eps", eps, "1e-5 only (Zamba2's Mamba-2 gated norm has a fixed "
                    "eps of 1e-5; tfjax's uses model.norm_eps)")
    D, n, N = hf["hidden_size"], hf["num_hidden_layers"], hf["num_attention_heads"]
    expand, heads = hf.get("mamba_expand", 2), hf.get("n_mamba_heads", 8)
    if (expand * D) % heads:
        raise ValueError(f"config.json: n_mamba_heads={heads} must divide mamba_expand * "
                         f"hidden_size = {expand * D}; fix n_mamba_heads")
    H = 2 * D // N  # transformers' attention_head_dim
    bias = bool(hf.get("add_bias_linear", False))
    rope = hf.get("use_mem_rope", False)
    t_min = float(hf.get("time_step_min", 0.001))
    c = dict(common_fields(hf), arch="decoder", d_model=D, num_layers=n, num_heads=N,
             num_kv_heads=hf.get("num_key_value_heads") or N, head_dim=H,
             d_ff=hf.get("intermediate_size") or 4 * D,
             max_len=hf.get("max_position_embeddings", 4096),
             activation=read_activation(hf, "hidden_act", gated=True), ffn_bias=bias,
             attention=dict(qkv_bias=False, out_bias=False, scale=(H / 2) ** -0.5),
             position="rope" if rope else "none",
             norm="rmsnorm", norm_eps=eps, norm_placement="pre",
             layer_pattern=shortest_pattern(_kinds(hf), whole_cycles=True),
             ffn_pattern=("none",),
             mamba2=dict(d_state=hf.get("mamba_d_state", 64), head_dim=expand * D // heads,
                         expand=expand, n_groups=hf.get("mamba_ngroups", 1),
                         d_conv=hf.get("mamba_d_conv", 4), chunk=hf.get("chunk_size", 256),
                         conv_bias=True, proj_bias=bias, dt_min=t_min,
                         dt_max=float(hf.get("time_step_max", 0.1)), dt_min_limit=t_min),
             shared=dict(num_blocks=hf.get("num_mem_blocks", 1), concat_embedding=True,
                         adapter_rank=hf.get("adapter_rank", 128),
                         attn_adapter=bool(hf.get("use_shared_attention_adapter", False)),
                         mlp_adapter=True))
    if rope:
        c["rope"] = read_rope(hf)
    return c


def _adapter(w: Weights, name: str, r: int, shape: tuple) -> tuple[np.ndarray, np.ndarray]:
    """transformers' `Sequential(Linear(in, r), Linear(r, out))` `name` -> A `[in, r]`,
    B `[r, *shape]`."""
    a, b = w[name + ".0.weight"], w[name + ".1.weight"]
    return a.T, b.T.reshape(r, *shape)


def weights(w: Weights, cfg: ModelConfig, hf: dict) -> dict:
    out = embedding_and_head(w, cfg, final_norm="model.final_layernorm")
    n, sh = cfg.num_layers, cfg.shared
    hybrid = [i for i in range(n) if cfg.layer_kind(i) == "mamba2_shared"]
    N, K, H, F, r = cfg.num_heads, cfg.kv_heads, cfg.head_size, cfg.d_ff, sh.adapter_rank
    for i in range(n):
        p, L = f"model.layers.{i}.", ("layers", i)
        if i in hybrid:
            u = hybrid.index(i)
            src, G = f"model.layers.{hybrid[u % sh.num_blocks]}.shared_transformer.", \
                L + ("mixer_input",)
            if sh.attn_adapter and r:
                for x, heads in (("q", N), ("k", K), ("v", K)):
                    a, b = _adapter(w, f"{src}self_attn.linear_{x}_adapter_list.{u}", r,
                                    (heads, H))
                    out[G + (f"{x}_a",)], out[G + (f"{x}_b",)] = a, b
            if r:
                out[G + ("mlp_a",)], out[G + ("mlp_b",)] = _adapter(
                    w, f"{src}feed_forward.gate_up_proj_adapter_list.{u}", r, (2, F))
            out[G + ("out",)] = w[p + "linear.weight"].T
            p += "mamba_decoder."
        out.update(norm_weights(w, p + "input_layernorm", L + ("attn_norm",), cfg))
        out.update(mamba2.mixer_weights(w, p + "mamba.", L + ("attn",), cfg))
    _check_copies(w, hybrid, sh.num_blocks)
    S = ("layers", "shared")
    blocks = [f"model.layers.{hybrid[m]}.shared_transformer." for m in range(sh.num_blocks)]

    def stacked(f):
        return np.stack([f(b) for b in blocks])

    out[S + ("in_norm", "scale")] = stacked(lambda b: w[b + "input_layernorm.weight"])
    out[S + ("ffn_norm", "scale")] = stacked(lambda b: w[b + "pre_ff_layernorm.weight"])
    for x, heads in (("q", N), ("k", K), ("v", K)):
        out[S + ("attn", x, "kernel")] = stacked(
            lambda b: heads_in(w[f"{b}self_attn.{x}_proj.weight"], heads, H))
    out[S + ("attn", "o", "kernel")] = stacked(
        lambda b: heads_out(w[b + "self_attn.o_proj.weight"], N, H))
    gate_up = [w[b + "feed_forward.gate_up_proj.weight"] for b in blocks]  # [2F, D]
    out[S + ("ffn", "wi_gate", "kernel")] = np.stack([g[:F].T for g in gate_up])
    out[S + ("ffn", "wi_up", "kernel")] = np.stack([g[F:].T for g in gate_up])
    out[S + ("ffn", "wo", "kernel")] = stacked(lambda b: w[b + "feed_forward.down_proj.weight"].T)
    if cfg.ffn_bias:
        bias = [w[b + "feed_forward.gate_up_proj.bias"] for b in blocks]
        out[S + ("ffn", "wi_gate", "bias")] = np.stack([g[:F] for g in bias])
        out[S + ("ffn", "wi_up", "bias")] = np.stack([g[F:] for g in bias])
        out[S + ("ffn", "wo", "bias")] = stacked(lambda b: w[b + "feed_forward.down_proj.bias"])
    return out


def _check_copies(w: Weights, hybrid: list[int], M: int) -> None:
    """The blocks saved again under later hybrid layers (see the module docstring) equal
    the ones they tie to, tensor by tensor, or a ValueError names the first that does
    not."""
    for u in range(M, len(hybrid)):
        dup = f"model.layers.{hybrid[u]}.shared_transformer."
        first = f"model.layers.{hybrid[u % M]}.shared_transformer."
        for name in sorted(k for k in w.ckpt if k.startswith(dup)):
            tied = first + name[len(dup):]
            a, b = w[name], w[tied] if tied in w else None
            if not isinstance(a, np.ndarray):  # symbolic (a mesh load): no values to compare
                continue
            if b is None or not np.array_equal(a, np.asarray(b)):
                raise ValueError(f"checkpoint: {name} differs from {tied}: Zamba2's shared "
                                 f"block {u % M} is saved twice with different values (the "
                                 f"tie was not applied); tfjax shares one block")


FAMILY = Family(model_types=("zamba2",), config=config, weights=weights)
