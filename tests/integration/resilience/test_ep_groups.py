"""The hang watch under expert parallelism: a rank that stops participating leaves its EP peer
waiting in the MoE layer's token exchange, and the dump names the ep group and its ranks."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from megalite.config.layout import validate
from megalite.config.schema import load_config
from megalite.parallel.calls import CommError
from megalite.testing.spawn import run_ranks
from megalite.train.build import build_trainer
from megalite.train.runtime import init_runtime
from tests.conftest import TINY
from tests.integration.model.test_moe_layouts import MOE
from tests.layouts import FP32_NO_DROPOUT
from tests.unit.resilience.test_hang import wait_for

TIMEOUT_S = 3  # parallel.timeout_s: rank 0's exchange raises after this long
HANG_AFTER = 1.5  # resilience.hang_after_s
STALL_AT = 2  # rank 1 stops participating before this step


class Stopped(Exception):
    """Rank 1 leaves the run (after it has been dumped)."""


def _stalled_ep_run(rank, world, tiny_data, run_dir):
    cfg = load_config(TINY + FP32_NO_DROPOUT + MOE + [
        f"data.dir={tiny_data}", "train.micro_batch_size=2", "train.global_batch_size=4",
        "ep=2", "zero=0", "train.max_steps=4", f"parallel.timeout_s={TIMEOUT_S}",
        f"resilience.hang_after_s={HANG_AFTER}", "resilience.hang_wait_s=2",
        "resilience.check_every=0", "resilience.straggler_report_every=0",
        "log.peak_tflops=1"])
    validate(cfg, world)
    trainer = build_trainer(cfg, init_runtime(cfg), Path(run_dir))
    dump = Path(run_dir) / "hang" / f"rank{rank:05d}.json"
    step = trainer.train_step

    def train_step():
        if rank == 1 and trainer.step + 1 == STALL_AT:
            wait_for(lambda: dump.exists() and json.loads(dump.read_text())["failure"],
                     "no failure dump")
            raise Stopped()
        return step()

    trainer.train_step = train_step
    error = None
    try:
        trainer.fit()
    except (CommError, Stopped) as e:
        error = type(e).__name__
    return {"error": error, "step": trainer.step}


@pytest.mark.distributed
def test_a_rank_stalled_under_ep_is_named_with_the_ep_group(tmp_path, tiny_data):
    """ep 2 over dp 2, no ZeRO: rank 0's first collective of step 2 is the first MoE layer's
    exchange of token counts over the ep group; rank 1 never arrives, and rank 0's hang dump
    names the all-to-all and the ep group's global ranks."""
    run_dir = tmp_path / "run"
    res = run_ranks(_stalled_ep_run, 2, args=(str(tiny_data), str(run_dir)), timeout_s=120)
    assert res[0] == {"error": "CommError", "step": STALL_AT - 1}, res
    assert res[1]["error"] == "Stopped", res
    what = json.loads((run_dir / "hang" / "rank00000.json").read_text())["request"]["what"]
    assert "all_to_all #" in what and "on the ep group (global ranks [0, 1])" in what, what
