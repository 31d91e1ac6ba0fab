"""What a `ModelConfig` computes, and where two differ: export's check that a family's
`config.json` says the same model.

`computation(cfg)` lists the fields that change what the model computes, by dotted
path, with derived values resolved (`head_dim=0` equals `head_dim=8` where d_model /
num_heads is 8) and what the model does not use left out (a section no layer has).
`config_diff(ours, theirs)` names each field where two configs differ;
`tfjax.interop.hf.export` maps a family's `to_hf` dict back through its `config` and
refuses a model for which that list is not empty. See docs/interop.md.
"""

from __future__ import annotations

import math
from typing import Any

from tfjax.config import ModelConfig, flat_fields

__all__ = ["NOT_COMPUTATION", "computation", "config_diff"]

# Fields that do not change what the model computes at inference (numerics, layout,
# training-only knobs); export writes the dtype it is asked for.
NOT_COMPUTATION = frozenset((
    "dtype", "param_dtype", "init_std", "dropout_rate", "scan_layers", "remat",
    "attention.impl", "attention.context_parallel", "attention.zigzag",
    "attention.ulysses_size", "moe.impl",
    "moe.aux_loss_weight", "moe.z_loss_weight", "moe.bias_update_rate", "ssm.chunk",
    "mamba2.chunk", "mamba2.dt_min", "mamba2.dt_max", "linear.chunk", "gdn.chunk"))
# A section's fields count only where a layer of its kind is.
_SECTION_KIND = {"ssm": "mamba", "mamba2": "mamba2", "linear": "linear", "gdn": "gated_deltanet",
                 "mla": "mla"}
_RECURRENT = frozenset(("mamba", "mamba2"))  # mixers with no attention heads of model.num_heads


def computation(cfg: ModelConfig) -> dict[str, Any]:
    """The fields of `cfg` that change what it computes, by dotted name, with derived
    values resolved (`head_dim` is the head size, `attention.scale` the scale in effect)
    and the fields of what the model does not use (a section no layer has, RoPE settings
    of a model without RoPE, an FFN's width where no layer has one) left out."""
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
