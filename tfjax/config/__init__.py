"""The config boundary: an `ml_collections.ConfigDict` becomes frozen dataclasses.

`run_config(cfg)` (a whole run) and `model_config(cfg.model)` convert and check before
anything is traced: an unknown key, a moved field, a wrong type, a value out of range
or an invalid combination raises `ValueError` naming the field and what would be right.
Below the boundary a layer takes its section's record whole (`Mamba(d_model, cfg.ssm)`),
never the ConfigDict. This package imports nothing else of tfjax; names a registry owns
are checked by `tfjax.models.check_names`. Modules: `model`, `attention`, `shared`, `vision`, `audio` (the
model's sections), `run` (the trainer's, `RunConfig`), `posttrain` (its preference and
distillation sections), `convert`, `checks`. See
docs/presets.md.
"""

from tfjax.config.attention import AttentionConfig
from tfjax.config.audio import AudioConfig
from tfjax.config.convert import (apply_variant, default_config, flat_fields, from_dict,
                                  model_config, moved_field, run_config, to_config_dict,
                                  unknown_field, upgrade_saved)
from tfjax.config.model import (DTYPES, GatedDeltaNetConfig, LinearConfig, MLAConfig,
                                Mamba2Config, ModelConfig, MoEConfig, RopeConfig, SSMConfig,
                                T5Config)
from tfjax.config.posttrain import (PREFERENCE_OBJECTIVES, REFERENCE_OBJECTIVES, DistillConfig,
                                    PreferenceConfig)
from tfjax.config.shared import SharedBlockConfig
from tfjax.config.vision import VisionConfig
from tfjax.config.run import (DCN_AXES, DEFAULT_RULES, MESH_AXES, CheckpointConfig, DataConfig,
                              LoraConfig, MeshConfig,
                              ParamGroup, RunConfig, TrainConfig, parse_param_groups,
                              parse_profile_steps)

__all__ = [
    "upgrade_saved",
    "AttentionConfig",
    "AudioConfig",
    "RopeConfig",
    "MoEConfig",
    "SSMConfig",
    "Mamba2Config",
    "LinearConfig",
    "GatedDeltaNetConfig",
    "MLAConfig",
    "SharedBlockConfig",
    "T5Config",
    "VisionConfig",
    "ModelConfig",
    "TrainConfig",
    "ParamGroup",
    "parse_param_groups",
    "parse_profile_steps",
    "DataConfig",
    "MeshConfig",
    "CheckpointConfig",
    "LoraConfig",
    "PreferenceConfig",
    "DistillConfig",
    "PREFERENCE_OBJECTIVES",
    "REFERENCE_OBJECTIVES",
    "RunConfig",
    "DEFAULT_RULES",
    "DTYPES",
    "MESH_AXES",
    "DCN_AXES",
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
