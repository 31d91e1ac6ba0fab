"""The config boundary: an `ml_collections.ConfigDict` becomes frozen dataclasses.

Presets in `configs/` are code (`get_config(arg=None) -> ConfigDict`) so they can
be overridden from the command line (`--config.model.num_layers=4`). The trainer,
the model builder and everything below take the frozen dataclasses made here,
never the ConfigDict; a layer takes its section's record whole (`Mamba(d_model,
cfg.ssm)`), never the whole `ModelConfig`.

Checks happen here, before anything is traced: an unknown key, a moved field, a
wrong type, a value out of range or an invalid combination raises `ValueError`
naming the field (`model.num_kv_heads`) and what would be right. This package
imports nothing else of tfjax, so names that a registry owns (`model.activation`,
`model.layer_pattern[i]`, ...) are checked where the registries live, by
`tfjax.models.build` (`tfjax.models.check_names`), still before anything compiles.

    model.py    ModelConfig and its sections (rope, moe, ssm, mamba2, linear, gdn, mla, t5)
    attention.py  its attention section (model.attention)
    shared.py   its shared-blocks section (model.shared, Zamba2)
    run.py      TrainConfig, DataConfig, MeshConfig, CheckpointConfig, RunConfig
    convert.py  ConfigDict / dict <-> dataclasses, presets' variants, moved fields, dotted paths
    checks.py   the field-error helpers
"""

from tfjax.config.attention import AttentionConfig
from tfjax.config.convert import (apply_variant, default_config, flat_fields, from_dict,
                                  model_config, moved_field, run_config, to_config_dict,
                                  unknown_field, upgrade_saved)
from tfjax.config.model import (DTYPES, GatedDeltaNetConfig, LinearConfig, MLAConfig,
                                Mamba2Config, ModelConfig, MoEConfig, RopeConfig, SSMConfig,
                                T5Config)
from tfjax.config.shared import SharedBlockConfig
from tfjax.config.run import (DEFAULT_RULES, MESH_AXES, CheckpointConfig, DataConfig,
                              LoraConfig, MeshConfig,
                              ParamGroup, RunConfig, TrainConfig, parse_param_groups,
                              parse_profile_steps)

__all__ = [
    "upgrade_saved",
    "AttentionConfig",
    "RopeConfig",
    "MoEConfig",
    "SSMConfig",
    "Mamba2Config",
    "LinearConfig",
    "GatedDeltaNetConfig",
    "MLAConfig",
    "SharedBlockConfig",
    "T5Config",
    "ModelConfig",
    "TrainConfig",
    "ParamGroup",
    "parse_param_groups",
    "parse_profile_steps",
    "DataConfig",
    "MeshConfig",
    "CheckpointConfig",
    "LoraConfig",
    "RunConfig",
    "DEFAULT_RULES",
    "DTYPES",
    "MESH_AXES",
    "model_config",
    "run_config",
    "default_config",
    "apply_variant",
    "from_dict",
    "flat_fields",
    "moved_field",
    "unknown_field",
    "to_config_dict",
]
