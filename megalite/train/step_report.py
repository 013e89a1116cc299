"""The trainer's reports: the metrics line that closes an interval of steps (`_record`), and
the figures it and the loop share (the last step's visible attention pairs, a loss averaged
over the ranks, the offloads' host memory). A base of `megalite.train.trainer.Trainer`, whose
parts it reads (cfg, rt, engine, sampler, batches, schedule, timers, ... and the last step's
lr, batch size and MoE figures); every method but `_visible_pairs` is collective.
"""
from __future__ import annotations

from typing import Optional

from megalite.config.schedule_rules import expected_bubble
from megalite.model.families import family
from megalite.parallel import comm
from megalite.train.interval import Interval, measured_bubble, slowest_phases
from megalite.train.metrics import attention_flops, peak_memory_bytes, throughput
from megalite.train.offload_metrics import offload_memory


class StepReport:
    """The reporting half of the Trainer (its fields are the Trainer's)."""

    def _offload_memory(self, steps: int = 1) -> dict:
        """The offloads' host bytes and copies (`megalite.train.offload_metrics`)."""
        return offload_memory(self.model.activation_offload, self.engine.offload,
                              self.topo.world_group, self.rt.device, steps)

    def _visible_pairs(self) -> int:
        """(query, key) pairs the document mask left in this rank's windows of the last step
        (`Documents.visible_pairs`; 0 without documents)."""
        return sum(mb[2].visible_pairs for mb in self.last_micro_batches if len(mb) > 2)

    def _global_mean(self, value: float) -> float:
        """A value held by the last pipeline stage (0 elsewhere), averaged over the DP x CP
        ranks (each CP rank's loss is the mean over its equal share of the tokens: their mean
        is the mean over the sequences' tokens, the serial run's)."""
        topo, group = self.topo, self.topo.grad_group
        value = comm.all_reduce_scalars([value], topo.pp_group, device=self.rt.device)[0]
        return comm.all_reduce_scalars([value], group, device=self.rt.device)[0] / group.size

    def _record(self, interval: Interval, val_loss: Optional[float], grad_norm: float
                ) -> dict:
        """The metrics line closing `interval` (collective: means and norms over ranks)."""
        cfg, topo, t = self.cfg, self.topo, self.cfg.train
        self.rt.synchronize()
        elapsed = interval.training_seconds()
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
                  "memory": {**peak_memory_bytes(self.rt.device), **self._offload_memory(steps)},
                  "comm": per_step,
                  "checkpoint_blocked_s": interval.checkpoint_s,
                  "skipped_steps": steps - len(losses),
                  "skipped_total": self.skipped_steps}
        record["step_phases_s"] = slowest_phases(self.timers, topo, self.rt.device, steps)
        documents = self.batches.documents
        if documents is not None and documents.mask:  # each rank's queries', over DP x CP
            pairs = comm.all_reduce_scalars([interval.visible_pairs], topo.grad_group,
                                            self.rt.device)[0]
            record.update(attention_flops(family(cfg.model).attention_flops_per_pair(cfg.model),
                                          pairs, interval.samples, t.seq_len, steps))
        if self.planner is not None:  # measured next to predicted (layout=auto)
            record["predicted_step_time_s"] = self.planner["prediction"]["step_s"]
        if self.loss_scaler is not None:
            record["loss_scale"] = self.loss_scaler.scale
        if self.last_moe is not None:  # per MoE layer, the last step's (model.moe)
            record["moe"] = self.last_moe
        if topo.pp_size > 1:
            record["pipeline_bubble"] = measured_bubble(self.schedule.trace, topo, self.rt.device)
            record["pipeline_in_flight"] = self.schedule.peak_in_flight
            record["pipeline_bubble_expected"] = expected_bubble(
                topo.pp_size, self.layout.micro_batches(self.last_batch_size),
                self.layout.virtual_stages, schedule=self.schedule.schedule)
        if cfg.log.pipeline_trace:
            self.schedule.trace.dump(self.run_dir / "pipeline_trace" / f"rank{self.rank:05d}.json",
                                     topo.coords.pp_rank, self.rank)
        return record
