"""Configuration: dataclasses with defaults, named model presets, YAML files and `key=value` overrides.

A config is built in layers, each overriding the last:
    defaults  ->  model preset (`--model NAME`)  ->  YAML file (`--config F`)  ->  `section.key=value`
and then validated, so every bad value stops with one line that names it and what is allowed.

    schema.py    the sections (ModelConfig, DataConfig, OptimConfig, TrainConfig, FinetuneConfig) and Config;
                 the parallel section's degrees (pp x dp_replicate x dp_shard x cp x tp: Degrees, mesh_degrees)
    presets.py   MODEL_PRESETS: published model shapes by name
    load.py      the layers above, and a run's config.yaml written and read back
    validate.py  validate (the first setting that cannot work; the degrees resolved first) and
                 config_warnings (the likely mistakes)
    rules.py     what combines with what: each refusal's one line (validate, the launch and the plan ask it)

This file presents the package's names; config/ imports only lmforge.modes and lmforge.common, and no
torch (the CLI parses its arguments before torch is loaded).
"""

from lmforge.config.load import (apply_dict, config_from_dict, lacking_key, load_config, make_config, parse_override,
                                 read_yaml, resume_change, resume_may_change, set_value)
from lmforge.config.presets import DEFAULT_PRESET, LLAMA3_ROPE_SCALING, MODEL_PRESETS
from lmforge.config.schema import (FAMILIES, FAMILY_MLPS, INIT_SCHEMES, LR_SCHEDULES, MLPS, ROPE_SCALING_KEYS,
                                   SECTIONS, Config, DataConfig, FinetuneConfig, ModelConfig, OptimConfig,
                                   TrainConfig, config_to_dict)
from lmforge.config.validate import _did_you_mean, config_warnings, validate
