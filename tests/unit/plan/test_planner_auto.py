"""layout=auto (megalite/plan/auto.py): the same choice from the same inputs, explicit layout
keys held fixed, a clear refusal when nothing fits, and a 2-rank run that trains like the
serial run and records its prediction next to the measured step time."""
from __future__ import annotations

import pytest

from megalite.config.errors import ConfigError
from megalite.config.schema import load_config
from megalite.plan.auto import launch_layout, run_profile
from megalite.plan.devices import device_profile
from tests.conftest import TINY

AUTO = ["layout=auto", "train.global_batch_size=8", "train.micro_batch_size=2",
        "train.max_steps=2", "checkpoint.every=0", "resilience.check_every=0",
        "resilience.straggler_report_every=0"]


def test_choice_is_pure_and_holds_explicit_keys():
    cfg = load_config(TINY + AUTO)
    a_cfg, a = launch_layout(cfg, 4, None, 4, [])
    b_cfg, b = launch_layout(load_config(TINY + AUTO), 4, None, 4, [])
    assert a.overrides == b.overrides and a_cfg == b_cfg and a.profile == "cpu"
    fixed = TINY + AUTO + ["tp=2", "zero=1"]
    held_cfg, held = launch_layout(load_config(fixed), 4, None, 4, fixed)
    assert held.fixed == {"micro_batch_size": 2, "tp": 2, "zero": 1}
    assert (held_cfg.tp, held_cfg.zero) == (2, 1)
    assert "held fixed (given on the command line): micro_batch_size=2, tp=2, zero=1" \
        in held.why
    with pytest.raises(ConfigError, match=r"layout=.auto.*tp=3.*no layout"):
        launch_layout(load_config(TINY + AUTO + ["tp=3"]), 4, None, 4, ["tp=3"])
    with pytest.raises(ConfigError, match="planner.device.*known: .*h100-80gb"):
        run_profile(load_config(["planner.device=h100-90gb"]), None)
    assert run_profile(load_config(["planner.device=a100-40gb"]), None) == \
        device_profile("a100-40gb")
