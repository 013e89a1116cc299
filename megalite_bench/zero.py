"""ZeRO against PyTorch's own sharding, in the same gloo world and the same run: megalite
zero=3 vs FSDP2 (`fully_shard`), megalite zero=1 vs DDP + `ZeroRedundancyOptimizer`.

One gloo world of spawned ranks per `--dp` runs all four on the same model: megalite's GPT2
(tp = pp = 1, dropout 0, fp32 on CPU), `init_parameters(seed=0)`, the same batches (each rank
its own), AdamW as megalite's `OptimConfig` (lr, betas, eps; decay 0.1 on matrices only;
foreach) at a constant lr, global-norm clipping at 1.0, `--micro-batches` of accumulation.
  megalite-z3/z1  ZeroEngine(zero=3 | 1, 25 MB buckets, zero=3 reshards after forward) and the
                  trainer's step: PipelineSchedule(pp=1).train_step -> finish_grad_sync ->
                  clip_and_step -> zero_grad.
  fsdp2           a plain GPT2; `fully_shard` on each block, then on the root (torchtitan's
                  wrapping; the root holds wte = lm_head, wpe, ln_f); gradients reduce-scattered
                  every micro-batch as zero=3 does; get_total_norm + clip_grads_with_norm_.
  ddp+zro         DDP(gradient_as_bucket_view=True, 25 MB buckets, no_sync on all but the last
                  micro-batch) + ZeroRedundancyOptimizer(AdamW); clip_grad_norm_.

Step time: steps interleaved A B C D, D C B A, ... (machine noise hits all alike), each after a
barrier and lasting until its slowest rank is done; median of `--steps` after `--warmup`.
`speed ratio` = reference time / megalite time (> 1: megalite faster than the `vs` contender).

Memory per rank (the maximum over ranks), MiB:
  state  the parameters, gradients and optimizer moments the contender holds right after its
         optimizer step, counted from the actual tensors (distinct storages, padding
         included): megalite's `ZeroEngine.state_bytes()`, FSDP2's DTensor local shards,
         ZeroRedundancyOptimizer's local optimizer state. This is what ZeRO changes.
  peak   CPU has no allocator peak counter. `torch.profiler(profile_memory=True)` records every
         allocation and free through torch's CPU allocator from the moment the contender is
         built; peak = the most bytes live (allocated in that window, not yet freed) during its
         steps 3 and 4 (steady state: optimizer state exists, DDP has rebuilt its buckets).
         It counts parameters, gradients, optimizer state, flat/bucket/communication buffers
         and activations; not Python objects, the (shared) batches, or what gloo allocates on
         its own threads (see `_peak`). (On CUDA this would be torch.cuda.max_memory_allocated;
         this benchmark is CPU/gloo only.)
`mem ratio` = megalite peak / reference peak (<= 1: megalite needs no more memory).

Sanity: the same math on the same batches, so every step's loss must agree: `loss rel diff` is
the largest relative difference, over all steps and ranks, between megalite and its reference.

    python scripts/bench.py zero --dp 2 4 --steps 10
"""
from __future__ import annotations

import bisect
import contextlib
import gc
import os
import statistics
import time
from dataclasses import replace
from typing import Callable, List, Tuple

import torch
import torch.distributed as dist

from megalite.testing.spawn import run_ranks

PAIRS = [("megalite-z3", "fsdp2"), ("megalite-z1", "ddp+zro")]
Step = Callable[[bool], Tuple[float, int]]  # step(probe) -> (mean loss, state bytes if probe)


def _batches(vocab: int, mb: int, seq: int, m: int, rank: int):
    g = torch.Generator().manual_seed(1000 + rank)
    ws = [torch.randint(0, vocab, (mb, seq + 1), generator=g) for _ in range(m)]
    return [(w[:, :-1].contiguous(), w[:, 1:].contiguous()) for w in ws]


