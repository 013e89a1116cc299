"""The configuration layer: the typed schema behind `conf/*.yaml` (`schema`, `sections`), the one
error every check raises (`errors`), the run's `Layout` and the checks before launch (`layout`),
the pipeline's partition of the blocks (`stage_partition`), the schedules' rules and bubble
(`schedule_rules`) and the fault drill's syntax (`inject`). It imports nothing else of megalite
but `megalite.utils`. The names below are its public API."""
from megalite.config.errors import ConfigError  # noqa: F401
from megalite.config.layout import Layout, validate  # noqa: F401
from megalite.config.schema import Config, load_config  # noqa: F401
