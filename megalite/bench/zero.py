"""ZeRO against PyTorch's own sharding: megalite zero=3 vs FSDP2 (`fully_shard`), megalite
zero=1 vs DDP + `ZeroRedundancyOptimizer` — step time and memory per rank, as ratios.

All four train the same model in the same gloo world (one spawned world per `--dp`): megalite's
GPT2 (tp = pp = 1, dropout 0, fp32 on CPU), the same `init_parameters`, the same batches on a
rank (different ones per rank), AdamW with `OptimConfig`'s defaults (lr, betas, eps, decay 0.1 on
matrices only, foreach) at a constant lr, global-norm clipping at 1.0, `--micro-batches`
gradient accumulation of the mean loss. megalite runs its trainer's step (PipelineSchedule
(pp = 1) -> finish_grad_sync -> clip_and_step -> zero_grad) on ZeroEngine(zero=3 | 1), buckets
of 25 MB, zero=3 resharding after forward. The references wrap a plain GPT2 instance:
  fsdp2    `fully_shard` on each block, then on the root (torchtitan's wrapping; the root holds
           wte = lm_head, wpe, ln_f), gradients reduce-scattered every micro-batch like zero=3;
           `get_total_norm` + `clip_grads_with_norm_`; `zero_grad(set_to_none=True)`.
  ddp+zro  DDP(gradient_as_bucket_view=True, 25 MB buckets, `no_sync` on all but the last
           micro-batch) + ZeroRedundancyOptimizer(AdamW); `clip_grad_norm_`.

Step time: the contenders' steps are interleaved (A B C D, D C B A, ...) so machine noise hits
all alike; every step starts after a barrier, its time is the slowest rank's, and the median over
`--steps` (after `--warmup`) is reported. Ratio = reference time / megalite time (> 1: megalite
faster; its partner is in `vs`).

Memory, per rank (max over ranks), MiB:
  state  bytes of the tensors the contender holds right after its optimizer step: parameters,
         gradients, optimizer moments — deduplicated by storage, so a flat buffer counts once
         and padding counts; megalite: `ZeroEngine.state_bytes()`; FSDP2: the DTensors' local
         shards; ZeroRedundancyOptimizer: its local optimizer's state. This is what ZeRO changes.
  peak   there is no allocator peak on CPU, so this is the peak of live bytes allocated through
         torch's CPU allocator, tracked by `torch.profiler` (profile_memory): from building the
         contender (model, engine/wrapper, optimizer) through its first step (which creates
         the optimizer state) to the end of its second step; the maximum during the second
         step. It covers parameters, gradients, optimizer state, bucket/communication buffers
         and activations made on the training thread, but not memory that gloo's own threads
         allocate, nor Python objects. The memory of the batches (shared) is not counted.
`mem ratio` = megalite peak / reference peak (<= 1: megalite uses no more memory).

Sanity: every step's loss of each megalite contender is compared with its reference's (same
math, same batches): `loss rel diff` is the largest relative difference over all steps and
ranks. CPU/gloo only, as the issue asks (on CUDA the peak would be torch.cuda.max_memory_allocated).

    python scripts/bench.py zero --dp 2 4 --steps 10
"""
from __future__ import annotations

import contextlib
import gc
import math
import multiprocessing as mp
import os
import queue as queue_mod
import socket
import statistics
import time
import traceback
from dataclasses import replace
from typing import Callable, Dict, List, Tuple

import torch
import torch.distributed as dist

PAIRS = [("megalite-z3", "fsdp2"), ("megalite-z1", "ddp+zro")]


def _batches(vocab: int, mb: int, seq: int, m: int, rank: int):
    g = torch.Generator().manual_seed(1000 + rank)  # each DP rank its own data
    ws = [torch.randint(0, vocab, (mb, seq + 1), generator=g) for _ in range(m)]
    return [(w[:, :-1].contiguous(), w[:, 1:].contiguous()) for w in ws]


