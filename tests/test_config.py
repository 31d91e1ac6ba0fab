"""The config boundary: every validation error names its field."""

import ml_collections
import pytest

from tfjax.config import ModelConfig, default_config, model_config, run_config

GOOD = dict(vocab_size=64, d_model=32, num_layers=2, num_heads=4, d_ff=64)


@pytest.mark.parametrize("override,field", [
    (dict(d_model=30), "model.d_model"),
    (dict(num_kv_heads=3), "model.num_kv_heads"),
    (dict(rope=dict(fraction=0.3)), "model.rope.fraction"),
    (dict(head_dim=6, rope=dict(fraction=0.5)), "model.rope.fraction"),
    (dict(layer_pattern=("local",), sliding_window=0), "model.sliding_window"),
    (dict(activation="swish"), "model.activation"),
    (dict(norm="batchnorm"), "model.norm"),
    (dict(position="xpos"), "model.position"),
    (dict(block="hybrid"), "model.block"),
    (dict(layer_pattern=("global", "dense_local")), r"model.layer_pattern\[1\]"),
    (dict(layer_pattern=()), "model.layer_pattern"),
    (dict(norm_placement="middle"), "model.norm_placement"),
    (dict(arch="seq2seq"), "model.arch"),
    (dict(attention_impl="flash9"), "model.attention_impl"),
    (dict(remat="some"), "model.remat"),
    (dict(dtype="float8"), "model.dtype"),
    (dict(rope=dict(scaling="yarn", factor=1.0)), "model.rope.factor"),
    (dict(rope=dict(scaling="magic", factor=2.0)), "model.rope.scaling"),
    (dict(rope=dict(layout="zigzag")), "model.rope.layout"),
    (dict(rope=dict(factor=0.5)), "model.rope.factor"),
    (dict(dropout_rate=1.0), "model.dropout_rate"),
    (dict(num_layers=0), "model.num_layers"),
    (dict(attn_softcap=-1.0), "model.attn_softcap"),
    (dict(block="parallel", norm_placement="post"), "model.norm_placement"),
    (dict(arch="encoder", prefix_lm=True), "model.prefix_lm"),
    (dict(type_vocab_size=2), "model.type_vocab_size"),
    (dict(num_classes=2), "model.num_classes"),
    (dict(num_encoder_layers=2), "model.num_encoder_layers"),
    (dict(arch="encoder_decoder", block="parallel"), "model.block"),
    (dict(nmu_layers=2), "model.nmu_layers"),  # typo
    (dict(num_layers="2"), "model.num_layers"),  # wrong type
    (dict(qk_norm=1), "model.qk_norm"),
    (dict(layer_pattern="global"), "model.layer_pattern"),
])
def test_invalid_model_values_name_the_field(override, field):
    cfg = {**GOOD, **override}
    with pytest.raises(ValueError, match=field):
        model_config(cfg)


def test_allowed_values_are_listed():
    with pytest.raises(ValueError, match="'swiglu'"):
        model_config({**GOOD, "activation": "swish"})
    with pytest.raises(ValueError, match="'rmsnorm_plus_one'"):
        model_config({**GOOD, "norm": "batchnorm"})


def test_valid_config_round_trips_and_is_frozen():
    cd = ml_collections.ConfigDict(GOOD)
    cfg = model_config(cd)
    assert isinstance(cfg, ModelConfig)
    assert cfg.kv_heads == 4 and cfg.head_size == 8 and cfg.scale == pytest.approx(8 ** -0.5)
    with pytest.raises(Exception):
        cfg.d_model = 3  # frozen
    assert hash(cfg) == hash(model_config(GOOD))  # hashable: usable as static jit data


def test_run_config_from_default_config():
    cd = default_config()
    cd.model.update(GOOD)
    run = run_config(cd)
    assert run.model.d_model == 32
