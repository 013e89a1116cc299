"""Pipeline step time against m: megalite's PipelineSchedule next to
`torch.distributed.pipelining.Schedule1F1B` (and, with `--virtual-stages v`, megalite's
interleaved schedule next to `ScheduleInterleaved1F1B`; with `--schedule zb-h1`, megalite's
zero-bubble ZB-H1 next to `ScheduleInterleavedZeroBubble` over one stage per rank, torch's
ZB1P; with `--schedule zb-v`, megalite's ZB-V next to `ScheduleZBVZeroBubble`, both over two
chunks per rank in the V placement, rank 0 holding the embedding and the LM head as one
parameter), on real gloo ranks (tp = dp = 1, world = pp).

For each pp in `--pp` a world of pp processes is spawned; for each v in `--virtual-stages` and
m in `--micro-batches` both contenders are built afresh from the same GPT-2 split
(`stage_chunks`: v chunks per rank, the same `GPT2` modules), the same initial weights
(`init_parameters`, same seed) and train on the same m micro-batches:

- megalite: its real training path, `schedule.train_step` -> `engine.finish_grad_sync` (tied
  embedding gradient summed over the first and last stage) -> `engine.clip_and_step` (global-norm
  clipping, AdamW) -> `engine.zero_grad` (ZeroEngine with zero = 0);
- torch: a `PipelineStage` over each chunk (the last returns its logits and `loss_fn` is the
  stage's own cross-entropy), `Schedule1F1B(stage, m, loss_fn)` or
  `ScheduleInterleaved1F1B(stages, m, loss_fn)` (they scale gradients by 1/m, as megalite
  does), then the same tied-gradient all-reduce, the same global
  norm clipping and `torch.optim.AdamW` with the same hyper-parameters and decay groups.

A step is timed from a barrier to the end of the optimizer step on each rank; the step time is
the slowest rank's. The two alternate step by step (A B B A ...) so that machine noise hits
both; reported are medians, the ratio torch / megalite (> 1: megalite faster), megalite's
measured bubble next to the ideal (p - 1) / (v·m + p - 1), and the relative difference of
the two losses at the first step (same weights, same batches, same math: ~0; on CPU they come
out bitwise equal) and at the last one. Dropout is off so that both compute the same function.
The untimed warmup steps absorb Schedule1F1B's shape inference on its first step.

Peak saved-activation bytes: the most bytes of floating-point tensors that autograd saved for
backward (parameters excluded; counted with saved-tensor hooks, each tensor until it is freed)
alive at once during a step, the largest over the ranks, for both contenders.

The bubble is the trainer's `pipeline_bubble`: each stage's time not spent in F, B or W,
against the step's common length (the longest stage's, as the stages start together),
averaged over stages and timed steps.

Notes. `Schedule1F1B` refuses m < p ("n/a" in the table); the interleaved schedules run only
where m is a multiple of p. The default vocabulary (2048) keeps
the LM head near one block's cost (8192 would make the last stage ~2x the others). With
more ranks than cores (pp = 4 on 2 cores) ranks share cores: a waiting rank yields its core to
a computing one, so the bubble is not comparable with the formula there.
"""
from __future__ import annotations

import statistics
import time
import weakref
from typing import List

import torch
import torch.distributed as dist
import torch.nn as nn

from megalite.config.layout import Layout
from megalite.config.schedule_rules import expected_bubble, resolve_schedule
from megalite.config.schema import Config, ModelConfig, OptimConfig
from megalite.config.stage_partition import ChunkPlacement, stage_chunks
from megalite.model.gpt2.stage import GPT2
from megalite.model.init import init_parameters
from megalite.model.stage import PipelineStage as Chunks
from megalite.model.stage import build_stage
from megalite.parallel.pipeline import PipelineSchedule
from megalite.parallel.topology import build_topology
from megalite.testing.spawn import run_ranks
from megalite.train.build import build_engine

LR, CLIP, SEED = 1e-3, 1.0, 1234
OPTIONS = ("micro_batches", "virtual_stages", "schedule", "steps", "warmup", "n_layer", "n_embd",
           "n_head", "seq_len", "micro_batch_size", "vocab_size")


