"""Optimizer offload (`offload.optimizer`) and activation offload: what they cost per step.

    megalite-bench offload                       # CPU: host AdamW, small-model step times
    megalite-bench offload --preset gpt2-xl --micro-batch 16 12 8 4 2 1 --micro-batches 8 1

Host AdamW throughput: parameter updates per second of PyTorch's CPU AdamW, fused kernel
against foreach, on `--adam-params` fp32 parameters (the host half of offload.optimizer),
alternating calls so machine noise hits both.

Step time: the real training path (GPT2 stage -> pipeline schedule -> ZeRO engine, one
rank) at offload.optimizer 0 / 0.5 / 1 (and, on CUDA, activation offload off / on), each
step timed alternately in the same process: median step time, the ratio to no offload, the
time blocked on offload copies (the `offload_wait` step phase) and, on CUDA, peak device
memory, tokens/s and MFU at the largest micro-batch of `--micro-batch` that fits without
offload. On CUDA, torchao's `CPUOffloadOptimizer` (fp32 parameters under bf16 autocast, as
torchao documents it) runs the same model and batches next to them where torchao is
importable. On CPU host = device: offload moves nothing and saves nothing, so the step-time
ratio there is the bookkeeping's cost (the extra copies and the host AdamW in pieces), not
PCIe's.
"""
from __future__ import annotations

import contextlib
import json
import time
from typing import Callable, Dict, List, Optional

import torch

from megalite.bench.timing import alternate, peak_memory, reset_peak
from megalite.config.layout import Layout
from megalite.config.schema import OptimConfig, load_config
from megalite.model.activation_offload import ActivationOffload
from megalite.model.gpt2 import GPT2, flops_per_token
from megalite.model.init import init_parameters
from megalite.parallel.offload import build_adamw
from megalite.parallel.pipeline import PipelineSchedule
from megalite.parallel.topology import build_topology
from megalite.parallel.zero import ZeroEngine
from megalite.train.host_threads import set_host_threads
from megalite.train.metrics import Peak, peak_tflops

FRACTIONS = (0.0, 0.5, 1.0)


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


class _WaitClock:
    """Stands in for the trainer's StepTimers: the seconds of the `offload_wait` phase."""

    def __init__(self):
        self.seconds = 0.0

    @contextlib.contextmanager
    def phase(self, name: str):
        t0 = time.perf_counter()
        yield
        self.seconds += time.perf_counter() - t0


def _runner(mcfg, device, dtype, precision, micro_batch: int, seq: int, fraction: float,
            activations: bool, batches):
    topo = build_topology(1, 1, 1)
    offload = ActivationOffload(device) if activations else None
    with torch.device(device):
        model = GPT2(mcfg, topo.tp_group, offload=offload)
    init_parameters(model, seed=0)
    clock = _WaitClock()
    engine = ZeroEngine(model, topo, Layout.of(topo, precision=precision), OptimConfig(),
                        offload_optimizer=fraction, offload_timers=clock)
    schedule = PipelineSchedule(model.chunks, topo, engine, (seq, micro_batch, mcfg.n_embd),
                                dtype, device)
    model.train()

    def step() -> None:
        schedule.train_step(batches)
        engine.finish_grad_sync()
        engine.clip_and_step(1e-4, 1.0)
        engine.zero_grad()
    return step, clock


def _torchao_runner(mcfg, device, micro_batch: int, seq: int, batches) -> Optional[Callable]:
    """torchao's CPUOffloadOptimizer on the same model (None where torchao is missing)."""
    try:
        from torchao.optim import CPUOffloadOptimizer
    except ImportError:
        return None
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


def _batches(vocab: int, micro_batch: int, seq: int, m: int, device):
    g = torch.Generator().manual_seed(0)
    w = torch.randint(0, vocab, (m, micro_batch, seq + 1), generator=g).to(device)
    return [(x[:, :-1], x[:, 1:]) for x in w]


def _largest_fitting(mcfg, device, dtype, precision, seq: int, candidates: List[int]) -> int:
    for mb in candidates:
        try:
            step, _ = _runner(mcfg, device, dtype, precision, mb, seq, 0.0, False,
                              _batches(mcfg.vocab_size, mb, seq, 1, device))
            step()
            return mb
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
    raise SystemExit(f"no micro-batch of {candidates} fits without offload")


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
    rows = []
    for m in args.micro_batches:
        batches = _batches(mcfg.vocab_size, mb, seq, m, device)
        variants = [(f, a) for a in ((False, True) if cuda else (False,)) for f in FRACTIONS]
        fns, clocks, memory = {}, {}, {}
        for f, a in variants:
            name = f"optimizer={f:g}" + (" activations" if a else "")
            reset_peak(device)
            fns[name], clocks[name] = _runner(mcfg, device, dtype, precision, mb, seq, f, a,
                                              batches)
            fns[name]()
            memory[name] = peak_memory(device)
        ao = _torchao_runner(mcfg, device, mb, seq, batches) if cuda else None
        if ao is not None:
            reset_peak(device)
            ao()
            fns["torchao CPUOffloadOptimizer"], memory["torchao CPUOffloadOptimizer"] = \
                ao, peak_memory(device)
        for c in clocks.values():
            c.seconds = 0.0
        seconds = alternate(fns, device, args.warmup, args.steps)
        base = seconds["optimizer=0"]
        tokens = mb * seq * m
        for name, s in seconds.items():
            calls = args.warmup + args.steps
            wait = clocks[name].seconds / calls if name in clocks else None
            rows.append({"m": m, "micro_batch": mb, "variant": name, "step_s": s,
                         "ratio": s / base, "offload_wait_s": wait,
                         "tokens_per_s": tokens / s, "peak_memory_gib": memory[name] / 2**30,
                         "mfu": None if peak.tflops is None else
                         tokens / s * flops_per_token(mcfg, seq) / (peak.tflops * 1e12)})
    return rows


def run(args) -> List[dict]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    set_host_threads(1.0, device, local_ranks=1)  # CUDA: the host cores a training run gets
    rows = []
    throughput = host_adamw_throughput(args.adam_params, args.steps, args.warmup)
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
        wait = "" if row["offload_wait_s"] is None else \
            f"  offload wait {row['offload_wait_s'] * 1e3:7.1f} ms"
        print(f"m={row['m']} mb={row['micro_batch']} {row['variant']:<30} "
              f"{row['step_s'] * 1e3:9.1f} ms/step  x{row['ratio']:.2f}{wait}  "
              f"peak {row['peak_memory_gib']:.2f} GiB  {row['tokens_per_s']:,.0f} tok/s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return rows
