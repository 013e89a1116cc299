"""layout=auto (megalite/plan/auto.py): the same choice from the same inputs, explicit layout
keys held fixed, a clear refusal when nothing fits, and a 2-rank run that trains like the
serial run and records its prediction next to the measured step time."""
from __future__ import annotations

import json

import pytest

from megalite.config.layout import validate
from megalite.config.schema import load_config
from megalite.plan.auto import launch_layout
from megalite.testing.spawn import run_ranks
from megalite.train.build import build_trainer
from megalite.train.runtime import init_runtime
from tests.conftest import TINY
from tests.layouts import FP32_NO_DROPOUT, close
from tests.unit.plan.test_planner_auto import AUTO


def _fit(rank, world, overrides, run_dir):
    cfg = load_config(overrides)
    cfg, auto = launch_layout(cfg, world, None, world, overrides)
    validate(cfg, world)
    trainer = build_trainer(cfg, init_runtime(cfg), run_dir, planner=auto.record())
    records = trainer.fit()
    return {"records": records, "layout": trainer.layout.as_dict(), "chosen": auto.overrides}


@pytest.mark.distributed
def test_auto_layout_trains_like_the_serial_run_and_records_its_prediction(tiny_data,
                                                                           tmp_path):
    common = TINY + FP32_NO_DROPOUT + [f"data.dir={tiny_data}"] + AUTO
    ranks = run_ranks(_fit, 2, args=(common, str(tmp_path / "auto")), timeout_s=300)
    serial_cfg = load_config(common + ["layout=manual"])
    validate(serial_cfg, 1)
    serial = build_trainer(serial_cfg, init_runtime(serial_cfg), tmp_path / "serial").fit()
    chosen = ranks[0]["layout"]
    assert chosen["world_size"] == 2 and ranks[1]["chosen"] == ranks[0]["chosen"]
    for got, want in zip(ranks[0]["records"], serial):
        assert close(got["loss"], want["loss"], 1e-5), (chosen, got["loss"], want["loss"])
        assert close(got["grad_norm"], want["grad_norm"], 1e-5)
    lines = [json.loads(x) for x in (tmp_path / "auto" / "metrics.jsonl").read_text().split("\n")
             if x]
    header = lines[0]["run"]
    assert header["planner"]["chosen"] == ranks[0]["chosen"]
    assert header["layout"] == chosen and header["planner"]["prediction"]["step_s"] > 0
    assert all(r["predicted_step_time_s"] == header["planner"]["prediction"]["step_s"]
               and r["step_time_s"] > 0 for r in lines[1:])
