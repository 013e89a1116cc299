"""The one launch path: validate -> plan once -> runtime -> build, returning one `Run`.

    run = launch(cfg, world, run_dir)                # validated here, the layout of this launch
    ready = plan_launch(cfg, world, layout)          # a layout preflight already checked
    run = ready.start(run_dir, planner=...)          # (megalite-pretrain logs ready.plan first)

`megalite-pretrain`, the self-test and the benchmarks that train start runs here; the plan
(`megalite.plan.memory.make_plan`) is made once per launch and handed to the metrics header."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from megalite.config.layout import Layout, validate
from megalite.config.schema import Config
from megalite.plan.memory import Plan, make_plan
from megalite.train.build import broadcast_run_dir, build_trainer
from megalite.train.runtime import Runtime, init_runtime, run_layout
from megalite.train.trainer import Trainer


@dataclass
class Run:
    """A launched run on this rank: its config, layout, plan, runtime and trainer."""

    cfg: Config
    layout: Layout
    plan: Plan
    runtime: Runtime
    trainer: Trainer
    run_dir: Path


@dataclass
class PlannedLaunch:
    """A validated config, its layout and its plan, before any process group exists."""

    cfg: Config
    layout: Layout
    plan: Plan

    def start(self, run_dir, planner: Optional[dict] = None, shared_run_dir: bool = True
              ) -> Run:
        """The runtime (process group, topology), then every part of the run (`build`)."""
        return self.build(init_runtime(self.cfg, self.layout), run_dir, planner, shared_run_dir)

    def build(self, runtime: Runtime, run_dir, planner: Optional[dict] = None,
              shared_run_dir: bool = True) -> Run:
        """Every part of the run on `runtime` (made by `start`, or a caller's own, such as the
        self-test's serial world of one). `run_dir`: rank 0's is every rank's when
        `shared_run_dir` (a launcher gives each rank its own), else each rank's own.
        `planner`: layout=auto's record for the metrics header."""
        run_dir = Path(run_dir).resolve()
        if shared_run_dir:
            run_dir = broadcast_run_dir(run_dir, runtime.topology)
        trainer = build_trainer(self.cfg, runtime, run_dir, planner=planner, plan=self.plan)
        return Run(self.cfg, self.layout, self.plan, runtime, trainer, run_dir)


def plan_launch(cfg: Config, world: int, layout: Optional[Layout] = None) -> PlannedLaunch:
    """`cfg` validated on `world` ranks (unless `layout` comes from a preflight that did) and
    planned once."""
    if layout is None:
        validate(cfg, world)
        layout = run_layout(cfg)
    return PlannedLaunch(cfg, layout, make_plan(cfg, layout))


def launch(cfg: Config, world: int, run_dir, planner: Optional[dict] = None,
           shared_run_dir: bool = True) -> Run:
    """Validate, plan, start: `plan_launch(cfg, world).start(run_dir, ...)`."""
    return plan_launch(cfg, world).start(run_dir, planner, shared_run_dir)
