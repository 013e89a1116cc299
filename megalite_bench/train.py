"""Single-device training throughput: megalite against `transformers`' model of the same family
(`GPT2LMHeadModel`, `LlamaForCausalLM`).

Both train the same shapes on the same batches with AdamW (decay on matrices, global-norm
clipping at 1.0, fused on CUDA) and mixed precision on CUDA: megalite keeps bf16 parameters
with fp32 master weights and fp32 gradient accumulation in its engine (Megatron's scheme);
transformers runs as its Trainer does with bf16=True (fp32 parameters under bf16 autocast).
megalite runs its real training path: the family's stage -> pipeline schedule (pp = 1) -> ZeRO
engine (zero = 0). Reported per configuration: tokens/s, model TFLOP/s and MFU (6N + 12·L·h·s
FLOPs per token as the family counts them, the device's dense bf16 peak), peak memory, and the
ratio megalite / transformers.

On CPU the two alternate step by step (noise hits both); on CUDA each runs alone, one after
the other, in the same process. `--micro-batch` takes candidates, largest first: the first
that fits in memory is used ("the largest micro-batch that fits").
"""
from __future__ import annotations

import gc
import json
from dataclasses import replace
from pathlib import Path
from typing import Callable, List, Optional, Tuple

import torch

from megalite.config.layout import PRECISION_DTYPES, Layout
from megalite.config.schema import Config, load_config
from megalite.config.train_section import ATTENTION_CHOICES
from megalite.model.families import causal_lm, family, flops_per_token
from megalite.model.init import init_parameters
from megalite.parallel.pipeline import PipelineSchedule
from megalite.parallel.rng import RNGTracker
from megalite.parallel.topology import build_topology
from megalite.parallel.zero import ZeroEngine
from megalite.train.build import build_engine
from megalite.train.metrics import peak_tflops
from megalite_bench.timing import alternate, peak_memory, reset_peak, synchronize, timed

Batches = List[Tuple[torch.Tensor, torch.Tensor]]


def megalite_parts(mcfg, device, micro_batch: int, seq: int, recompute: bool, compile: bool,
                   attention: str = "auto", recompute_layers: Optional[int] = None
                   ) -> Tuple[PipelineSchedule, ZeroEngine]:
    """The benchmark path's schedule and engine: one rank, zero 0, the model in training mode
    (`megalite_bench.gpu_worker` times its phases)."""
    precision = "bf16" if device.type == "cuda" else "fp32"
    dtype = PRECISION_DTYPES[precision]
    topo = build_topology(1, 1, 1)
    rng = RNGTracker(0, 0, 0, 0, device)
    with torch.device(device):
        model = causal_lm(mcfg, tp_group=topo.tp_group, rng=rng, recompute=recompute,
                          compile=compile, attention=attention, recompute_layers=recompute_layers)
    init_parameters(model, seed=0)
    engine = build_engine(Config(), Layout.of(topo, precision=precision), topo, model)
    schedule = PipelineSchedule(model.chunks, topo, engine, (seq, micro_batch, mcfg.n_embd), dtype,
                                device)
    model.train()
    return schedule, engine


def megalite_step(mcfg, device, micro_batch: int, seq: int, recompute: bool, compile: bool,
                  attention: str = "auto", recompute_layers: Optional[int] = None
                  ) -> Callable[[Batches], None]:
    schedule, engine = megalite_parts(mcfg, device, micro_batch, seq, recompute, compile,
                                      attention, recompute_layers)

    def step(batches: Batches) -> None:
        schedule.train_step(batches)
        engine.finish_grad_sync()
        engine.clip_and_step(1e-4, 1.0)
        engine.zero_grad()
    return step


