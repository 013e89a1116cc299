"""Planning: every prediction megalite makes before (or instead of) running — the memory and
traffic plan of a layout (`memory`, its peak moments `peak_moments`, from `dims`,
`stage_terms`, `chunks`, `offload`, `zero_table`, context parallelism's `cp_terms`), the
cheapest placement that fits (`fit`), the device table (`devices`), device profiles and their
calibration (`profile_file`, `calibrate*`), the time model and the links each group uses
(`time_model`, a stage's terms `stage_time`, `comm_time`, `links`, `traffic`), the layout
search and `layout=auto` (`space`, `search`, `report`, `auto`). The names below are its public
API, imported when first used (so that a light module of the package, e.g. `devices`, does not
import torch). The ZeRO table is `megalite.plan.zero_table.zero_table()`."""
import importlib

_API = {"Plan": "megalite.plan.memory", "make_plan": "megalite.plan.memory"}
__all__ = list(_API)


def __getattr__(name: str):
    if name not in _API:
        raise AttributeError(f"module 'megalite.plan' has no attribute {name!r}")
    return getattr(importlib.import_module(_API[name]), name)
