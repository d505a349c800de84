"""Building a config in layers, each overriding the last:
    defaults  ->  model preset (`--model NAME`)  ->  YAML file (`--config F`)  ->  `section.key=value`
then validated; and a run's config.yaml written and read back.
"""

import copy
import dataclasses
import types
import typing
from pathlib import Path

import yaml

from lmforge.common.errors import LmforgeError
from lmforge.config.presets import DEFAULT_PRESET, MODEL_PRESETS
from lmforge.config.schema import SECTIONS, Config, ModelConfig, config_to_dict
from lmforge.config.validate import _did_you_mean, validate


def make_config(preset: str | None = DEFAULT_PRESET, path: str | Path | None = None,
                overrides: typing.Sequence[str] = ()) -> Config:
    """Defaults, then the preset, then the YAML file, then `section.key=value` overrides; validated."""
    cfg = Config()
    if preset is not None:
        if preset not in MODEL_PRESETS:
            raise LmforgeError(f"unknown model preset {preset!r}{_did_you_mean(preset, MODEL_PRESETS)}; "
                               f"presets: {', '.join(MODEL_PRESETS)}")
        cfg.model = ModelConfig(**copy.deepcopy(MODEL_PRESETS[preset]))  # its rope_scaling is the user's to change
    if path is not None:
        apply_dict(cfg, read_yaml(path), origin=str(path))
    for item in overrides:
        key, value = parse_override(item)
        set_value(cfg, key, value, origin="command line")
    validate(cfg)
    if cfg.optim.decay_steps is None:  # a new config: the schedule's length is fixed now (see OptimConfig)
        cfg.optim.decay_steps = cfg.train.max_steps
    return cfg


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise LmforgeError(f"config file {path} not found")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as err:
        raise LmforgeError(f"config file {path} is not UTF-8 text (byte {err.start}): save it as UTF-8") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise LmforgeError(f"config file {path} is not valid YAML{where}: {problem}") from None
    if not isinstance(data, dict):
        raise LmforgeError(f"config file {path} must hold a mapping of sections (model, data, optim, train)")
    return data


def apply_dict(cfg: Config, data: dict, origin: str) -> None:
    """Apply a nested {section: {key: value}} mapping, as read from YAML."""
    for section, values in data.items():
        if not isinstance(values, dict):
            raise LmforgeError(f"{origin}: {section!r} must be a section holding key: value pairs")
        for key, value in values.items():
            set_value(cfg, f"{section}.{key}", value, origin=origin)


def parse_override(item: str) -> tuple[str, str]:
    if "=" not in item:
        raise LmforgeError(f"cannot read {item!r}: overrides look like section.key=value, e.g. train.max_steps=100")
    key, value = item.split("=", 1)
    return key.strip(), value.strip()


# older names of a setting, read as its name today (in files, on the command line and in older runs' config.yaml)
ALIASES = {"train.pipeline_stages": "parallel.pp"}


def set_value(cfg: Config, key: str, value, origin: str) -> None:
    """Set `section.key` on cfg, converting `value` to the field's type; an older name (ALIASES) sets
    the new one, and the two given different values by one origin (a file, the command line) are
    refused (a later origin overrides an earlier one's, whichever the spelling)."""
    spelled, key = key, ALIASES.get(key, key)
    all_keys = [f"{s}.{f.name}" for s in SECTIONS for f in dataclasses.fields(getattr(cfg, s))]
    if key not in all_keys:
        raise LmforgeError(f"{origin}: unknown config key {key!r}{_did_you_mean(key, all_keys)}")
    section, name = key.split(".")
    target = getattr(cfg, section)
    hint = typing.get_type_hints(type(target))[name]
    try:
        value = _coerce(value, hint, spelled)
    except LmforgeError as err:  # a file's wrong-typed value: name the file
        raise LmforgeError(str(err) if origin == "command line" else f"{origin}: {err}") from None
    if key == "parallel.pp" and value == 0:
        return  # parallel.pp's "not set" before it became the pipeline's one name (older runs' config.yaml)
    if key in ALIASES.values():
        given = cfg.__dict__.setdefault("_spellings", {}).setdefault(origin, {})  # each spelling's value, by origin
        given[spelled] = value
        if len(set(given.values())) > 1:  # the name and its older one (one alias each), different values
            old = next(k for k in given if k != key)
            where = "" if origin == "command line" else f"{origin}: "
            raise LmforgeError(f"{where}{key}={given[key]} and {old}={given[old]} disagree: set one of them "
                               f"({old} is {key}'s older name)")
    setattr(target, name, value)


