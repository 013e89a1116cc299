"""`init_from` a `transformers` directory or hub id takes the model from its config.json: the
family (config.json's model_type) and every shape key (`megalite.model.family.ModelKeys`), so
`megalite-pretrain init_from=Qwen/Qwen3-30B-A3B` needs no model keys. A `model.*` key the user
gives (on the command line, or through a `model=<preset>`) that disagrees with config.json is
refused by name before launch; the keys config.json gives as training defaults (dropout,
initialisation, the aux loss's coefficient) are taken where the user gives none. A megalite or
DCP checkpoint as `init_from` is held to the model config as before (`megalite.train.init_from`).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Dict, Iterable, Set

from omegaconf import OmegaConf

from megalite.checkpoint.dcp_export import find_dcp
from megalite.checkpoint.resolve import find_checkpoint
from megalite.config.errors import ConfigError
from megalite.config.model import ModelConfig
from megalite.config.moe import MoEConfig
from megalite.config.schema import CONF_DIR, Config
from megalite.model import hf_io
from megalite.train.init_from import is_path


def is_hf_source(source: str) -> bool:
    """A transformers directory (config.json) or a hub id: not a megalite or DCP checkpoint,
    not a missing path (which `check_init_from` names)."""
    if find_dcp(source) is not None or find_checkpoint(source) is not None:
        return False
    path = Path(source).expanduser()
    if path.exists():
        return (path / "config.json").is_file()
    return not is_path(source)


def _flatten(values: dict, prefix: str = "") -> Set[str]:
    keys = set()
    for key, value in values.items():
        keys.add(prefix + key)
        if isinstance(value, dict):
            keys |= _flatten(value, f"{prefix}{key}.")
    return keys


def given_model_keys(overrides: Iterable[str]) -> Set[str]:
    """The `model.*` keys (dotted below `model.`) the overrides give: `model.<key>=...` and
    every key of a `model=<preset>`."""
    given: Set[str] = set()
    for override in overrides:
        key, sep, value = str(override).partition("=")
        key = key.lstrip("+~")
        if key == "model" and sep:
            given |= _flatten(OmegaConf.to_container(
                OmegaConf.load(CONF_DIR / "model" / f"{value}.yaml")))
        elif key.startswith("model."):
            given.add(key[len("model."):])
    return given


def _value(model: ModelConfig, key: str):
    for part in key.split("."):
        model = getattr(model, part)
    return model


def _overlaps(given: str, key: str) -> bool:
    return given == key or given.startswith(key + ".") or key.startswith(given + ".")


def _with(model: ModelConfig, values: Dict[str, object]) -> ModelConfig:
    """`model` with dotted `values` set (moe.<key> in its section)."""
    moe = {k[len("moe."):]: v for k, v in values.items() if k.startswith("moe.")}
    top = {k: v for k, v in values.items() if not k.startswith("moe.")}
    return dataclasses.replace(model, **top, moe=MoEConfig(**{**model.moe.__dict__, **moe}))


def adopt_init_from_model(cfg: Config, overrides: Iterable[str]) -> Config:
    """`cfg` with the model of its `init_from`'s config.json (module docstring); `cfg` itself
    where init_from is unset or a checkpoint."""
    source = cfg.init_from
    if not source or not is_hf_source(source):
        return cfg
    keys = hf_io.model_keys_of(source)
    given = given_model_keys(overrides)
    for key, theirs in keys.shape.items():
        ours = _value(cfg.model, key)
        if ours != theirs and any(_overlaps(g, key) for g in given):
            raise ConfigError(f"model.{key}={ours!r}: init_from={source!r} has {theirs!r} "
                              f"(config.json); drop model.{key} (init_from gives the model's "
                              f"shape) or set model.{key}={theirs!r}")
    defaults = {k: v for k, v in keys.defaults.items()
                if not any(_overlaps(g, k) for g in given)}
    name = {} if "name" in given else {"name": source}
    return dataclasses.replace(cfg, model=_with(cfg.model, {**keys.shape, **defaults, **name}))
