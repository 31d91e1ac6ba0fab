"""The config boundary: every validation error names its field. Types, ranges and
combinations are `tfjax.config`'s; registry-owned names are checked at build time
(`tfjax.models.check_names`, through `build`), before anything is built."""

import ml_collections
import pytest

from tfjax import models
from tfjax.config import (ModelConfig, apply_variant, default_config, model_config,
                          moved_field, run_config, to_config_dict, upgrade_saved)

GOOD = dict(vocab_size=64, d_model=32, num_layers=2, num_heads=4, d_ff=64)


@pytest.mark.parametrize("override,field", [
    (dict(d_model=30), "model.d_model"),
    (dict(num_kv_heads=3), "model.num_kv_heads"),
    (dict(rope=dict(fraction=0.3)), "model.rope.fraction"),
    (dict(head_dim=6, rope=dict(fraction=0.5)), "model.rope.fraction"),
    (dict(layer_pattern=("local",), attention=dict(sliding_window=0)),
     "model.attention.sliding_window"),
    (dict(layer_pattern=()), "model.layer_pattern"),
    (dict(dtype="float8"), "model.dtype"),
    (dict(rope=dict(scaling="yarn", factor=1.0)), "model.rope.factor"),
    (dict(rope=dict(factor=0.5)), "model.rope.factor"),
    (dict(dropout_rate=1.0), "model.dropout_rate"),
    (dict(num_layers=0), "model.num_layers"),
    (dict(attention=dict(softcap=-1.0)), "model.attention.softcap"),
    (dict(v_head_dim=-8), "model.v_head_dim"),
    (dict(mla=dict(kv_lora_rank=0)), "model.mla.kv_lora_rank"),
    (dict(layer_pattern=("mla",), position="alibi"), "model.position"),
    (dict(layer_pattern=("mla",), rope=dict(fraction=0.5)), "model.rope.fraction"),
    (dict(layer_pattern=("mla",), mla=dict(qk_rope_head_dim=5)), "model.mla.qk_rope_head_dim"),
    (dict(attention=dict(sinks=1)), "model.attention.sinks"),
    (dict(block="parallel", norm_placement="post"), "model.norm_placement"),
    (dict(arch="encoder", prefix_lm=True), "model.prefix_lm"),
    (dict(type_vocab_size=2), "model.type_vocab_size"),
    (dict(num_classes=2), "model.num_classes"),
    (dict(num_encoder_layers=2), "model.num_encoder_layers"),
    (dict(arch="encoder_decoder", block="parallel"), "model.block"),
    (dict(nmu_layers=2), "model.nmu_layers"),  # typo
    (dict(num_layers="2"), "model.num_layers"),  # wrong type
    (dict(attention=dict(qk_norm=1)), "model.attention.qk_norm"),
    (dict(layer_pattern="global"), "model.layer_pattern"),
    (dict(ssm=dict(d_state=0)), "model.ssm.d_state"),
    (dict(linear=dict(chunk=0)), "model.linear.chunk"),
    (dict(moe=dict(capacity_factor=-1.0)), "model.moe.capacity_factor"),
    (dict(position="t5", t5=dict(num_buckets=0)), "model.t5.num_buckets"),
    (dict(moe=dict(num_experts="4")), "model.moe.num_experts"),  # wrong type in a section
    (dict(moe=dict(experts=4)), "model.moe.experts"),  # unknown field of a section
])
def test_invalid_model_values_name_the_field(override, field):
    cfg = {**GOOD, **override}
    with pytest.raises(ValueError, match=field):
        model_config(cfg)


# Names that registries own: the config accepts them; the build-time check names them.
NAMES = [
    (dict(activation="swish"), "model.activation"),
    (dict(norm="batchnorm"), "model.norm"),
    (dict(position="xpos"), "model.position"),
    (dict(block="hybrid"), "model.block"),
    (dict(layer_pattern=("global", "dense_local")), r"model.layer_pattern\[1\]"),
    (dict(ffn_pattern=("dense", "sparse")), r"model.ffn_pattern\[1\]"),
    (dict(norm_placement="middle"), "model.norm_placement"),
    (dict(arch="seq2seq"), "model.arch"),
    (dict(attention=dict(impl="flash9")), "model.attention.impl"),
    (dict(remat="some"), "model.remat"),
    (dict(rope=dict(scaling="magic", factor=2.0)), "model.rope.scaling"),
    (dict(rope=dict(layout="zigzag")), "model.rope.layout"),
    (dict(moe=dict(impl="sparse")), "model.moe.impl"),
    (dict(linear=dict(feature_map="cosine")), "model.linear.feature_map"),
    (dict(arch="encoder", layer_pattern=("mamba",)), "model.layer_pattern"),
]


@pytest.mark.parametrize("override,field", NAMES)
def test_invalid_names_are_named_at_build_time(override, field):
    cfg = model_config({**GOOD, **override})  # types and ranges are fine
    with pytest.raises(ValueError, match=field):
        models.check_names(cfg)
    with pytest.raises(ValueError, match=field):
        models.build({**GOOD, **override})  # fails before anything is built


