"""The training loop. It composes the pieces; the parallel logic lives in megalite/parallel.

    data (DP-sharded sampler) -> pipeline schedule (1F1B over this rank's model stage)
        -> ZeRO engine (gradient reduction, global-norm clipping, sharded AdamW) -> metrics

One optimizer step = m = global_batch_size / (micro_batch_size * dp) micro-batches per DP rank
(the step's global batch size: `train.rampup_batch_size` grows it over the first samples),
each loss scaled by 1/m so the accumulated gradient is the gradient of the mean loss over the
rank's share; averaging over DP then gives the gradient of the mean over the global batch — the
same number the serial run computes.
"""
from __future__ import annotations

import contextlib
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from megalite.config import Config, data_sources, num_micro_batches
from megalite.data.loader import TokenShards, TrainBatches, check_vocab, val_batches
from megalite.data.sampler import BlendedSampler, ResumableSampler
from megalite.model.gpt2 import flops_per_token, num_parameters
from megalite.model.init import init_parameters, load_global_state
from megalite.model.stage import build_stage
from megalite.parallel import comm
from megalite.parallel.pipeline import PipelineSchedule, stage_chunks
from megalite.parallel.schedule import expected_bubble
from megalite.parallel.rng import RNGTracker
from megalite.parallel.zero import ZeroEngine
from megalite.plan import make_plan
from megalite.runtime import Runtime
from megalite.train import checkpoint as ckpt
from megalite.train.async_checkpoint import CheckpointSaver
from megalite.train.batch_size import BatchSizeSchedule
from megalite.train.gc_control import ScheduledGC
from megalite.train.init_from import load_init_state
from megalite.train.loss_scale import LossScaler
from megalite.train.metrics import (MetricsWriter, Peak, peak_memory_bytes, peak_tflops,
                                    throughput)
from megalite.train.optim import lr_at
from megalite.train.profiling import StepProfiler
from megalite.train.resume import candidates as resume_candidates
from megalite.train.resume import checkpoint_root
from megalite.train.stop import StopRequest
from megalite.train.timers import PHASES, StepTimers


class NonFiniteError(FloatingPointError):
    """Too many consecutive steps with a NaN/inf loss or gradient."""