def _model_cfg(o: dict) -> ModelConfig:
    return ModelConfig(name="bench", n_layer=o["n_layer"], n_embd=o["n_embd"], n_head=o["n_head"],
                       n_positions=max(o["seq_len"], 256), vocab_size=o["vocab_size"],
                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def _stage_model(cfg: ModelConfig, topo, blocks: List[range], v_shape: bool = False) -> Chunks:
    model = build_stage(cfg, blocks, topo.coords.pp_rank, topo.pp_size, v_shape,
                        tp_group=topo.tp_group)
    for chunk in model.chunks:
        init_parameters(chunk, SEED)
    return model.train()


class TorchStage(nn.Module):
    """A megalite stage with the pipelining contract: token ids (first stage) or hidden states
    in, hidden states out; the last stage returns its logits [s, b, V] (the loss is loss_fn)."""

    def __init__(self, gpt: GPT2):
        super().__init__()
        self.gpt = gpt

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.gpt
        if not g.last:
            return g(x)
        x = g.embed(x) if g.first else x
        for block in g.transformer.h.values():
            x = block(x)
        return g.logits_local(x)


class SavedActivationBytes:
    """Peak bytes of the tensors autograd saves for backward (floating point, parameters
    excluded) alive at once: saved-tensor hooks count each when packed, a finalizer when it is
    freed. `with counter:` around a step; `take_peak()` reads and resets the peak."""

    def __init__(self):
        self.live = self.peak = 0
        self._ids: set = set()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point() and not isinstance(t, nn.Parameter) and id(t) not in self._ids:
            nbytes = t.numel() * t.element_size()
            self._ids.add(id(t))
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(t, self._freed, id(t), nbytes)
        return t

    def _freed(self, key: int, nbytes: int) -> None:
        self._ids.discard(key)
        self.live -= nbytes

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)

    def take_peak(self) -> int:
        peak, self.peak = self.peak, self.live
        return peak


def _megalite(cfg, topo, blocks, o, schedule_name="auto"):
    model = _stage_model(cfg, topo, blocks, schedule_name == "zb-v")
    engine = build_engine(Config(optim=OptimConfig(lr=LR)), Layout.of(topo), topo, model)
    schedule = PipelineSchedule(model.chunks, topo, engine, (o["seq_len"], o["micro_batch_size"],
                                                      cfg.n_embd), torch.float32,
                                torch.device("cpu"), schedule=schedule_name)

    def step(batches):
        loss = schedule.train_step(batches)
        engine.finish_grad_sync()
        engine.clip_and_step(LR, CLIP)
        engine.zero_grad()
        trace = schedule.trace
        return loss.item(), trace.busy, trace.wall
    return step


