"""The project's typed configuration (layer 3).

One tree of OmegaConf structured dataclasses (:mod:`.schema`), loaded from YAML and overridden by
``key=value`` arguments (:mod:`.loading`). An unknown key, a wrong type or an out-of-range value
fails at load time with the key's name and value (:class:`ConfigError` of :mod:`.keys`; the checks are in :mod:`.checks`).
Every field is documented where it is defined; :mod:`.docs` writes the config as YAML with that
documentation. Builders in the trainer unpack the config into keyword arguments: it never enters
the math.
"""

from ppo_core.config.checks import (
    READ_KEYS,
    UPPER_BOUNDS,
    WRITE_KEYS,
    check_write_paths,
    code_free_folders,
    validate_config,
)
from ppo_core.config.choices import CHOICES
from ppo_core.config.docs import field_docs, save_config, to_yaml
from ppo_core.config.keys import MAX_VALUE_CHARS, ConfigError, flatten
from ppo_core.config.loading import load_config
from ppo_core.config.schema import (
    BaseConfig,
    Config,
    DataConfig,
    EvalConfig,
    FlowConfig,
    GenerationConfig,
    IngestConfig,
    KLConfig,
    LoraConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    PPOConfig,
    PromoteConfig,
    ScheduleConfig,
    TrainConfig,
    ValidationConfig,
)

__all__ = [
    "CHOICES",
    "MAX_VALUE_CHARS",
    "READ_KEYS",
    "UPPER_BOUNDS",
    "WRITE_KEYS",
    "BaseConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "EvalConfig",
    "FlowConfig",
    "GenerationConfig",
    "IngestConfig",
    "KLConfig",
    "LoraConfig",
    "ModelConfig",
    "OptimConfig",
    "PPOConfig",
    "ParallelConfig",
    "PromoteConfig",
    "ScheduleConfig",
    "TrainConfig",
    "ValidationConfig",
    "check_write_paths",
    "code_free_folders",
    "field_docs",
    "flatten",
    "load_config",
    "save_config",
    "to_yaml",
    "validate_config",
]
