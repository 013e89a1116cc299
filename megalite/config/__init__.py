"""The configuration layer: the typed schema behind `conf/*.yaml` (`schema`, `train_section`,
`sections`), the one error every check raises (`errors`), the run's `Layout` and the checks
before launch (`layout`, `grid_rules`), the pipeline's partition of the blocks
(`stage_partition`), the schedules' rules and bubble (`schedule_rules`) and the fault drill's
syntax (`inject`). It imports nothing else of megalite but `megalite.utils`. The names below
are its public API, imported when first used (so that importing a light module of the package,
e.g. `families`, does not import torch)."""
import importlib

_API = {"ConfigError": "megalite.config.errors", "Layout": "megalite.config.layout",
        "validate": "megalite.config.layout", "Config": "megalite.config.schema",
        "load_config": "megalite.config.schema"}
__all__ = list(_API)


def __getattr__(name: str):
    if name not in _API:
        raise AttributeError(f"module 'megalite.config' has no attribute {name!r}")
    return getattr(importlib.import_module(_API[name]), name)
