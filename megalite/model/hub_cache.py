"""`init_from` a hub id (`gpt2`, `meta-llama/Llama-3.2-1B`) through huggingface_hub's cache.

`local_snapshot(source, files)` turns a hub id into the local directory of its cached snapshot
(HF_HUB_CACHE, default ~/.cache/huggingface/hub): what is asked for (`files`: the config alone,
CONFIG_FILES, for the checks before launch, which every rank runs; the config and the
safetensors weights, one file or shards with their index, WEIGHT_FILES, where the weights are
read: first by one rank of each node) is downloaded once with `snapshot_download`, or, offline
(HF_HUB_OFFLINE=1) or with the hub unreachable, found in the cache alone
(`local_files_only=True`). A model neither cached nor downloadable is a ConfigError of one line
naming the id, the cache and what to do: no traceback. A local directory is returned as is.
"""
from __future__ import annotations

from pathlib import Path
from typing import List

from megalite.config.errors import ConfigError

# what the checks before launch read of a repository: no weights
CONFIG_FILES = ["config.json"]
# what init_from reads of a repository (not its other formats: .bin, .gguf, original/...)
WEIGHT_FILES = ["config.json", "generation_config.json", "*.safetensors",
                "model.safetensors.index.json"]


def _cache_dir() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def local_snapshot(source: str, files: List[str]) -> str:
    """The directory holding `source`: itself if it is one (or no hub id at all), else the hub
    id's cached snapshot holding `files` (patterns; downloaded into the cache first unless
    offline)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(source)
    except HFValidationError:
        return source  # a path (that read_hf_config names when it holds no config.json)
    if Path(source).is_dir():
        return source

    try:  # online, snapshot_download itself falls back to the cache when the hub is unreachable
        return snapshot_download(source, allow_patterns=files,
                                 local_files_only=_offline())
    except (OSError, ValueError) as e:
        why = ("HF_HUB_OFFLINE=1" if _offline() else
               f"the hub is unreachable, has no such model or refuses it: {str(e).splitlines()[0]}"
               if str(e) else "the hub is unreachable or has no such model")
        raise ConfigError(
            f"init_from={source!r}: not a local directory, not in the Hugging Face cache "
            f"({_cache_dir()}) and not downloadable ({why}; {type(e).__name__}); download it "
            f"where the hub is reachable (hf download {source}) or give a directory written "
            "by save_pretrained") from e
