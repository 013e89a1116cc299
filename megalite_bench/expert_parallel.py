"""Expert parallelism on a tiny MoE: one gloo world of `--world` ranks (default the largest
`--ep`; tp = cp = pp = 1, EP folded over the DP ranks, the same global batch in every arm), a
trainer per ep in `--ep` (default 1 2 4) and, at ep > 1, per `parallel.ep_dispatch`
(alltoall, allgather), all built in the same world and launched as `megalite-pretrain`
launches them (`megalite.train.launch.launch`). For each:

  peak bytes per rank   measured in the trainer's step `--warmup` + 1 as `megalite-bench cp`
                        measures it (live tensor bytes at the step's start, less what the
                        world held before this trainer was built, + the most the step's own
                        allocations hold at once: `megalite_bench.memory.PeakBytes`), the
                        largest rank's; next to the launch's own plan for that rank
                        (`Run.plan`: E/ep experts a rank, their states over EDP, the
                        dispatch's buffers). It falls with ep as the experts' share does.
  EP wire bytes         the "ep" group's wire bytes of that measured step (the topology's
                        `CommCounter`), the largest rank's, against the plan's
                        (`stage.comm["ep"]`: the all-gather's exactly; the all-to-all's under
                        balanced routing, exact only where a capacity makes every expert keep
                        the same rows on every rank; otherwise the ratio shows the routing's
                        skew, or the capacity's drops)
  tokens/s              global tokens per optimizer step over the median step time (each step
                        from a barrier, the slowest rank's), the arms' timed steps alternated
                        (A B C ... C B A) so that a shared machine's drift hits all alike.
                        Only ratios inside one world mean anything: the ranks share this
                        machine's cores.

Then, in the same world, the anchors' expert-parallel layers (DeepSpeed-MoE's
`deepspeed.moe.layer.MoE`, megatron-core's `megatron.core.transformer.moe.moe_layer.MoELayer`)
beside megalite's MoE layer at the trainers' shape, each ep of `--ep`: the same weights and
tokens, their outputs and gradients compared, peak bytes and tokens/s of a forward and
backward side by side (`megalite_bench.expert_parallel_anchors`); an anchor that does not
import, or does not run here, is listed with its error.

    megalite-bench ep                                       # mixtral-tiny, ep 1 2 4, 4 ranks
    megalite-bench ep --ep 1 2 --seq-len 64 --steps 2       # a smoke run
"""
from __future__ import annotations

import dataclasses
import statistics
import tempfile
import time
from pathlib import Path
from typing import Dict, List

import torch
import torch.distributed as dist

from megalite.testing.spawn import run_ranks
from megalite_bench.expert_parallel_anchors import (
    anchor_layers,
    anchor_lines,
    compare,
    compare_lines,
)
from megalite_bench.on_off import CHECKS_OFF, prepared_corpus

DISPATCHES = ("alltoall", "allgather")


def arms(eps: List[int]) -> List[tuple]:
    """(ep, dispatch) of each trainer: ep 1 once (no exchange), each ep > 1 per dispatch."""
    return [(ep, d) for ep in eps for d in (DISPATCHES if ep > 1 else ("-",))]


def trainer_overrides(args, ep: int, dispatch: str, data: str, run_dir: str) -> List[str]:
    """A benchmark trainer at `ep` (`dispatch`): no evaluation, no logging services, no checks."""
    batch = args.micro_batch * args.world
    return [f"model={args.preset}", f"model.n_positions={args.seq_len}",
            *[f"model.{kv}" for kv in args.model], f"data.dir={data}",
            f"train.seq_len={args.seq_len}", f"train.micro_batch_size={args.micro_batch}",
            f"train.global_batch_size={batch}", "train.max_steps=1000000",
            "train.eval_every=0", "log.wandb=false", "log.progress=false", "log.peak_tflops=1",
            f"checkpoint.dir={run_dir}/ckpt", *CHECKS_OFF, f"ep={ep}",
            *([f"parallel.ep_dispatch={dispatch}"] if ep > 1 else [])]


