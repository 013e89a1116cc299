"""Optimizer offload (`offload.optimizer`) and activation offload: what they cost per step.

    megalite-bench offload                       # CPU: host AdamW, small-model step times
    megalite-bench offload --preset gpt2-xl --micro-batch 8 --micro-batches 4   # one GPU

Host AdamW throughput: parameter updates per second of PyTorch's CPU AdamW, fused kernel
against foreach, on `--adam-params` fp32 parameters (the host half of offload.optimizer),
alternating calls so machine noise hits both.

Step time: the real training path (GPT2 stage -> pipeline schedule -> ZeRO engine, one
rank) at offload.optimizer 0 / 0.5 / 1 (and, on CUDA, activation offload off / on: every
block; `--variants F:act:K` the first K blocks; `--act-fit-gib G` adds the planner's choice
for a G GiB device, the fewest first blocks under which the plan fits). One
variant is alive at a time — built, warmed up, timed, freed — so a gpt2-xl sweep fits one
80 GB GPU (every variant's model and engine at once would need ~112 GB of state before any
activation); the no-offload baseline is rebuilt and timed again every `--baseline-every`
variants and at the end, so drift over the run (clocks, thermals, other jobs) shows as the
baselines' spread, and each variant's ratio is against the mean of the baselines around it.
Each variant is warmed up past its first host step (the host AdamW creates its moments
there: a slow first step that is not the steady state) before `--steps` steps are timed.
Reported per variant: every timed step's seconds (`times_s`) and their median, the ratio,
under optimizer offload a timeline of the timed steps (`timeline`: each range's copies to and
from the host, host step and the waits on it, `megalite.parallel.offload_timeline`; per kind
`timeline_s`), the time the step waited for offload
copies (the `offload_wait` step phase, measured as the trainer measures it: on CUDA with
CUDA events around each wait, so the next forward's stalls on the parameter copies' events
count, not only the CPU's blocking waits; activation offload's waits inside the backward
are in the step time, not in this column), and on CUDA peak device memory, tokens/s and MFU,
at the largest micro-batch of `--micro-batch` that fits without offload. On CUDA, torchao's
`CPUOffloadOptimizer` (fp32 parameters under bf16 autocast, as torchao documents it) runs the
same model and batches, also alone, where torchao is importable: it is optional and not a
megalite dependency; a GPU machine without network needs its wheel carried along
(`pip download --no-deps torchao` where there is network, `pip install --no-deps
torchao-*.whl` there). On CPU
host = device: offload moves nothing and saves nothing, so the step-time ratio there is the
bookkeeping's cost (the extra copies and the host AdamW in pieces), not PCIe's; it is also
reported in CPU seconds of the process per step (`cpu_ratio`: every thread, the offload
worker's included), which a shared machine's other jobs move far less than wall time.
"""
from __future__ import annotations

import contextlib
import gc
import json
import statistics
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch

from megalite.config.layout import Layout
from megalite.config.schema import Config, OffloadConfig, OptimConfig, load_config
from megalite.model.activation_offload import ActivationOffload
from megalite.model.families import flops_per_token
from megalite.model.gpt2.stage import GPT2
from megalite.model.init import init_parameters
from megalite.parallel.host_range import build_adamw
from megalite.parallel.offload import OptimizerOffload
from megalite.parallel.offload_timeline import OffloadTimeline, totals
from megalite.parallel.pipeline import PipelineSchedule
from megalite.parallel.topology import build_topology
from megalite.train.build import build_engine
from megalite.train.host_threads import set_host_threads
from megalite.train.metrics import Peak, peak_tflops
from megalite.train.timers import StepTimers
from megalite_bench.offload_variants import (
    build_order,
    parse_variants,
    planned_activation_layers,
    variant_name,
)
from megalite_bench.timing import alternate, peak_memory, reset_peak, synchronize, timed


