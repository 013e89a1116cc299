"""The training loop. It composes the pieces; the parallel logic lives in megalite/parallel.

    data (DP-sharded sampler) -> pipeline schedule (1F1B over this rank's model stage)
        -> ZeRO engine (gradient reduction, global-norm clipping, sharded AdamW) -> metrics

One optimizer step = m = global_batch_size / (micro_batch_size * dp) micro-batches per DP rank
(the step's global batch size: `train.rampup_batch_size` grows it over the first samples),
each loss scaled by 1/m so the accumulated gradient is the gradient of the mean loss over the
rank's share; averaging over DP then gives the gradient of the mean over the global batch — the
same number the serial run computes. With context parallelism a rank's loss is the mean over
its seq_len/cp tokens of each sequence (every CP rank holds as many), and the average runs over
DP x CP (`Topology.grad_group`): again the mean over the global batch's tokens.
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, List, Optional, Tuple

import torch

from megalite.checkpoint.async_save import CheckpointSaver
from megalite.checkpoint.state import Progress, RunState
from megalite.config.layout import Layout
from megalite.config.schema import Config
from megalite.data.documents import counted_targets, with_loss_share
from megalite.data.loader import TokenShards, TrainBatches, val_batches
from megalite.eval.choice import ChoiceEval, ChoiceScores
from megalite.model.moe.step import clear_routing, routing_step
from megalite.model.stage import PipelineStage
from megalite.parallel import comm
from megalite.parallel.pipeline import PipelineSchedule
from megalite.parallel.topology import Topology
from megalite.parallel.zero import ZeroEngine
from megalite.resilience.inject import FaultInjector
from megalite.resilience.replicas import ReplicaCheck
from megalite.resilience.rerun import RerunAttribution
from megalite.resilience.stragglers import StragglerReport
from megalite.train.batch_size import BatchSizeSchedule
from megalite.train.gc_control import ScheduledGC
from megalite.train.interval import Interval
from megalite.train.loss_scale import LossScaler
from megalite.train.metrics import MetricsWriter, Peak
from megalite.train.optim import lr_at
from megalite.train.profiling import StepProfiler
from megalite.train.runtime import Runtime
from megalite.train.step_guard import StepGuard
from megalite.train.step_report import StepReport
from megalite.train.stop import StopRequest
from megalite.train.timers import StepTimers
from megalite.utils.log import get_logger


@dataclass(eq=False)
class Trainer(StepReport):
    """The loop over the parts `megalite.train.build.build_trainer` makes for one rank, all of
    them given at construction (an Optional part is off, and checked before use)."""

    cfg: Config
    rt: Runtime  # the layout, topology and device
    run_dir: Path
    # data
    data_sources: List[Tuple[Path, float]]
    val_shards: List[TokenShards]
    sampler: object  # ResumableSampler or BlendedSampler
    batches: TrainBatches
    batch_size: BatchSizeSchedule
    # the model and its parallel machinery
    model: PipelineStage
    engine: ZeroEngine
    schedule: PipelineSchedule
    loss_scaler: Optional[LossScaler]  # precision=fp16
    flops_per_token: int
    # checkpoints: the saved state (one list, `megalite.train.run_state`) and its saver
    progress: Progress  # the step and the skipped steps
    state: RunState
    saver: CheckpointSaver
    # around the steps
    stop_request: StopRequest
    profiler: StepProfiler
    timers: StepTimers
    peak: Peak
    writer: Optional[MetricsWriter]  # rank 0's
    hellaswag: Optional[ChoiceEval]  # eval.hellaswag's scoring
    planner: Optional[dict]  # layout=auto's choice and prediction (metrics header)
    # resilience services (`megalite.train.resilience_services`), None when off
    replicas: Optional[ReplicaCheck]  # resilience.check_every
    stragglers: Optional[StragglerReport]  # resilience.straggler_report_every
    hang_watch: Optional[contextlib.AbstractContextManager]  # resilience.hang_dump
    rerun: Optional[RerunAttribution]  # resilience.rerun
    injector: Optional[FaultInjector]  # resilience.inject's drill
    # the loop's own
    guard: StepGuard = field(init=False)  # executions, skip accounting, loss scale, drills
    last_batch_size: int = field(default=0, init=False)  # of the last step taken
    last_lr: float = field(default=0.0, init=False)
    last_micro_batches: list = field(default_factory=list, init=False)  # of the last step
    last_moe: Optional[dict] = field(default=None, init=False)  # the last step's MoE figures
    _val: Optional[List[Tuple[torch.Tensor, torch.Tensor]]] = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.guard = StepGuard(self.schedule, self.engine, self.timers, self.progress,
                               self.cfg.train, self.loss_scaler, self.injector)

    @property
    def rank(self) -> int:
        return self.topo.rank

    @property
    def topo(self) -> Topology:
        return self.rt.topology

    @property
    def layout(self) -> Layout:
        return self.rt.layout

    @property
    def step(self) -> int:
        """Optimizer steps taken (a resumed run counts from its checkpoint's)."""
        return self.progress.step

    @property
    def skipped_steps(self) -> int:
        return self.progress.skipped_steps

    @property
    def ckpt_root(self) -> Path:
        return self.saver.root

    # --- checkpoints --------------------------------------------------------------------

    def use_rerun(self, rerun: Optional[RerunAttribution]) -> None:
        """The rerun attribution of the next steps (None: off), e.g. the one built, switched
        off and on by a benchmark that times steps with and without it (the one switched off
        stops listening to the engine's gradient launches)."""
        if self.rerun is not None and self.rerun is not rerun:
            self.rerun.listen(False)
        if rerun is not None:
            rerun.listen(True)
        self.rerun = rerun

    def save(self) -> Optional[Path]:
        """Checkpoint the current step (collective). Returns the published directory, or None
        with checkpoint.async_save (published in the background; `self.saver.wait()`). With
        resilience.check_every the step's replica check runs first unless it has passed
        (ReplicaMismatchError: nothing is saved)."""
        if self.replicas is not None and self.replicas.passed_step != self.step:
            self.replicas.check(self.step)
        self.engine.wait_for_params()  # the master ranges alias the parameters on CPU
        return self.saver.save(self.engine, self.state.capture())

    # --- the loss share -----------------------------------------------------------------

    def _with_loss_share(self, micro_batches: list) -> list:
        """train.eos_loss=false: the micro-batches with the loss share of their step (or of the
        validation set), from the counted targets summed over DP x CP
        (`megalite.data.documents.with_loss_share`); else unchanged."""
        rule = self.batches.documents
        if rule is None or rule.eos_loss:
            return micro_batches
        group = self.topo.grad_group
        counted = comm.all_reduce_scalars([counted_targets(micro_batches)], group,
                                          device=self.rt.device)[0]
        return with_loss_share(micro_batches, counted, group.size)

    # --- the loop -----------------------------------------------------------------------

    def train_step(self) -> Tuple[Optional[float], float]:
        """One optimizer step; returns (this replica's mean loss on the last stage, 0.0 on the
        others, None if the step was skipped; the global grad norm).

        A NaN/inf global gradient norm (the same number on every rank, so every rank decides
        alike) skips the update: the batch is consumed, the step counted in `skipped_steps`;
        `train.max_bad_steps` such steps in a row stop the run. With fp16 the gradients carry
        the loss scale: the norm and the update are unscaled, and an overflow that the
        dynamic scale absorbs (by shrinking) does not count towards max_bad_steps. With
        resilience.rerun a suspicious step is judged before its optimizer step
        (`megalite.resilience.rerun`): a batch judged bad data is skipped and counted alike."""
        lr = lr_at(self.step, self.cfg.optim, self.cfg.train.max_steps)
        scale = self.loss_scaler.scale if self.loss_scaler is not None else 1.0
        self.model.train()
        timers = self.timers
        self.last_batch_size = self.batch_size.at(self.sampler.consumed_samples)
        with timers.phase("data"):
            micro_batches = self._with_loss_share(self.batches.next_step(self.last_batch_size))
        self.last_micro_batches = micro_batches
        if self.rerun is not None:
            self.rerun.before_step()

        def execute(execution: int, batches: list) -> Tuple[torch.Tensor, torch.Tensor]:
            clear_routing(self.model.chunks)  # an execution's routing figures alone
            return self.guard.execute(execution, batches, scale)

        loss, norm = execute(0, micro_batches)
        finite = math.isfinite(norm.item())
        skip = self.rerun is not None and self.rerun.judge(  # resilience.rerun: before the
            self.step + 1, loss, norm, micro_batches,       # optimizer step, maybe re-executed
            self.batches.last_samples, execute)
        with timers.phase("optimizer"):
            # MoE: the step's expert counts over DP x CP, the selection bias updated from them;
            # every stage's figures on every rank (the logging rank's are the whole model's)
            self.last_moe = routing_step(self.model.chunks, self.topo.grad_group,
                                         finite and not skip, self.topo.pp_group,
                                         self.rt.device)
            if finite and not skip:
                self.engine.clip_and_step(lr, self.cfg.optim.grad_clip, norm, grad_scale=scale)
            self.engine.zero_grad()
        self.last_lr = lr
        self.progress.step += 1
        self.guard.count_skipped(finite, skip)
        return (loss.item() if finite and not skip else None), norm.item()

    def val_batches(self) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """This DP rank's share of the fixed validation set, read at the first evaluation (a
        run with train.eval_every=0 needs no validation windows)."""
        if self._val is None:
            t, c = self.cfg.train, self.topo.coords
            self._val = self._with_loss_share(val_batches(self.val_shards, t.micro_batch_size, t.seq_len,
                                    t.eval_steps, t.global_batch_size, dp_rank=c.dp_rank,
                                    dp_size=self.topo.dp_size, device=self.rt.device,
                                    weights=[w for _, w in self.data_sources],
                                    reads=self.batches.reads,
                                    documents=self.batches.documents, cp=self.batches.cp))
        return self._val

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        loss = self.schedule.evaluate(self.val_batches())
        self.engine.release_params()
        return self._global_mean(loss)

    def evaluate_hellaswag(self) -> ChoiceScores:
        """eval.hellaswag's examples scored (collective; every rank gets every score)."""
        if self.hellaswag is None:
            raise ValueError("eval.hellaswag is not set: this run has no examples to score")
        return self.hellaswag.evaluate(self.model, self.engine)

    def _downstream(self) -> dict:
        """The metrics of the evaluations beyond the validation loss (none when off)."""
        if self.hellaswag is None:
            return {}
        scores = self.evaluate_hellaswag()
        return {"hellaswag_acc": scores.acc, "hellaswag_acc_norm": scores.acc_norm}

    def fit(self, around_step: Optional[Callable] = None) -> List[dict]:
        """Train to train.max_steps: evaluate, check replicas, report stragglers, checkpoint
        and log on their schedules (a step that evaluates or reports stragglers also writes a
        metrics line; a checkpointed step is replica-checked first). Returns the metric
        records. A background save still in flight is waited for at the end (also when
        training fails, so the last checkpoint taken gets published). `around_step`: a
        caller's hook around each step (a benchmark times one beside it), called with
        `train_step` and returning its result."""
        try:
            records = self._fit(around_step or (lambda step: step()))
        except BaseException:
            with contextlib.suppress(Exception):  # the training error is the one to report
                self.saver.close()
            raise
        finally:
            self.batches.close()  # the token shards' descriptors (reopened if read again)
            if self.engine.offload is not None:  # its worker thread (restarted if needed)
                self.engine.offload.close()
        self.saver.close()
        if self.writer is not None:
            self.writer.close()
        return records

    def check_after_step(self, saving: bool) -> Optional[dict]:
        """The resilience checks after an optimizer step (collective): the replica check when
        due or when this step is about to be checkpointed (`saving`; it raises
        ReplicaMismatchError before anything is saved), and the straggler report when due.
        Returns the report ({} on ranks other than 0), None when none was due."""
        if self.replicas is not None and self.replicas.due(self.step, saving):
            self.replicas.check(self.step)
        if self.stragglers is None or not self.stragglers.due(self.step):
            return None
        report = self.stragglers.report(self.step, self.timers.take_compute())
        return {} if report is None else report

    def _fit(self, around_step: Callable) -> List[dict]:
        cfg, t = self.cfg, self.cfg.train
        counter = self.topo.counter
        records: List[dict] = []
        self.rt.synchronize()
        interval = Interval()
        self.timers.reset()  # phases of steps run outside fit are not this interval's
        if self.stragglers is not None:
            self.stragglers.start(self.step)
        with self.stop_request as stop, ScheduledGC(t.gc_every) as collector, \
                self.hang_watch or contextlib.nullcontext():
            while self.step < t.max_steps:
                before = counter.snapshot()
                with self.profiler.step(self.step + 1):
                    loss, grad_norm = around_step(self.train_step)
                collector.after_step(self.step)
                interval.excluded_s += self.profiler.take_export_seconds()
                interval.add_step(loss, counter.delta(counter.snapshot(), before),
                                  self.last_batch_size, self._visible_pairs())
                stopping = stop.reason()
                end = self.step == t.max_steps
                last = end or stopping is not None
                saving = bool(cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0) \
                    or last
                stragglers = self.check_after_step(saving)
                val_loss, downstream = None, {}
                if t.eval_every and (self.step % t.eval_every == 0 or end):
                    e0 = time.perf_counter()
                    val_loss = self.evaluate()
                    downstream = self._downstream()
                    interval.excluded_s += time.perf_counter() - e0
                if saving:
                    c0 = time.perf_counter()
                    self.save()
                    interval.checkpoint_s += time.perf_counter() - c0
                if (self.step % cfg.log.every == 0 or last or val_loss is not None
                        or stragglers is not None):
                    records.append({**self._record(interval, val_loss, grad_norm),
                                    **downstream})
                    if stragglers:
                        records[-1]["straggler_report"] = stragglers
                    if self.writer is not None:
                        self.writer.log(records[-1])
                    interval = Interval()
                if stopping is not None:
                    get_logger().info(f"stopped after step {self.step} "
                                      f"({stopping}); the checkpoint of this step continues it "
                                      "with checkpoint.resume=auto")
                    break
            self.saver.wait()  # the last save published while exit_signal is still handled
        self.profiler.close()
        self.engine.wait_for_params()
        return records
