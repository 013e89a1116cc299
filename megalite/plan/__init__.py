"""Planning: every prediction megalite makes before (or instead of) running — the memory and
traffic plan of a layout (`memory`, from `dims`, `stage_terms`, `chunks`, `offload`,
`zero_table`, context parallelism's `cp_terms`), the cheapest placement that fits (`fit`), the
device table (`devices`), device profiles and their calibration (`profile_file`,
`calibrate*`), the time model and the links each group uses (`time_model`, `comm_time`,
`links`, `traffic`), the layout search and `layout=auto` (`space`, `search`, `report`,
`auto`). The names below are its public API."""
from megalite.plan.memory import Plan, make_plan  # noqa: F401
from megalite.plan.zero_table import zero_table  # noqa: F401