def transformers_step(mcfg, device, compile: bool) -> Callable[[Batches], None]:
    import transformers

    mapping = family(mcfg).hf
    torch.manual_seed(0)
    hf_cfg = mapping.hf_config(mcfg)
    hf_cfg._attn_implementation = "sdpa"  # the same attention kernel as megalite
    model = getattr(transformers, mapping.model_class)(hf_cfg).to(device).train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    extra = {"fused": True} if device.type == "cuda" else {"foreach": True}
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}], lr=1e-4, **extra)
    forward = torch.compile(model) if compile else model
    cuda = device.type == "cuda"

    def step(batches: Batches) -> None:
        for x, _ in batches:
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
                loss = forward(input_ids=x, labels=x).loss  # HF shifts the labels itself
            (loss / len(batches)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def random_batches(vocab: int, micro_batch: int, seq: int, micro_batches: int, device) -> Batches:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(micro_batches):
        w = torch.randint(0, vocab, (micro_batch, seq + 1), generator=g).to(device)
        out.append((w[:, :-1], w[:, 1:]))
    return out


def _fits(make: Callable[[int], Callable[[Batches], None]], candidates: List[int], vocab: int,
          seq: int, micro_batches: int, device, warmup: int
          ) -> Tuple[Optional[int], Optional[Callable]]:
    """The largest micro-batch from `candidates` whose warmup steps run (and the step)."""
    for mb in candidates:
        step = None
        try:
            step = make(mb)
            batches = random_batches(vocab, mb, seq, micro_batches, device)
            for _ in range(max(1, warmup)):
                step(batches)
            synchronize(device)
            return mb, step
        except torch.OutOfMemoryError:
            del step
            gc.collect()
            torch.cuda.empty_cache()
    return None, None


def _row(name, mb, seq, micro_batches, seconds, fpt, peak, memory):
    tokens = mb * seq * micro_batches
    tps = tokens / seconds
    tflops = tps * fpt / 1e12
    return {"model": name, "micro_batch": mb, "tokens_per_s": tps, "tflops": tflops,
            "mfu": tflops / peak.tflops if peak.tflops else None, "peak_memory_gib": memory / 2**30,
            "step_s": seconds}


def run(args) -> List[dict]:
    device = torch.device(args.device)
    peak = peak_tflops(device, args.peak_tflops)
    print(f"device={device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}"
          f"), threads={torch.get_num_threads()}, torch {torch.__version__}, "
          f"peak={peak.tflops} TFLOP/s ({peak.source})", flush=True)
    results = []
    for preset in args.presets:
        mcfg = replace(load_config([f"model={preset}"]).model, resid_pdrop=args.dropout,
                       embd_pdrop=args.dropout, attn_pdrop=args.dropout)
        seq = min(args.seq_len, mcfg.n_positions)
        fpt = flops_per_token(mcfg, seq)
        variants = [(f"megalite{_recompute_name(r)}{'+compile' if c else ''}"
                     f"{'' if a == 'auto' else '+' + a}", r, c, a)
                    for r in recompute_settings(args) for c in args.compile
                    for a in args.attention]
        hf_variants = [(f"transformers{'+compile' if c else ''}", c) for c in args.compile
                       if args.reference]
        if device.type == "cpu":
            mb = args.micro_batch[0]
            fns = {}
            batches = random_batches(mcfg.vocab_size, mb, seq, args.micro_batches, device)
            for name, r, c, a in variants:
                step = megalite_step(mcfg, device, mb, seq, r[0], c, a, r[1])
                fns[name] = (lambda s: lambda: s(batches))(step)
            for name, c in hf_variants:
                step = transformers_step(mcfg, device, c)
                fns[name] = (lambda s: lambda: s(batches))(step)
            times = alternate(fns, device, args.warmup, args.steps)
            for name, t in times.items():
                results.append({"preset": preset, "seq": seq,
                                **_row(name, mb, seq, args.micro_batches, t, fpt, peak, 0)})
        else:
            contenders = [(n, (lambda r, c, a: lambda mb: megalite_step(
                mcfg, device, mb, seq, r[0], c, a, r[1]))(r, c, a))
                          for n, r, c, a in variants]
            contenders += [(n, (lambda c: lambda mb: transformers_step(mcfg, device, c))(c))
                           for n, c in hf_variants]
            for name, make in contenders:
                reset_peak(device)
                mb, step = _fits(make, args.micro_batch, mcfg.vocab_size, seq,
                                 args.micro_batches, device, args.warmup)
                if step is None:
                    print(f"{preset} {name}: no micro-batch of {args.micro_batch} fits", flush=True)
                    continue
                batches = random_batches(mcfg.vocab_size, mb, seq, args.micro_batches, device)
                reset_peak(device)  # not the high-water mark of a larger micro-batch that failed
                times = sorted(timed(lambda: step(batches), device) for _ in range(args.steps))
                row = _row(name, mb, seq, args.micro_batches, times[len(times) // 2], fpt, peak,
                           peak_memory(device))
                results.append({"preset": preset, "seq": seq, **row})
                print(json.dumps(results[-1]), flush=True)
                if args.profile:
                    profile_step(lambda: step(batches), device,
                                 Path(args.profile) / f"{preset}-{name}.json.gz")
                del step
                gc.collect()
                torch.cuda.empty_cache()
    _print_table(results)
    return results


def profile_step(step: Callable[[], None], device, trace: Path, rows: int = 25) -> None:
    """One step under torch.profiler: the kernels that took the most device time, and a Chrome
    trace (chrome://tracing, ui.perfetto.dev) at `trace`."""
    from torch.profiler import ProfilerActivity, profile

    trace.parent.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
        synchronize(device)
    prof.export_chrome_trace(str(trace))
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=70),
          flush=True)
    print(f"trace: {trace}", flush=True)