def _coerce(value, hint, key: str):
    allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    text = value.strip().lower() if isinstance(value, str) else None
    if type(None) in allowed and (value is None or text in ("none", "null", "~")):
        return None
    if bool in allowed:
        if isinstance(value, bool):
            return value
        if text in ("true", "yes", "on", "1", "false", "no", "off", "0"):
            return text in ("true", "yes", "on", "1")
    if int in allowed:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        try:
            return int(str(value).replace("_", ""))
        except ValueError:
            pass
    if float in allowed:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        try:
            return float(str(value))
        except ValueError:
            pass
    if dict in allowed:  # a YAML mapping, or one typed on the command line: key={a: 1, b: 2}
        parsed = yaml.safe_load(value) if isinstance(value, str) else value
        if isinstance(parsed, dict):
            return parsed
    if str in allowed and not isinstance(value, (dict, list, bool)):
        return str(value)
    if str in allowed and isinstance(value, list) and all(isinstance(v, str) for v in value):
        return ",".join(value)  # a YAML list of paths for data.source
    names = " or ".join("null" if t is type(None) else t.__name__ for t in allowed)
    raise LmforgeError(f"{key} must be {names}, got {value!r}")


def config_from_dict(data: dict, origin: str) -> Config:
    cfg = Config()
    apply_dict(cfg, data, origin=origin)
    validate(cfg)
    return cfg


def load_config(path: str | Path) -> Config:
    return config_from_dict(read_yaml(path), origin=str(path))


def resume_may_change(key: str) -> bool:
    """Whether a resume may change setting `key` (a command-line override, or the run's config.yaml
    against its checkpoint's): how the run trains and splits the work, and where its prepared data
    lies; never the model or the data, whose weights and tokens the checkpoint was trained with, nor
    optim.name, whose states it holds (for Muon, its split of the parameters)."""
    return key == "data.dir" or key.startswith(("train.", "optim.", "parallel.")) and key != "optim.name"


def resume_change(saved: Config, cfg: Config) -> tuple[str, object, object] | None:
    """(key, value in `cfg`, value in `saved`) of the first setting a resume may not change that
    differs between a checkpoint's config (`saved`) and the one it is resumed with, or None."""
    ours, theirs = config_to_dict(cfg), config_to_dict(saved)
    for section, values in ours.items():
        for name, value in values.items():
            key = f"{section}.{name}"
            if not resume_may_change(key) and theirs[section][name] != value:
                return key, value, theirs[section][name]
    return None


# the sections every lmforge version has written into a run's config.yaml
WRITTEN_SECTIONS = ("model", "data", "optim", "train")


def lacking_key(path: str | Path, reference: str | Path | None) -> str | None:
    """The first setting config file `reference` holds that config file `path` lacks (older names
    read as today's), or None; without a reference, the first of WRITTEN_SECTIONS it lacks or holds
    empty. lmforge writes every setting into a run's config.yaml, so one that lacks a setting its
    checkpoint's copy holds was cut short or edited: its defaults are not the run's."""
    def keys(data: dict) -> list[str]:
        return [ALIASES.get(f"{section}.{key}", f"{section}.{key}") for section, values in data.items()
                if isinstance(values, dict) for key in values]

    data = read_yaml(path)
    if reference is None:
        return next((section for section in WRITTEN_SECTIONS if not data.get(section)), None)
    ours = set(keys(data))
    return next((key for key in keys(read_yaml(reference)) if key not in ours), None)