class Trainer:
    def __init__(self, cfg: Config, runtime: Runtime, run_dir: Path):
        self.cfg, self.rt, self.run_dir = cfg, runtime, Path(run_dir)
        topo = self.topo = runtime.topology
        self.rank = topo.rank
        self.data_sources = data_sources(cfg.data)
        self.train_shards = [TokenShards(d, "train") for d, _ in self.data_sources]
        self.val_shards = [TokenShards(d, "val") for d, _ in self.data_sources]
        for shards in self.train_shards:
            check_vocab(shards.meta["vocab_size"], cfg.model.vocab_size)

        c = topo.coords
        self.stages = stage_chunks(cfg.model.n_layer, topo.pp, cfg.parallel.virtual_stages,
                                   cfg.parallel.edge_stage_layers)
        self.rng = RNGTracker(cfg.seed, c.tp, c.pp, c.dp, runtime.device)
        with torch.device(runtime.device):
            self.model = build_stage(cfg.model, self.stages[c.pp], c.pp, topo.pp,
                                     tp_group=topo.tp_group, sequence_parallel=cfg.sp,
                                     rng=self.rng, recompute=cfg.train.recompute,
                                     compile=cfg.train.compile, attention=cfg.train.attention,
                                     recompute_layers=cfg.train.recompute_layers)
        init_state = load_init_state(cfg.init_from, cfg.model) if cfg.init_from else None
        for chunk in self.model.chunks:
            init_parameters(chunk, cfg.seed)  # the same global weights in every layout
            if init_state is not None:
                load_global_state(chunk, init_state)
        self.engine = ZeroEngine(
            self.model, topo, cfg.zero, cfg.optim, param_dtype=runtime.compute_dtype,
            bucket_mb=cfg.parallel.bucket_mb, sequence_parallel=cfg.sp,
            reshard_after_forward=cfg.parallel.reshard_after_forward,
            overlap_param_gather=cfg.parallel.overlap_param_gather)

        t = cfg.train
        self.num_micro = num_micro_batches(cfg, topo.world_size)
        seq_local = t.seq_len // topo.tp if cfg.sp and topo.tp > 1 else t.seq_len
        self.schedule = PipelineSchedule(
            self.model.chunks, topo, self.engine, (seq_local, t.micro_batch_size, cfg.model.n_embd),
            runtime.compute_dtype, runtime.device)
        weights = [w for _, w in self.data_sources]
        sizes = [s.num_samples(t.seq_len) for s in self.train_shards]
        self.sampler = ResumableSampler(sizes[0], t.global_batch_size, dp_rank=c.dp,
                                        dp_size=topo.dp, seed=cfg.seed) if len(sizes) == 1 \
            else BlendedSampler(sizes, weights, t.global_batch_size, dp_rank=c.dp,
                                dp_size=topo.dp, seed=cfg.seed)
        self.batches = TrainBatches(self.train_shards, self.sampler, t.micro_batch_size,
                                    t.seq_len, runtime.device)
        self.batch_size = BatchSizeSchedule(t.global_batch_size, t.rampup_batch_size)
        self.last_batch_size = t.global_batch_size  # of the last step taken
        self._val: Optional[List[Tuple[torch.Tensor, torch.Tensor]]] = None

        self.ckpt_root = checkpoint_root(cfg, self.run_dir)
        self.step = 0
        self.skipped_steps = 0  # non-finite steps skipped so far (this process)
        self.bad_in_a_row = 0
        self.loss_scaler = LossScaler.from_config(cfg.loss_scale) \
            if runtime.compute_dtype == torch.float16 else None
        self._resume()
        self._set_aside_later_checkpoints()
        self.stop_request = StopRequest(t.max_minutes, t.exit_signal, topo, runtime.device)
        self.profiler = StepProfiler(cfg.log.profile_steps, self.run_dir / "profile", self.rank,
                                     runtime.device)
        self.timers = StepTimers(runtime.device)
        self.saver = CheckpointSaver(
            self.ckpt_root, cfg, topo, runtime.device, background=cfg.checkpoint.async_save,
            state_numel=ckpt.written_numel(self.engine, cfg, topo))
        self.flops_per_token = flops_per_token(cfg.model, t.seq_len)
        # MFU is reported by rank 0; the other ranks need not spend a CPU matmul measurement
        self.peak = peak_tflops(runtime.device, cfg.log.peak_tflops) if self.rank == 0 \
            else Peak(None, "reported by rank 0")
        self.state_bytes = comm_gather_state_bytes(self.engine, topo)
        self.writer: Optional[MetricsWriter] = None
        if self.rank == 0:
            self.writer = MetricsWriter(
                self.run_dir, self.run_header(), cfg.log.wandb, cfg.log.project,
                cfg.log.run_name, asdict(cfg), t.max_steps, self.step, cfg.log.progress)

    # --- checkpoints --------------------------------------------------------------------

    def _resume(self) -> None:
        setting = self.cfg.checkpoint.resume
        tried = resume_candidates(setting, self.ckpt_root)
        if setting == "auto" and not tried and self.rank == 0:
            print(f"checkpoint.resume=auto: no complete checkpoint in {self.ckpt_root}; "
                  "starting from scratch")
        for path in tried:
            try:
                meta, rng = ckpt.load_checkpoint(path, self.engine, self.cfg, self.topo)
            except ckpt.CheckpointError as e:
                if setting != "auto":
                    raise
                if self.rank == 0:
                    print(f"checkpoint {path} unusable, trying the previous one: {e}")
                continue
            self.step = meta["step"]
            self.skipped_steps = meta["skipped_steps"]
            if self.loss_scaler is not None:
                self.loss_scaler.load_state_dict(meta.get("loss_scaler"))
            self.sampler.load_state_dict(meta["sampler"])
            if self.rank == 0:
                for warning in data_position_warnings(meta, self.cfg):
                    print(f"megalite: warning: {warning}", file=sys.stderr)
            if rng is not None:
                ckpt.set_rng_state(self.rng, rng)
            else:  # another layout: fresh dropout streams, derived from the seed and the step
                self.rng.reseed(self.cfg.seed + 1_000_003 * self.step)
            if self.rank == 0:
                print(f"resumed from {path} at step {self.step}")
            return
        if tried:
            raise ckpt.CheckpointError(f"no usable checkpoint in {self.ckpt_root}")

    def _set_aside_later_checkpoints(self) -> None:
        """Checkpoints after the step this run starts from belong to an abandoned continuation
        (or failed to load): out of the way of `keep` and `resume=auto`."""
        if self.rank == 0:
            for moved in ckpt.set_aside_later_checkpoints(self.ckpt_root, self.step):
                print(f"megalite: this run starts at step {self.step}; moved the later "
                      f"checkpoint to {moved}", file=sys.stderr)
        if dist.is_available() and dist.is_initialized():
            dist.barrier()

    def save(self) -> Optional[Path]:
        """Checkpoint the current step (collective). Returns the published directory, or None
        with checkpoint.async_save (published in the background; `self.saver.wait()`)."""
        self.engine.wait_for_params()  # the master ranges alias the parameters on CPU
        return self.saver.save(self.step, self.engine, ckpt.rng_state(self.rng), self.progress())

    def progress(self) -> ckpt.Progress:
        """The run's position besides its tensors, as a checkpoint records it."""
        return ckpt.Progress(self.sampler.state_dict(), self.skipped_steps,
                             None if self.loss_scaler is None else self.loss_scaler.state_dict())

    # --- reporting ----------------------------------------------------------------------

    def run_header(self) -> dict:
        cfg, topo, m = self.cfg, self.topo, self.cfg.model
        return {
            "layout": {"tp": topo.tp, "pp": topo.pp, "dp": topo.dp, "zero": cfg.zero,
                       "sp": cfg.sp, "virtual_stages": cfg.parallel.virtual_stages,
                       "world_size": topo.world_size},
            "stages": [[[r.start, r.stop] for r in chunks] for chunks in self.stages],
            "micro_batches": self.num_micro,
            "model": {"name": m.name, "n_layer": m.n_layer, "n_embd": m.n_embd,
                      "n_head": m.n_head, "n_positions": m.n_positions, "ffn_size": m.ffn_size},
            "vocab_size": m.vocab_size, "padded_vocab_size": self.model.padded_vocab,
            "tokenizer_vocab_size": self.train_shards[0].meta["vocab_size"],
            "parameters": num_parameters(m),
            "flops_per_token": self.flops_per_token,
            "flops_formula": "6N + 12*L*h*s (N = parameters except position embedding)",
            "peak_tflops_per_device": self.peak.tflops, "peak_source": self.peak.source,
            "device": str(self.rt.device), "compute_dtype": str(self.rt.compute_dtype),
            "seq_len": cfg.train.seq_len, "micro_batch_size": cfg.train.micro_batch_size,
            "global_batch_size": cfg.train.global_batch_size,
            "tokens_per_step": cfg.train.global_batch_size * cfg.train.seq_len,
            "model_state_bytes": self.state_bytes,
            "plan": make_plan(cfg, topo.world_size, self.rt.device.type).as_dict(),
            "data_dir": str(self.data_sources[0][0]),
            "data_sources": [[str(d), w] for d, w in self.data_sources],
            "run_dir": str(self.run_dir),
            "start_step": self.step,
        }

    def _global_mean(self, value: float) -> float:
        """A value held by the last pipeline stage (0 elsewhere), averaged over DP replicas."""
        topo = self.topo
        value = comm.all_reduce_scalars([value], topo.pp_group, device=self.rt.device)[0]
        return comm.all_reduce_scalars([value], topo.dp_group, device=self.rt.device)[0] / topo.dp

    def _slowest_phases(self, steps: int) -> dict:
        """Seconds per step in each phase of the step (`megalite.train.timers`), of the rank
        slowest in that phase."""
        spent = self.timers.take()
        values = [spent[p] / steps for p in PHASES]
        for group in (self.topo.mp_group, self.topo.dp_group):  # together: the whole world
            values = comm.all_reduce_scalars(values, group, self.rt.device,
                                             op=dist.ReduceOp.MAX)
        return dict(zip(PHASES, values))

    def _measured_bubble(self) -> float:
        """Idle fraction of this log step's pipeline, averaged over the stages. The stages start
        the step together (the previous step ended with a global reduction), so each stage's
        idle time counts against the step's common length, the longest stage's: a stage that
        finishes its last backward early waits for the earlier stages' backwards."""
        trace, group = self.schedule.trace, self.topo.pp_group
        wall = comm.all_reduce_scalars([trace.wall], group, op=dist.ReduceOp.MAX,
                                       device=self.rt.device)[0]
        idle = 1.0 - trace.busy / wall if wall > 0 else 0.0
        return comm.all_reduce_scalars([idle], group, device=self.rt.device)[0] / self.topo.pp

    # --- the loop -----------------------------------------------------------------------

    def train_step(self) -> Tuple[Optional[float], float]:
        """One optimizer step; returns (this replica's mean loss on the last stage, 0.0 on the
        others, None if the step was skipped; the global grad norm).

        A NaN/inf global gradient norm (the same number on every rank, so every rank decides
        alike) skips the update: the batch is consumed, the step counted in `skipped_steps`;
        `train.max_bad_steps` such steps in a row stop the run. With fp16 the gradients carry
        the loss scale: the norm and the update are unscaled, and an overflow that the
        dynamic scale absorbs (by shrinking) does not count towards max_bad_steps."""
        lr = lr_at(self.step, self.cfg.optim, self.cfg.train.max_steps)
        scale = self.loss_scaler.scale if self.loss_scaler is not None else 1.0
        self.model.train()
        timers = self.timers
        self.last_batch_size = self.batch_size.at(self.sampler.consumed_samples)
        with timers.phase("data"):
            micro_batches = self.batches.next_step(self.last_batch_size)
        with timers.phase("forward_backward"):
            loss = self.schedule.train_step(micro_batches, loss_scale=scale)
        with timers.phase("grad_sync"):
            self.engine.finish_grad_sync()
        with timers.phase("optimizer"):
            norm = self.engine.grad_norm() / scale
            finite = math.isfinite(norm.item())
            if finite:
                self.engine.clip_and_step(lr, self.cfg.optim.grad_clip, norm, grad_scale=scale)
            self.engine.zero_grad()
        self.last_lr = lr
        self.step += 1
        self._count_non_finite(finite)
        return (loss if finite else None), norm.item()

    def _count_non_finite(self, finite: bool) -> None:
        """Skipped steps, the loss scale's response, and the stop after too many in a row."""
        absorbed = self.loss_scaler is not None and self.loss_scaler.update(overflow=not finite)
        if finite:
            self.bad_in_a_row = 0
        else:
            self.skipped_steps += 1
            self.bad_in_a_row = 0 if absorbed else self.bad_in_a_row + 1
        if self.bad_in_a_row >= self.cfg.train.max_bad_steps:
            scaler = self.loss_scaler
            at_floor = "" if scaler is None else (
                f" at the dynamic loss scale's floor loss_scale.min={scaler.scale:g}"
                if scaler.dynamic else f" at the static loss_scale.static={scaler.scale:g}")
            raise NonFiniteError(
                f"{self.bad_in_a_row} steps in a row (up to step {self.step}) had a non-finite "
                f"loss or gradient{at_floor} (train.max_bad_steps="
                f"{self.cfg.train.max_bad_steps}); lower optim.lr, check the data, or resume "
                "from an earlier checkpoint")

    def val_batches(self) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """This DP rank's share of the fixed validation set, read at the first evaluation (a
        run with train.eval_every=0 needs no validation windows)."""
        if self._val is None:
            t, c = self.cfg.train, self.topo.coords
            self._val = val_batches(self.val_shards, t.micro_batch_size, t.seq_len,
                                    t.eval_steps, t.global_batch_size, dp_rank=c.dp,
                                    dp_size=self.topo.dp, device=self.rt.device,
                                    weights=[w for _, w in self.data_sources])
        return self._val

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        loss = self.schedule.evaluate(self.val_batches())
        self.engine.release_params()
        return self._global_mean(loss)

    def fit(self) -> List[dict]:
        """Train to train.max_steps: evaluate, checkpoint and log on their schedules (a step
        that evaluates also writes a metrics line). Returns the metric records. A background
        save still in flight is waited for at the end (also when training fails, so the last
        checkpoint taken gets published)."""
        try:
            records = self._fit()
        except BaseException:
            with contextlib.suppress(Exception):  # the training error is the one to report
                self.saver.close()
            raise
        self.saver.close()
        if self.writer is not None:
            self.writer.close()
        return records

    def _fit(self) -> List[dict]:
        cfg, t = self.cfg, self.cfg.train
        counter = self.topo.counter
        records: List[dict] = []
        self.rt.synchronize()
        interval = _Interval()
        self.timers.take()  # phases of steps run outside fit are not this interval's
        with self.stop_request as stop, ScheduledGC(t.gc_every) as collector:
            while self.step < t.max_steps:
                before = counter.snapshot()
                with self.profiler.step(self.step + 1):
                    loss, grad_norm = self.train_step()
                collector.after_step(self.step)
                interval.excluded_s += self.profiler.take_export_seconds()
                interval.add_step(loss, counter.delta(counter.snapshot(), before),
                                  self.last_batch_size)
                stopping = stop.reason()
                end = self.step == t.max_steps
                last = end or stopping is not None
                val_loss = None
                if t.eval_every and (self.step % t.eval_every == 0 or end):
                    e0 = time.perf_counter()
                    val_loss = self.evaluate()
                    interval.excluded_s += time.perf_counter() - e0
                if (cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0) or last:
                    c0 = time.perf_counter()
                    self.save()
                    interval.checkpoint_s += time.perf_counter() - c0
                if self.step % cfg.log.every == 0 or last or val_loss is not None:
                    records.append(self._record(interval, val_loss, grad_norm))
                    if self.writer is not None:
                        self.writer.log(records[-1])
                    interval = _Interval()
                if stopping is not None:
                    if self.rank == 0:
                        print(f"megalite: stopped after step {self.step} ({stopping}); the "
                              "checkpoint of this step continues it with "
                              "checkpoint.resume=auto", file=sys.stderr)
                    break
            self.saver.wait()  # the last save published while exit_signal is still handled
        self.profiler.close()
        self.engine.wait_for_params()
        return records

    def _record(self, interval: "_Interval", val_loss: Optional[float], grad_norm: float
                ) -> dict:
        """The metrics line closing `interval` (collective: means and norms over ranks)."""
        cfg, topo, t = self.cfg, self.topo, self.cfg.train
        self.rt.synchronize()
        elapsed = time.perf_counter() - interval.t0 - interval.excluded_s - interval.checkpoint_s
        steps, losses = interval.steps, interval.losses
        per_step = {k: {n: v / steps for n, v in c.items()}
                    for k, c in interval.comm.items() if c.get("calls")}
        mean_loss = self._global_mean(sum(losses) / len(losses)) if losses else None
        tokens = interval.samples * t.seq_len
        record = {"step": self.step, "loss": mean_loss, "val_loss": val_loss,
                  "lr": self.last_lr, "grad_norm": grad_norm,
                  "param_norm": self.engine.param_norm().item(),
                  **throughput(tokens, elapsed, self.flops_per_token, topo.world_size,
                               self.peak),
                  "step_time_s": elapsed / steps,
                  "consumed_tokens": self.sampler.consumed_samples * t.seq_len,
                  "global_batch_size": self.last_batch_size,
                  "memory": peak_memory_bytes(self.rt.device), "comm": per_step,
                  "checkpoint_blocked_s": interval.checkpoint_s,
                  "skipped_steps": steps - len(losses),
                  "skipped_total": self.skipped_steps}
        record["step_phases_s"] = self._slowest_phases(steps)
        if self.loss_scaler is not None:
            record["loss_scale"] = self.loss_scaler.scale
        if topo.pp > 1:
            record["pipeline_bubble"] = self._measured_bubble()
            record["pipeline_bubble_expected"] = expected_bubble(
                topo.pp, self.last_batch_size // (t.micro_batch_size * topo.dp),
                cfg.parallel.virtual_stages)
        if cfg.log.pipeline_trace:
            self.schedule.trace.dump(self.run_dir / "pipeline_trace" / f"rank{self.rank:05d}.json",
                                     topo.coords.pp, self.rank)
        return record