def _print_table(results: List[dict]) -> None:
    print(f"\n{'preset':<8} {'seq':>5} {'model':<30} {'mb':>3} {'tokens/s':>10} {'TFLOP/s':>8} "
          f"{'MFU':>6} {'mem GiB':>8} {'vs transformers':>15}")
    for r in results:
        base = [b for b in results if b["preset"] == r["preset"] and b["model"] == "transformers"]
        ratio = r["tokens_per_s"] / base[0]["tokens_per_s"] if base else float("nan")
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"
        print(f"{r['preset']:<8} {r['seq']:>5} {r['model']:<30} {r['micro_batch']:>3} "
              f"{r['tokens_per_s']:>10.0f} {r['tflops']:>8.2f} {mfu:>6} "
              f"{r['peak_memory_gib']:>8.2f} {ratio:>15.3f}")


def recompute_settings(args) -> List[Tuple[bool, Optional[int]]]:
    """(recompute, recompute_layers) per variant: off, and on for each --recompute-layers."""
    return [setting for r in args.recompute for setting in (
        [(True, n) for n in args.recompute_layers] if r else [(False, None)])]


def _recompute_name(setting: Tuple[bool, Optional[int]]) -> str:
    on, layers = setting
    return "" if not on else "+recompute" if layers is None else f"+recompute{layers}"


def add_arguments(parser) -> None:
    parser.add_argument("--presets", nargs="+", default=["tiny", "gpt2"])
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, nargs="+", default=[4],
                        help="candidates, largest first; the first that fits is used")
    parser.add_argument("--micro-batches", type=int, default=1, help="per optimizer step")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--recompute", type=int, nargs="+", default=[0], choices=[0, 1])
    parser.add_argument("--recompute-layers", type=int, nargs="+", default=[None],
                        help="with --recompute 1: recompute only the first N blocks "
                        "(train.recompute_layers); several values give several variants")
    parser.add_argument("--compile", type=int, nargs="+", default=[0], choices=[0, 1])
    parser.add_argument("--attention", nargs="+", default=["auto"], choices=list(ATTENTION_CHOICES),
                        help="SDPA kernels to compare (train.attention)")
    parser.add_argument("--profile", default=None, metavar="DIR",
                        help="after timing, profile one step of each configuration: print the "
                        "top kernels, write a Chrome trace per configuration into DIR")
    parser.add_argument("--reference", type=int, default=1, choices=[0, 1],
                        help="also run transformers' model of the family (default 1)")
    parser.add_argument("--peak-tflops", type=float, default=None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
