"""Stopping early and cleanly (train.max_minutes, train.exit_signal): every rank stops after
the same step with a checkpoint of it, and checkpoint.resume=auto continues from there."""
from __future__ import annotations

import pytest

from megalite.config.errors import ConfigError
from megalite.config.layout import validate
from megalite.config.schema import load_config
from tests.conftest import TINY


@pytest.mark.parametrize("override,key", [("train.max_minutes=0", "train.max_minutes"),
                                          ("train.exit_signal=SIGKILL", "train.exit_signal")])
def test_bad_stop_settings_are_refused(override, key):
    with pytest.raises(ConfigError, match=key):
        validate(load_config(TINY + [override]), 1)
