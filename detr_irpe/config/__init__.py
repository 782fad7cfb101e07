"""One typed configuration for model, loss, data, training and evaluation.

- :mod:`~detr_irpe.config.schema`: the sections (``data``, ``train``, and the bases of
  the family-selected ``model`` and ``loss``), :class:`Config`;
- :mod:`~detr_irpe.config.loading`: YAML files, ``_base_`` chains, ``section.key=value``
  overrides, the family's sections chosen by ``model.family``;
- :mod:`~detr_irpe.config.checks`: the value checks every section uses;
- :mod:`~detr_irpe.config.estimates`: sizes against this machine's memory;
- :mod:`~detr_irpe.config.plugins`: ``model.import``.

Only the builders (a family's ``build``, ``build_dataset``, the tools) read the config;
the classes take explicit keyword arguments.
"""

from detr_irpe.config.loading import (
    CONFIG_DIR,
    config_from_dict,
    family_name_of,
    find_yaml,
    list_configs,
    load_config,
    merge_dicts,
    parse_override,
    read_yaml_with_base,
    resolve_config_path,
    save_config,
    upgrade_config_dict,
)
from detr_irpe.config.plugins import import_modules
from detr_irpe.config.schema import (
    AMP_MODES,
    AUGMENTATIONS,
    DATA_REPORT_MODES,
    DEVICES,
    LOGGERS,
    LR_SCHEDULES,
    Config,
    DataConfig,
    EmaConfig,
    LossConfig,
    ModelConfig,
    TrainConfig,
    import_names,
)
from detr_irpe.errors import ConfigError

__all__ = [
    "AMP_MODES",
    "AUGMENTATIONS",
    "CONFIG_DIR",
    "DATA_REPORT_MODES",
    "DEVICES",
    "LOGGERS",
    "LR_SCHEDULES",
    "Config",
    "ConfigError",
    "DataConfig",
    "EmaConfig",
    "LossConfig",
    "ModelConfig",
    "TrainConfig",
    "config_from_dict",
    "family_name_of",
    "find_yaml",
    "import_modules",
    "import_names",
    "list_configs",
    "load_config",
    "merge_dicts",
    "parse_override",
    "read_yaml_with_base",
    "resolve_config_path",
    "save_config",
    "upgrade_config_dict",
]