def test_allowed_values_are_listed():
    with pytest.raises(ValueError, match="'swiglu'"):
        models.build({**GOOD, "activation": "swish"})
    with pytest.raises(ValueError, match="'rmsnorm_plus_one'"):
        models.build({**GOOD, "norm": "batchnorm"})
    with pytest.raises(ValueError, match="'global', 'linear', 'local', 'mamba'"):
        models.build({**GOOD, "layer_pattern": ("ssm",)})
    with pytest.raises(ValueError, match="'auto', 'blockwise'"):
        models.build({**GOOD, "attention": {"impl": "flash9"}})


# Every flat field that moved into a section, and where it is now.
MOVED = {
    "num_experts": "moe.num_experts", "experts_per_token": "moe.experts_per_token",
    "moe_d_ff": "moe.d_ff", "shared_experts": "moe.shared_experts",
    "router_renormalize": "moe.router_renormalize", "capacity_factor": "moe.capacity_factor",
    "moe_impl": "moe.impl", "moe_aux_loss_weight": "moe.aux_loss_weight",
    "moe_z_loss_weight": "moe.z_loss_weight", "ssm_d_state": "ssm.d_state",
    "ssm_d_conv": "ssm.d_conv", "ssm_expand": "ssm.expand", "ssm_dt_rank": "ssm.dt_rank",
    "ssm_chunk": "ssm.chunk", "ssm_conv_bias": "ssm.conv_bias", "ssm_proj_bias": "ssm.proj_bias",
    "ssm_inner_norm": "ssm.inner_norm", "linear_feature_map": "linear.feature_map",
    "linear_chunk": "linear.chunk", "t5_num_buckets": "t5.num_buckets",
    "t5_max_distance": "t5.max_distance",
}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_a_moved_field_names_its_new_path(old):
    new = MOVED[old]
    section, field = new.split(".")
    assert field in {f for f in vars(getattr(ModelConfig(), section))}  # the new path exists
    msg = f"model.{old} moved to model.{new}"
    with pytest.raises(ValueError, match=f"^{msg}$"):  # a dict config, one line
        model_config({**GOOD, old: 1})
    cd = default_config()
    cd.model[old] = 1  # a preset that sets the old name
    with pytest.raises(ValueError, match=f"^{msg}$"):
        run_config(cd)
    with pytest.raises(ValueError, match=f"preset variant 'tiny': {msg}"):
        apply_variant(default_config(), "tiny", {"tiny": {"model": {old: 1}}})
    assert moved_field(f"model.{old}") == f"model.{new}"  # what the CLI asks


def test_a_saved_run_from_before_the_move_still_loads():
    """A run's config.json written with the flat fields (every field is saved, so
    every old run has them) upgrades to the sections; a current one is unchanged."""
    want = run_config({"model": {**GOOD, "ffn_pattern": ("moe",),
                                 "moe": {"num_experts": 4, "d_ff": 48}, "t5": {"num_buckets": 8}}})
    saved = to_config_dict(want).to_dict()
    old = dict(saved, model={k: v for k, v in saved["model"].items()
                             if k not in ("moe", "ssm", "linear", "t5")})
    for flat, new in MOVED.items():
        section, field = new.split(".")
        old["model"][flat] = saved["model"][section][field]
    assert run_config(upgrade_saved(old)) == want
    assert upgrade_saved(saved) == saved
    assert run_config(upgrade_saved(saved)) == want
    with pytest.raises(ValueError, match="moved to"):  # without the upgrade: the error
        run_config(old)


def test_moved_field_is_only_for_moved_paths():
    for path in ("model.d_ff", "model.moe.d_ff", "model.nope", "train.steps", "train.nope.x",
                 "model.rope.theta"):
        assert moved_field(path) is None


def test_sections_convert_and_stay_hashable():
    cfg = model_config({**GOOD, "ffn_pattern": ("moe",),
                        "moe": {"num_experts": 4, "d_ff": 32, "impl": "dense"},
                        "ssm": ml_collections.ConfigDict({"d_state": 8}), "t5": {"num_buckets": 8}})
    assert (cfg.moe.num_experts, cfg.moe.d_ff, cfg.moe.impl, cfg.moe.experts_per_token) == (
        4, 32, "dense", 2)
    assert cfg.ssm.d_state == 8 and cfg.ssm.d_conv == 4 and cfg.t5.num_buckets == 8
    assert hash(cfg) == hash(model_config(cfg))


def test_valid_config_round_trips_and_is_frozen():
    cd = ml_collections.ConfigDict(GOOD)
    cfg = model_config(cd)
    assert isinstance(cfg, ModelConfig)
    assert cfg.kv_heads == 4 and cfg.head_size == 8 and cfg.attention_scale == pytest.approx(8 ** -0.5)
    with pytest.raises(Exception):
        cfg.d_model = 3  # frozen
    assert hash(cfg) == hash(model_config(GOOD))  # hashable: usable as static jit data


def test_run_config_from_default_config():
    cd = default_config()
    cd.model.update(GOOD)
    run = run_config(cd)
    assert run.model.d_model == 32