def torch_pipeline_step(cfg, topo, blocks, m, schedule_name="auto"):
    """torch.distributed.pipelining's schedule `schedule_name` over a stage of this rank's
    `blocks` built and initialised apart (`SEED`), then the clipping and AdamW step
    megalite's engine takes: a function of one step's micro-batches."""
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
        ScheduleZBVZeroBubble,
    )

    v_shape = schedule_name == "zb-v"
    model = _stage_model(cfg, topo, blocks, v_shape)
    v, rank = len(blocks), topo.coords.pp_rank
    first, last = any(c.first for c in model.chunks), any(c.last for c in model.chunks)
    place = ChunkPlacement(topo.pp_size, v, v_shape)
    stages = [PipelineStage(TorchStage(chunk), place.slice_of(rank, c), topo.pp_size * v,
                            torch.device("cpu")) for c, chunk in enumerate(model.chunks)]
    # loss_fn on every stage: without it a stage runs forward-only (`_has_backward` False) and
    # the last stage hangs sending it backward metadata.
    loss_fn = model.chunks[-1].loss
    if schedule_name == "zb-h1":  # torch's ZB1P over one stage per rank
        schedule = ScheduleInterleavedZeroBubble(stages, n_microbatches=m, loss_fn=loss_fn)
    elif v_shape:  # its per-stage 1/m would scale the embedding rank 0's two stages share
        #            twice: scaled once below instead
        schedule = ScheduleZBVZeroBubble(stages, n_microbatches=m, loss_fn=loss_fn,
                                         scale_grads=False)
    elif v == 1:
        schedule = Schedule1F1B(stages[0], n_microbatches=m, loss_fn=loss_fn)
    else:
        schedule = ScheduleInterleaved1F1B(stages, n_microbatches=m, loss_fn=loss_fn)
    named = list(model.named_parameters())
    oc = OptimConfig(lr=LR)
    groups = [{"params": [p for n, p in named if model.param_specs[n].weight_decay == d],
               "weight_decay": oc.weight_decay if d else 0.0} for d in (True, False)]
    opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=LR, betas=tuple(oc.betas),
                            eps=oc.eps, foreach=True)
    tied = [p for n, p in named if model.param_specs[n].tied]  # (the V: one parameter)
    counted = [p for n, p in named if not model.param_specs[n].tied_copy]

    def step(batches):
        losses: list = []
        args = (torch.cat([x for x, _ in batches]),) if first else ()
        extra = {"target": torch.cat([y for _, y in batches]), "losses": losses} if last else {}
        schedule.step(*args, return_outputs=False, **extra)
        for p in tied:  # the two copies of the tied embedding: first + last stage
            dist.all_reduce(p.grad, group=topo.embedding_group.pg)
        grads = [p.grad for p in counted if p.grad is not None]
        if v_shape:
            torch._foreach_mul_(grads, 1.0 / m)
        sq = torch.stack(torch._foreach_norm(grads)).square().sum()
        dist.all_reduce(sq)  # global norm over the stages (as megalite's grad_norm)
        torch._foreach_mul_([p.grad for p in model.parameters() if p.grad is not None],
                            torch.clamp(CLIP / (sq.sqrt() + 1e-6), max=1.0))
        opt.step()
        opt.zero_grad(set_to_none=True)
        return (torch.stack(losses).mean().item() if losses else 0.0), 0.0, 0.0
    return step


def _timed(step, batches, saved: SavedActivationBytes):
    dist.barrier()
    t0 = time.perf_counter()
    with saved:
        loss, busy, wall = step(batches)
    return time.perf_counter() - t0, loss, busy, wall