def _largest(value: float) -> float:
    t = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _ep_wire_bytes(step_comm: Dict[str, dict]) -> float:
    return sum(v["wire_bytes"] for k, v in step_comm.items() if k.startswith("ep/"))


def _build_and_measure(args, ep: int, dispatch: str, data: str, root: str) -> dict:
    """A trainer launched at `ep`/`dispatch`, its warmup steps and the measured step's peak
    bytes and EP wire bytes."""
    from megalite.config.schema import load_config
    from megalite.train.launch import launch
    from megalite_bench.memory import PeakBytes, live_storages, live_tensor_bytes

    run_dir = f"{root}/ep{ep}-{dispatch}"
    before = live_storages()  # the world's and any earlier trainer's tensors
    run = launch(load_config(trainer_overrides(args, ep, dispatch, data, run_dir)),
                 args.world, run_dir)
    trainer = run.trainer
    for _ in range(args.warmup):
        trainer.train_step()
    base = live_tensor_bytes(torch.device("cpu"), before)
    counter = trainer.topo.counter
    comm_before = counter.snapshot()
    with PeakBytes() as peak:
        trainer.train_step()
    wire = _ep_wire_bytes(counter.delta(counter.snapshot(), comm_before))
    stage = run.plan.stages[trainer.topo.coords.pp_rank]
    return {"trainer": trainer, "ep": ep, "dispatch": dispatch,
            "measured": _largest(base + peak.bytes), "planned": stage.bytes["total"],
            "wire": _largest(wire), "wire_planned": stage.comm.get("ep", 0.0),
            "tokens": trainer.last_batch_size * args.seq_len}


def _timed_steps(trainers: Dict[tuple, object], steps: int) -> Dict[tuple, float]:
    """Median seconds per step of each trainer, steps alternated A B .. B A from barriers."""
    names = list(trainers)
    times: Dict[tuple, List[float]] = {n: [] for n in names}
    for i in range(steps):
        for name in (names if i % 2 == 0 else names[::-1]):
            dist.barrier()
            t0 = time.perf_counter()
            trainers[name].train_step()
            times[name].append(_largest(time.perf_counter() - t0))
    return {n: statistics.median(v) for n, v in times.items()}


def _world(rank: int, world: int, args, data: str, root: str, anchors: List[dict]) -> dict:
    """{"rows": one per trainer, "layers": `compare`'s result}."""
    built = {(ep, d): _build_and_measure(args, ep, d, data, root) for ep, d in arms(args.ep)}
    seconds = _timed_steps({k: b["trainer"] for k, b in built.items()}, args.steps)
    rows = [{**{k: v for k, v in b.items() if k != "trainer"},
             "tokens_per_s": b["tokens"] / seconds[key]} for key, b in built.items()]
    del built
    return {"rows": rows, "layers": _layers(rank, world, args, data, root, anchors)}


def _layers(rank: int, world: int, args, data: str, root: str, anchors: List[dict]) -> dict:
    """The MoE layer of the trainers' model (its routed experts; no balancing losses) beside
    the anchors' (`expert_parallel_anchors.compare`), from one seeded serial layer; this
    rank's tokens [seq-len, micro-batch, h] and the loss's weights g, seeded by rank."""
    from megalite.config.schema import load_config
    from megalite.model.moe.layer import MoELayer

    model = load_config(trainer_overrides(args, 1, "-", data, root)).model
    torch.manual_seed(0)
    serial = MoELayer(dataclasses.replace(model.moe, shared_experts=0), model.n_embd,
                      model.ffn_size, 0)
    for p in serial.parameters():
        torch.nn.init.normal_(p, std=model.initializer_range)
    x, g = (torch.randn(args.seq_len, args.micro_batch, model.n_embd,
                        generator=torch.Generator().manual_seed(seed * world + rank))
            for seed in (1, 2))
    return compare(rank, world, serial, args.ep, x, g, args.layer_steps, anchors)


