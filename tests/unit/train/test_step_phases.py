"""Where a step's time goes (megalite.train.timers), reported per phase for the slowest rank,
and Python's garbage collector run at fixed steps (megalite.train.gc_control)."""
from __future__ import annotations

import pytest

from megalite.config.errors import ConfigError
from megalite.config.layout import validate
from megalite.config.schema import load_config
from tests.conftest import TINY


def test_gc_every_must_be_positive():
    with pytest.raises(ConfigError, match="train.gc_every=0: must be >= 1"):
        validate(load_config(TINY + ["train.gc_every=0"]), 1)