def _worker(rank: int, pp: int, o: dict) -> List[dict]:
    """One rank of a gloo world of pp ranks (1 thread each, see megalite.testing.spawn)."""
    topo = build_topology(1, pp, 1)
    cfg = _model_cfg(o)
    g = torch.Generator().manual_seed(SEED)
    rows = []
    runs = [(v, n) for v in o["virtual_stages"] for n in o["schedule"] if n != "zb-v"
            and (v > 1) == (resolve_schedule(n, v) == "interleaved")]  # chunks per rank
    runs += [(2, "zb-v")] if "zb-v" in o["schedule"] else []  # two, in a V
    for v, name in runs:
        split = stage_chunks(cfg.n_layer, pp, v, v_shape=name == "zb-v")
        for m in o["micro_batches"]:
            if resolve_schedule(name, v) == "interleaved" and (m < pp or m % max(1, m // pp)):
                continue  # megalite's needs m >= pp, torch's m a multiple of its rounds
            rows.append(_compare(topo, cfg, split, m, o, g, name))
            if rank == 0:
                print(f"pp={pp} v={v} {name} m={m} done: megalite "
                      f"{rows[-1]['megalite_s']:.3f} s", flush=True)
    return rows


def _compare(topo, cfg, split, m: int, o: dict, g: torch.Generator, name: str = "auto"
             ) -> dict:
    pp, v, blocks = topo.pp_size, len(split[0]), split[topo.coords.pp_rank]
    words = torch.randint(0, cfg.vocab_size, (m, o["micro_batch_size"], o["seq_len"] + 1),
                          generator=g)
    batches = [(w[:, :-1].contiguous(), w[:, 1:].contiguous()) for w in words]
    fns = {"megalite": _megalite(cfg, topo, blocks, o, name)}
    if m >= pp:  # Schedule1F1B raises "Number of microbatches must be >= stages" otherwise
        fns["torch"] = torch_pipeline_step(cfg, topo, blocks, m, name)
    saved = {n: SavedActivationBytes() for n in fns}
    peaks = {n: 0 for n in fns}
    times = {n: [] for n in fns}
    losses = {n: [] for n in fns}
    bubbles = []
    for i in range(o["warmup"] + o["steps"]):
        for contender in (list(fns) if i % 2 == 0 else list(fns)[::-1]):
            dt, loss, busy, wall = _timed(fns[contender], batches, saved[contender])
            peaks[contender] = max(peaks[contender], saved[contender].take_peak())
            t = torch.tensor([dt, wall])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank's step
            s = torch.tensor([loss, busy / pp])
            dist.all_reduce(s)  # loss from the last stage; mean busy time over the stages
            losses[contender].append(s[0].item())
            if i >= o["warmup"]:
                times[contender].append(t[0].item())
                if contender == "megalite":
                    bubbles.append(1 - s[1].item() / t[1].item())
    peak = torch.tensor([float(peaks[n]) for n in fns])
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)  # the largest over the ranks
    row = {"pp": pp, "v": v, "m": m, "schedule": resolve_schedule(name, v),
           "blocks": [[len(r) for r in c] for c in split],
           "megalite_s": statistics.median(times["megalite"]),
           "bubble": statistics.mean(bubbles),
           "bubble_expected": expected_bubble(pp, m, v, name),
           "saved_mib": peak[0].item() / 2**20,
           "loss_first": losses["megalite"][0], "loss_last": losses["megalite"][-1]}
    if "torch" in fns:
        lm, lt = losses["megalite"], losses["torch"]
        row.update(torch_s=statistics.median(times["torch"]), torch_saved_mib=peak[1].item() / 2**20,
                   rel_diff_first=abs(lm[0] - lt[0]) / abs(lt[0]),
                   rel_diff_last=abs(lm[-1] - lt[-1]) / abs(lt[-1]))
    return row


def run(args) -> List[dict]:
    o = {k: getattr(args, k) for k in OPTIONS}
    print(f"torch {torch.__version__}, gloo, 1 thread per rank; GPT-2 n_layer={o['n_layer']} "
          f"n_embd={o['n_embd']} vocab={o['vocab_size']} seq={o['seq_len']} "
          f"micro-batch={o['micro_batch_size']}; {o['warmup']} warmup + {o['steps']} timed steps",
          flush=True)
    results: List[dict] = []
    for pp in args.pp:
        results += run_ranks(_worker, pp, args=(o,), timeout_s=3600)[0]
    _print_table(results)
    return results


def _print_table(rows: List[dict]) -> None:
    print("\nstep time: median over timed steps (slowest rank); torch/megalite > 1: megalite "
          "faster. bubble: megalite's, mean over stages and steps; expected: the schedule's "
          "formula. saved MiB: peak saved-activation bytes (largest rank), megalite / torch.")
    print(f"{'pp':>3} {'v':>2} {'schedule':>11} {'m':>3} {'megalite s':>11} {'torch s':>9} "
          f"{'torch/megalite':>15} {'bubble':>7} {'expected':>9} {'saved MiB':>13} "
          f"{'loss rel diff 1st/last':>23}")
    for r in rows:
        if "torch_s" in r:
            torch_s, ratio = f"{r['torch_s']:.3f}", f"{r['torch_s'] / r['megalite_s']:.3f}"
            diff = f"{r['rel_diff_first']:.1e} / {r['rel_diff_last']:.1e}"
            saved = f"{r['saved_mib']:.1f} / {r['torch_saved_mib']:.1f}"
        else:
            torch_s = ratio = diff = "n/a (m<p)"
            saved = f"{r['saved_mib']:.1f} / -"
        print(f"{r['pp']:>3} {r['v']:>2} {r['schedule']:>11} {r['m']:>3} {r['megalite_s']:>11.3f} "
              f"{torch_s:>9} {ratio:>15} {r['bubble']:>7.3f} {r['bubble_expected']:>9.3f} "
              f"{saved:>13} {diff:>23}")


def add_arguments(parser) -> None:
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--virtual-stages", type=int, nargs="+", default=[1],
                        help="model chunks per rank (> 1: the interleaved schedules)")
    parser.add_argument("--schedule", nargs="+", default=["auto"],
                        choices=["auto", "1f1b", "interleaved", "zb-h1", "zb-v"],
                        help="megalite's parallel.schedule (torch: Schedule1F1B, "
                             "ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble, "
                             "ScheduleZBVZeroBubble; zb-v: two chunks per rank, whatever "
                             "--virtual-stages says)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per contender")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=2048)
