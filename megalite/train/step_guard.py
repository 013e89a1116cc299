"""The guarded part of an optimizer step (`Trainer.train_step`), between its batch and its
update: each execution of the step's forward/backward and gradient reductions (execution 0;
later ones are resilience.rerun's re-executions, `megalite.resilience.rerun`), run inside
resilience.inject's drill when one is armed; and the accounting after the verdict — a step
skipped for a non-finite gradient or as bad data, the fp16 loss scale's response, the stop
after train.max_bad_steps skipped steps in a row.
"""
from __future__ import annotations

import contextlib
from typing import Tuple

import torch


class NonFiniteError(FloatingPointError):
    """Too many consecutive steps with a NaN/inf loss or gradient."""


def execute_step(trainer, execution: int, micro_batches: list, scale: float
                 ) -> Tuple[torch.Tensor, torch.Tensor]:
    """One execution of `trainer`'s step on `micro_batches` (loss scale `scale`), within
    resilience.inject's drill if armed; returns (this rank's mean loss, the global grad norm,
    unscaled)."""
    timers = trainer.timers
    drill = contextlib.nullcontext() if trainer.injector is None \
        else trainer.injector.around(trainer.step + 1, execution)
    with drill:
        with timers.phase("forward_backward"):
            loss = trainer.schedule.train_step(micro_batches, loss_scale=scale)
        with timers.phase("grad_sync"):
            trainer.engine.finish_grad_sync()
    with timers.phase("optimizer"):
        return loss, trainer.engine.grad_norm() / scale


def count_skipped(trainer, finite: bool, data_skip: bool = False) -> None:
    """After `trainer`'s step: skipped steps (non-finite, or a batch resilience.rerun skipped),
    the loss scale's response, and NonFiniteError after too many in a row. A finite batch
    skipped as bad data is neither a good step for the dynamic scale's growth window nor an
    overflow: the scale does not see it."""
    scaler = trainer.loss_scaler
    counted = scaler is not None and not (finite and data_skip)
    absorbed = counted and scaler.update(overflow=not finite)
    if finite and not data_skip:
        trainer.bad_in_a_row = 0
    else:
        trainer.progress.skipped_steps += 1
        trainer.bad_in_a_row = 0 if absorbed else trainer.bad_in_a_row + 1
    max_bad = trainer.cfg.train.max_bad_steps
    if trainer.bad_in_a_row >= max_bad:
        at_floor = "" if scaler is None else (
            f" at the dynamic loss scale's floor loss_scale.min={scaler.scale:g}"
            if scaler.dynamic else f" at the static loss_scale.static={scaler.scale:g}")
        raise NonFiniteError(
            f"{trainer.bad_in_a_row} steps in a row (up to step {trainer.step}) had a "
            f"non-finite loss or gradient{at_floor} (train.max_bad_steps={max_bad}); lower "
            "optim.lr, check the data, or resume from an earlier checkpoint")
