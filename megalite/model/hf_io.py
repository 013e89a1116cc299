"""`transformers` directories (or hub ids) read and written for any family, through the
family's mapping (`Family.hf`: `megalite.model.gpt2.hf` for GPT-2, `megalite.model.llama.hf` for
Llama): the checks before launch (config.json only), the weights of `init_from`, and the
export's directory."""
from __future__ import annotations

from pathlib import Path
from typing import Dict, Optional

import torch

from megalite.config.errors import ConfigError
from megalite.config.schema import ModelConfig
from megalite.model.families import families, family, family_of_model_type
from megalite.model.family import ModelKeys
from megalite.model.hub_cache import CONFIG_FILES, WEIGHT_FILES, local_snapshot


def _architecture_check(source: str, cfg: ModelConfig, model_type: Optional[str]) -> None:
    """`source` holds a model of the configured family; otherwise name what would read it."""
    mapping = family(cfg).hf
    if model_type == mapping.model_type:
        return
    other = family_of_model_type(model_type)
    remedy = (f"set model.arch={other.name} (or a {other.name} preset) to read it"
              if other is not None else "megalite reads " + ", ".join(
                  f"{f.hf.model_class} (model.arch={f.name})" for f in families()))
    raise ConfigError(f"init_from={source!r}: a {model_type!r} model, but model.arch="
                      f"{cfg.arch} reads {mapping.model_class} ({mapping.model_type!r}); "
                      f"{remedy}")


def read_hf_config(source: str, cfg: ModelConfig):
    """The config.json of `source` (a directory or a hub id: its config.json alone is fetched),
    of the configured family."""
    from transformers import AutoConfig

    mapping = family(cfg).hf
    local = local_snapshot(source, CONFIG_FILES)  # a hub id through huggingface_hub's cache
    try:
        hf_cfg = AutoConfig.from_pretrained(local)
    except (OSError, ValueError) as e:
        raise ConfigError(f"init_from={source!r}: no {mapping.display} config.json there ({e}); "
                          "give a directory written by save_pretrained or a hub id such as "
                          f"{mapping.hub_example}") from e
    _architecture_check(source, cfg, getattr(hf_cfg, "model_type", None))
    return hf_cfg


def model_keys_of(source: str) -> ModelKeys:
    """The model config `source`'s config.json describes (its model_type picks the family;
    config.json alone is read, a hub id's fetched): what `init_from` takes."""
    from transformers import AutoConfig

    try:
        hf_cfg = AutoConfig.from_pretrained(local_snapshot(source, CONFIG_FILES))
    except (OSError, ValueError) as e:
        raise ConfigError(f"init_from={source!r}: no transformers config.json there ({e}); "
                          "give a directory written by save_pretrained or a hub id such as "
                          "gpt2") from e
    model_type = getattr(hf_cfg, "model_type", None)
    found = family_of_model_type(model_type)
    if found is None or found.hf.model_keys is None:
        raise ConfigError(f"init_from={source!r}: a {model_type!r} model; megalite reads "
                          + ", ".join(f"{f.hf.model_class} ({f.hf.model_type!r})"
                                      for f in families()))
    return found.hf.model_keys(hf_cfg, source)


def check_init_from(source: str, cfg: ModelConfig) -> None:
    """Before launch: `source` has a config of the configured family (config.json only, no
    weights read) that matches the model config."""
    family(cfg).hf.check_config(cfg, read_hf_config(source, cfg), source)


def load_hf_state_dict(source: str, cfg: ModelConfig) -> Dict[str, torch.Tensor]:
    """Read the family's `transformers` weights from a local directory or a hub id, as
    megalite names (fp32): the config is checked first, so a hub id's weights are fetched only
    for a model of the configured shape."""
    import transformers

    mapping = family(cfg).hf
    hf_cfg = read_hf_config(source, cfg)
    mapping.check_config(cfg, hf_cfg, source)
    try:
        hf = getattr(transformers, mapping.model_class).from_pretrained(
            local_snapshot(source, WEIGHT_FILES), torch_dtype=torch.float32)
    except OSError as e:
        raise ConfigError(f"init_from={source!r}: cannot load a {mapping.model_class} from it "
                          f"({e}); give a directory written by save_pretrained or a hub id"
                          ) from e
    return mapping.from_hf_state_dict(hf.state_dict())


def save_hf(sd: Dict[str, torch.Tensor], cfg: ModelConfig, out_dir: Path,
            tokenizer_dir: Optional[Path] = None) -> Path:
    """Write a `transformers` directory of the family's model class (config.json,
    generation_config.json, model.safetensors, and the tokenizer files with its special token
    ids in the configs)."""
    import transformers
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    mapping = family(cfg).hf
    if mapping.check_export is not None:
        mapping.check_export(cfg)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir)) if tokenizer_dir else None
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id} \
        if tokenizer is not None else {}
    hf = getattr(transformers, mapping.model_class)(mapping.hf_config(cfg, **ids))
    missing, unexpected = hf.load_state_dict(mapping.to_hf_state_dict(sd), strict=False)
    missing = [m for m in missing if not mapping.derived(m)]
    if missing or unexpected:
        raise ValueError(f"state does not map onto {mapping.model_class}: missing {missing}, "
                         f"unexpected {unexpected}")
    out_dir = Path(out_dir)
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        hf.save_pretrained(out_dir, safe_serialization=True)
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    if tokenizer is not None:
        tokenizer.model_max_length = cfg.n_positions  # the model's context, for truncation=True
        tokenizer.save_pretrained(out_dir)
    return out_dir