def table(rows: List[dict]) -> List[str]:
    """The table's lines: per row its peak and plan (MiB) and their ratio, both against ep 1's,
    the EP wire bytes against the plan's, tokens/s, and allgather's tokens/s over alltoall's."""
    base = rows[0]
    lines = [f"{'ep':>3} {'dispatch':>9} {'peak MiB':>9} {'plan MiB':>9} {'meas/plan':>9} "
             f"{'peak/ep1':>9} {'plan/ep1':>9} {'EP wire MiB':>11} {'wire/plan':>9} "
             f"{'tokens/s':>9} {'ag/a2a':>7}"]
    by = {(r["ep"], r["dispatch"]): r for r in rows}
    for r in rows:
        a2a = by.get((r["ep"], "alltoall"))
        versus = f"{r['tokens_per_s'] / a2a['tokens_per_s']:.3f}" \
            if r["dispatch"] == "allgather" and a2a else ""
        wire = f"{r['wire'] / r['wire_planned']:.4f}" if r["wire_planned"] else "-"
        lines.append(
            f"{r['ep']:>3} {r['dispatch']:>9} {r['measured'] / 2**20:>9.2f} "
            f"{r['planned'] / 2**20:>9.2f} {r['measured'] / r['planned']:>9.4f} "
            f"{r['measured'] / base['measured']:>9.3f} {r['planned'] / base['planned']:>9.3f} "
            f"{r['wire'] / 2**20:>11.3f} {wire:>9} {r['tokens_per_s']:>9.0f} {versus:>7}")
    for d in DISPATCHES:
        peaks = [r["measured"] for r in rows if r["dispatch"] in (d, "-")]
        falls = all(a > b for a, b in zip(peaks, peaks[1:]))
        lines.append(f"measured peak per rank falls with ep ({d}): {'yes' if falls else 'NO'}")
    return lines


def run(args) -> Dict[str, List[dict]]:
    """{"rows": one per (ep, dispatch), "layers": one per ep and MoE layer (megalite's, each
    anchor's that runs), "anchors": each anchor's import result, "status": what each anchor
    that imports did in the world}."""
    args.world = args.world or max(args.ep)
    if args.ep[0] != 1 or any(args.world % ep for ep in args.ep):
        raise SystemExit(f"megalite-bench ep: --ep {' '.join(map(str, args.ep))} --world "
                         f"{args.world}: the ep sizes start at 1 (the ratios' base) and "
                         "divide --world, e.g. --ep 1 2 4 --world 4")
    anchors = anchor_layers()
    with tempfile.TemporaryDirectory() as tmp:
        data = args.data or str(prepared_corpus(Path(tmp)))
        out = run_ranks(_world, args.world, args=(args, data, tmp, anchors), timeout_s=3600)[0]
    rows, layers = out["rows"], out["layers"]
    print(f"\n{' '.join([args.preset, *args.model])}, seq {args.seq_len}, micro-batch "
          f"{args.micro_batch}, fp32, {args.world} gloo ranks (ep folded over dp), "
          f"{args.steps} timed steps after {args.warmup} warmup + 1 measured")
    print("\n".join(table(rows)))
    print(f"the MoE layer beside the anchors' expert-parallel layers, same weights and tokens "
          f"({args.seq_len} x {args.micro_batch} a rank), forward + backward, megalite's "
          f"all-to-all at ep > 1, {args.layer_steps} timed steps:")
    print("\n".join(compare_lines(layers["rows"])))
    print("\n".join(anchor_lines(anchors, layers["status"])))
    return {"rows": rows, "layers": layers["rows"], "anchors": anchors,
            "status": layers["status"]}


def add_arguments(parser) -> None:
    parser.add_argument("--preset", default="mixtral-tiny", help="model preset (conf/model)")
    parser.add_argument("--model", nargs="*", default=[], metavar="KEY=VALUE",
                        help="model overrides, e.g. moe.capacity_factor=0.25")
    parser.add_argument("--ep", type=int, nargs="+", default=[1, 2, 4],
                        help="ep sizes (1 first), each dividing --world")
    parser.add_argument("--world", type=int, default=0, help="ranks (default: the largest ep)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per trainer")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--layer-steps", type=int, default=20,
                        help="timed forward + backward steps per MoE layer (megalite's, "
                             "each anchor's)")
    parser.add_argument("--data", default=None, help="a prepared data directory")
