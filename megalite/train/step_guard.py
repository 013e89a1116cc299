"""The step object the Trainer owns (`StepGuard`): the guarded part of an optimizer step
(`Trainer.train_step`), between its batch and its update: each execution of the step's
forward/backward and gradient reductions (execution 0; later ones are resilience.rerun's
re-executions, `megalite.resilience.rerun`), run inside resilience.inject's drill when one is
armed; and the accounting after the verdict — a step skipped for a non-finite gradient or as
bad data, the fp16 loss scale's response, the stop after train.max_bad_steps skipped steps in
a row. No module but `megalite.train.trainer` holds it or writes the Trainer's fields.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Optional, Tuple

import torch

from megalite.checkpoint.state import Progress
from megalite.config.train_section import TrainConfig
from megalite.parallel.pipeline import PipelineSchedule
from megalite.parallel.zero import ZeroEngine
from megalite.resilience.inject import FaultInjector
from megalite.train.loss_scale import LossScaler
from megalite.train.timers import StepTimers


class NonFiniteError(FloatingPointError):
    """Too many consecutive steps with a NaN/inf loss or gradient."""


@dataclass(eq=False)
class StepGuard:
    """The guarded part of the steps of one Trainer, which makes and owns it: the parts a step
    executes with, the drill, the loss scale, and its own count of skipped steps in a row."""

    schedule: PipelineSchedule
    engine: ZeroEngine
    timers: StepTimers
    progress: Progress  # the step and the skipped steps (checkpointed)
    train: TrainConfig  # its max_bad_steps, read at each step
    loss_scaler: Optional[LossScaler] = None  # precision=fp16
    injector: Optional[FaultInjector] = None  # resilience.inject's drill
    bad_in_a_row: int = field(default=0, init=False)  # skipped steps in a row

    def execute(self, execution: int, micro_batches: list, scale: float
                ) -> Tuple[torch.Tensor, torch.Tensor]:
        """One execution of the next step on `micro_batches` (loss scale `scale`), within
        resilience.inject's drill if armed; returns (this rank's mean loss, the global grad
        norm, unscaled)."""
        timers = self.timers
        drill = contextlib.nullcontext() if self.injector is None \
            else self.injector.around(self.progress.step + 1, execution)
        with drill:
            with timers.phase("forward_backward"):
                loss = self.schedule.train_step(micro_batches, loss_scale=scale)
            with timers.phase("grad_sync"):
                self.engine.finish_grad_sync()
        with timers.phase("optimizer"):
            return loss, self.engine.grad_norm() / scale

    def count_skipped(self, finite: bool, data_skip: bool = False) -> None:
        """After a step (counted in `progress` already): skipped steps (non-finite, or a
        batch resilience.rerun skipped), the loss scale's response, and NonFiniteError after
        too many in a row. A finite batch skipped as bad data is neither a good step for the
        dynamic scale's growth window nor an overflow: the scale does not see it."""
        scaler = self.loss_scaler
        counted = scaler is not None and not (finite and data_skip)
        absorbed = counted and scaler.update(overflow=not finite)
        if finite and not data_skip:
            self.bad_in_a_row = 0
        else:
            self.progress.skipped_steps += 1
            self.bad_in_a_row = 0 if absorbed else self.bad_in_a_row + 1
        max_bad = self.train.max_bad_steps
        if self.bad_in_a_row >= max_bad:
            at_floor = "" if scaler is None else (
                f" at the dynamic loss scale's floor loss_scale.min={scaler.scale:g}"
                if scaler.dynamic else f" at the static loss_scale.static={scaler.scale:g}")
            raise NonFiniteError(
                f"{self.bad_in_a_row} steps in a row (up to step {self.progress.step}) had a "
                f"non-finite loss or gradient{at_floor} (train.max_bad_steps="
                f"{max_bad}); lower optim.lr, check the data, or resume from an "
                "earlier checkpoint")
