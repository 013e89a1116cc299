"""log.profile_steps: torch.profiler over a window of steps, a trace and a table per rank."""
from __future__ import annotations

import pytest

from megalite.config.errors import ConfigError
from megalite.config.layout import validate
from megalite.config.schema import load_config
from tests.conftest import TINY


@pytest.mark.parametrize("steps", ["[3]", "[3,2]", "[0,1]", "[5,6]"])
def test_bad_profile_window_is_refused(steps):
    cfg = load_config(TINY + ["train.max_steps=4", f"log.profile_steps={steps}"])
    with pytest.raises(ConfigError, match="log.profile_steps"):
        validate(cfg, 1)