def add_arguments(p) -> None:
    p.add_argument("--preset", default=None, help="model preset (default: gpt2-xl on CUDA, a "
                   "4-layer 256-wide model on CPU)")
    p.add_argument("--seq-len", type=int, default=None, help="default 1024 CUDA, 128 CPU")
    p.add_argument("--micro-batch", type=int, nargs="+", default=None,
                   help="candidates, largest first: the first that fits without offload")
    p.add_argument("--micro-batches", type=int, nargs="+", default=[4],
                   help="micro-batches per step (m), one row set per value")
    p.add_argument("--adam-params", type=int, default=20_000_000,
                   help="parameters of the host AdamW throughput test")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--baseline-every", type=int, default=2,
                   help="time a rebuilt no-offload baseline after every N variants (and at "
                   "the start and end): drift shows as the baselines' spread")
    p.add_argument("--variants", nargs="+", default=None, metavar="F[:act[:K]]",
                   help="only these variants, e.g. 0.5 1 0:act 1:act 0:act:8 (K: the first K "
                   "blocks' activations only; default: optimizer 0 / 0.5 / 1, with "
                   "activation offload off and, on CUDA, of every block)")
    p.add_argument("--act-fit-gib", type=float, default=None, metavar="GIB",
                   help="also the planner's activation offload for a device of GIB GiB: the "
                   "fewest first blocks under which the plan fits (megalite.plan.fit), "
                   "optimizer offload off")
    p.add_argument("--skip-adam", action="store_true", help="skip the host AdamW throughput")
    p.add_argument("--torchao", type=int, default=1, choices=[0, 1],
                   help="on CUDA, also torchao's CPUOffloadOptimizer where importable")
    p.add_argument("--out", default=None, help="also write the rows as JSON here")


