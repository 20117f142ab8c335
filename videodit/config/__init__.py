"""The configuration: one typed schema (``schema.py``, a leaf) and how a config is read
(``load.py``: presets, YAML, ``key=value`` overrides, validation)."""

from videodit.config.load import (builtin_presets, describe, from_dict, from_yaml, load_config, parse_override,
                                  to_dict, to_yaml)
from videodit.config.schema import (MODEL_PRESETS, AudioConfig, CheckpointConfig, Config, DataConfig, DiffusionConfig, DistillConfig,
                                    LoraConfig, MemoryConfig, ModelConfig, ParallelConfig, SampleConfig, TextConfig,
                                    ToyConfig, TrainConfig, ValidationConfig, VAEConfig)

__all__ = ["MODEL_PRESETS", "AudioConfig", "CheckpointConfig", "Config", "DataConfig", "DiffusionConfig", "DistillConfig", "LoraConfig", "MemoryConfig",
           "ModelConfig", "ParallelConfig", "SampleConfig", "TextConfig", "ToyConfig", "TrainConfig",
           "ValidationConfig", "VAEConfig", "builtin_presets", "describe", "from_dict", "from_yaml", "load_config",
           "parse_override", "to_dict", "to_yaml"]
