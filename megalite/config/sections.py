"""The configuration sections of a run's services — logging, fp16 loss scaling, checkpoints,
downstream evaluation, offload, resilience — each checking its own fields
(`megalite.config.schema` composes them into `Config`, with the model, data, training,
optimizer and parallel sections)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

from megalite.config.errors import fail
from megalite.config.inject import parse_inject


@dataclass
class LogConfig:
    every: int = 10  # steps between metric lines
    wandb: str = "auto"  # auto (online with credentials, else offline) | true | offline | false
    project: str = "megalite"
    run_name: Optional[str] = None
    peak_tflops: Optional[float] = None  # per-device peak FLOP/s override (TFLOP/s) for MFU
    progress: bool = True  # console progress bar
    pipeline_trace: bool = False  # write each rank's F/B schedule trace (Chrome trace format)
    #                              to <run dir>/pipeline_trace/ at every log step
    profile_steps: Optional[List[int]] = None  # [first, last]: run these steps (numbered as in
    #                                             metrics.jsonl) under torch.profiler; per rank
    #                                             a Chrome trace + top-ops table in <run dir>/profile/
    all_ranks: bool = False  # every rank logs its messages (megalite/utils/log.py); false = rank 0 only

    def check(self) -> None:
        if self.wandb not in ("auto", "true", "offline", "false"):
            fail("log.wandb", self.wandb, "use auto, true, offline or false")
        if self.every < 1:
            fail("log.every", self.every, "must be >= 1")
        steps = self.profile_steps
        if steps is not None and (len(steps) != 2 or not 1 <= steps[0] <= steps[1]):
            fail("log.profile_steps", list(steps),
                  "two step numbers [first, last] with 1 <= first <= last (and first <= "
                  "train.max_steps), e.g. [10, 12]; null = no profiling")
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            fail("log.peak_tflops", self.peak_tflops, "must be > 0 or null (= device table)")


@dataclass
class LossScaleConfig:
    """Loss scaling for precision=fp16 (megalite.train.loss_scale; Megatron's --loss-scale,
    --initial-loss-scale, --min-loss-scale, --loss-scale-window, --hysteresis)."""

    static: Optional[float] = None  # a fixed scale; None = dynamic scaling with the keys below
    initial: float = 65536.0  # dynamic: the first scale (2^16)
    min: float = 1.0  # dynamic: the scale never drops below this; overflows there count as
    #                   non-finite steps (train.max_bad_steps)
    window: int = 1000  # dynamic: the scale doubles after this many steps without overflow
    hysteresis: int = 2  # dynamic: overflows tolerated (skipped) before the scale halves

    def check(self) -> None:
        if self.static is not None and not (self.static > 0 and math.isfinite(self.static)):
            fail("loss_scale.static", self.static, "must be a positive number (e.g. 1024), or "
                  "null for dynamic scaling")
        for key in ("initial", "min"):
            value = getattr(self, key)
            if not (value > 0 and math.isfinite(value)):
                fail(f"loss_scale.{key}", value, f"must be a positive number (default "
                      f"{getattr(LossScaleConfig, key)})")
        if self.min > self.initial:
            fail("loss_scale.min", self.min, f"must be <= loss_scale.initial={self.initial}")
        for key in ("window", "hysteresis"):
            if getattr(self, key) < 1:
                fail(f"loss_scale.{key}", getattr(self, key), f"must be >= 1 (default "
                      f"{getattr(LossScaleConfig, key)})")


@dataclass
class CheckpointConfig:
    dir: Optional[str] = None  # None = <run dir>/checkpoints
    every: int = 0  # steps between checkpoints (0 = only at the end)
    resume: str = "none"  # none | auto (latest complete checkpoint in dir) | path to a checkpoint
    keep: int = 3  # most recent checkpoints kept
    async_save: bool = False  # write in a background thread: the loop only waits for a copy of
    #                           the rank's state in host memory (torchtitan's async checkpoint)
    timeout_s: float = 3600.0  # timeout of the checkpoint protocol's collectives (its own gloo
    #                            group): how long ranks wait for the slowest writer or reader

    def check(self) -> None:
        if self.every < 0 or self.keep < 1:
            fail("checkpoint.every/keep", (self.every, self.keep),
                  "every must be >= 0 (0 = only at the end), keep >= 1")
        if not (self.timeout_s > 0 and math.isfinite(self.timeout_s)):
            fail("checkpoint.timeout_s", self.timeout_s, "must be a positive number of "
                  "seconds (e.g. 3600: the slowest rank's write of its share, with fsync)")
        if self.resume not in ("none", "auto") and not Path(self.resume).exists():
            fail("checkpoint.resume", self.resume,
                  "use none, auto, or the path of an existing checkpoint directory")


@dataclass
class EvalConfig:
    """Downstream evaluation at every `train.eval_every` steps, next to the validation loss
    (`megalite.eval`)."""

    hellaswag: Optional[str] = None  # HellaSwag examples: a local .jsonl / .json / .parquet
    #                                  file (fields ctx, endings, label) or a hub dataset id
    #                                  (its validation split); null = no HellaSwag evaluation
    hellaswag_examples: Optional[int] = None  # the first N examples in file order; null = all

    def check(self) -> None:
        if self.hellaswag is not None and not str(self.hellaswag).strip():
            fail("eval.hellaswag", self.hellaswag, "name a HellaSwag .jsonl/.parquet file (e.g. "
                  "hellaswag_val.jsonl) or a hub dataset id, or null (off)")
        n = self.hellaswag_examples
        if n is not None and (isinstance(n, bool) or n < 1):
            fail("eval.hellaswag_examples", n, "must be a positive number of examples (the "
                  "first N of the file), or null for all of them")


@dataclass
class OffloadConfig:
    """Training state kept in host memory instead of the device's (docs/offload.md:
    Activation offload); the copies overlap compute on CUDA and save nothing on CPU."""

    activations: bool = False  # what the transformer blocks save for backward goes to host
    #                            memory in forward and comes back in backward (parameters stay)
    activations_layers: Optional[int] = None  # with activations: only the first N blocks of
    #   each pipeline stage (each model chunk with virtual stages) that are not recomputed
    #   (train.recompute_layers come first); None = every block not recomputed
    optimizer: float = 0.0  # the fraction (0..1) of this rank's owned optimizer range whose
    #   fp32 master weights and AdamW moments live in host memory, stepped by the CPU AdamW
    #   (0 = off, 1 = all; docs/offload.md: Optimizer offload)

    def messages(self, device_type: str) -> List[str]:
        """What a run should know about offload.optimizer before it starts."""
        if self.optimizer > 0 and device_type != "cuda":
            return [f"offload.optimizer={self.optimizer:g} on CPU: the optimizer state is "
                    "copied from host memory to host memory, which saves nothing (the offload "
                    "path runs, for testing); on CUDA it lives in pinned host memory"]
        return []

    def check(self) -> None:
        f = self.optimizer
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 <= f <= 1.0:
            fail("offload.optimizer", f, "must be a fraction between 0 and 1 (0 = off, 0.5 = "
                 "half of each rank's optimizer state in host memory, 1 = all of it)")
        n = self.activations_layers
        if n is not None and (isinstance(n, bool) or n < 1 or not self.activations):
            fail("offload.activations_layers", n,
                 "needs offload.activations=true and a value >= 1 (the blocks offloaded at the "
                 "start of each pipeline stage, after the recomputed ones), or null for every "
                 "block")


HANG_SIGNALS = ("SIGUSR1", "SIGUSR2", None)
HANG_AFTER_FRACTION = 0.8  # resilience.hang_after_s=null: this fraction of a group's timeout


@dataclass
class ResilienceConfig:
    """Faults that do not crash (`megalite.resilience`): replicas that silently diverge,
    ranks that silently slow the others down, and ranks that hang the others."""

    check_every: int = 100  # steps between replica-consistency checks (0 = off): the ranks
    #   that must hold identical values compare checksums after the optimizer step, and a
    #   mismatch stops the run naming ranks, tensors and step; when > 0 every checkpoint step
    #   is checked too, before the checkpoint is taken
    tp_rtol: float = 1e-3  # TP replicas without sp (each TP rank computes their gradients
    #   itself; GPU kernels need not be deterministic) are compared within this tolerance:
    #   per 4096-element chunk of each tensor, the replicas' sums may differ by tp_rtol x the
    #   chunk's L1 norm (0 = bitwise)
    straggler_report_every: int = 100  # steps per straggler window (0 = off): each rank's
    #   compute time per step phase, without the time it waited in collectives, gathered
    #   every N steps; a slow rank is named in the log and metrics.jsonl
    straggler_factor: float = 1.5  # slower than the median of its pipeline stage's ranks by
    #   this factor ...
    straggler_min_s: float = 0.1  # ... and by at least this many seconds per step
    hang_dump: bool = True  # record each rank's last collectives per group; when one fails
    #   or times out, every rank writes its thread stacks and those to <run dir>/hang/ and
    #   the rank that noticed names the ranks that did not arrive (hang/summary.txt)
    hang_history: int = 32  # collectives remembered per group and rank
    hang_wait_s: float = 10.0  # how long the rank that noticed waits for the others' dumps
    hang_after_s: Optional[float] = None  # an operation (collective, pipeline transfer, object
    #   collective) of a training group not complete this long after its launch is a hang:
    #   every rank dumps before NCCL's watchdog (parallel.timeout_s) ends the processes; must be
    #   below parallel.timeout_s. The checkpoint group gets the same fraction of its own
    #   timeout (checkpoint.timeout_s). null: HANG_AFTER_FRACTION (0.8) of each group's timeout
    hang_signal: Optional[str] = "SIGUSR2"  # SIGUSR1 | SIGUSR2 | null: sent to any rank of a
    #   live run, every rank dumps and training goes on
    rerun: str = "off"  # off | on_nan | on_spike: re-execute a suspicious step before its
    #   optimizer step and attribute it to a transient fault (named ranks), a persistent fault
    #   or the data (megalite.resilience.rerun)
    spike_factor: float = 3.0  # on_spike: a loss or grad norm above factor x its running median
    spike_window: int = 100  # on_spike: the running median is over this many applied steps
    spike_warmup: Optional[int] = None  # on_spike: steps recorded before spikes are judged
    rerun_tolerance: float = 1e-5  # relative difference under which two executions of a
    #   step agree (0 = bitwise); changes of several DP replicas' own results at once are
    #   called non-determinism, not a fault (megalite.resilience.verdicts)
    rerun_deterministic: bool = True  # with rerun on CUDA: torch's deterministic algorithms
    #   for the whole run, so that a re-execution reproduces a healthy step (costs speed)
    inject: Optional[str] = None  # fault drill (megalite.config.inject), e.g.
    #   rank:1/step:3/target:param/kind:transient; refused unless allow_inject=true
    allow_inject: bool = False  # the explicit switch that lets resilience.inject run

    def check(self) -> None:
        for key in ("check_every", "straggler_report_every"):
            value = getattr(self, key)
            if isinstance(value, bool) or value < 0:
                fail(f"resilience.{key}", value, "must be >= 0 steps (0 = off; e.g. 100)")
        if not (self.straggler_factor > 1 and math.isfinite(self.straggler_factor)):
            fail("resilience.straggler_factor", self.straggler_factor,
                 "must be a number > 1 (e.g. 1.5: a rank 50% slower than the median)")
        if not (self.straggler_min_s >= 0 and math.isfinite(self.straggler_min_s)):
            fail("resilience.straggler_min_s", self.straggler_min_s,
                 "must be >= 0 seconds per step (e.g. 0.1; 0 = the factor alone decides)")
        if not (0 <= self.tp_rtol < 1 and math.isfinite(self.tp_rtol)):
            fail("resilience.tp_rtol", self.tp_rtol,
                 "must be >= 0 and < 1 (e.g. 1e-3; 0 = TP replicas compared bitwise)")
        self._check_hang()
        self._check_rerun()

    def _check_hang(self) -> None:
        if isinstance(self.hang_history, bool) or self.hang_history < 1:
            fail("resilience.hang_history", self.hang_history,
                 "must be >= 1 collective per group (e.g. 32)")
        if not (self.hang_wait_s > 0 and math.isfinite(self.hang_wait_s)):
            fail("resilience.hang_wait_s", self.hang_wait_s,
                 "must be a positive number of seconds (e.g. 10)")
        if self.hang_signal not in HANG_SIGNALS:
            fail("resilience.hang_signal", self.hang_signal,
                 "use SIGUSR1 or SIGUSR2, or null (no dump on a signal)")
        after = self.hang_after_s
        if after is not None and (isinstance(after, bool) or not (after > 0 and
                                                                  math.isfinite(after))):
            fail("resilience.hang_after_s", after, "must be a positive number of seconds below "
                 "parallel.timeout_s (e.g. 480 of 600), or null (0.8 of each group's timeout)")

    def check_with_timeout(self, timeout_s: float) -> None:
        """The hang threshold fires before the collective timeout (NCCL's watchdog)."""
        if self.hang_after_s is not None and self.hang_after_s >= timeout_s:
            fail("resilience.hang_after_s", self.hang_after_s,
                 f"must be below parallel.timeout_s={timeout_s:g}: a hang is dumped before "
                 "the timeout ends the processes (NCCL's watchdog); e.g. "
                 f"{HANG_AFTER_FRACTION * timeout_s:g}, or null")

    def hang_thresholds(self, timeout_s: float, checkpoint_timeout_s: float
                        ) -> Tuple[float, float]:
        """(seconds, seconds): the hang threshold of the training groups (timeout `timeout_s`,
        parallel.timeout_s) and of the checkpoint group (checkpoint.timeout_s): the same
        fraction of each group's own timeout."""
        fraction = HANG_AFTER_FRACTION if self.hang_after_s is None \
            else self.hang_after_s / timeout_s
        return fraction * timeout_s, fraction * checkpoint_timeout_s

    def check_with_exit_signal(self, exit_signal: Optional[str]) -> None:
        """The dump signal must not be the one that stops the run (`train.exit_signal`)."""
        if self.hang_signal is not None and self.hang_signal == exit_signal:
            fail("resilience.hang_signal", self.hang_signal,
                 "is train.exit_signal too; use the other of SIGUSR1/SIGUSR2, or null")

    def _check_rerun(self) -> None:
        if self.rerun not in RERUN_MODES:
            fail("resilience.rerun", self.rerun, f"use one of {', '.join(RERUN_MODES)}")
        if not (self.spike_factor > 1 and math.isfinite(self.spike_factor)):
            fail("resilience.spike_factor", self.spike_factor,
                 "must be a number > 1 (e.g. 3: a loss or grad norm 3x its running median)")
        if isinstance(self.spike_window, bool) or self.spike_window < 1:
            fail("resilience.spike_window", self.spike_window, "must be >= 1 step (e.g. 100)")
        warmup = self.spike_warmup
        if self.rerun == "on_spike" and warmup is None:
            fail("resilience.spike_warmup", warmup, "resilience.rerun=on_spike needs a warm-up "
                 "length: the steps recorded before a spike is judged (e.g. 100)")
        if warmup is not None and (isinstance(warmup, bool) or warmup < 1):
            fail("resilience.spike_warmup", warmup, "must be >= 1 step (e.g. 100) or null")
        if not (self.rerun_tolerance >= 0 and math.isfinite(self.rerun_tolerance)):
            fail("resilience.rerun_tolerance", self.rerun_tolerance,
                 "must be >= 0 (0 = the executions must agree bitwise; e.g. 1e-5)")
        if self.inject is not None:
            if not self.allow_inject:
                fail("resilience.inject", self.inject,
                     "fault injection corrupts the run on purpose: set "
                     "resilience.allow_inject=true to run this drill, or inject=null")
            parse_inject(self.inject)


RERUN_MODES = ("off", "on_nan", "on_spike")


@dataclass
class PlannerConfig:
    """Where `layout=auto` takes its device from (`megalite.plan.memory`; docs/planner.md)."""

    device: str = "auto"  # a device profile name (h100-80gb, a100-80gb, ..., cpu); auto = the
    #                       table entry of the detected GPU, cpu without one
    profile: Optional[str] = None  # a calibrated profile file (scripts/plan.py --calibrate);
    #                                overrides device
    gpus_per_node: Optional[int] = None  # ranks per node; None = the ranks started on this
    #                                      node (torchrun --nproc_per_node)
    moe_imbalance: float = 1.0  # with ep > 1: the busiest EP rank's routed rows over the mean
    #                             (1.0: balanced; megalite-plan --moe-imbalance-from RUN reads
    #                             a run's logged figures; megalite.plan.expert_time)

    def check(self) -> None:
        f = self.moe_imbalance
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not f >= 1.0:
            fail("planner.moe_imbalance", f, "must be a number >= 1.0 (the busiest EP rank's "
                 "routed rows over the mean; 1.0 is balanced routing)")
        if self.gpus_per_node is not None and (isinstance(self.gpus_per_node, bool)
                                               or self.gpus_per_node < 1):
            fail("planner.gpus_per_node", self.gpus_per_node,
                 "must be a positive number of ranks per node, or null (torchrun's "
                 "--nproc_per_node)")
        if self.profile is not None and not Path(self.profile).exists():
            fail("planner.profile", self.profile, "no such file; write one with "
                 "scripts/plan.py --calibrate, or use planner.device=NAME")