def host_adamw_throughput(numel: int, steps: int, warmup: int) -> Dict[str, float]:
    """Parameter updates per second of the CPU AdamW, fused and foreach, on `numel` fp32
    parameters in 8 tensors (alternating)."""
    cpu = torch.device("cpu")
    fns = {}
    for kind in ("fused", "foreach"):
        params = [torch.nn.Parameter(torch.randn(numel // 8)) for _ in range(8)]
        for p in params:
            p.grad = torch.randn_like(p)
        try:
            opt = build_adamw(params, [True] * 8, OptimConfig(), kind)
        except RuntimeError as e:  # no fused CPU kernel in this PyTorch
            print(f"megalite-bench offload: AdamW({kind}=True) on CPU: {e}")
            continue
        fns[kind] = opt.step
    seconds = alternate(fns, cpu, warmup, steps)
    return {kind: numel // 8 * 8 / s for kind, s in seconds.items()}


def build_variant(mcfg, device, dtype, precision, micro_batch: int, seq: int, fraction: float,
                  activations: bool, batches, layers: Optional[int] = None):
    """One variant's step (model, engine, schedule on one rank), its step timers and its
    optimizer offload (None without): offload.optimizer=`fraction`, activation offload of
    every block or the first `layers`."""
    topo = build_topology(1, 1, 1)
    offload = ActivationOffload(device, layers) if activations else None
    with torch.device(device):
        model = GPT2(mcfg, topo.tp_group, offload=offload)
    init_parameters(model, seed=0)
    clock = StepTimers(device)  # CUDA: event marks around each wait (megalite.train.timers)
    engine = build_engine(Config(offload=OffloadConfig(optimizer=fraction)),
                          Layout.of(topo, precision=precision), topo, model, clock)
    schedule = PipelineSchedule(model.chunks, topo, engine, (seq, micro_batch, mcfg.n_embd),
                                dtype, device)
    model.train()

    def step() -> None:
        schedule.train_step(batches)
        engine.finish_grad_sync()
        engine.clip_and_step(1e-4, 1.0)
        engine.zero_grad()
    return step, clock, engine.offload


def torchao_available() -> bool:
    """Whether torchao's CPUOffloadOptimizer imports (optional: not a megalite dependency)."""
    import importlib.util

    try:
        return importlib.util.find_spec("torchao.optim") is not None
    except ImportError:  # no torchao package at all
        return False


def _torchao_runner(mcfg, device, micro_batch: int, seq: int, batches) -> Callable:
    """torchao's CPUOffloadOptimizer on the same model (`torchao_available()` first)."""
    from torchao.optim import CPUOffloadOptimizer

    topo = build_topology(1, 1, 1)
    with torch.device(device):
        model = GPT2(mcfg, topo.tp_group).train()
    init_parameters(model, seed=0)
    opt = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, fused=True)

    def step() -> None:
        for x, y in batches:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = model(x, y) / len(batches)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    return step


def random_batches(vocab: int, micro_batch: int, seq: int, m: int, device):
    g = torch.Generator().manual_seed(0)
    w = torch.randint(0, vocab, (m, micro_batch, seq + 1), generator=g).to(device)
    return [(x[:, :-1], x[:, 1:]) for x in w]


def _free(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _largest_fitting(mcfg, device, dtype, precision, seq: int, candidates: List[int]) -> int:
    """The largest of `candidates` whose no-offload step runs (each try freed before the
    next)."""
    for mb in candidates:
        step = None
        try:
            step, _, _ = build_variant(mcfg, device, dtype, precision, mb, seq, 0.0, False,
                              random_batches(mcfg.vocab_size, mb, seq, 1, device))
            step()
            return mb
        except torch.cuda.OutOfMemoryError:
            pass
        finally:
            del step
            _free(device)
    raise SystemExit(f"no micro-batch of {candidates} fits without offload")


def time_variant(make: Callable[[], Tuple[Callable[[], None], Optional[StepTimers],
                                         Optional[OptimizerOffload]]], device,
                 warmup: int, steps: int) -> dict:
    """Build one variant (`make`: its step, step timers, optimizer offload), warm it up past
    its first host step (which creates the host AdamW's moments: the host is idle before the
    first timed step), time `steps` steps, free it: every step's seconds and their median,
    offload waits per step, peak device memory; with optimizer offload the timeline of the
    timed steps (`timeline`: spans of copies, host steps, waits and each `step`, seconds
    since the first began, and the wait for the last host step after them; `timeline_s`: each
    kind's seconds per step, of the spans begun inside the steps); on CPU also the
    median CPU seconds of the process per step (`cpu_s`: what other jobs on a shared machine
    barely move, unlike wall time)."""
    reset_peak(device)
    step = clock = offload = None
    try:
        step, clock, offload = make()
        for _ in range(max(1, warmup)):
            step()
        if offload is not None:
            offload.step_done()
        synchronize(device)
        if clock is not None:
            clock.reset()
        reset_peak(device)
        timeline = None if offload is None else OffloadTimeline(device)
        if timeline is not None:
            offload.record(timeline)
            timeline.begin()
        times, cpu = [], []
        for i in range(steps):
            c0 = time.process_time()
            with timeline.on_host("step", i) if timeline else contextlib.nullcontext():
                times.append(timed(step, device))
            cpu.append(time.process_time() - c0)
        wait = clock.take()["offload_wait"] / steps if clock is not None else None
        got = {"step_s": statistics.median(times), "times_s": times, "offload_wait_s": wait,
               "peak_memory_gib": peak_memory(device) / 2**30}
        if timeline is not None:
            offload.step_done()  # the last step's host work, drawn whole
            got["timeline"] = spans = timeline.take()
            last = max(x["end_s"] for x in spans if x["kind"] == "step")
            # per step: what began inside the timed steps (not the wait for the last host step)
            got["timeline_s"] = {k: v / steps for k, v in totals(
                [x for x in spans if x["start_s"] < last]).items()}
            offload.record(None)
        if device.type == "cpu":  # every thread of the process, the offload worker's too
            got["cpu_s"] = statistics.median(cpu)
        return got
    finally:
        del step, clock, offload
        _free(device)


def step_times(args, device) -> List[dict]:
    cuda = device.type == "cuda"
    preset = args.preset or ("gpt2-xl" if cuda else None)
    small = [] if preset else ["model.n_layer=4", "model.n_embd=256", "model.n_head=4",
                               "model.vocab_size=8192"]
    mcfg = load_config(([f"model={preset}"] if preset else []) + small + [
        "model.resid_pdrop=0", "model.embd_pdrop=0", "model.attn_pdrop=0"]).model
    seq = args.seq_len or (1024 if cuda else 128)
    precision, dtype = ("bf16", torch.bfloat16) if cuda else ("fp32", torch.float32)
    mb = _largest_fitting(mcfg, device, dtype, precision, seq, args.micro_batch or [2]) \
        if cuda else (args.micro_batch or [2])[0]
    peak = peak_tflops(device, None) if cuda else Peak(None, "not on CPU")
    variants = parse_variants(getattr(args, "variants", None), cuda)
    rows = []
    for m in args.micro_batches:
        wanted = list(variants)
        if getattr(args, "act_fit_gib", None):
            layers = planned_activation_layers(
                [f"model={preset}"] if preset else small, seq, mb, m, args.act_fit_gib)
            print(f"megalite-bench offload: the planner's activation offload for "
                  f"{args.act_fit_gib:g} GiB at micro-batch {mb} x {m}: "
                  f"offload.activations_layers={layers}", flush=True)
            wanted.append((0.0, True, layers))
        order = build_order(wanted, getattr(args, "baseline_every", 2))
        batches = random_batches(mcfg.vocab_size, mb, seq, m, device)
        tokens = mb * seq * m
        timed_rows = []
        for i, (name, fraction, act, layers) in enumerate(order):
            def make(fraction=fraction, act=act, layers=layers):
                return build_variant(mcfg, device, dtype, precision, mb, seq, fraction, act,
                                     batches, layers)
            try:
                got = time_variant(make, device, args.warmup, args.steps)
            except torch.cuda.OutOfMemoryError as e:
                got = {"error": f"out of memory: {str(e).splitlines()[0]}"}
            timed_rows.append({"order": i, "variant": name, **got})
            print(json.dumps({"m": m, "micro_batch": mb, **timed_rows[-1]}), flush=True)
        if cuda and getattr(args, "torchao", 1) and torchao_available():
            try:
                got = time_variant(lambda: (_torchao_runner(mcfg, device, mb, seq, batches),
                                            None, None), device, args.warmup, args.steps)
            except torch.cuda.OutOfMemoryError as e:
                got = {"error": f"out of memory: {str(e).splitlines()[0]}"}
            timed_rows.append({"order": len(order), "variant": "torchao CPUOffloadOptimizer",
                               **got})
            print(json.dumps({"m": m, "micro_batch": mb, **timed_rows[-1]}), flush=True)
        elif cuda and getattr(args, "torchao", 1):
            print("megalite-bench offload: torchao is not importable: its CPUOffloadOptimizer "
                  "is not compared (pip install torchao; offline, carry its wheel)", flush=True)
        rows += with_ratios(timed_rows, m, mb, tokens, mcfg, seq, peak)
    return rows


def with_ratios(timed_rows: List[dict], m: int, mb: int, tokens: int, mcfg, seq: int,
                 peak: Peak) -> List[dict]:
    """Each row's ratio to the mean of the baselines timed just before and after it (on
    CPU also `cpu_ratio`, of the CPU seconds); the baselines' spread (max / min) on every
    row: the drift of the run."""
    base_name = variant_name(0.0, False)
    bases = [r for r in timed_rows if r["variant"] == base_name and "step_s" in r]
    spread = max(b["step_s"] for b in bases) / min(b["step_s"] for b in bases) \
        if bases else None

    def around(r: dict, key: str) -> float:
        before = [b[key] for b in bases if b["order"] <= r["order"]][-1:]
        after = [b[key] for b in bases if b["order"] >= r["order"]][:1]
        return statistics.mean(before + after)
    out = []
    for r in timed_rows:
        row = {"m": m, "micro_batch": mb, **r, "baseline_spread": spread}
        if "step_s" in r and bases:
            row.update(ratio=r["step_s"] / around(r, "step_s"), tokens_per_s=tokens / r["step_s"],
                       mfu=None if peak.tflops is None else
                       tokens / r["step_s"] * flops_per_token(mcfg, seq) / (peak.tflops * 1e12))
            if "cpu_s" in r and all("cpu_s" in b for b in bases):
                row["cpu_ratio"] = r["cpu_s"] / around(r, "cpu_s")
        out.append(row)
    return out


def run(args) -> List[dict]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    set_host_threads(1.0, device, local_ranks=1)  # CUDA: the host cores a training run gets
    rows = []
    throughput = {} if getattr(args, "skip_adam", False) else \
        host_adamw_throughput(args.adam_params, args.steps, args.warmup)
    for kind, rate in throughput.items():
        rows.append({"bench": "host_adamw", "kind": kind, "params": args.adam_params,
                     "params_per_s": rate})
        print(f"host AdamW {kind:>8}: {rate / 1e6:8.1f} M parameters/s "
              f"({args.adam_params / 1e6:.0f}M fp32 parameters, {torch.get_num_threads()} "
              "threads)")
    if len(throughput) == 2:
        print(f"fused / foreach: {throughput['fused'] / throughput['foreach']:.2f}x")
    for row in step_times(args, device):
        rows.append({"bench": "step", **row})
        if "error" in row:
            print(f"m={row['m']} mb={row['micro_batch']} {row['variant']:<30} {row['error']}")
            continue
        wait = "" if row.get("offload_wait_s") is None else \
            f"  offload wait {row['offload_wait_s'] * 1e3:7.1f} ms"
        cpu = "" if "cpu_ratio" not in row else \
            f"  cpu {row['cpu_s'] * 1e3:7.1f} ms x{row['cpu_ratio']:.2f}"
        print(f"m={row['m']} mb={row['micro_batch']} {row['variant']:<30} "
              f"{row['step_s'] * 1e3:9.1f} ms/step  x{row.get('ratio', float('nan')):.2f}"
              f"{cpu}{wait}  peak {row['peak_memory_gib']:.2f} GiB  "
              f"{row.get('tokens_per_s', 0):,.0f} tok/s  (baselines' spread "
              f"x{row['baseline_spread'] or float('nan'):.3f})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return rows
