"""A Config training a given ModelConfig, for tests that plan one model under several settings."""

import copy

from lmforge.config import Config, ModelConfig, parse_override, set_value, validate


def config_of(model: ModelConfig, *overrides: str) -> Config:
    """A Config of `model` with the `section.key=value` overrides, validated as make_config validates."""
    cfg = Config(model=copy.deepcopy(model))
    for item in overrides:
        set_value(cfg, *parse_override(item), origin="test")
    validate(cfg)
    return cfg