def _nbytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (DTensors: their local shards)."""
    from torch.distributed.tensor import DTensor
    seen = {}
    for t in tensors:
        if t is None:
            continue
        s = (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _opt_tensors(opt) -> List[torch.Tensor]:
    return [v for st in opt.state.values() for k, v in st.items() if k != "step" and torch.is_tensor(v)]


def _groups(model) -> List[dict]:
    """AdamW groups as megalite makes them: decay on matrices only (by ParamSpec)."""
    named = list(model.named_parameters())
    decay = [p for n, p in named if model.param_specs[n].weight_decay]
    rest = [p for n, p in named if not model.param_specs[n].weight_decay]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def _make(name: str, mcfg, topo, batches, optim) -> Callable[[bool], Tuple[float, int]]:
    """Build one contender; returns step(probe) -> (mean loss, state bytes if probe else 0)."""
    from megalite.model.gpt2 import GPT2
    from megalite.model.init import init_parameters

    model = GPT2(mcfg, topo.tp_group)
    init_parameters(model, seed=0)
    model.train()
    m = len(batches)
    hp = dict(lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps, foreach=True)
    if name.startswith("megalite"):
        from megalite.parallel.pipeline import PipelineSchedule
        from megalite.parallel.zero import ZeroEngine
        engine = ZeroEngine(model, topo, 3 if name.endswith("z3") else 1, optim)
        x = batches[0][0]
        schedule = PipelineSchedule(model, topo, engine, (x.shape[1], x.shape[0], mcfg.n_embd),
                                    torch.float32, torch.device("cpu"))

        def step(probe: bool) -> Tuple[float, int]:
            loss = schedule.train_step(batches)
            engine.finish_grad_sync()
            engine.clip_and_step(optim.lr, optim.grad_clip)
            state = sum(engine.state_bytes().values()) if probe else 0
            engine.zero_grad()
            return loss, state
        return step
    if name == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import DTensor
        mesh = init_device_mesh("cpu", (topo.dp,))
        for block in model.transformer.h.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(_groups(model), **hp)
        fwd, params = model, list(model.parameters())

        def clip() -> None:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
            norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
            torch.nn.utils.clip_grads_with_norm_(params, optim.grad_clip, norm, foreach=True)
        no_sync = lambda last: contextlib.nullcontext()  # noqa: E731  (sync every micro-batch)
    else:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel as DDP
        fwd = DDP(model, gradient_as_bucket_view=True, bucket_cap_mb=25)
        opt = ZeroRedundancyOptimizer(_groups(model), optimizer_class=torch.optim.AdamW, **hp)
        params = list(model.parameters())
        clip = lambda: torch.nn.utils.clip_grad_norm_(params, optim.grad_clip, foreach=True)  # noqa: E731
        no_sync = lambda last: contextlib.nullcontext() if last else fwd.no_sync()  # noqa: E731

    def step(probe: bool) -> Tuple[float, int]:
        total = torch.zeros(())
        for i, (x, y) in enumerate(batches):
            with no_sync(i == m - 1):
                loss = fwd(x, y)
                (loss / m).backward()
            total += loss.detach()
        clip()
        opt.step()
        state = 0
        if probe:
            local = opt.optim if name == "ddp+zro" else opt  # ZeRO-1: this rank's optimizer
            state = _nbytes(params + [p.grad for p in params] + _opt_tensors(local))
        opt.zero_grad(set_to_none=name == "fsdp2")
        return total.item() / m, state
    return step


def _peak_during(prof, label: str) -> int:
    """Peak of live tracked bytes (since the profile began) inside record_function `label`."""
    from torch._C._profiler import _EventType

    def walk(nodes):
        for n in nodes:
            yield n
            yield from walk(n.children)
    events = list(walk(prof.profiler.kineto_results.experimental_event_tree()))
    span = next(e for e in events if e.name == label)
    allocs = sorted((e for e in events if e.tag == _EventType.Allocation),
                    key=lambda e: e.start_time_ns)
    base = allocs[0].extra_fields.total_allocated - allocs[0].extra_fields.alloc_size
    live = [(a.start_time_ns, a.extra_fields.total_allocated - base) for a in allocs]
    at_start = [v for t, v in live if t < span.start_time_ns][-1:]  # live when the step began
    return max(at_start + [v for t, v in live if span.start_time_ns <= t <= span.end_time_ns])


def _rank(rank: int, world: int, mcfg, args) -> List[dict]:
    from torch.profiler import ProfilerActivity, profile, record_function

    from megalite.config import OptimConfig
    from megalite.parallel.topology import build_topology
    topo, optim = build_topology(1, 1, world), OptimConfig()
    batches = _batches(mcfg.vocab_size, args.micro_batch, args.seq_len, args.micro_batches, rank)
    names = [n for pair in PAIRS for n in pair]
    steps, state, peak, losses = {}, {}, {}, {n: [] for n in names}
    for name in names:  # one at a time: build, step 1, step 2 (memory measured in step 2)
        gc.collect()
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            steps[name] = _make(name, mcfg, topo, batches, optim)
            losses[name].append(steps[name](False)[0])
            with record_function("measured_step"):
                loss, state[name] = steps[name](True)
        losses[name].append(loss)
        peak[name] = _peak_during(prof, "measured_step")
    times = {n: [] for n in names}
    for i in range(args.warmup + args.steps):
        for name in (names if i % 2 == 0 else names[::-1]):
            dist.barrier()
            t0 = time.perf_counter()
            loss, _ = steps[name](False)
            dt = time.perf_counter() - t0
            losses[name].append(loss)
            if i >= args.warmup:
                times[name].append(dt)
    t = torch.tensor([times[n] for n in names], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step lasts until its slowest rank is done
    mem = torch.tensor([[state[n], peak[n]] for n in names], dtype=torch.float64)
    dist.all_reduce(mem, op=dist.ReduceOp.MAX)
    diff = torch.tensor([max(abs(a - b) / max(abs(b), 1e-12)
                             for a, b in zip(losses[m], losses[r])) for m, r in PAIRS])
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    rows = []
    for j, name in enumerate(names):
        rows.append({"dp": world, "contender": name, "step_s": statistics.median(t[j].tolist()),
                     "state_mib": mem[j, 0].item() / 2**20, "peak_mib": mem[j, 1].item() / 2**20})
    for k, (m, r) in enumerate(PAIRS):
        a, b = rows[names.index(m)], rows[names.index(r)]
        a.update(vs=r, speed_ratio=b["step_s"] / a["step_s"],
                 mem_ratio=a["peak_mib"] / b["peak_mib"], loss_rel_diff=diff[k].item())
    return rows


def _entry(rank, world, port, threads, fn, args, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        torch.set_num_threads(threads)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        try:
            q.put((rank, True, fn(rank, world, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:
        q.put((rank, False, traceback.format_exc()))


def spawn(fn, world: int, args=(), timeout_s: float = 1800.0):
    """fn(rank, world, *args) on `world` gloo ranks (spawned processes); rank 0's result."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    threads = max(1, (os.cpu_count() or 1) // world)
    procs = [ctx.Process(target=_entry, args=(r, world, port, threads, fn, args, q), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results, deadline = {}, time.monotonic() + timeout_s
    try:
        while len(results) < world:
            try:
                rank, ok, value = q.get(timeout=1.0)
            except queue_mod.Empty:
                if time.monotonic() > deadline or any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError(f"ranks died or timed out: {[p.exitcode for p in procs]}")
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return results[0]


def run(args) -> List[dict]:
    from megalite.config import load_config
    mcfg = load_config([f"model={args.preset}", *[f"model.{o}" for o in args.model]]).model
    mcfg = replace(mcfg, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    args.seq_len = min(args.seq_len, mcfg.n_positions)
    print(f"model={args.preset} L={mcfg.n_layer} h={mcfg.n_embd} V={mcfg.vocab_size} "
          f"seq={args.seq_len} micro_batch={args.micro_batch} micro_batches={args.micro_batches} "
          f"torch {torch.__version__}, {os.cpu_count()} CPUs, gloo", flush=True)
    rows = []
    for dp in args.dp:
        rows += spawn(_rank, dp, (mcfg, args))
    _print_table(rows)
    return rows


def _print_table(rows: List[dict]) -> None:
    print(f"\n{'dp':>3} {'contender':<12} {'step ms':>8} {'state MiB':>9} {'peak MiB':>9} "
          f"{'vs':<8} {'speed ratio':>11} {'mem ratio':>9} {'loss rel diff':>13}")
    for r in rows:
        extra = (f"{r['vs']:<8} {r['speed_ratio']:>11.3f} {r['mem_ratio']:>9.3f} "
                 f"{r['loss_rel_diff']:>13.2e}") if "vs" in r else ""
        print(f"{r['dp']:>3} {r['contender']:<12} {r['step_s'] * 1e3:>8.1f} "
              f"{r['state_mib']:>9.2f} {r['peak_mib']:>9.2f} {extra}")


def add_arguments(parser) -> None:
    parser.add_argument("--preset", default="tiny", help="conf/model preset")
    parser.add_argument("--model", nargs="*", default=[], metavar="KEY=VALUE",
                        help="model overrides, e.g. n_layer=2 n_embd=64")
    parser.add_argument("--dp", type=int, nargs="+", default=[2, 4], help="one gloo world each")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batches", type=int, default=2, help="per optimizer step")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
