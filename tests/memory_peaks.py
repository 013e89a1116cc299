"""Real training steps' peak live tensor bytes next to the memory plan's peak: the helper the
plan's tests share (tests/unit/plan/test_plan.py in this process, tests/integration/plan/test_plan.py on
spawned gloo ranks).

The peak is that of a run's second step (the first allocates AdamW's moments in its optimizer
step: from the second on every state is alive through a whole step): the bytes of every tensor
of the run alive before it (`megalite_bench.memory.live_tensor_bytes`, found through the
garbage collector, less what the process held before the run was built) + the most bytes
the step's own allocations hold at once (`megalite_bench.memory.PeakBytes`: the CPU
allocator's events recorded by the profiler, replayed in time order). Measuring one step
keeps what gloo's worker thread frees out of the profiler's sight at the end of the first (a
step's last gradient reduction) from counting."""
from __future__ import annotations

from pathlib import Path
from typing import Dict, List

import pytest

from megalite.config.layout import Layout, validate
from megalite.config.schema import load_config
from megalite.plan.memory import make_plan
from megalite.train.build import build_trainer
from megalite.train.runtime import init_runtime
from megalite_bench.memory import PeakBytes, live_storages, live_tensor_bytes
from tests.conftest import TINY
from tests.layouts import FP32_NO_DROPOUT


def overrides(data: Path, run: List[str]) -> List[str]:
    return TINY + FP32_NO_DROPOUT + [f"data.dir={data}"] + run


def measured_peak(data: Path, run: List[str], run_dir: Path, world: int = 1
                  ) -> Dict[str, int]:
    """This rank's peak live tensor bytes in the second step of `run`, and its pipeline
    stage."""
    cfg = load_config(overrides(data, run))
    validate(cfg, world)
    before = live_storages()  # other tests' tensors, alive in this process
    trainer = build_trainer(cfg, init_runtime(cfg), run_dir)
    trainer.train_step()
    base = live_tensor_bytes(before=before)
    with PeakBytes() as peak:
        trainer.train_step()
    return {"peak": base + peak.bytes, "stage": trainer.topo.coords.pp_rank}


def peaks_rank(rank: int, world: int, data: Path, runs: List[List[str]], run_dir: Path
               ) -> List[Dict[str, int]]:
    """A spawned rank's `measured_peak` of each run, in turn."""
    return [measured_peak(data, run, run_dir / f"run{i}_rank{rank}", world)
            for i, run in enumerate(runs)]


def assert_plan_holds(data: Path, run: List[str], world: int, measured: Dict[str, int],
                      moment: str, rel: float = 0.05) -> None:
    """The plan's peak for the measured rank's stage is within `rel` of the measured peak,
    at `moment` (the term that dominates the configuration decides where it peaks)."""
    cfg = load_config(overrides(data, run))
    stage = make_plan(cfg, Layout.from_config(cfg, world, "cpu")).stages[measured["stage"]]
    terms = {name: {k: round(v) for k, v in m.items()} for name, m in stage.moments.items()}
    assert stage.peak_at == moment, (run, stage.peak_at, terms)
    assert measured["peak"] == pytest.approx(stage.bytes["total"], rel=rel), \
        (run, measured, terms)