def _nbytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (DTensors: their local shards)."""
    from torch.distributed.tensor import DTensor
    storages = {}
    for t in tensors:
        if t is not None:
            s = (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())


def _make(name: str, mcfg, topo, batches, optim) -> Step:
    """Build one contender on a fresh, identically initialised GPT2."""
    from megalite.model.gpt2.stage import GPT2
    from megalite.model.init import init_parameters

    model = GPT2(mcfg, topo.tp_group)
    init_parameters(model, seed=0)
    model.train()
    if name.startswith("megalite"):
        return _megalite_step(name, model, mcfg, topo, batches, optim)
    return _torch_step(name, model, topo, batches, optim)


def _megalite_step(name: str, model, mcfg, topo, batches, optim) -> Step:
    from megalite.config.layout import Layout
    from megalite.config.schema import Config
    from megalite.parallel.pipeline import PipelineSchedule
    from megalite.train.build import build_engine

    layout = Layout.of(topo, zero_stage=3 if name.endswith("z3") else 1)
    engine = build_engine(Config(optim=optim), layout, topo, model)
    mb, seq = batches[0][0].shape
    schedule = PipelineSchedule(model.chunks, topo, engine, (seq, mb, mcfg.n_embd),
                                torch.float32, torch.device("cpu"))

    def step(probe: bool) -> Tuple[float, int]:
        loss = schedule.train_step(batches)
        engine.finish_grad_sync()
        engine.clip_and_step(optim.lr, optim.grad_clip)
        state = sum(engine.state_bytes().values()) if probe else 0
        engine.zero_grad()
        return loss.item(), state
    return step


def _torch_step(name: str, model, topo, batches, optim) -> Step:
    """FSDP2 (`fully_shard`) or DDP + ZeroRedundancyOptimizer on `model`."""
    m = len(batches)

    def adamw_groups() -> List[dict]:  # as megalite's: decay on matrices only (by ParamSpec)
        named = list(model.named_parameters())
        return [{"params": [p for n, p in named if model.param_specs[n].weight_decay == d],
                 "weight_decay": optim.weight_decay if d else 0.0} for d in (True, False)]
    hp = dict(lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps, foreach=True)
    if name == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import DTensor
        mesh = init_device_mesh("cpu", (topo.dp_size,))
        for block in model.transformer.h.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        fwd, opt = model, torch.optim.AdamW(adamw_groups(), **hp)
        local_opt, params = opt, list(model.parameters())
        no_sync = lambda last: contextlib.nullcontext()  # noqa: E731
    else:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel as DDP
        fwd = DDP(model, gradient_as_bucket_view=True, bucket_cap_mb=25)
        opt = ZeroRedundancyOptimizer(adamw_groups(), optimizer_class=torch.optim.AdamW, **hp)
        local_opt, params = opt.optim, list(model.parameters())  # optim: this rank's part
        no_sync = lambda last: contextlib.nullcontext() if last else fwd.no_sync()  # noqa: E731

    def step(probe: bool) -> Tuple[float, int]:
        total = torch.zeros(())
        for i, (x, y) in enumerate(batches):
            with no_sync(i == m - 1):
                loss = fwd(x, y)
                (loss / m).backward()
            total += loss.detach()
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
        if name == "fsdp2" and isinstance(norm, DTensor):
            norm = norm.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(params, optim.grad_clip, norm, foreach=True)
        opt.step()
        moments = [v for s in local_opt.state.values() for k, v in s.items() if k != "step"]
        state = _nbytes(params + [p.grad for p in params] + moments) if probe else 0
        opt.zero_grad(set_to_none=name == "fsdp2")
        return total.item() / m, state
    return step


def _peak(prof, measured: int) -> int:
    """Most bytes live during the last `measured` record_function("step") spans, rebuilt by
    address from the allocation events since the profile began. The profiler sees only this
    thread's frees; a block freed on one of gloo's threads (its copy of a reduce-scatter input,
    when the Work dies there) is taken as freed once a new allocation overlaps it, and a block
    made inside a collective at the latest when its step ends (every contender waits for its
    collectives within the step)."""
    from torch._C._profiler import _EventType

    def walk(nodes):
        for n in nodes:
            yield n
            yield from walk(n.children)

    def in_collective(e) -> bool:
        while e is not None and not e.name.startswith("c10d::"):
            e = e.parent
        return e is not None
    events = list(walk(prof.profiler.kineto_results.experimental_event_tree()))
    spans = sorted((e.start_time_ns, e.end_time_ns) for e in events if e.name == "step")
    timeline = sorted([(e.start_time_ns, e.extra_fields.ptr, e.extra_fields.alloc_size,
                        in_collective(e)) for e in events if e.tag == _EventType.Allocation]
                      + [(end, 0, 0, True) for _, end in spans])  # size 0: a step ends
    starts, blocks, total, peak = [], {}, 0, 0  # live: sorted addresses; address -> (size, comm)

    def drop(ptr: int) -> None:
        nonlocal total
        total -= blocks.pop(ptr)[0]
        starts.pop(bisect.bisect_left(starts, ptr))
    for t, ptr, size, comm in timeline:
        before = total
        if size > 0:
            i = max(0, bisect.bisect_right(starts, ptr) - 1)
            for p in [p for p in starts[i:bisect.bisect_left(starts, ptr + size)]
                      if p + blocks[p][0] > ptr]:
                drop(p)  # overlapped: freed unseen
            bisect.insort(starts, ptr)
            blocks[ptr] = (size, comm)
            total += size
        elif size < 0 and ptr in blocks:  # (frees of blocks older than the profile: ignored)
            drop(ptr)
        elif size == 0:
            for p in [p for p, (_, c) in blocks.items() if c]:
                drop(p)
        if any(lo <= t <= hi for lo, hi in spans[-measured:]):
            peak = max(peak, before, total)
    return peak


def _rank(rank: int, world: int, mcfg, args) -> List[dict]:
    from torch.profiler import ProfilerActivity, profile, record_function

    from megalite.config.schema import OptimConfig
    from megalite.parallel.topology import build_topology
    topo, optim = build_topology(1, 1, world), OptimConfig()
    batches = _batches(mcfg.vocab_size, args.micro_batch, args.seq_len, args.micro_batches, rank)
    names = [n for pair in PAIRS for n in pair]
    steps, state, peak, losses = {}, {}, {}, {n: [] for n in names}
    for name in names:  # one at a time: build, 4 steps under the memory profiler
        gc.collect()
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            steps[name] = _make(name, mcfg, topo, batches, optim)
            for i in range(4):
                with record_function("step"):
                    loss, state[name] = steps[name](i == 3)
                losses[name].append(loss)
        peak[name] = _peak(prof, measured=2)
    times = {n: [] for n in names}
    for i in range(args.warmup + args.steps):
        for name in (names if i % 2 == 0 else names[::-1]):
            dist.barrier()
            t0 = time.perf_counter()
            loss, _ = steps[name](False)
            if i >= args.warmup:
                times[name].append(time.perf_counter() - t0)
            losses[name].append(loss)
    t = torch.tensor([times[n] for n in names], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # per step: the slowest rank
    mem = torch.tensor([[state[n], peak[n]] for n in names], dtype=torch.float64) / 2**20
    dist.all_reduce(mem, op=dist.ReduceOp.MAX)
    diff = torch.tensor([max(abs(a - b) / abs(b) for a, b in zip(losses[x], losses[y]))
                         for x, y in PAIRS])
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    rows = {n: {"dp": world, "contender": n, "step_s": statistics.median(t[j].tolist()),
                "state_mib": mem[j, 0].item(), "peak_mib": mem[j, 1].item()}
            for j, n in enumerate(names)}
    for k, (x, y) in enumerate(PAIRS):
        rows[x].update(vs=y, speed_ratio=rows[y]["step_s"] / rows[x]["step_s"],
                       mem_ratio=rows[x]["peak_mib"] / rows[y]["peak_mib"],
                       loss_rel_diff=diff[k].item())
    return list(rows.values())


def run(args) -> List[dict]:
    from megalite.config.schema import load_config
    mcfg = load_config([f"model={args.preset}", *[f"model.{o}" for o in args.model]]).model
    mcfg = replace(mcfg, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    args.seq_len = min(args.seq_len, mcfg.n_positions)
    print(f"model={args.preset} L={mcfg.n_layer} h={mcfg.n_embd} V={mcfg.vocab_size} seq="
          f"{args.seq_len} micro_batch={args.micro_batch} micro_batches={args.micro_batches}, "
          f"torch {torch.__version__}, {os.cpu_count()} CPUs", flush=True)
    rows = []
    for dp in args.dp:  # one world of dp spawned ranks (one thread each); rank 0's rows
        rows += run_ranks(_rank, dp, (mcfg, args), timeout_s=3600)[0]
    print(f"\n{'dp':>3} {'contender':<12} {'step ms':>8} {'state MiB':>9} {'peak MiB':>9} "
          f"{'vs':<8} {'speed ratio':>11} {'mem ratio':>9} {'loss rel diff':>13}")
    for r in rows:
        pair = (f"{r['vs']:<8} {r['speed_ratio']:>11.3f} {r['mem_ratio']:>9.3f} "
                f"{r['loss_rel_diff']:>13.2e}") if "vs" in r else ""
        print(f"{r['dp']:>3} {r['contender']:<12} {r['step_s'] * 1e3:>8.1f} "
              f"{r['state_mib']:>9.2f} {r['peak_mib']:>9.2f} {pair}")
    return rows


def add_arguments(parser) -> None:
    parser.add_argument("--preset", default="tiny", help="model preset (conf/model)")
    parser.add_argument("--model", nargs="*", default=[], metavar="KEY=VALUE",
                        help="model overrides, e.g. n_layer=2 n_embd=64")
    parser.add_argument("--dp", type=int, nargs="+", default=[2, 4], help="a gloo world each")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batches", type=int, default=2, help="per optimizer step")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
