"""The training loop. It composes the pieces; the parallel logic lives in megalite/parallel.

One optimizer step = `global_batch_size / (micro_batch_size * dp)` micro-batches per DP rank,
each loss scaled by 1/num_micro so the accumulated gradient is the gradient of the mean loss
over the rank's share; averaging over DP then gives the gradient of the mean over the global
batch — the same number the serial run computes.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from megalite.config import Config, resolve_path
from megalite.data.loader import ResumableSampler, TokenShards, TrainBatches, check_vocab, val_batches
from megalite.model.gpt2 import GPT2, count_parameters, flops_per_token
from megalite.model.hf import load_hf_state_dict
from megalite.parallel import comm
from megalite.parallel.zero import DataParallelGrads
from megalite.runtime import Runtime
from megalite.train import checkpoint as ckpt
from megalite.train.metrics import MetricsWriter, peak_memory_bytes, peak_tflops, throughput
from megalite.train.optim import build_optimizer, clip_grads_, global_grad_norm, lr_at, set_lr


def dropout_seed(cfg: Config, runtime: Runtime) -> int:
    """Replicas see different data and so draw different dropout masks."""
    return cfg.seed + 7919 * (runtime.topology.coords.dp + 1)


class Trainer:
    def __init__(self, cfg: Config, runtime: Runtime, run_dir: Path):
        self.cfg, self.rt, self.run_dir = cfg, runtime, Path(run_dir)
        topo = runtime.topology
        self.rank = topo.rank
        data_dir = resolve_path(cfg.data.dir)
        self.train_shards = TokenShards(data_dir, "train")
        self.val_shards = TokenShards(data_dir, "val")
        check_vocab(self.train_shards.meta["vocab_size"], cfg.model.vocab_size)

        torch.manual_seed(cfg.seed)  # identical initial weights on every replica
        self.model = GPT2(cfg.model).to(runtime.device)
        if cfg.init_from:
            self.model.load_state_dict(load_hf_state_dict(cfg.init_from, cfg.model))
        self.params = list(self.model.parameters())
        self.optimizer = build_optimizer(self.model, cfg.optim, runtime.device)
        self.dp_grads = DataParallelGrads(self.params, topo.dp_group)
        torch.manual_seed(dropout_seed(cfg, runtime))

        t = cfg.train
        self.num_micro = t.global_batch_size // (t.micro_batch_size * topo.dp)
        self.sampler = ResumableSampler(
            self.train_shards.num_samples(t.seq_len), t.global_batch_size,
            dp_rank=topo.coords.dp, dp_size=topo.dp, seed=cfg.seed)
        self.batches = TrainBatches(self.train_shards, self.sampler, t.micro_batch_size,
                                    t.seq_len, runtime.device)
        self.val = val_batches(self.val_shards, t.micro_batch_size, t.seq_len, t.eval_steps,
                               t.global_batch_size,
                               dp_rank=topo.coords.dp, dp_size=topo.dp, device=runtime.device)

        self.ckpt_root = resolve_path(cfg.checkpoint.dir) if cfg.checkpoint.dir \
            else self.run_dir / "checkpoints"
        self.step = 0
        self._resume()
        self.flops_per_token = flops_per_token(cfg.model, t.seq_len)
        self.peak = peak_tflops(runtime.device, cfg.log.peak_tflops)
        self.writer: Optional[MetricsWriter] = None
        if self.rank == 0:
            self.writer = MetricsWriter(
                self.run_dir, self.run_header(), cfg.log.wandb, cfg.log.project,
                cfg.log.run_name, asdict(cfg), t.max_steps, self.step, cfg.log.progress)

    def _resume(self) -> None:
        setting = self.cfg.checkpoint.resume
        if setting == "none":
            return
        path = ckpt.latest_checkpoint(self.ckpt_root) if setting == "auto" \
            else resolve_path(setting)
        if path is None:
            if self.rank == 0:
                print(f"checkpoint.resume=auto: no complete checkpoint in {self.ckpt_root}; "
                      "starting from scratch")
            return
        meta = ckpt.load_checkpoint(path, self.model, self.optimizer, self.cfg, self.rank)
        self.step = meta["step"]
        self.sampler.load_state_dict({"consumed_samples": meta["consumed_samples"]})
        if self.rank == 0:
            print(f"resumed from {path} at step {self.step}")

    def run_header(self) -> dict:
        cfg, topo, m = self.cfg, self.rt.topology, self.cfg.model
        return {
            "layout": {"tp": topo.tp, "pp": topo.pp, "dp": topo.dp, "zero": cfg.zero,
                       "sp": cfg.sp, "world_size": topo.world_size},
            "model": {"name": m.name, "n_layer": m.n_layer, "n_embd": m.n_embd,
                      "n_head": m.n_head, "n_positions": m.n_positions, "ffn_size": m.ffn_size},
            "vocab_size": m.vocab_size,
            "tokenizer_vocab_size": self.train_shards.meta["vocab_size"],
            "parameters": count_parameters(self.model),
            "flops_per_token": self.flops_per_token,
            "flops_formula": "6N + 12*L*h*s (N = parameters except position embedding)",
            "peak_tflops_per_device": self.peak.tflops, "peak_source": self.peak.source,
            "device": str(self.rt.device), "compute_dtype": str(self.rt.compute_dtype),
            "seq_len": cfg.train.seq_len, "micro_batch_size": cfg.train.micro_batch_size,
            "global_batch_size": cfg.train.global_batch_size,
            "tokens_per_step": cfg.train.global_batch_size * cfg.train.seq_len,
            "data_dir": str(resolve_path(cfg.data.dir)), "run_dir": str(self.run_dir),
            "start_step": self.step,
        }

    def train_step(self) -> Tuple[float, float]:
        """One optimizer step; returns (this rank's mean micro-batch loss, global grad norm)."""
        set_lr(self.optimizer, lr_at(self.step, self.cfg.optim, self.cfg.train.max_steps))
        self.model.train()
        total = torch.zeros((), device=self.rt.device)
        for x, y in self.batches.next_step():
            with self.rt.autocast():
                loss = self.model(x, y)
            (loss / self.num_micro).backward()
            total += loss.detach()
        self.dp_grads.sync()
        norm = global_grad_norm(self.params, self.rt.topology.mp_group)
        clip_grads_(self.params, self.cfg.optim.grad_clip, norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return total.item() / self.num_micro, norm.item()

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        losses = []
        for x, y in self.val:
            with self.rt.autocast():
                losses.append(self.model(x, y).float().item())
        local = sum(losses) / len(losses)
        dp = self.rt.topology.dp_group
        return comm.all_reduce_scalars([local], dp, device=self.rt.device)[0] / dp.size

    def fit(self) -> List[dict]:
        cfg, topo = self.cfg, self.rt.topology
        t = cfg.train
        records: List[dict] = []
        interval_losses: List[float] = []
        comm_before = topo.counter.snapshot()
        self.rt.synchronize()
        t0 = time.perf_counter()
        excluded_s = 0.0
        while self.step < t.max_steps:
            loss, grad_norm = self.train_step()
            interval_losses.append(loss)
            last = self.step == t.max_steps
            val_loss = None
            if t.eval_every and (self.step % t.eval_every == 0 or last):
                e0 = time.perf_counter()
                val_loss = self.evaluate()
                excluded_s += time.perf_counter() - e0
            if self.step % cfg.log.every == 0 or last:
                self.rt.synchronize()
                elapsed = time.perf_counter() - t0 - excluded_s
                steps = len(interval_losses)
                mean_loss = comm.all_reduce_scalars(
                    [sum(interval_losses) / steps], topo.dp_group, device=self.rt.device
                )[0] / topo.dp
                comm_now = topo.counter.snapshot()
                per_step = {k: {n: v / steps for n, v in c.items()}
                            for k, c in topo.counter.delta(comm_now, comm_before).items()}
                tokens = steps * t.global_batch_size * t.seq_len
                record = {"step": self.step, "loss": mean_loss, "val_loss": val_loss,
                          "lr": self.optimizer.param_groups[0]["lr"], "grad_norm": grad_norm,
                          **throughput(tokens, elapsed, self.flops_per_token, topo.world_size,
                                       self.peak),
                          "step_time_s": elapsed / steps,
                          "consumed_tokens": self.sampler.consumed_samples * t.seq_len,
                          "memory": peak_memory_bytes(self.rt.device), "comm": per_step}
                records.append(record)
                if self.writer is not None:
                    self.writer.log(record)
                if not math.isfinite(mean_loss):
                    raise FloatingPointError(f"loss is {mean_loss} at step {self.step}")
                interval_losses, comm_before, excluded_s = [], topo.counter.snapshot(), 0.0
                t0 = time.perf_counter()
            if (cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0) or last:
                c0 = time.perf_counter()
                ckpt.save_checkpoint(self.ckpt_root, self.step, self.model, self.optimizer,
                                     self.sampler.consumed_samples, cfg, self.rank,
                                     topo.world_size, cfg.checkpoint.keep)
                excluded_s += time.perf_counter() - c0
        if self.writer is not None:
            self.writer.close()
        return records


def broadcast_run_dir(run_dir: Path) -> Path:
    """Rank 0's run directory, on every rank (Hydra's timestamp may differ between ranks)."""
    if not (dist.is_available() and dist.is_initialized()):
        return run_dir
    box = [str(run_dir)]
    dist.broadcast_object_list(box, src=0)
    return Path(box[0])