@dataclass
class _Interval:
    """What the steps since the last metrics line add up to."""
    t0: float = field(default_factory=time.perf_counter)
    steps: int = 0
    samples: int = 0  # sequences trained on (the global batch sizes of the steps)
    losses: List[float] = field(default_factory=list)  # of the steps not skipped
    comm: dict = field(default_factory=dict)  # bytes sent by the training steps
    excluded_s: float = 0.0  # evaluation, profiler export: not training time
    checkpoint_s: float = 0.0  # waiting for checkpoint saves

    def add_step(self, loss: Optional[float], step_comm: dict, batch_size: int) -> None:
        self.steps += 1
        self.samples += batch_size
        if loss is not None:
            self.losses.append(loss)
        for key, counts in step_comm.items():
            acc = self.comm.setdefault(key, {})
            for name, value in counts.items():
                acc[name] = acc.get(name, 0) + value


def data_position_warnings(meta: dict, cfg: Config) -> List[str]:
    """The sampler's position is a count of samples (windows of train.seq_len + 1 tokens from a
    permutation seeded by `seed`, over `data.dir` or the `data.blend`): resumed under another
    seq_len, seed or data it points elsewhere in the data. Legal (e.g. a longer context late in
    training), but worth saying."""
    then = {"train.seq_len": meta["config"]["train"]["seq_len"], "seed": meta["config"]["seed"],
            "data": _data_label(meta["data_sources"])}
    now = {"train.seq_len": cfg.train.seq_len, "seed": cfg.seed,
           "data": _data_label([[str(d), w] for d, w in data_sources(cfg.data)])}
    return [f"{key}={now[key]!r} differs from the checkpoint's {then[key]!r}: the resumed run "
            f"continues at sample {meta['consumed_samples']} of a different order of windows, "
            "not where the checkpointed run stopped"
            for key in then if then[key] != now[key]]


def _data_label(sources: List[list]):
    """A data directory alone by its path, a blend as its [weight, dir] list."""
    if len(sources) == 1:
        return sources[0][0]
    return [x for d, w in sources for x in (w, d)]


def comm_gather_state_bytes(engine: ZeroEngine, topo) -> List[dict]:
    """Every rank's model-state bytes (parameters, gradients, optimizer), for the run header."""
    mine = {"rank": topo.rank, "tp": topo.coords.tp, "pp": topo.coords.pp, "dp": topo.coords.dp,
            **engine.state_bytes()}
    if not (dist.is_available() and dist.is_initialized()):
        return [mine]
    out = [None] * topo.world_size
    dist.all_gather_object(out, mine)
    return out


def broadcast_run_dir(run_dir: Path) -> Path:
    """Rank 0's run directory, on every rank (Hydra's timestamp may differ between ranks)."""
    return Path(ckpt.broadcast_object(str(run_dir)))
